package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// Two modules each register a publisher through the value group; the
// dispatcher runs with the app, delivers both modules' events and stops
// cleanly with it.
func TestFxModuleWithTwoPublishingModules(t *testing.T) {
	tdb := pgtest.NewDB(t)
	chatTopic := outbox.Topic{Namespace: "chat", Topic: "message_sent"}
	billingTopic := outbox.Topic{Namespace: "billing", Topic: "invoice_paid"}
	got := make(chan outbox.Topic, 10)
	publisherModule := func(name string, topic outbox.Topic) fx.Option {
		return fx.Module(name, fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: topic, Name: name, Publish: func(ctx context.Context, d outbox.Delivery) error {
				got <- outbox.Topic{Namespace: d.Namespace, Topic: d.Topic}
				return nil
			}}
		})))
	}
	log := newOutcomeLog()
	var (
		d      *outbox.Dispatcher
		client *outbox.Client
		p      *db.Provider
	)
	app := fxtest.New(t,
		fx.Supply(db.Config{DSN: tdb.DSN}),
		fx.Supply(outbox.DispatcherConfig{PollInterval: 50 * time.Millisecond, Logger: quietLog, OnOutcome: log.hook}),
		fx.Supply(quietLog),
		db.Module,
		outbox.Module,
		publisherModule("chat", chatTopic),
		publisherModule("billing", billingTopic),
		fx.Populate(&d, &client, &p),
		fx.NopLogger,
	)
	app.RequireStart()
	if d == nil || client == nil {
		t.Fatalf("Module provided dispatcher %v and client %v", d, client)
	}
	if st := d.Task().Status(); st.String() != "running" {
		t.Fatalf("dispatcher %s after app start", st)
	}
	for _, topic := range []outbox.Topic{chatTopic, billingTopic, chatTopic} {
		if _, err := client.Enqueue(ctx, p.Pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	log.waitFor(t, "3 deliveries", finalCount(outbox.StatusDelivered, 3))
	seen := map[outbox.Topic]int{}
	for range 3 {
		seen[<-got]++
	}
	if seen[chatTopic] != 2 || seen[billingTopic] != 1 {
		t.Fatalf("delivered %v", seen)
	}
	app.RequireStop()
	if st := d.Task().Status(); st.String() != "stopped" {
		t.Fatalf("dispatcher %s after app stop", st)
	}
}

// A service that only enqueues includes Module with no publisher: the app
// starts and stops, no dispatcher runs (the *Dispatcher is nil), and the
// *Client enqueues with the Config from the graph.
func TestFxModuleWithoutPublishers(t *testing.T) {
	tdb := pgtest.NewDB(t)
	var (
		d      *outbox.Dispatcher
		client *outbox.Client
		p      *db.Provider
	)
	app := fxtest.New(t,
		fx.Supply(db.Config{DSN: tdb.DSN}),
		fx.Supply(outbox.Config{MaxPayloadBytes: 64}),
		fx.Supply(quietLog),
		db.Module,
		outbox.Module,
		fx.Populate(&d, &client, &p),
		fx.NopLogger,
	)
	app.RequireStart()
	if d != nil {
		t.Fatalf("a dispatcher (%v) without publishers", d)
	}
	if client == nil {
		t.Fatal("no client")
	}
	res, err := client.Enqueue(ctx, p.Pool, msg(1))
	if err != nil {
		t.Fatal(err)
	}
	big := msg(2)
	big.Payload = []byte(`"` + strings.Repeat("x", 64) + `"`)
	if _, err := client.Enqueue(ctx, p.Pool, big); !errors.Is(err, outbox.ErrPayloadTooLarge) {
		t.Fatalf("payload above the supplied Config's limit: %v, want ErrPayloadTooLarge", err)
	}
	app.RequireStop()
	// Nothing delivered it: it waits, pending, for a dispatcher elsewhere.
	if e := get(t, clientOn(t, tdb.Provider.Pool, outbox.Config{}), res.ID); e.Status != outbox.StatusPending || e.Attempts != 0 {
		t.Fatalf("event after the app ran: %+v", e)
	}
}

func TestFxModuleRejectsDuplicatePublishers(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pub := func(name string) fx.Option {
		return fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: testTopic, Name: name, Publish: func(context.Context, outbox.Delivery) error { return nil }}
		}))
	}
	// The test's own provider stands in for db.Module: an app that fails
	// to build never runs its stop hooks, so db.Module's pool would leak.
	app := fx.New(fx.Supply(tdb.Provider), outbox.Module, pub("one"), pub("two"), fx.NopLogger)
	err := app.Err()
	if !errors.Is(err, outbox.ErrDuplicatePublisher) || !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("two publishers for one topic: %v, want ErrDuplicatePublisher", err)
	}
	if msg := err.Error(); !strings.Contains(msg, `"one"`) || !strings.Contains(msg, `"two"`) {
		t.Fatalf("the error must name both publishers: %s", msg)
	}
}
