package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"go.uber.org/fx"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// exampleDB gives an Example its own migrated database on the test server,
// and a Client on it.
func exampleDB() (*pgtest.DB, *outbox.Client, func()) {
	d, err := pgtest.Open()
	if err != nil {
		panic(err)
	}
	client, err := outbox.New(outboxpg.New(d.Provider.Pool), outbox.Config{Logger: quietLog})
	if err != nil {
		panic(err)
	}
	return d, client, func() { _ = d.Close() }
}

// Create the outbox tables in a schema of your choice. The client is bound
// to that schema: its enqueues, dispatchers and Admin all use it.
func ExampleClient_Migrate() {
	tdb, _, done := exampleDB()
	defer done()
	ctx := context.Background()
	client, err := outbox.New(outboxpg.New(tdb.Provider.Pool), outbox.Config{Schema: "billing"})
	if err != nil {
		panic(err)
	}
	if err := client.Migrate(ctx); err != nil { // safe to run from every replica at start-up
		panic(err)
	}
	res, err := client.Enqueue(ctx, tdb.Provider.Pool, outbox.Message{Namespace: "billing", Topic: "invoice_issued", Payload: json.RawMessage(`{}`)})
	if err != nil {
		panic(err)
	}
	var schema string
	if err := tdb.Provider.Pool.QueryRow(ctx, `SELECT schemaname FROM pg_stat_user_tables WHERE relname = 'modkit_outbox_events' AND schemaname = 'billing'`).Scan(&schema); err != nil {
		panic(err)
	}
	e, _ := client.Admin().Get(ctx, res.ID)
	fmt.Println(schema, e.Status)
	// Output: billing pending
}

// Enqueue an event in the transaction that makes the change it describes:
// both commit or neither does. A second enqueue with the same dedupe key is
// answered with the first event's id.
func ExampleClient_Enqueue() {
	tdb, client, done := exampleDB()
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
			res, err = client.Enqueue(ctx, tx, outbox.Message{
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
	_, err = client.Enqueue(ctx, pool, outbox.Message{Namespace: "Shop!", Topic: "order_paid", Payload: json.RawMessage(`{}`)})
	var verr *outbox.ValidationError
	fmt.Println(errors.Is(err, outbox.ErrInvalidMessage), errors.As(err, &verr) && verr.Field == "Namespace")
	// Output:
	// same event: true already enqueued: false true
	// true true
}

// Enqueue many events in one statement; duplicates inside the batch and
// against the table are answered with the existing ids.
func ExampleClient_EnqueueBatch() {
	tdb, client, done := exampleDB()
	defer done()
	ctx := context.Background()
	var msgs []outbox.Message
	for _, sku := range []string{"a-1", "b-2", "a-1"} {
		msgs = append(msgs, outbox.Message{Namespace: "stock", Topic: "reserved", DedupeKey: outbox.Key("sku/" + sku),
			Payload: json.RawMessage(fmt.Sprintf(`{"sku": %q}`, sku))})
	}
	res, err := client.EnqueueBatch(ctx, tdb.Provider.Pool, msgs)
	if err != nil {
		panic(err)
	}
	fmt.Println(len(res), "results;", "first and third are one event:", res[0].ID == res[2].ID, res[2].AlreadyEnqueued)
	// Output: 3 results; first and third are one event: true true
}

// Run a dispatcher without fx: one publisher per (namespace, topic), start,
// and stop when done. Returning outbox.Permanent(err) from a publisher
// dead-letters the event at once; any other error retries it.
func ExampleClient_NewDispatcher() {
	tdb, client, done := exampleDB()
	defer done()
	ctx := context.Background()

	delivered := make(chan string, 1)
	d, err := client.NewDispatcher(outbox.DispatcherConfig{}, outbox.Publisher{
		Topic: outbox.Topic{Namespace: "shop", Topic: "order_paid"},
		Publish: func(ctx context.Context, m outbox.Delivery) error {
			var body struct {
				OrderID int `json:"order_id"`
			}
			if err := json.Unmarshal(m.Payload, &body); err != nil {
				return outbox.Permanent(err) // retrying cannot fix a malformed payload
			}
			delivered <- fmt.Sprintf("order %d paid (attempt %d)", body.OrderID, m.Attempt)
			return nil
		},
	})
	if err != nil {
		panic(err)
	}
	if err := d.Start(ctx); err != nil {
		panic(err)
	}
	defer d.Stop(ctx)

	if _, err := client.Enqueue(ctx, tdb.Provider.Pool, outbox.Message{
		Namespace: "shop", Topic: "order_paid", Payload: json.RawMessage(`{"order_id": 7}`),
	}); err != nil {
		panic(err)
	}
	fmt.Println(<-delivered)
	// Output: order 7 paid (attempt 1)
}

// A consumer whose effect is rows in the outbox's own database uses
// HandleTx: its writes and the delivered mark commit together, so a
// redelivery after a crash finds the work either done or not begun.
func ExamplePublisher_handleTx() {
	tdb, client, done := exampleDB()
	defer done()
	ctx := context.Background()
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE ledger (event_id uuid PRIMARY KEY, amount int)`); err != nil {
		panic(err)
	}
	booked := make(chan struct{}, 1)
	d, err := client.NewDispatcher(outbox.DispatcherConfig{OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
		if o.Status == outbox.StatusDelivered {
			booked <- struct{}{}
		}
	}}, outbox.Publisher{
		Topic: outbox.Topic{Namespace: "pay", Topic: "captured"},
		HandleTx: func(ctx context.Context, tx pgx.Tx, m outbox.Delivery) error {
			var body struct{ Amount int }
			if err := json.Unmarshal(m.Payload, &body); err != nil {
				return outbox.Permanent(err)
			}
			_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1, $2)`, m.ID, body.Amount)
			return err
		},
	})
	if err != nil {
		panic(err)
	}
	if err := d.Start(ctx); err != nil {
		panic(err)
	}
	defer d.Stop(ctx)
	res, err := client.Enqueue(ctx, pool, outbox.Message{Namespace: "pay", Topic: "captured", Payload: json.RawMessage(`{"Amount": 250}`)})
	if err != nil {
		panic(err)
	}
	<-booked
	var amount int
	if err := pool.QueryRow(ctx, `SELECT amount FROM ledger WHERE event_id = $1`, res.ID).Scan(&amount); err != nil {
		panic(err)
	}
	fmt.Println("booked", amount)
	// Output: booked 250
}

