package outbox_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Two dispatchers of one process (one MeterProvider), each leading its own
// topic's maintenance: each should report its topic's depth gauges and its
// own degraded gauge.
func TestGaugesOfTwoDispatchersInOneProcess(t *testing.T) {
	reader := mtInstall(t)
	c, _ := newClient(t, outbox.Config{})
	nop := func(context.Context, outbox.Delivery) error { return nil }
	ta, tb := outbox.Topic{Namespace: "bug", Topic: "a"}, outbox.Topic{Namespace: "bug", Topic: "b"}
	log := newOutcomeLog()
	a, passesA := mtStartHooked(t, c, testConfig(log), outbox.Publisher{Topic: ta, Publish: nop})
	b, passesB := mtStartHooked(t, c, testConfig(log), outbox.Publisher{Topic: tb, Publish: nop})
	passesA.waitHeld(t, "a leads its topic", "maintenance:bug:a")
	passesB.waitHeld(t, "b leads its topic", "maintenance:bug:b")
	rm := mtCollect(t, reader)
	for _, x := range []struct {
		d     *outbox.Dispatcher
		topic outbox.Topic
	}{{a, ta}, {b, tb}} {
		if _, points := mtValue(rm, "outbox.dead.count", mtTopicAttrs(x.topic)); points != 1 {
			t.Errorf("outbox.dead.count of %v: %d points, want 1", x.topic, points)
		}
		if _, points := mtValue(rm, "outbox.dispatcher.degraded", mtWorkerAttrs(x.d)); points != 1 {
			t.Errorf("outbox.dispatcher.degraded of the dispatcher of %v: %d points, want 1", x.topic, points)
		}
	}
}

// A dispatcher that stopped (and resigned its maintenance lease) should no
// longer report the depth gauges of the topic it led.
func TestStoppedDispatcherStopsReportingGauges(t *testing.T) {
	reader := mtInstall(t)
	c, _ := newClient(t, outbox.Config{})
	topic := outbox.Topic{Namespace: "bug", Topic: "stale"}
	d, passes := mtStartHooked(t, c, testConfig(newOutcomeLog()), outbox.Publisher{Topic: topic,
		Publish: func(context.Context, outbox.Delivery) error { return nil }})
	passes.waitHeld(t, "the lease", "maintenance:bug:stale")
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if v, points := mtValue(mtCollect(t, reader), "outbox.pending.depth", mtTopicAttrs(topic)); points != 0 {
		t.Errorf("a stopped dispatcher still reports outbox.pending.depth = %v for %v", v, topic)
	}
}

// Events the maintenance sweep dead-letters should be counted in
// outbox.events.dead under their topic, like every other outcome.
func TestSweptDeadCountedUnderItsTopic(t *testing.T) {
	reader := mtInstall(t)
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	topic := outbox.Topic{Namespace: "bug", Topic: "swept"}
	if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	// One attempt used and failed: pending, attempts 1.
	st := admStore(t, pool, "public", nil)
	admSettle(t, st, driver.Retry, "x", admClaim(t, st, 1, topic)...)
	// A dispatcher allowing one attempt can only sweep it.
	cfg := testConfig(newOutcomeLog())
	cfg.MaxAttempts = 1
	_, passes := mtStartHooked(t, c, cfg, outbox.Publisher{Topic: topic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	passes.waitHeld(t, "a sweep", "maintenance:bug:swept")
	if n := countRows(t, pool, "status = 'dead'"); n != 1 {
		t.Fatalf("%d dead, want the swept one", n)
	}
	rm := mtCollect(t, reader)
	if v, _ := mtValue(rm, "outbox.events.dead", mtTopicAttrs(topic)); v != 1 {
		none, _ := mtValue(rm, "outbox.events.dead", *attribute.EmptySet())
		t.Errorf("outbox.events.dead of %v = %v, want 1 (without attributes: %v)", topic, v, none)
	}
}
