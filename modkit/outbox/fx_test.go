package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// Two modules each register a publisher through the value group; the
// dispatcher runs with the app, delivers both modules' events and stops
// cleanly with it.
func TestFxModuleWithTwoPublishingModules(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	chatTopic := outbox.Topic{Namespace: "chat", Topic: "message_sent"}
	billingTopic := outbox.Topic{Namespace: "billing", Topic: "invoice_paid"}
	got := make(chan outbox.Topic, 10)
	publisherModule := func(name string, topic outbox.Topic) fx.Option {
		return fx.Module(name, fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: topic, Name: name, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
				got <- outbox.Topic{Namespace: m.Namespace, Topic: m.Topic}
				return nil
			}}
		})))
	}
	log := newSettledLog()
	var d *outbox.Dispatcher
	app := fxtest.New(t,
		fx.Supply(db.Config{DSN: tdb.DSN}),
		fx.Supply(outbox.DispatcherConfig{PollInterval: 50 * time.Millisecond, Logger: quietLog, OnSettled: log.hook}),
		db.Module,
		outbox.Module,
		publisherModule("chat", chatTopic),
		publisherModule("billing", billingTopic),
		fx.Populate(&d),
		fx.NopLogger,
	)
	app.RequireStart()
	pool := tdb.Provider.Pool
	for _, topic := range []outbox.Topic{chatTopic, billingTopic, chatTopic} {
		if _, err := outbox.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{}`)}); err != nil {
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

func TestFxModuleRejectsDuplicatePublishers(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pub := func(name string) fx.Option {
		return fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: testTopic, Name: name, Publish: func(context.Context, outbox.ClaimedMessage) error { return nil }}
		}))
	}
	// The test's own provider stands in for db.Module: an app that fails
	// to build never runs its stop hooks, so db.Module's pool would leak.
	app := fx.New(fx.Supply(tdb.Provider), outbox.Module, pub("one"), pub("two"), fx.NopLogger)
	err := app.Err()
	if !errors.Is(err, outbox.ErrDuplicatePublisher) {
		t.Fatalf("two publishers for one topic: %v, want ErrDuplicatePublisher", err)
	}
	if msg := err.Error(); !strings.Contains(msg, `"one"`) || !strings.Contains(msg, `"two"`) {
		t.Fatalf("the error must name both publishers: %s", msg)
	}
}
