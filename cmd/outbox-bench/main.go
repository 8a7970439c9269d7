// Command outbox-bench measures the modkit transactional outbox
// (modkit/outbox) against a real PostgreSQL and prints one table: the
// machine, the server and its settings, then for each workload the
// library's figure, a raw-SQL baseline measured in the same run, their
// ratio and the target it is held to.
//
// By default it starts a throwaway PostgreSQL cluster with fsync and
// synchronous_commit on (internal/pgserver, durable like production) and
// removes it afterwards. With -dsn (or DATABASE_URL) it uses that server
// instead: it creates a database for the run (or, if the role may not, a
// schema) and drops it at the end, so nothing is left behind.
//
// Workloads (-only picks some, comma-separated):
//
//	dispatch  drain -events preloaded events with the outbox's Dispatcher
//	          and a no-op publisher, against a raw claim+ack loop on 2
//	          connections; also with Publisher.DeleteOnDelivery (opt-in)
//	latency   commit-to-publish latency at fixed enqueue rates (-rates), with
//	          NOTIFY and poll-only, plus a raw LISTEN/NOTIFY round trip
//	enqueue   one event per transaction from -producers producers for
//	          -duration, Client.Enqueue against a plain INSERT
//	bulk      Client.EnqueueBatch in batches of -bulk-batch against COPY
//	scale     the dispatch rate with -retained delivered rows kept and with a
//	          -backlog pending events, against the empty-table rate
//	idle      statements per second of an idle dispatcher (NOTIFY on)
//
// and, only when named, experiments: variants of the claim, ack and bulk
// insert run as raw SQL, and the dispatcher under other session settings,
// each against the unchanged form, to size changes to the library.
//
// Every comparison is measured in -rounds rounds (3 by default) that run
// the library and its baseline alternately, and is reported as medians
// with their spread (see rounds.go), so that a machine loaded by something
// else during one phase does not pass for a regression.
//
// The defaults finish in about five to six minutes on an otherwise idle
// 2-core machine (twice that when other work shares it). -rounds=1 with
// -duration=10s -events=200000 measures each side once, as earlier
// versions of this program did. For the full-size scale figures use
// -retained=10000000 -backlog=1000000 (the target, 0.9× of the empty-table
// rate, is for 10 million delivered rows kept).
//
// Usage:
//
//	make bench-outbox BENCHFLAGS='-only=dispatch,scale -events=500000'
//	go run ./cmd/outbox-bench -json > bench.json
//	go run ./cmd/outbox-bench -only=dispatch -cpuprofile=cpu.out -memprofile=mem.out -explain
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/modkit-go/modkit/internal/termlog"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// options are the command-line settings.
type options struct {
	dsn                string
	only               []string
	events             int
	rounds             int
	duration           time.Duration
	batch              int
	concurrency        int
	rawWorkers         int
	dispatcherConns    int32
	dispatcherSettings map[string]string
	producers          int
	latencyProducers   int
	rates              []int
	bulkEvents         int
	bulkBatch          int
	retained           int
	backlog            int
	scaleRaw           bool
	idle               time.Duration
	payload            int
	json               bool
	cpuprofile         string
	memprofile         string
	explain            bool
	verbose            bool
}

// workload is one named part of the benchmark.
type workload struct {
	name     string
	run      func(b *bench, ctx context.Context) error
	optional bool // run only when -only names it
}

