package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// notifyIntervalDefault is outbox.Config.NotifyInterval's documented
// default. The library does not export it (nor any Config accessor), so
// the notes that mention it use this copy.
const notifyIntervalDefault = "1ms"

// newClient returns an outbox client on pool for the run's schema, with
// cfg otherwise as given. Its dispatchers log to the bench's dispatcher
// logger.
func (b *bench) newClient(pool *pgxpool.Pool, cfg outbox.Config) (*outbox.Client, error) {
	cfg.Schema = b.t.schema
	if cfg.Logger == nil {
		cfg.Logger = b.dispatcherLog
	}
	return outbox.New(outboxpg.New(pool), cfg)
}

// noopPublisher is a publisher for benchTopic that calls fn (if set) and
// succeeds.
func noopPublisher(fn func(d outbox.Delivery)) outbox.Publisher {
	return outbox.Publisher{Topic: benchTopic, Name: "outbox-bench", Publish: func(_ context.Context, d outbox.Delivery) error {
		if fn != nil {
			fn(d)
		}
		return nil
	}}
}

// newDispatcher builds a dispatcher for benchTopic on pool with cfg, its
// publisher calling fn for every delivery.
func (b *bench) newDispatcher(pool *pgxpool.Pool, cfg outbox.DispatcherConfig, fn func(d outbox.Delivery)) (*outbox.Dispatcher, error) {
	client, err := b.newClient(pool, outbox.Config{})
	if err != nil {
		return nil, err
	}
	return client.NewDispatcher(cfg, noopPublisher(fn))
}

// resolveDefaults reads the library's dispatcher defaults from a
// dispatcher that is built but never started (building one does no I/O),
// so that the baselines and notes follow the library rather than copies of
// its constants; it fills in the options left at "library default" and
// checks that the dispatcher accepts the configured batch and concurrency
// before any workload runs.
func (b *bench) resolveDefaults() error {
	d, err := b.newDispatcher(b.t.admin, outbox.DispatcherConfig{}, nil)
	if err != nil {
		return fmt.Errorf("read the library's defaults: %w", err)
	}
	b.defaults = d.Config()
	if b.opts.concurrency == 0 {
		b.opts.concurrency = b.defaults.Concurrency
	}
	if _, err := b.newDispatcher(b.t.admin, outbox.DispatcherConfig{BatchSize: b.opts.batch, Concurrency: b.opts.concurrency}, nil); err != nil {
		return fmt.Errorf("-batch %d, -concurrency %d: %w", b.opts.batch, b.opts.concurrency, err)
	}
	return nil
}

// claimParams are the raw claim's parameters as the library passes them:
// $1 MaxAttempts, $2 topic keys ("namespace:topic"), $3 limit, $4 worker
// id, $5 lease.
func (b *bench) claimParams(limit int, worker any) []any {
	keys := []string{benchTopic.Namespace + ":" + benchTopic.Topic}
	return []any{b.defaults.MaxAttempts, keys, limit, worker, b.defaults.LeaseDuration}
}
