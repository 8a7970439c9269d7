// Command minichat runs the Mini Chat demo end to end (make demo): with
// DATABASE_URL unset it starts a throwaway PostgreSQL, then migrates,
// starts the fx app, drives a few hundred simulated turns, and prints a
// reconciled summary. It exits 0 only if the run reconciles, 1 if it does
// not, 2 if it could not run and 130 if interrupted.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/modkit-go/modkit/examples/minichat/app"
	"github.com/modkit-go/modkit/internal/pgserver"
	"github.com/modkit-go/modkit/internal/termlog"
)

func main() {
	os.Exit(run())
}

// run is main with deferred clean-up: os.Exit skips defers, so it is only
// called once run has returned.
func run() int {
	opts, verbose := parseFlags()
	out := slog.New(termlog.NewHandler(os.Stderr, slog.LevelInfo))
	// The library and the modules log at Error only, unless -v: a demo
	// with injected failures would otherwise print a Warn line per retry
	// between the progress lines. Dead letters are worth a line.
	libLevel := slog.LevelError
	if verbose {
		libLevel = slog.LevelDebug
	}
	opts.Logger = slog.New(termlog.NewHandler(os.Stderr, libLevel))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	dsn, stopDB, err := database(ctx, out)
	if err != nil {
		out.Error("no database", "error", err)
		return 2
	}
	defer stopDB()
	opts.DSN = dsn
	opts.Progress = func(p app.Progress) {
		out.Info("progress", "elapsed", p.Elapsed.Round(time.Second), "turns", fmt.Sprintf("%d/%d", p.TurnsStarted, p.TurnsGoal),
			"finalised", p.TurnsFinal, "delivered", p.Delivered, "retried", p.Retried, "dead", p.Dead)
	}

	out.Info("running the scenario", "turns", opts.Turns, "users", opts.Users)
	sum, err := app.Run(ctx, opts)
	switch {
	case err != nil && ctx.Err() != nil:
		// err says how the run ended: the interruption, and any error of
		// stopping the app.
		out.Warn("interrupted", "error", err)
		return 130
	case err != nil:
		out.Error("demo failed", "error", err)
		return 2
	}
	if err := sum.Print(os.Stdout); err != nil {
		out.Error("printing the summary", "error", err)
		return 2
	}
	if !sum.Reconciled {
		return 1
	}
	return 0
}

func parseFlags() (opts app.Options, verbose bool) {
	flag.IntVar(&opts.Turns, "turns", app.TurnsDefault, "simulated turns in total")
	flag.IntVar(&opts.Users, "users", app.UsersDefault, "concurrent simulated users (spread over two tenants)")
	flag.IntVar(&opts.RaceEvery, "race-every", app.RaceEveryDefault, "make every n-th turn of a user a watchdog race")
	flag.Float64Var(&opts.TransientFailureRate, "fail-rate", app.TransientFailureRateDefault,
		"fraction of first deliveries the collector fails transiently (negative: none)")
	flag.IntVar(&opts.MalformedEvents, "malformed", app.MalformedEventsDefault,
		"malformed probe events to enqueue, which must end dead (negative: none)")
	flag.Uint64Var(&opts.Seed, "seed", 1, "seed of the simulated outcomes and injected failures")
	flag.BoolVar(&verbose, "v", false, "log the library and the modules at debug level")
	flag.Parse()
	return opts, verbose
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
