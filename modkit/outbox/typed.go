package outbox

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"reflect"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/db"
)

// TypedTopic binds a topic to the Go type of its payload, T, which is
// encoded as JSON with encoding/json. Declare one per topic, next to T, and
// use it on both sides:
//
//	var OrderPlaced = outbox.NewTypedTopic[OrderPlacedEvent]("shop", "order_placed")
//
//	_, err := OrderPlaced.Enqueue(ctx, client, tx, OrderPlacedEvent{OrderID: id})
//
//	OrderPlaced.Publisher(func(ctx context.Context, d outbox.TypedDelivery[OrderPlacedEvent]) error {
//		return notifyWarehouse(ctx, d.Value.OrderID)
//	})
//
// or, for an effect in the outbox's own database, TxPublisher (HandleTx).
//
// For a dedupe key or a tenant, build the Message with Message and set them
// before enqueueing it. The zero TypedTopic has no topic: enqueues and
// publishers built from it are refused. encoding/json replaces invalid
// UTF-8 in T's strings with U+FFFD rather than failing, so such a string
// is enqueued changed, where a raw Message payload holding the same bytes
// is refused (ErrInvalidPayload); validate the text T carries if that
// matters.
type TypedTopic[T any] struct{ topic Topic }

// NewTypedTopic returns the typed topic (namespace, topic) for payloads of
// type T. The names are checked when the topic is used (Enqueue, or the
// dispatcher's registration of its Publisher).
func NewTypedTopic[T any](namespace, topic string) TypedTopic[T] {
	return TypedTopic[T]{topic: Topic{Namespace: namespace, Topic: topic}}
}

// Topic returns the (namespace, topic) pair.
func (tt TypedTopic[T]) Topic() Topic { return tt.topic }

// Message encodes v as the payload of a Message of this topic. Set
// DedupeKey or TenantID on it as needed, then pass it to Client.Enqueue or
// EnqueueBatch. An error (matching ErrInvalidPayload) means v cannot be
// encoded as JSON; one matching ErrInvalidNamespace, that tt is the zero
// TypedTopic.
func (tt TypedTopic[T]) Message(v T) (Message, error) {
	if tt.topic == (Topic{}) {
		return Message{}, &ValidationError{Field: "Namespace", Kind: ErrInvalidNamespace, single: true,
			Reason: fmt.Sprintf("this TypedTopic[%s] is the zero value, which names no topic: make it with NewTypedTopic", reflect.TypeFor[T]())}
	}
	payload, err := json.Marshal(v)
	if err != nil {
		return Message{}, &ValidationError{Field: "Payload", Kind: ErrInvalidPayload, single: true,
			Reason: fmt.Sprintf("encoding %s as JSON for %s failed: %v", reflect.TypeFor[T](), tt.topic, err)}
	}
	return Message{Namespace: tt.topic.Namespace, Topic: tt.topic.Topic, Payload: payload}, nil
}

// Enqueue encodes v and enqueues it through c in tx, as Client.Enqueue does.
func (tt TypedTopic[T]) Enqueue(ctx context.Context, c *Client, tx db.Runner, v T) (Enqueued, error) {
	m, err := tt.Message(v)
	if err != nil {
		return Enqueued{}, err
	}
	return c.Enqueue(ctx, tx, m)
}

// TypedDelivery is a Delivery with its payload decoded into Value. The
// raw bytes stay in Delivery.Payload.
type TypedDelivery[T any] struct {
	Delivery
	// Value is Payload decoded with encoding/json.
	Value T
}

// Publisher returns the Publisher of this topic that decodes each payload
// into a T and calls publish. A payload that does not decode into T can
// never succeed: it is dead-lettered at once (a Permanent error naming the
// type) without calling publish. So is a JSON null when T is not a
// pointer, interface, map or slice: encoding/json would leave a zero T
// that no TypedTopic[T] producer can have sent.
//
// Decoding is encoding/json's otherwise: a field missing from the payload
// keeps its zero value and a field T does not have is ignored, so that
// producers and publishers can add fields at different times. Where a
// value must be present, check it in publish and return a Permanent error.
func (tt TypedTopic[T]) Publisher(publish func(ctx context.Context, d TypedDelivery[T]) error) Publisher {
	p, decode := tt.publisher()
	if publish == nil {
		return p // refused by NewDispatcher: neither Publish nor HandleTx
	}
	p.Publish = func(ctx context.Context, d Delivery) error {
		td, err := decode(d)
		if err != nil {
			return err
		}
		return publish(ctx, td)
	}
	return p
}

// TxPublisher is Publisher for a handler that records its effect in the
// outbox's database: handle runs as Publisher.HandleTx does, in tx, which
// commits its writes and the event's delivery together (so each event's
// effect happens once), with the payload decoded as Publisher decodes it.
func (tt TypedTopic[T]) TxPublisher(handle func(ctx context.Context, tx pgx.Tx, d TypedDelivery[T]) error) Publisher {
	p, decode := tt.publisher()
	if handle == nil {
		return p // refused by NewDispatcher: neither Publish nor HandleTx
	}
	p.HandleTx = func(ctx context.Context, tx pgx.Tx, d Delivery) error {
		td, err := decode(d)
		if err != nil {
			return err
		}
		return handle(ctx, tx, td)
	}
	return p
}

// publisher returns the topic's Publisher without its call, and the
// decoding of a Delivery into a TypedDelivery (see Publisher), whose
// errors are Permanent.
func (tt TypedTopic[T]) publisher() (Publisher, func(Delivery) (TypedDelivery[T], error)) {
	typ := reflect.TypeFor[T]()
	typeName := typ.String()
	nullable := false
	switch typ.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice:
		nullable = true
	}
	p := Publisher{Topic: tt.topic, Name: fmt.Sprintf("TypedTopic[%s] %s", typeName, tt.topic)}
	return p, func(d Delivery) (TypedDelivery[T], error) {
		td := TypedDelivery[T]{Delivery: d}
		if !nullable && string(bytes.TrimSpace(d.Payload)) == "null" {
			return td, Permanent(fmt.Errorf("the payload of event %s is null, which is no %s", d.ID, typeName))
		}
		if err := json.Unmarshal(d.Payload, &td.Value); err != nil {
			return td, Permanent(fmt.Errorf("decoding the payload of event %s into %s: %w", d.ID, typeName, err))
		}
		return td, nil
	}
}
