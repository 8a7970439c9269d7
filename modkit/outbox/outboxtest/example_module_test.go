package outboxtest_test

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// The module under test: placing an order writes the order and its event in
// one transaction.

type OrderPlaced struct {
	OrderID string `json:"order_id"`
	Cents   int64  `json:"cents"`
}

var OrderPlacedTopic = outbox.NewTypedTopic[OrderPlaced]("shop", "order_placed")

type Orders struct {
	pool   *db.Provider
	outbox *outbox.Client
}

func (o *Orders) Place(ctx context.Context, id string, cents int64) error {
	return o.pool.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, cents) VALUES ($1, $2)`, id, cents); err != nil {
			return err
		}
		_, err := OrderPlacedTopic.Enqueue(ctx, o.outbox, tx, OrderPlaced{OrderID: id, Cents: cents})
		return err
	})
}

// The module's test. In the module's own _test.go file it is
//
//	func TestMain(m *testing.M) { outboxtest.Main(m) }
//
//	func TestPlaceOrder(t *testing.T) { … }
//
// with the body below; t is a *testing.T.
func testPlaceOrder(t outboxtest.TB) {
	ctx := context.Background()
	client, tdb := outboxtest.NewClient(t, outbox.Config{})
	if _, err := tdb.Provider.Pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, cents bigint NOT NULL)`); err != nil {
		t.Fatalf("create orders: %v", err)
	}
	orders := &Orders{pool: tdb.Provider, outbox: client}
	if err := orders.Place(ctx, "o-1", 1250); err != nil {
		t.Fatalf("place: %v", err)
	}

	// The event is there, with the payload the module promised.
	outboxtest.RequireEnqueued(t, client, OrderPlacedTopic.Topic(), outboxtest.Payload(OrderPlaced{OrderID: "o-1", Cents: 1250}))

	// And the consumer gets it: deliver everything to a recorder.
	rec := outboxtest.NewRecorder()
	published := outboxtest.Drain(t, client, rec.Publisher(OrderPlacedTopic.Topic()))
	for _, d := range published {
		fmt.Printf("published %s/%s %s\n", d.Namespace, d.Topic, d.Payload)
	}
}

func Example_moduleTest() {
	t := &exampleT{}
	defer t.cleanup()
	testPlaceOrder(t)
	// Output:
	// published shop/order_placed {"cents": 1250, "order_id": "o-1"}
}

// exampleT stands in for the *testing.T a real test receives. Its log is
// dropped, as go test shows a passing test's log only with -v (the
// helpers log what the test may want to know when it fails: a drained
// dispatcher's warnings, say).
type exampleT struct{ cleanups []func() }

func (*exampleT) Helper()                           {}
func (*exampleT) Logf(string, ...any)               {}
func (*exampleT) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (e *exampleT) Cleanup(f func())                { e.cleanups = append(e.cleanups, f) }
func (e *exampleT) cleanup() {
	for _, f := range slices.Backward(e.cleanups) {
		f()
	}
}
