// Command outbox-soak runs the modkit outbox (modkit/outbox) under faults for
// minutes and checks that nothing was lost.
//
// It starts producers that enqueue events at a steady rate, each in a
// transaction that also records the event in soak_enqueued (so the set of
// committed events is known exactly), some of them poison (their publisher
// always fails, transiently or permanently). Several dispatcher processes
// (this binary re-executed with -child) deliver them; each delivery is
// recorded by the publisher in soak_deliveries with the event id, the lease
// token and the process id. Meanwhile the dispatchers are SIGKILLed and
// replaced at random, and PostgreSQL is restarted with an immediate
// shutdown now and then. At the end the producers stop, the dispatchers
// drain the outbox, and the run is verified:
//
//   - every healthy event enqueued was delivered (by id) and marked delivered;
//   - every duplicate delivery coincides with a killed dispatcher or a
//     restart;
//   - no row is left pending or processing (an expired lease included);
//   - dead rows are exactly the poison events, never delivered;
//   - every settlement was made under a valid lease, and every delivered
//     mark by a lease whose publish reached the downstream (an audit
//     trigger records each transition out of processing).
//
// It prints a summary and exits non-zero on any failure.
//
// By default it starts a throwaway durable PostgreSQL cluster
// (internal/pgserver, fsync and synchronous_commit on, so a restart loses
// nothing committed) and removes it afterwards. With -dsn or DATABASE_URL it
// uses that server, in a database created for the run and dropped at the
// end; the server is then never restarted.
//
// Usage:
//
//	make soak SOAKFLAGS='-duration 1m'
//	go run ./cmd/outbox-soak -duration 10m -dispatchers 4 -rate 500 -kill-every 5s
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// options are the command-line settings.
type options struct {
	duration     time.Duration
	dispatchers  int
	producers    int
	rate         int
	poisonEvery  int
	killEvery    time.Duration
	restartEvery time.Duration
	lease        time.Duration
	maxAttempts  int
	drainTimeout time.Duration
	dsn          string
	seed         uint64
	child        bool
	verbose      bool
}

func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("outbox-soak", flag.ContinueOnError)
	fs.DurationVar(&o.duration, "duration", 5*time.Minute, "how long producers enqueue and faults are injected")
	fs.IntVar(&o.dispatchers, "dispatchers", 3, "dispatcher processes running at once")
	fs.IntVar(&o.producers, "producers", 2, "producer goroutines (the rate is shared among them)")
	fs.IntVar(&o.rate, "rate", 200, "events enqueued per second, in total")
	fs.IntVar(&o.poisonEvery, "poison-every", 100, "every n-th event is poison (alternately failing transiently and permanently); 0 for none")
	fs.DurationVar(&o.killEvery, "kill-every", 10*time.Second, "mean time between SIGKILLs of a random dispatcher; 0 for none")
	fs.DurationVar(&o.restartEvery, "restart-every", 30*time.Second, "mean time between PostgreSQL restarts (own cluster only); 0 for none")
	fs.DurationVar(&o.lease, "lease", 2*time.Second, "the dispatchers' lease duration")
	fs.IntVar(&o.maxAttempts, "max-attempts", 4, "the dispatchers' MaxAttempts")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 3*time.Minute, "how long the dispatchers get to drain the outbox after the producers stop")
	fs.StringVar(&o.dsn, "dsn", os.Getenv("DATABASE_URL"), "PostgreSQL server to use (default $DATABASE_URL; empty: a throwaway cluster)")
	fs.Uint64Var(&o.seed, "seed", 0, "random seed for the fault schedule (0: random)")
	fs.BoolVar(&o.child, "child", false, "run as a dispatcher process (internal: the soak starts these itself)")
	fs.BoolVar(&o.verbose, "v", false, "print progress and the dispatchers' warnings as they happen")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	switch {
	case o.duration <= 0:
		return o, errors.New("-duration must be positive")
	case o.dispatchers < 1:
		return o, errors.New("-dispatchers must be at least 1")
	case o.producers < 1 || o.rate < o.producers:
		return o, errors.New("-producers must be at least 1 and -rate at least -producers")
	case o.poisonEvery < 0 || o.killEvery < 0 || o.restartEvery < 0:
		return o, errors.New("-poison-every, -kill-every and -restart-every must not be negative")
	case o.lease < 300*time.Millisecond:
		return o, errors.New("-lease must be at least 300ms")
	case o.maxAttempts < 1:
		return o, errors.New("-max-attempts must be at least 1")
	}
	if o.seed == 0 {
		o.seed = rand.Uint64()
	}
	return o, nil
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-soak:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if o.child {
		if err := runChild(ctx, o); err != nil {
			fmt.Fprintln(os.Stderr, "outbox-soak child:", err)
			os.Exit(1)
		}
		return
	}
	ok, err := run(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-soak:", err)
		os.Exit(1)
	}
	if !ok {
		os.Exit(1)
	}
}

// logf prints a timestamped progress line.
func logf(format string, args ...any) {
	fmt.Printf("%s  %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}
