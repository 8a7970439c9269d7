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
//   - every commit a producer saw succeed is in the database (checked
//     against the producers' own record, kept in memory, since a lost
//     commit would take its soak_enqueued row with it);
//   - every healthy event enqueued was delivered (by id) and marked delivered;
//   - every duplicate delivery coincides with a killed dispatcher or a
//     restart, and its first delivery was never recorded as delivered (a
//     delivery recorded for good and made again is unexplained whatever
//     faults came between);
//   - no delivered or dead event is changed afterwards (an audit trigger);
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
//	make soak SOAKFLAGS='-preset harsh -seed 77'
//	go run ./cmd/outbox-soak -duration 10m -dispatchers 4 -rate 500 -kill-every 5s
//
// -preset harsh is the schedule of issue 18 (a SIGKILL every ~2s, a restart
// every ~12s, a 1s lease, 5 dispatchers, 600 events/s, for 2 minutes);
// flags given with it override its values.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"os/signal"
	"slices"
	"strings"
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
	// deleteOnDelivery runs the dispatchers with Publisher.DeleteOnDelivery.
	deleteOnDelivery bool
	drainTimeout     time.Duration
	dsn              string
	seed             uint64
	child            bool
	verbose          bool
	preset           string
}

// presets are named schedules: flag name to value. "harsh" is issue 18's
// schedule: a SIGKILL every ~2s, a PostgreSQL restart every ~12s and a 1s
// lease, so that kills often land inside publishes and outcome writes.
var presets = map[string]map[string]string{
	"default": {},
	"harsh": {
		"duration": "2m", "kill-every": "2s", "restart-every": "12s", "lease": "1s",
		"dispatchers": "5", "rate": "600", "producers": "6", "max-attempts": "3",
	},
}

func presetHelp() string {
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(presets)) {
		fmt.Fprintf(&b, "\n  %-8s", name+":")
		if len(presets[name]) == 0 {
			b.WriteString(" the flags' defaults")
		}
		for _, flag := range slices.Sorted(maps.Keys(presets[name])) {
			fmt.Fprintf(&b, " -%s %s", flag, presets[name][flag])
		}
	}
	return b.String()
}

// applyPreset sets the preset's values for the flags not given explicitly.
func (o *options) applyPreset(fs *flag.FlagSet) error {
	if o.preset == "" {
		return nil
	}
	values, ok := presets[o.preset]
	if !ok {
		return fmt.Errorf("-preset %q: unknown (default, harsh)", o.preset)
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	for name, value := range values {
		if !explicit[name] {
			if err := fs.Set(name, value); err != nil {
				return fmt.Errorf("-preset %s: %w", o.preset, err)
			}
		}
	}
	return nil
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
	fs.BoolVar(&o.deleteOnDelivery, "delete-on-delivery", false, "the dispatchers delete each event as they record its delivery (Publisher.DeleteOnDelivery)")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 3*time.Minute, "how long the dispatchers get to drain the outbox after the producers stop")
	fs.StringVar(&o.dsn, "dsn", os.Getenv("DATABASE_URL"), "PostgreSQL server to use (default $DATABASE_URL; empty: a throwaway cluster)")
	fs.Uint64Var(&o.seed, "seed", 0, "random seed for the fault schedule (0: random)")
	fs.BoolVar(&o.child, "child", false, "run as a dispatcher process (internal: the soak starts these itself)")
	fs.BoolVar(&o.verbose, "v", false, "print progress and the dispatchers' warnings as they happen")
	fs.StringVar(&o.preset, "preset", "", "a named schedule; flags given explicitly override its values:"+presetHelp())
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if err := o.applyPreset(fs); err != nil {
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
