package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
)

type orderPlaced struct {
	OrderID string `json:"order_id"`
	Cents   int64  `json:"cents"`
}

var orderPlacedTopic = outbox.NewTypedTopic[orderPlaced]("shop", "order_placed")

// A typed topic encodes T at enqueue and hands the publisher T decoded,
// with the raw payload still there; a payload that does not decode into T,
// or a JSON null for a T that cannot be nil, is dead-lettered at once
// without reaching the publisher. A null for a pointer T is delivered as
// nil.
func TestTypedTopic(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	first, err := orderPlacedTopic.Enqueue(ctx, c, pool, orderPlaced{OrderID: "o-1", Cents: 1250})
	if err != nil {
		t.Fatal(err)
	}
	m, err := orderPlacedTopic.Message(orderPlaced{OrderID: "o-2", Cents: 99})
	if err != nil {
		t.Fatal(err)
	}
	m.DedupeKey = outbox.Key("order/o-2")
	second, err := c.Enqueue(ctx, pool, m)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := c.Enqueue(ctx, pool, m); err != nil || !again.AlreadyEnqueued {
		t.Fatalf("the typed message's dedupe key: %+v %v", again, err)
	}
	topic := orderPlacedTopic.Topic()
	bad, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`"not an order"`)})
	if err != nil {
		t.Fatal(err)
	}
	null, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`null`)})
	if err != nil {
		t.Fatal(err)
	}
	pointerTopic := outbox.NewTypedTopic[*orderPlaced]("shop", "order_maybe")
	nilPointer, err := pointerTopic.Enqueue(ctx, c, pool, nil)
	if err != nil {
		t.Fatal(err)
	}

	got := make(chan outbox.TypedDelivery[orderPlaced], 5)
	gotPointer := make(chan outbox.TypedDelivery[*orderPlaced], 1)
	log := newOutcomeLog()
	startDispatcher(t, c, testConfig(log), orderPlacedTopic.Publisher(func(_ context.Context, d outbox.TypedDelivery[orderPlaced]) error {
		got <- d
		return nil
	}), pointerTopic.Publisher(func(_ context.Context, d outbox.TypedDelivery[*orderPlaced]) error {
		gotPointer <- d
		return nil
	}))
	log.waitFor(t, "five outcomes", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m) == 5 })
	close(got)
	want := map[uuid.UUID]orderPlaced{first.ID: {"o-1", 1250}, second.ID: {"o-2", 99}}
	for d := range got {
		if d.Value != want[d.ID] || !strings.Contains(string(d.Payload), `"order_id"`) {
			t.Errorf("delivery %s: value %+v, payload %s; want %+v", d.ID, d.Value, d.Payload, want[d.ID])
		}
		delete(want, d.ID)
	}
	if len(want) != 0 {
		t.Fatalf("not delivered: %v", want)
	}
	e := get(t, c, bad.ID)
	if e.Status != outbox.StatusDead || e.Attempts != 1 || e.LastError == nil || !strings.Contains(*e.LastError, "outbox_test.orderPlaced") {
		t.Fatalf("undecodable payload: %+v", e)
	}
	e = get(t, c, null.ID)
	if e.Status != outbox.StatusDead || e.Attempts != 1 || e.LastError == nil || !strings.Contains(*e.LastError, "is null, which is no outbox_test.orderPlaced") {
		t.Fatalf("null payload: %+v", e)
	}
	if d := <-gotPointer; d.ID != nilPointer.ID || d.Value != nil {
		t.Fatalf("a null payload of a pointer topic: %s with %v; want %s with nil", d.ID, d.Value, nilPointer.ID)
	}
}

// The zero TypedTopic names no topic: it is refused on both sides.
func TestTypedTopicZeroValueRefused(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	var zero outbox.TypedTopic[orderPlaced]
	// Message says what is wrong (it left the namespace empty, for Enqueue
	// to refuse as an empty namespace); so Enqueue does.
	if m, err := zero.Message(orderPlaced{}); !errors.Is(err, outbox.ErrInvalidNamespace) || (err == nil || !strings.Contains(err.Error(), "zero value")) {
		t.Fatalf("message of the zero TypedTopic: %+v, %v; want ErrInvalidNamespace saying it is the zero value", m, err)
	}
	if _, err := zero.Enqueue(ctx, c, tdb.Provider.Pool, orderPlaced{}); !errors.Is(err, outbox.ErrInvalidNamespace) || (err == nil || !strings.Contains(err.Error(), "NewTypedTopic")) {
		t.Fatalf("enqueue through the zero TypedTopic: %v, want ErrInvalidNamespace naming NewTypedTopic", err)
	}
	pub := zero.Publisher(func(context.Context, outbox.TypedDelivery[orderPlaced]) error { return nil })
	if _, err := c.NewDispatcher(outbox.DispatcherConfig{}, pub); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("dispatcher for the zero TypedTopic: %v, want ErrInvalidConfig", err)
	}
	if _, err := outbox.NewTypedTopic[func()]("shop", "funcs").Message(func() {}); !errors.Is(err, outbox.ErrInvalidPayload) {
		t.Fatalf("unencodable value: %v, want ErrInvalidPayload", err)
	}
}

// TxPublisher hands a HandleTx handler the payload decoded: its writes in
// tx commit with the delivery, and a payload that does not decode is
// dead-lettered without calling it (its transaction rolled back).
func TestTypedTopicTxPublisher(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, "CREATE TABLE placed (order_id text PRIMARY KEY, cents bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	good, err := orderPlacedTopic.Enqueue(ctx, c, pool, orderPlaced{OrderID: "o-7", Cents: 700})
	if err != nil {
		t.Fatal(err)
	}
	topic := orderPlacedTopic.Topic()
	bad, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`[1, 2]`)})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	log := newOutcomeLog()
	startDispatcher(t, c, testConfig(log), orderPlacedTopic.TxPublisher(func(ctx context.Context, tx pgx.Tx, d outbox.TypedDelivery[orderPlaced]) error {
		calls.Add(1)
		_, err := tx.Exec(ctx, "INSERT INTO placed VALUES ($1, $2)", d.Value.OrderID, d.Value.Cents)
		return err
	}))
	log.waitFor(t, "two outcomes", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m) == 2 })
	var cents int64
	if err := pool.QueryRow(ctx, "SELECT cents FROM placed WHERE order_id = 'o-7'").Scan(&cents); err != nil || cents != 700 {
		t.Fatalf("the handler's row: %d, %v; want 700", cents, err)
	}
	if e := get(t, c, good.ID); e.Status != outbox.StatusDelivered {
		t.Fatalf("the decodable event: %s, want delivered", e.Status)
	}
	if e := get(t, c, bad.ID); e.Status != outbox.StatusDead || e.LastError == nil || !strings.Contains(*e.LastError, "outbox_test.orderPlaced") {
		t.Fatalf("the undecodable event: %+v, want dead naming the type", e)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want once (not for the undecodable payload)", n)
	}
}
