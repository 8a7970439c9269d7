package outbox

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// PublishFunc delivers one event to its consumer (seed 004's publish
// callback). Return nil when the consumer has it; an error to retry with
// backoff; an error wrapped with Permanent to dead-letter at once. ctx ends
// before the event's lease does (see DispatcherConfig.LeaseHeadroom): a
// publisher that respects it never outlives its lease. The dispatcher never
// looks inside the payload. Delivery is at least once: the same event (same
// ID and DedupeKey) can arrive again after a crash or a lost ack, so the
// consumer must be idempotent.
type PublishFunc func(ctx context.Context, m ClaimedMessage) error

// TxHandlerFunc handles one event inside a transaction of the outbox's own
// database, for consumers whose effects are rows in that database. The
// dispatcher marks the event delivered in the same transaction and commits:
// the handler's writes and the ack happen together or not at all, so the
// effect is exactly once even though delivery is at least once. Return an
// error (or Permanent) as for PublishFunc; the transaction is then rolled
// back. Do not commit or roll back tx yourself.
type TxHandlerFunc func(ctx context.Context, tx pgx.Tx, m ClaimedMessage) error

// Publisher registers the consumer of one (namespace, topic). Exactly one of
// Publish and HandleTx must be set.
type Publisher struct {
	Topic Topic
	// Publish hands events to an external consumer (a broker, a webhook,
	// an in-process call).
	Publish PublishFunc
	// HandleTx consumes events in a transaction of the outbox database
	// (transactional handler mode).
	HandleTx TxHandlerFunc
	// Name says who registered it, for error messages and logs. Default:
	// the function's name.
	Name string
}

// PublisherGroup is the fx value group that collects Publishers: provide
// them with fx.ResultTags(`group:"outbox_publishers"`), or with
// AsPublisher.
const PublisherGroup = "outbox_publishers"

func (p Publisher) name() string {
	if p.Name != "" {
		return p.Name
	}
	var fn any = p.Publish
	if p.Publish == nil {
		fn = p.HandleTx
	}
	if f := runtime.FuncForPC(reflect.ValueOf(fn).Pointer()); f != nil {
		return f.Name()
	}
	return "unnamed publisher"
}

// ErrDuplicatePublisher is returned when two publishers claim the same
// (namespace, topic).
var ErrDuplicatePublisher = errors.New("outbox: two publishers for one topic")

// Publishers is the registry of who publishes what. The zero value is
// ready to use; it is not safe for concurrent Register calls (register
// everything before starting the dispatcher).
type Publishers struct {
	byTopic map[Topic]Publisher
}

// Register adds p. It fails if p is incomplete or its topic already has a
// publisher; the error names both.
func (r *Publishers) Register(p Publisher) error {
	if err := validateTopics([]Topic{p.Topic}); err != nil {
		return fmt.Errorf("outbox: publisher %s: %w", p.name(), err)
	}
	if (p.Publish == nil) == (p.HandleTx == nil) {
		return fmt.Errorf("outbox: publisher for %s: set exactly one of Publish and HandleTx", p.Topic)
	}
	if r.byTopic == nil {
		r.byTopic = map[Topic]Publisher{}
	}
	if prev, ok := r.byTopic[p.Topic]; ok {
		return fmt.Errorf("%w: %s is registered by both %q and %q", ErrDuplicatePublisher, p.Topic, prev.name(), p.name())
	}
	r.byTopic[p.Topic] = p
	return nil
}

// Topics lists the registered topics, sorted.
func (r *Publishers) Topics() []Topic {
	out := make([]Topic, 0, len(r.byTopic))
	for t := range r.byTopic {
		out = append(out, t)
	}
	slices.SortFunc(out, func(a, b Topic) int { return strings.Compare(a.String(), b.String()) })
	return out
}

func (r *Publishers) lookup(t Topic) (Publisher, bool) {
	p, ok := r.byTopic[t]
	return p, ok
}
