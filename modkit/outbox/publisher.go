package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Topic names a (namespace, topic) pair.
type Topic struct {
	Namespace string
	Topic     string
}

// String returns "namespace/topic", as errors, logs and the dashboard
// write a topic. (The database, notifications, span names and the keys of
// Admin.Unserved's and Backlog's topics write "namespace:topic".)
func (t Topic) String() string { return t.Namespace + "/" + t.Topic }

// compareTopics orders topics by namespace, then topic, byte by byte.
func compareTopics(a, b Topic) int {
	return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Topic, b.Topic))
}

// key is the topic as the driver and notifications spell it.
func (t Topic) key() string { return t.Namespace + ":" + t.Topic }

// Delivery is one event handed to a publisher.
type Delivery struct {
	// ID is the event's stable id: the same on every redelivery.
	ID        uuid.UUID
	Namespace string
	Topic     string
	TenantID  *uuid.UUID
	DedupeKey *string
	// Payload as enqueued (as jsonb normalises it: key order and
	// whitespace may differ).
	Payload json.RawMessage
	// Attempt counts delivery attempts including this one (1 on the first).
	Attempt int
	// MaxAttempts is the budget of the dispatcher delivering it.
	MaxAttempts int
	// CreatedAt is when the event was enqueued (its transaction's start).
	CreatedAt time.Time
	// OrderingKey is the message's ordering key ("" without one), and
	// Sequence the event's place among the key's events (1, 2, …; 0
	// without a key). Events of one key reach the publisher one at a
	// time, in Sequence order: the next is claimed only after this one is
	// delivered (or dead and skipped). A key whose sequence row an
	// operator pruned (Admin.PruneSequences: it had no event left) starts
	// again at 1 when used again, so (OrderingKey, Sequence) names an
	// event only until then: deduplicate by ID.
	OrderingKey string
	Sequence    int64
	// Headers as enqueued (Message.Headers, plus the W3C trace context of
	// the enqueue, which the dispatcher also restores into the publish
	// ctx); nil when there are none. Do not modify.
	Headers map[string]string

	leaseToken uuid.UUID
}

// Publisher registers the consumer of one (namespace, topic). Exactly one of
// Publish and HandleTx must be set.
type Publisher struct {
	Topic Topic
	// Publish delivers one event to an external consumer (a broker, a
	// webhook, an in-process call). Return nil when the consumer has it; an
	// error to retry with backoff (an error with a RetryAfter()
	// time.Duration method, such as outboxhttp's StatusError for a
	// Retry-After header, waits at least that long, at most 24h); an error
	// wrapped with Permanent to dead-letter at once. ctx ends at the publish deadline, before the
	// event's lease does: a publisher that respects it never outlives its
	// lease. One that ignores it is abandoned at the deadline, its attempt
	// counted as failed (see the package documentation, "Topic
	// isolation"). Delivery is at least once: the same event (same ID
	// and DedupeKey) can arrive again after a crash or a lost outcome, so
	// the consumer must be idempotent.
	Publish func(ctx context.Context, d Delivery) error
	// HandleTx consumes one event inside a transaction of the outbox's own
	// PostgreSQL database, for consumers whose effects are rows there. The
	// dispatcher marks the event delivered in the same transaction and
	// commits: the handler's writes and the outcome happen together or not
	// at all, so the effect is exactly once even though delivery is at
	// least once. Return errors as for Publish; the transaction is then
	// rolled back. Do not commit or roll back tx yourself. Each call holds
	// one pool connection for its whole transaction, so by default the
	// dispatcher's topics with HandleTx share the pool's connections less
	// three (for its claims, outcome writes and listener), at least one
	// call each: a single such topic runs 1 at a time on a pool of 4 (pgx's
	// default is the larger of 4 and the number of CPUs). For more at once,
	// raise the pool's MaxConns (or set Concurrency); NewDispatcher logs a
	// warning when the pool is smaller than these publishers' limits plus
	// three.
	HandleTx func(ctx context.Context, tx pgx.Tx, d Delivery) error
	// Name says who registered it, for errors and logs. Default: the
	// function's name.
	Name string
	// Concurrency bounds this topic's publishes in flight, so that one slow
	// or hung topic cannot take every worker of its dispatcher. Default:
	// the dispatcher's Concurrency when it serves one topic, half of it
	// (at least 1) when it serves several; with HandleTx, at most what the
	// pool has connections for (see HandleTx). At most the dispatcher's
	// Concurrency. A topic's second and later publishes do not take the
	// dispatcher's last free slot while another topic has no publish in
	// flight: topics whose publishes hang, alone or together, leave that
	// slot to the others, and so while any topic is idle the busy ones
	// together use one slot fewer than the dispatcher's Concurrency. A
	// topic's first publish may take any free slot, so topics allowed one
	// slot each (the default when the dispatcher's Concurrency is below 4)
	// can together hold every slot.
	Concurrency int
	// Retention keeps this topic's delivered events this long before the
	// dispatcher's maintenance purges them (and with them their dedupe
	// keys). Zero takes DispatcherConfig.Retention; negative keeps them
	// forever. Since migration 0025, events kept longer than other topics'
	// retentions are read by those topics' purges only on their full walk,
	// once an hour (see DispatcherConfig.Retention).
	Retention time.Duration
	// DeleteOnDelivery deletes each of this topic's events in the write
	// that records its delivery, instead of keeping it as delivered until
	// Retention ends. The attempts ledger keeps its history, the delivery
	// included (Admin.History); Admin.Get, Admin.List, Admin.Stats,
	// Admin.Settled and Admin.Series no longer see it (the dashboard's
	// delivery charts show none of its deliveries), and its dedupe key is free again at once, so an
	// enqueue of the same key after the delivery enqueues a new event. It
	// saves the database a third of the WAL an event costs and the purge of
	// delivered events; after migrations 0018 and 0019 drains ran 18-43%
	// faster than with delivered events kept (BENCHMARKS.md, "Delete on
	// delivery" and "Kept deliveries by lease token"). Off by default: seed
	// 004 keeps delivered events, and their dedupe keys, for the
	// retention. Retention must be zero when it is set.
	DeleteOnDelivery bool
	// SkipDeadHeads lets the later events of an ordering key go on when
	// one of the key's events becomes dead. By default a dead event holds
	// its key back (payments must not skip) until an operator skips it
	// (Admin.SkipHead) or replays it; Admin.BlockedKeys lists such keys.
	// The events after a dead head go on as soon as the dispatcher has
	// recorded its death.
	SkipDeadHeads bool
}

