// Command river-bench runs modkit/outbox and River (github.com/riverqueue/river)
// side by side on one PostgreSQL, in one program, with the rounds of every
// comparison alternated (outbox, River, raw SQL, outbox, River, raw SQL, …),
// and prints each figure as the median of its rounds with their min–max,
// next to the ratios outbox/River and outbox/raw-SQL.
//
// It is a Go module of its own (bench/river) so that the library's go.mod
// never requires River. The outbox tables live in schema "outbox" (migrated
// by modkit's migrator), River's in schema "river" (migrated by
// rivermigrate), and the write-reduction experiments use scratch tables in
// schema "scratch".
//
// Workloads (-only, comma-separated):
//
//	dispatch  drain -events preloaded no-op events: outbox Dispatcher with
//	          library defaults, the same with Config.SynchronousCommit,
//	          River tuned (FetchCooldown -river-fetch-cooldown,
//	          -river-workers workers), and a raw claim+ack loop
//	enqueue   one event per transaction from -producers producers:
//	          Client.Enqueue, River InsertTx, a plain INSERT
//	bulk      batches of -bulk-batch: Client.EnqueueBatch, River
//	          InsertManyFastTx (COPY), a raw COPY into the outbox table
//	latency   commit-to-work latency at the fixed rates of -rates for
//	          -latency-duration per round and system (use -latency-duration=90s
//	          or more for steady-state figures)
//	writes    (only when named) WAL bytes and commits per event of today's
//	          write path and of leaner table designs, on scratch tables
//
// Usage:
//
//	make bench-river
//	make bench-river RIVERFLAGS='-only=latency -rates=2000 -latency-duration=120s'
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

type options struct {
	dsn             string
	only            []string
	rounds          int
	events          int
	duration        time.Duration
	latencyDuration time.Duration
	rates           []int
	producers       int
	latencyProds    int
	bulkEvents      int
	bulkBatch       int
	rawWorkers      int
	rawBatch        int
	riverWorkers    int
	riverCooldown   time.Duration
	riverConns      int
	writeEvents     int
	latencyBatch    int
	latencyDelete   bool
	notifyInterval  time.Duration
	payload         int
	writeDesigns    []string
}

var allWorkloads = []string{"dispatch", "enqueue", "bulk", "latency", "writes"}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("river-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var only, rates, designs string
	fs.StringVar(&o.dsn, "dsn", os.Getenv("DATABASE_URL"), "PostgreSQL server (default $DATABASE_URL; empty starts a throwaway durable cluster); a database is created for the run and dropped afterwards")
	fs.StringVar(&only, "only", "dispatch,enqueue,bulk,latency", "workloads to run, comma-separated, of "+strings.Join(allWorkloads, ","))
	fs.IntVar(&o.rounds, "rounds", 3, "rounds per comparison; the sides of a comparison alternate within every round")
	fs.IntVar(&o.events, "events", 100000, "events (jobs) preloaded and drained per dispatch round")
	fs.DurationVar(&o.duration, "duration", 3*time.Second, "length of each enqueue phase")
	fs.DurationVar(&o.latencyDuration, "latency-duration", 5*time.Second, "length of each latency phase (steady state needs 60s or more)")
	fs.StringVar(&rates, "rates", "500,2000", "enqueue rates (events/s) of the latency workload")
	fs.IntVar(&o.producers, "producers", 8, "concurrent producers of the enqueue workload")
	fs.IntVar(&o.latencyProds, "latency-producers", 8, "producers sharing the fixed rate of the latency workload")
	fs.IntVar(&o.bulkEvents, "bulk-events", 300000, "events per bulk phase (phases of a few seconds, so that a round is not one burst of noise)")
	fs.IntVar(&o.bulkBatch, "bulk-batch", 1000, "events per batch (one transaction each)")
	fs.IntVar(&o.rawWorkers, "raw-workers", 2, "connections of the raw claim+ack loop")
	fs.IntVar(&o.rawBatch, "raw-batch", 500, "claim size of the raw claim+ack loop")
	fs.IntVar(&o.riverWorkers, "river-workers", 1000, "River MaxWorkers of the default queue")
	fs.DurationVar(&o.riverCooldown, "river-fetch-cooldown", time.Millisecond, "River FetchCooldown")
	fs.IntVar(&o.riverConns, "river-conns", 10, "MaxConns of River's pool")
	fs.IntVar(&o.latencyBatch, "latency-outbox-batch", 0, "BatchSize of the outbox dispatcher in the latency workload (0: the library's default)")
	fs.DurationVar(&o.notifyInterval, "notify-interval", 0, "Config.NotifyInterval of the outbox producers of the enqueue and latency workloads (0: the library's default)")
	fs.BoolVar(&o.latencyDelete, "latency-delete-on-delivery", false, "the outbox publisher of the latency workload deletes events on delivery (Publisher.DeleteOnDelivery)")
	fs.IntVar(&o.writeEvents, "write-events", 100000, "events per phase of the writes workload")
	fs.StringVar(&designs, "write-designs", "", "designs of the writes workload to run, comma-separated by their letters (e.g. B,C2,H); empty runs all")
	fs.IntVar(&o.payload, "payload", 128, "approximate payload size in bytes")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	for _, w := range strings.Split(only, ",") {
		if w = strings.TrimSpace(w); w == "" {
			continue
		}
		if !slices.Contains(allWorkloads, w) {
			return o, fmt.Errorf("-only: unknown workload %q", w)
		}
		o.only = append(o.only, w)
	}
	for _, d := range strings.Split(designs, ",") {
		if d = strings.TrimSpace(d); d != "" {
			o.writeDesigns = append(o.writeDesigns, d)
		}
	}
	for _, s := range strings.Split(rates, ",") {
		r, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || r <= 0 {
			return o, fmt.Errorf("-rates: %q is not a positive number", s)
		}
		o.rates = append(o.rates, r)
	}
	switch {
	case len(o.only) == 0:
		return o, errors.New("-only names no workload")
	case o.rounds < 1, o.events < 1, o.bulkEvents < 1, o.bulkBatch < 1, o.producers < 1, o.latencyProds < 1,
		o.rawWorkers < 1, o.rawBatch < 1, o.latencyBatch < 0, o.riverWorkers < 1, o.riverConns < 2, o.writeEvents < 1:
		return o, errors.New("counts must be positive (and -river-conns at least 2)")
	case o.duration <= 0, o.latencyDuration <= 0:
		return o, errors.New("durations must be positive")
	case o.notifyInterval < 0:
		return o, errors.New("-notify-interval must not be negative")
	}
	return o, nil
}