var workloads = []workload{
	{name: "dispatch", run: (*bench).runDispatch},
	{name: "latency", run: (*bench).runLatency},
	{name: "enqueue", run: (*bench).runEnqueue},
	{name: "bulk", run: (*bench).runBulk},
	{name: "scale", run: (*bench).runScale},
	{name: "idle", run: (*bench).runIdle},
	{name: "ordering", run: (*bench).runOrdering},
	{name: "brokers", run: (*bench).runBrokers},
	{name: "experiments", run: (*bench).runExperiments, optional: true},
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("outbox-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var names, defaults []string
	for _, w := range workloads {
		names = append(names, w.name)
		if !w.optional {
			defaults = append(defaults, w.name)
		}
	}
	var only, rates string
	fs.StringVar(&o.dsn, "dsn", os.Getenv("DATABASE_URL"), "PostgreSQL server to use (default $DATABASE_URL; empty starts a throwaway durable cluster); a database or schema is created for the run and dropped afterwards")
	fs.StringVar(&only, "only", strings.Join(defaults, ","), "comma-separated workloads to run (experiments: raw-SQL variants for tuning the library, not run by default)")
	fs.IntVar(&o.events, "events", 100000, "events preloaded and drained by each dispatch round (and by the empty and retained-rows scale runs)")
	const roundsUsage = "rounds per comparison: library and baseline run alternately this many times each, and the medians are reported with their spread"
	fs.IntVar(&o.rounds, "rounds", 3, roundsUsage)
	fs.IntVar(&o.rounds, "repeat", 3, "the same as -rounds")
	fs.DurationVar(&o.duration, "duration", 3*time.Second, "length of each timed phase of the enqueue and latency workloads, per round (latency: per rate and mode)")
	fs.IntVar(&o.batch, "batch", 500, "dispatcher BatchSize, and the batch of the raw claim baseline")
	fs.IntVar(&o.concurrency, "concurrency", 0, "dispatcher Concurrency (0: the library's default)")
	fs.IntVar(&o.rawWorkers, "raw-workers", 2, "goroutines (each with its own connection) of the raw claim+ack baseline")
	var conns int
	fs.IntVar(&conns, "dispatcher-conns", 0, "MaxConns of the dispatcher's pool (0: pgx default, max(4, CPUs))")
	var settings string
	fs.StringVar(&settings, "dispatcher-settings", "", "session settings of the dispatcher's pool, e.g. synchronous_commit=off,plan_cache_mode=force_custom_plan")
	fs.IntVar(&o.producers, "producers", 8, "concurrent producers of the enqueue workload")
	fs.IntVar(&o.latencyProducers, "latency-producers", 8, "producer goroutines sharing the fixed enqueue rate of the latency workload")
	fs.StringVar(&rates, "rates", "500,2000", "enqueue rates (events/s) of the latency workload")
	fs.IntVar(&o.bulkEvents, "bulk-events", 300000, "events written per bulk enqueue phase (per round; phases of a few seconds, so that a round is not one burst of noise)")
	fs.IntVar(&o.bulkBatch, "bulk-batch", 1000, "events per EnqueueBatch call (and per COPY)")
	fs.IntVar(&o.retained, "retained", 1000000, "delivered rows kept in the table for the scale workload")
	fs.IntVar(&o.backlog, "backlog", 200000, "pending events drained by each backlog round of the scale workload (1000000 for the issue's figure)")
	fs.BoolVar(&o.scaleRaw, "scale-raw", false, "also run the raw-SQL baseline on the retained-rows table")
	fs.DurationVar(&o.idle, "idle", 30*time.Second, "window over which the idle dispatcher's statements are counted")
	fs.IntVar(&o.payload, "payload", 128, "approximate payload size in bytes")
	fs.BoolVar(&o.json, "json", false, "print the report as JSON instead of a table")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the whole run (the client side: dispatcher, producers) to this file")
	fs.StringVar(&o.memprofile, "memprofile", "", "write a heap profile of the whole run's allocations (go tool pprof -sample_index=alloc_space) to this file at its end")
	fs.BoolVar(&o.explain, "explain", false, "print EXPLAIN (ANALYZE, BUFFERS) of the claim, outcome and raw ack statements before every drain, to stderr (the library's claim and outcome are function calls: their time and buffers, not the plans inside)")
	fs.BoolVar(&o.verbose, "v", false, "log the dispatcher's info messages too")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: go run ./cmd/outbox-bench [flags]\n\nBenchmarks modkit/outbox against PostgreSQL and prints one table. Workloads: %s.\n\n",
			strings.Join(names, ", "))
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	for _, name := range strings.Split(only, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		if !slices.Contains(names, name) {
			return o, fmt.Errorf("-only: unknown workload %q (have %s)", name, strings.Join(names, ", "))
		}
		o.only = append(o.only, name)
	}
	for _, s := range strings.Split(rates, ",") {
		r, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || r <= 0 {
			return o, fmt.Errorf("-rates: %q is not a positive number", s)
		}
		o.rates = append(o.rates, r)
	}
	o.dispatcherConns = int32(conns)
	for _, kv := range strings.Split(settings, ",") {
		if strings.TrimSpace(kv) == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return o, fmt.Errorf("-dispatcher-settings: %q is not name=value", kv)
		}
		if o.dispatcherSettings == nil {
			o.dispatcherSettings = map[string]string{}
		}
		o.dispatcherSettings[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	switch {
	case len(o.only) == 0:
		return o, errors.New("-only names no workload")
	case o.rounds < 1:
		return o, errors.New("-rounds must be positive")
	case o.events < 1, o.bulkEvents < 1, o.backlog < 1, o.retained < 0:
		return o, errors.New("-events, -bulk-events and -backlog must be positive, -retained not negative")
	case o.batch < 1, o.bulkBatch < 1: // the library checks -batch's upper bound when the run starts
		return o, errors.New("-batch and -bulk-batch must be positive")
	case o.concurrency < 0, o.rawWorkers < 1, o.producers < 1, o.latencyProducers < 1, conns < 0:
		return o, errors.New("-raw-workers, -producers and -latency-producers must be positive, -concurrency and -dispatcher-conns not negative")
	case o.duration <= 0, o.idle <= 0:
		return o, errors.New("-duration and -idle must be positive")
	}
	return o, nil
}

// params lists the sizes in force, for the report.
func (o options) params() map[string]string {
	p := map[string]string{"only": strings.Join(o.only, ","), "rounds": fmt.Sprint(o.rounds)}
	has := func(name string) bool { return slices.Contains(o.only, name) }
	if has("dispatch") || has("scale") || has("experiments") || has("ordering") || has("brokers") {
		p["events"], p["batch"], p["concurrency"], p["raw_workers"] = itoa(int64(o.events)), fmt.Sprint(o.batch), fmt.Sprint(o.concurrency), fmt.Sprint(o.rawWorkers)
	}
	if has("latency") {
		var rs []string
		for _, r := range o.rates {
			rs = append(rs, fmt.Sprint(r))
		}
		p["rates"], p["latency_producers"] = strings.Join(rs, ","), fmt.Sprint(o.latencyProducers)
	}
	if has("enqueue") {
		p["producers"] = fmt.Sprint(o.producers)
	}
	if has("enqueue") || has("latency") || has("experiments") {
		p["duration"] = o.duration.String()
	}
	if has("bulk") || has("experiments") {
		p["bulk_events"], p["bulk_batch"] = itoa(int64(o.bulkEvents)), fmt.Sprint(o.bulkBatch)
	}
	if has("scale") {
		p["retained"], p["backlog"] = itoa(int64(o.retained)), itoa(int64(o.backlog))
	}
	if has("idle") {
		p["idle"] = o.idle.String()
	}
	p["payload_bytes"] = fmt.Sprint(o.payload)
	if len(o.dispatcherSettings) > 0 {
		var kv []string
		for _, k := range slices.Sorted(maps.Keys(o.dispatcherSettings)) {
			kv = append(kv, k+"="+o.dispatcherSettings[k])
		}
		p["dispatcher_settings"] = strings.Join(kv, ",")
	}
	return p
}

// bench holds what the workloads share.
type bench struct {
	opts          options
	t             *target
	src           *eventSource
	log           *slog.Logger // progress, to stderr
	dispatcherLog *slog.Logger
	report        *report
	// defaults is the dispatcher configuration the library fills in for a
	// zero DispatcherConfig (see libraryDefaults).
	defaults    outbox.DispatcherConfig
	retainedNow int // delivered rows the current drain started with
}

func (b *bench) add(r row) { b.report.Results = append(b.report.Results, r) }

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	opts, err := parseFlags(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		return 2
	}
	// The first interrupt stops the run and cleans up; once the context is
	// done a second one kills the process (the cluster dies with it).
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stop)

	log := slog.New(termlog.NewHandler(os.Stderr, slog.LevelInfo))
	dlevel := slog.LevelWarn
	if opts.verbose {
		dlevel = slog.LevelInfo
	}
	b := &bench{
		opts: opts, log: log, src: newEventSource(opts.payload),
		dispatcherLog: slog.New(termlog.NewHandler(os.Stderr, dlevel)),
		report: &report{
			Started: time.Now(),
			Command: strings.TrimSpace("go run ./cmd/outbox-bench " + strings.Join(args, " ")),
			Machine: machineInfo(),
			Rounds:  opts.rounds,
		},
	}
	if opts.cpuprofile != "" {
		f, err := os.Create(opts.cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "outbox-bench:", err)
			return 1
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "outbox-bench:", err)
			return 1
		}
		defer pprof.StopCPUProfile()
	}

	code := b.runAll(ctx)
	if opts.memprofile != "" {
		if err := writeHeapProfile(opts.memprofile); err != nil {
			fmt.Fprintln(os.Stderr, "outbox-bench:", err)
			code = 1
		}
	}
	b.report.Params = b.opts.params() // after runAll resolved the library's defaults
	b.report.Elapsed = time.Since(b.report.Started).Round(time.Second).String()
	b.report.Machine["load_end"] = loadAverage()
	if opts.json {
		if err := b.report.printJSON(os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "outbox-bench:", err)
			return 1
		}
	} else {
		b.report.print(os.Stdout)
	}
	return code
}