func (p Publisher) name() string {
	if p.Name != "" {
		return p.Name
	}
	var fn any = p.Publish
	if p.Publish == nil {
		fn = p.HandleTx
	}
	if fn == nil || reflect.ValueOf(fn).IsNil() {
		return "unnamed publisher"
	}
	if f := runtime.FuncForPC(reflect.ValueOf(fn).Pointer()); f != nil {
		return f.Name()
	}
	return "unnamed publisher"
}

func validateTopic(t Topic) error {
	if !validName(t.Namespace) || !validName(t.Topic) {
		return configError("topic %q/%q: namespace and topic must match %s", t.Namespace, t.Topic, namePattern)
	}
	return nil
}

// registry is who publishes what, with each topic's settings resolved.
type registry struct {
	byKey  map[string]*Publisher
	topics []Topic // sorted
	keys   []string
	// skipDead are the keys of the topics whose publishers skip dead
	// heads.
	skipDead []string
	// telemetry holds each registered topic's span options and metric
	// attributes, built once: building them per event cost about a sixth
	// of a drain's client CPU.
	telemetry map[Topic]topicTelemetry
}

// topicTelemetry is what the dispatcher attaches to one topic's publish
// spans and measurements.
type topicTelemetry struct {
	spanOptions []trace.SpanStartOption
	attrs       metric.MeasurementOption
}

func newTopicTelemetry(t Topic) topicTelemetry {
	return topicTelemetry{spanOptions: publishSpanOptions(t), attrs: topicAttrs(t)}
}

// telemetryOf returns t's telemetry, built afresh for a topic that is not
// registered.
func (r *registry) telemetryOf(t Topic) topicTelemetry {
	if tt, ok := r.telemetry[t]; ok {
		return tt
	}
	return newTopicTelemetry(t)
}

func newRegistry(pubs []Publisher) (*registry, error) {
	r := &registry{byKey: map[string]*Publisher{}, telemetry: map[Topic]topicTelemetry{}}
	for _, p := range pubs {
		if err := validateTopic(p.Topic); err != nil {
			return nil, fmt.Errorf("publisher %s: %w", p.name(), err)
		}
		if (p.Publish == nil) == (p.HandleTx == nil) {
			return nil, configError("publisher %s for %s: set exactly one of Publish and HandleTx", p.name(), p.Topic)
		}
		if p.DeleteOnDelivery && p.Retention != 0 {
			return nil, configError("publisher %s for %s: Retention is %v with DeleteOnDelivery set; delivered events are then deleted at once, so leave Retention zero",
				p.name(), p.Topic, p.Retention)
		}
		if p.Concurrency < 0 {
			return nil, configError("publisher %s for %s: Concurrency is %d; it must not be negative", p.name(), p.Topic, p.Concurrency)
		}
		if prev, ok := r.byKey[p.Topic.key()]; ok {
			return nil, fmt.Errorf("%w: %s is registered by both %q and %q", ErrDuplicatePublisher, p.Topic, prev.name(), p.name())
		}
		r.byKey[p.Topic.key()] = &p
		r.topics = append(r.topics, p.Topic)
		r.telemetry[p.Topic] = newTopicTelemetry(p.Topic)
	}
	slices.SortFunc(r.topics, func(a, b Topic) int { return strings.Compare(a.key(), b.key()) })
	for _, t := range r.topics {
		r.keys = append(r.keys, t.key())
		if r.byKey[t.key()].SkipDeadHeads {
			r.skipDead = append(r.skipDead, t.key())
		}
	}
	return r, nil
}
