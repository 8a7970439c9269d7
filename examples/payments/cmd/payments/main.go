// Command payments runs the payments demo end to end (make demo-payments):
// with DATABASE_URL unset it starts a throwaway PostgreSQL, creates the
// run's login roles, starts a payment rail on 127.0.0.1 and two dispatcher
// processes (this binary with -dispatcher), accepts payment instructions
// with injected rail faults, SIGKILLs one dispatcher mid-run, and prints
// the reconciliation. It exits 0 only if the run reconciles, 1 if it does
// not, 2 if it could not run and 130 if interrupted.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"github.com/modkit-go/modkit/examples/payments/app"
	"github.com/modkit-go/modkit/internal/pgserver"
	"github.com/modkit-go/modkit/internal/termlog"
)

func main() {
	os.Exit(run())
}

func run() int {
	var (
		opts       app.Options
		dispatcher bool
		verbose    bool
	)
	flag.BoolVar(&dispatcher, "dispatcher", false, "run as a dispatcher process (the demo starts these itself)")
	flag.IntVar(&opts.Instructions, "instructions", app.InstructionsDefault, "payment instructions in total")
	flag.IntVar(&opts.Participants, "participants", app.ParticipantsDefault, "participants the instructions are spread over")
	flag.IntVar(&opts.Invalid, "invalid", app.InvalidDefault, "instructions that break a rail rule and must end dead (negative: none)")
	flag.IntVar(&opts.Dispatchers, "dispatchers", app.DispatchersDefault, "dispatcher processes (one is killed)")
	flag.Float64Var(&opts.Faults.Unavailable, "fail-rate", app.DefaultFaults.Unavailable, "fraction of rail requests answered 503")
	flag.Float64Var(&opts.Faults.LostResponse, "lost-rate", app.DefaultFaults.LostResponse, "fraction of rail payments whose answer is lost")
	flag.DurationVar(&opts.Faults.Latency, "latency", app.DefaultFaults.Latency, "the rail's largest injected latency")
	flag.Uint64Var(&opts.Seed, "seed", 1, "seed of the instructions and the injected faults")
	flag.BoolVar(&verbose, "v", false, "log the library at debug level")
	flag.Parse()

	libLevel := slog.LevelError
	if verbose {
		libLevel = slog.LevelDebug
	}
	opts.Logger = slog.New(termlog.NewHandler(os.Stderr, libLevel))
	out := slog.New(termlog.NewHandler(os.Stderr, slog.LevelInfo))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	if dispatcher {
		if err := app.RunDispatcherProcess(ctx, os.Stdin, os.Stdout, opts.Logger); err != nil {
			out.Error("dispatcher", "error", err)
			return 2
		}
		return 0
	}

	dsn, stopDB, err := database(ctx, out)
	if err != nil {
		out.Error("no database", "error", err)
		return 2
	}
	defer stopDB()
	opts.DSN = dsn
	self, err := os.Executable()
	if err != nil {
		out.Error("locating this binary", "error", err)
		return 2
	}
	args := []string{"-dispatcher"}
	if verbose {
		args = append(args, "-v")
	}
	opts.Spawn = func() *exec.Cmd { return exec.Command(self, args...) }
	opts.Progress = func(format string, a ...any) { out.Info(fmt.Sprintf(format, a...)) }

	out.Info("running the payments scenario", "instructions", opts.Instructions, "participants", opts.Participants)
	sum, err := app.Run(ctx, opts)
	switch {
	case err != nil && ctx.Err() != nil:
		out.Warn("interrupted")
		return 130
	case err != nil:
		out.Error("demo failed", "error", err)
		return 2
	}
	if err := sum.Print(os.Stdout); err != nil {
		out.Error("printing the reconciliation", "error", err)
		return 2
	}
	if !sum.Reconciled {
		return 1
	}
	return 0
}

// database returns the DSN to use: DATABASE_URL if set, else a throwaway
// PostgreSQL, which the returned stop function removes.
func database(ctx context.Context, out *slog.Logger) (dsn string, stop func(), err error) {
	if dsn := os.Getenv("DATABASE_URL"); dsn != "" {
		out.Info("using DATABASE_URL")
		return dsn, func() {}, nil
	}
	out.Info("DATABASE_URL is not set: starting a throwaway PostgreSQL")
	cluster, err := pgserver.Start(ctx, pgserver.Options{})
	if err != nil {
		return "", nil, fmt.Errorf("start a throwaway PostgreSQL: %w", err)
	}
	out.Info("PostgreSQL ready", "version", cluster.Version(), "port", cluster.Port())
	return cluster.DSN("postgres"), func() {
		if err := cluster.Stop(); err != nil {
			out.Warn("stopping the throwaway PostgreSQL", "error", err)
		}
	}, nil
}