type bench struct {
	opts   options
	env    *env
	log    *slog.Logger
	src    *source
	report *report
}

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	opts, err := parseFlags(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "river-bench:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	b := &bench{opts: opts, log: log, src: newSource(opts.payload), report: &report{
		started: time.Now(), command: strings.TrimSpace("river-bench " + strings.Join(args, " ")),
		loadStart: loadAverage(), cpus: runtime.NumCPU(),
	}}
	code := b.runAll(ctx)
	b.report.loadEnd = loadAverage()
	b.report.elapsed = time.Since(b.report.started).Round(time.Second)
	b.report.print(os.Stdout)
	return code
}

func (b *bench) runAll(ctx context.Context) int {
	e, err := openEnv(ctx, b.opts.dsn, b.log)
	if err != nil {
		b.report.errors = append(b.report.errors, "set-up: "+err.Error())
		return 1
	}
	defer e.close()
	b.env = e
	b.report.server = e.server
	b.report.version, b.report.settings = e.postgresInfo(ctx)
	steps := map[string]func(context.Context) error{
		"dispatch": b.runDispatch, "enqueue": b.runEnqueue, "bulk": b.runBulk, "latency": b.runLatency, "writes": b.runWrites,
	}
	code := 0
	for _, w := range allWorkloads {
		if !slices.Contains(b.opts.only, w) {
			continue
		}
		start := time.Now()
		b.log.Info("workload " + w)
		if err := steps[w](ctx); err != nil {
			if ctx.Err() != nil {
				b.report.errors = append(b.report.errors, "interrupted during "+w)
				return 130
			}
			b.log.Error("workload failed", "workload", w, "error", err)
			b.report.errors = append(b.report.errors, w+": "+err.Error())
			code = 1
			continue
		}
		b.log.Info("workload "+w+" done", "took", time.Since(start).Round(time.Second))
	}
	return code
}

// alternate runs rounds rounds of sides, each round running every side once
// in the order given, and returns each side's results in round order.
func alternate[T any](ctx context.Context, b *bench, workload string, sides []side[T]) ([][]T, error) {
	out := make([][]T, len(sides))
	for round := range b.opts.rounds {
		for i, s := range sides {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			b.log.Info(fmt.Sprintf("%s: round %d of %d: %s", workload, round+1, b.opts.rounds, s.name))
			v, err := s.run(ctx)
			if err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", s.name, round+1, err)
			}
			out[i] = append(out[i], v)
		}
	}
	return out, nil
}

type side[T any] struct {
	name string
	run  func(ctx context.Context) (T, error)
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(b))[0]
}
