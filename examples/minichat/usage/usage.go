// Package usage is Mini Chat's usage collector: the consumer of the
// mini-chat/usage_snapshot events. It records each turn's usage once, keyed
// by (tenant, turn, request), in its own table, inside the transaction in
// which the outbox acks the event (outbox.Publisher.HandleTx): the record
// and the ack commit together, and a redelivered event finds its record
// already there and changes nothing.
package usage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.uber.org/fx"

	"github.com/modkit-go/modkit/examples/minichat/events"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// ErrBackendUnavailable is the injected transient failure.
var ErrBackendUnavailable = errors.New("usage: billing backend unavailable (injected)")

// Config tunes the collector. The zero value records everything and
// injects no failures.
type Config struct {
	// TransientFailureRate is the fraction of first delivery attempts that
	// fail with ErrBackendUnavailable, as if the billing backend were
	// briefly down; the outbox retries them with backoff. 0 disables it.
	TransientFailureRate float64
	// Seed makes the injected failures reproducible.
	Seed uint64
	// OnFirstSeen, if set, is called when the collector is first handed a
	// well-formed event (attempt 1), with the turn id and the local time
	// (the demo measures commit-to-publish latency with it). Keep it fast.
	OnFirstSeen func(turnID uuid.UUID, at time.Time)
}

// Stats counts what the collector saw. Recorded counts inserts made in
// handler transactions; in the rare case where the ack then fails to
// commit, the event is delivered again and counted again here, while the
// table keeps one row.
type Stats struct {
	Recorded          int64 // usage records inserted
	Redeliveries      int64 // events whose record already existed: ignored
	TransientFailures int64 // injected failures (retried by the outbox)
	Rejected          int64 // malformed events rejected permanently (dead-lettered)
}

// Collector records usage. It is safe for concurrent use.
type Collector struct {
	cfg Config
	log *slog.Logger

	mu  sync.Mutex // guards rng
	rng *rand.Rand

	recorded, redeliveries, transient, rejected atomic.Int64
}

// NewCollector returns a collector.
func NewCollector(cfg Config, log *slog.Logger) *Collector {
	if log == nil {
		log = slog.Default()
	}
	return &Collector{cfg: cfg, log: log.With("module", "usage"),
		rng: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))}
}

// Stats returns a snapshot of the counters.
func (c *Collector) Stats() Stats {
	return Stats{Recorded: c.recorded.Load(), Redeliveries: c.redeliveries.Load(),
		TransientFailures: c.transient.Load(), Rejected: c.rejected.Load()}
}

// Publisher is the collector's registration with the outbox, in
// transactional handler mode.
func (c *Collector) Publisher() outbox.Publisher {
	return outbox.Publisher{Topic: events.UsageTopic, Name: "usage-collector", HandleTx: c.Handle}
}

// Handle records one usage event in tx, which the dispatcher commits
// together with the event's ack. A malformed event is rejected with
// outbox.Permanent, which dead-letters it at once; a failure injected by
// Config.TransientFailureRate is an ordinary error, which the outbox
// retries.
func (c *Collector) Handle(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
	snap, err := decode(d)
	if err != nil {
		c.rejected.Add(1)
		return outbox.Permanent(err)
	}
	if d.Attempt == 1 {
		if c.cfg.OnFirstSeen != nil {
			c.cfg.OnFirstSeen(snap.TurnID, time.Now())
		}
		if c.injectFailure() {
			c.transient.Add(1)
			return fmt.Errorf("record usage of turn %s: %w", snap.TurnID, ErrBackendUnavailable)
		}
	}
	inserted, err := record(ctx, tx, d.ID, snap)
	if err != nil {
		return err
	}
	if !inserted {
		c.redeliveries.Add(1)
		c.log.Debug("usage already recorded; redelivery ignored", "turn_id", snap.TurnID, "event_id", d.ID, "attempt", d.Attempt)
		return nil
	}
	c.recorded.Add(1)
	return nil
}

// decode parses and checks an event: the payload must be a valid snapshot
// whose (tenant, turn, request) agree with the event's tenant and dedupe
// key.
func decode(d outbox.Delivery) (*events.UsageSnapshot, error) {
	var snap events.UsageSnapshot
	if err := json.Unmarshal(d.Payload, &snap); err != nil {
		return nil, fmt.Errorf("%w: %w", events.ErrMalformed, err)
	}
	if err := snap.Validate(); err != nil {
		return nil, err
	}
	if d.TenantID == nil || *d.TenantID != snap.TenantID {
		return nil, fmt.Errorf("%w: the event's tenant is not the payload's tenant_id %s", events.ErrMalformed, snap.TenantID)
	}
	if want := events.DedupeKey(snap.TenantID, snap.TurnID, snap.RequestID); d.DedupeKey == nil || *d.DedupeKey != want {
		return nil, fmt.Errorf("%w: dedupe key is not %q", events.ErrMalformed, want)
	}
	return &snap, nil
}

// record inserts the usage row unless the (tenant, turn, request) already
// has one, and reports whether it inserted.
func record(ctx context.Context, tx pgx.Tx, eventID uuid.UUID, s *events.UsageSnapshot) (bool, error) {
	tag, err := tx.Exec(ctx, `INSERT INTO minichat_usage_records
	(tenant_id, turn_id, request_id, user_id, chat_id, event_id, terminal_state, billing_outcome,
	 input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, reasoning_tokens, credits_micro)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (tenant_id, turn_id, request_id) DO NOTHING`,
		s.TenantID, s.TurnID, s.RequestID, s.UserID, s.ChatID, eventID, s.TerminalState, s.BillingOutcome,
		s.Usage.InputTokens, s.Usage.OutputTokens, s.Usage.CacheReadTokens, s.Usage.CacheWriteTokens,
		s.Usage.ReasoningTokens, s.CreditsMicro)
	if err != nil {
		return false, fmt.Errorf("record usage of turn %s: %w", s.TurnID, err)
	}
	return tag.RowsAffected() == 1, nil
}

func (c *Collector) injectFailure() bool {
	if c.cfg.TransientFailureRate <= 0 {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rng.Float64() < c.cfg.TransientFailureRate
}

// ModuleParams is what Module takes from the graph.
type ModuleParams struct {
	fx.In
	Config Config       `optional:"true"`
	Logger *slog.Logger `optional:"true"`
}

// Module provides the *Collector and registers its publisher with the
// outbox (in the outbox_publishers value group, through
// outbox.AsPublisher). It takes an optional Config and *slog.Logger.
var Module = fx.Module("minichat-usage",
	fx.Provide(func(p ModuleParams) *Collector { return NewCollector(p.Config, p.Logger) }),
	fx.Provide(outbox.AsPublisher(func(c *Collector) outbox.Publisher { return c.Publisher() })),
)
