package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// benchTopic is the (namespace, topic) of every outbox event of the run.
var benchTopic = outbox.Topic{Namespace: "bench", Topic: "events"}

// source makes the one event shape both systems carry: a JSON payload of
// about the configured size with a sequence number; outbox events also get
// a tenant and a dedupe key "<tenant>/<run>/<seq>" (River jobs get no
// uniqueness, except in the enqueue workload's "both deduplicating" side:
// River's unique jobs cost extra and are not what its users reach for by
// default).
type source struct {
	tenant uuid.UUID
	pad    string
}

func newSource(payload int) *source {
	return &source{tenant: uuid.New(), pad: strings.Repeat("x", max(0, payload-48))}
}

func (s *source) payload(seq int64) []byte {
	return []byte(`{"seq":` + strconv.FormatInt(seq, 10) + `,"kind":"usage_snapshot","pad":"` + s.pad + `"}`)
}

func (s *source) message(run string, seq int64) outbox.Message {
	return outbox.Message{Namespace: benchTopic.Namespace, Topic: benchTopic.Topic,
		TenantID:  outbox.Tenant(s.tenant),
		DedupeKey: outbox.Key(s.tenant.String() + "/" + run + "/" + strconv.FormatInt(seq, 10)),
		Payload:   s.payload(seq)}
}

// noopArgs is the River job of the run: the same payload fields as the
// outbox events.
type noopArgs struct {
	Seq  int64  `json:"seq"`
	What string `json:"kind"`
	Pad  string `json:"pad"`
}

func (noopArgs) Kind() string { return "bench_noop" }

func (s *source) job(seq int64) noopArgs {
	return noopArgs{Seq: seq, What: "usage_snapshot", Pad: s.pad}
}

// noopWorker works a job by calling onWork (if set) and succeeding.
type noopWorker struct {
	river.WorkerDefaults[noopArgs]
	onWork func(seq int64)
}

func (w *noopWorker) Work(_ context.Context, job *river.Job[noopArgs]) error {
	if w.onWork != nil {
		w.onWork(job.Args.Seq)
	}
	return nil
}

// warnLogger logs warnings and errors only (River's and the dispatcher's).
func warnLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// newRiver builds a River client on pool, tuned as the comparison
// was (FetchCooldown -river-fetch-cooldown, MaxWorkers -river-workers on
// the default queue), whose worker calls onWork. An unstarted client serves
// inserts.
func (b *bench) newRiver(pool *pgxpool.Pool, onWork func(seq int64)) (*river.Client[pgx.Tx], error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, &noopWorker{onWork: onWork})
	return river.NewClient(riverpgxv5.New(pool), &river.Config{
		Schema:        riverSchema,
		Queues:        map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: b.opts.riverWorkers}},
		FetchCooldown: b.opts.riverCooldown,
		Workers:       workers,
		Logger:        warnLogger(),
	})
}

// newOutbox builds an outbox client on pool for the run's schema.
func (b *bench) newOutbox(pool *pgxpool.Pool, cfg outbox.Config) (*outbox.Client, error) {
	cfg.Schema = outboxSchema
	if cfg.Logger == nil {
		cfg.Logger = warnLogger()
	}
	return outbox.New(outboxpg.New(pool), cfg)
}

// newDispatcher builds a dispatcher with cfg (library defaults for the
// zero value) whose no-op publisher calls onPublish (if set).
func (b *bench) newDispatcher(pool *pgxpool.Pool, clientCfg outbox.Config, deleteOnDelivery bool, cfg outbox.DispatcherConfig,
	onPublish func(d outbox.Delivery)) (*outbox.Dispatcher, error) {
	client, err := b.newOutbox(pool, clientCfg)
	if err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = warnLogger()
	}
	return client.NewDispatcher(cfg, outbox.Publisher{Topic: benchTopic, Name: "river-bench", DeleteOnDelivery: deleteOnDelivery,
		Publish: func(_ context.Context, d outbox.Delivery) error {
			if onPublish != nil {
				onPublish(d)
			}
			return nil
		}})
}

// since stamps a time as nanoseconds after base, never 0 (0 means unset).
func since(base time.Time) int64 { return int64(time.Since(base)) + 1 }

// notifyNote says how often the outbox producers of the enqueue and latency
// workloads send NOTIFY.
func (b *bench) notifyNote() string {
	if b.opts.notifyInterval > 0 {
		return fmt.Sprintf("NOTIFY at most every %v per client and topic (-notify-interval)", b.opts.notifyInterval)
	}
	return "NOTIFY at most every 1ms per client and topic (Config.NotifyInterval default)"
}