// An operator lists dead events and replays them, by id or by filter. Each
// replay is recorded in the event's History (a "replayed" entry naming who
// asked); last_error keeps the error the event died with.
func ExampleAdmin_ReplayDead() {
	tdb, client, done := exampleDB()
	defer done()
	ctx := context.Background()
	pool := tdb.Provider.Pool
	topic := outbox.Topic{Namespace: "mail", Topic: "welcome"}
	dead := make(chan struct{}, 1)
	d, err := client.NewDispatcher(outbox.DispatcherConfig{Logger: quietLog, OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
		if o.Status == outbox.StatusDead {
			dead <- struct{}{}
		}
	}}, outbox.Publisher{Topic: topic, Publish: func(context.Context, outbox.Delivery) error {
		return outbox.Permanent(errors.New("mailbox does not exist"))
	}})
	if err != nil {
		panic(err)
	}
	if err := d.Start(ctx); err != nil {
		panic(err)
	}
	if _, err := client.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: json.RawMessage(`{}`)}); err != nil {
		panic(err)
	}
	<-dead
	_ = d.Stop(ctx) // stop it, so the replayed event stays pending for us to see

	admin := client.Admin()
	page, err := admin.List(ctx, outbox.EventFilter{Status: outbox.StatusDead, Namespace: topic.Namespace})
	if err != nil {
		panic(err)
	}
	fmt.Println(len(page.Events), "dead:", *page.Events[0].LastError)
	replayed, err := admin.ReplayDead(ctx, "ops@example.com", outbox.EventFilter{Namespace: topic.Namespace, Topic: topic.Topic})
	if err != nil {
		panic(err)
	}
	e, _ := admin.Get(ctx, replayed[0])
	fmt.Println(len(replayed), "replayed; now", e.Status, "with", e.Attempts, "attempts")
	// Output:
	// 1 dead: attempt 1 of 10 failed permanently: mailbox does not exist
	// 1 replayed; now pending with 0 attempts
}

// In an fx app, outbox.Module provides the *Client and runs a dispatcher for
// the publishers the app's modules contribute with AsPublisher; it starts
// and stops with the app.
func ExampleModule() {
	tdb, _, done := exampleDB()
	defer done()
	delivered := make(chan string, 1)
	var client *outbox.Client
	app := fx.New(
		fx.NopLogger,
		fx.Supply(tdb.Provider),
		fx.Supply(outbox.DispatcherConfig{Logger: quietLog}),
		outbox.Module,
		fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: outbox.Topic{Namespace: "shop", Topic: "order_paid"},
				Publish: func(_ context.Context, m outbox.Delivery) error { delivered <- string(m.Payload); return nil }}
		})),
		fx.Populate(&client),
	)
	ctx := context.Background()
	if err := app.Start(ctx); err != nil {
		panic(err)
	}
	defer app.Stop(ctx)
	if _, err := client.Enqueue(ctx, tdb.Provider.Pool, outbox.Message{Namespace: "shop", Topic: "order_paid", Payload: json.RawMessage(`{"order_id": 9}`)}); err != nil {
		panic(err)
	}
	fmt.Println(<-delivered)
	// Output: {"order_id": 9}
}
