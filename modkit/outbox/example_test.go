package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// exampleDB gives an Example its own migrated database on the test server.
func exampleDB() (*pgtest.DB, func()) {
	d, err := pgtest.Open()
	if err != nil {
		panic(err)
	}
	return d, func() { _ = d.Close() }
}

// Enqueue an event in the transaction that makes the change it describes:
// both commit or neither does. A second enqueue with the same dedupe key is
// answered with the first event's id.
func ExampleEnqueue() {
	tdb, done := exampleDB()
	defer done()
	ctx := context.Background()
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY, state text)`); err != nil {
		panic(err)
	}

	placeOrder := func(id int) (outbox.Enqueued, error) {
		var res outbox.Enqueued
		err := db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES ($1, 'paid') ON CONFLICT DO NOTHING`, id); err != nil {
				return err
			}
			var err error
			res, err = outbox.Enqueue(ctx, tx, outbox.Message{
				Namespace: "shop",
				Topic:     "order_paid",
				DedupeKey: outbox.Key(fmt.Sprintf("order/%d", id)),
				Payload:   json.RawMessage(fmt.Sprintf(`{"order_id": %d}`, id)),
			})
			return err
		})
		return res, err
	}

	first, err := placeOrder(42)
	if err != nil {
		panic(err)
	}
	again, err := placeOrder(42)
	if err != nil {
		panic(err)
	}
	fmt.Println("same event:", first.ID == again.ID, "already enqueued:", first.AlreadyEnqueued, again.AlreadyEnqueued)

	// Bad input is rejected before anything is written.
	_, err = outbox.Enqueue(ctx, pool, outbox.Message{Namespace: "Shop!", Topic: "order_paid", Payload: json.RawMessage(`{}`)})
	var verr *outbox.ValidationError
	fmt.Println(errors.Is(err, outbox.ErrInvalidMessage), errors.As(err, &verr) && verr.Field == "Namespace")
	// Output:
	// same event: true already enqueued: false true
	// true true
}

// Run a dispatcher without fx: register a publisher per (namespace, topic),
// start, and stop when done. Returning outbox.Permanent(err) from a
// publisher dead-letters the event at once; any other error retries it.
func ExampleDispatcher() {
	tdb, done := exampleDB()
	defer done()
	ctx := context.Background()

	delivered := make(chan string, 1)
	var pubs outbox.Publishers
	err := pubs.Register(outbox.Publisher{
		Topic: outbox.Topic{Namespace: "shop", Topic: "order_paid"},
		Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
			var body struct {
				OrderID int `json:"order_id"`
			}
			if err := json.Unmarshal(m.Payload, &body); err != nil {
				return outbox.Permanent(err) // retrying cannot fix a malformed payload
			}
			delivered <- fmt.Sprintf("order %d paid (attempt %d)", body.OrderID, m.Attempts)
			return nil
		},
	})
	if err != nil {
		panic(err)
	}
	d, err := outbox.NewDispatcher(tdb.Provider.Pool, &pubs, outbox.DispatcherConfig{Logger: quietLog})
	if err != nil {
		panic(err)
	}
	if err := d.Start(ctx); err != nil {
		panic(err)
	}
	defer d.Stop(ctx)

	if _, err := outbox.Enqueue(ctx, tdb.Provider.Pool, outbox.Message{
		Namespace: "shop", Topic: "order_paid", Payload: json.RawMessage(`{"order_id": 7}`),
	}); err != nil {
		panic(err)
	}
	fmt.Println(<-delivered)
	// Output: order 7 paid (attempt 1)
}