// runAll opens the target, runs the selected workloads in order and
// removes the target. A failed workload is reported and the others still
// run; an interrupt stops the run.
func (b *bench) runAll(ctx context.Context) int {
	t, err := openTarget(ctx, b.opts.dsn, b.log)
	if err != nil {
		b.report.Errors = append(b.report.Errors, "set-up: "+err.Error())
		return 1
	}
	defer t.close()
	b.t = t
	b.report.Postgres.Server = t.server
	if b.report.Postgres.Version, b.report.Postgres.Settings, err = t.postgresInfo(ctx); err != nil {
		b.report.Errors = append(b.report.Errors, "read server settings: "+err.Error())
		return 1
	}
	if err := b.resolveDefaults(); err != nil {
		b.report.Errors = append(b.report.Errors, "set-up: "+err.Error())
		return 2
	}
	code := 0
	for _, w := range workloads {
		if !slices.Contains(b.opts.only, w.name) {
			continue
		}
		start := time.Now()
		b.log.Info("workload " + w.name)
		if err := w.run(b, ctx); err != nil {
			if ctx.Err() != nil {
				b.report.Errors = append(b.report.Errors, "interrupted during "+w.name)
				return 130
			}
			b.log.Error("workload failed", "workload", w.name, "error", err)
			b.report.Errors = append(b.report.Errors, w.name+": "+err.Error())
			code = 1
			continue
		}
		b.log.Info("workload "+w.name+" done", "took", time.Since(start).Round(time.Second))
	}
	return code
}

// writeHeapProfile writes the allocations since the start (and what is
// live) to path.
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
