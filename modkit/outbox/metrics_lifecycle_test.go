package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

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

// The depth gauges follow claims and outcomes within about a second, not
// only the maintenance passes: with the next pass an hour away, they show
// the events a publisher holds, and zero once those are delivered.
func TestDepthGaugesFollowDeliveries(t *testing.T) {
	reader := mtInstall(t)
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	topic := outbox.Topic{Namespace: "gauges", Topic: "fresh"}
	for i := range 3 {
		if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{}`)}); err != nil {
			t.Fatalf("enqueue %d: %v", i, err)
		}
	}
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.SweepInterval = time.Hour // one maintenance pass, at start
	d, err := c.NewDispatcher(cfg, outbox.Publisher{Topic: topic, Publish: func(ctx context.Context, _ outbox.Delivery) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	refreshed := make(chan struct{}, 1)
	outbox.OnGaugeRefresh(d, func() {
		select {
		case refreshed <- struct{}{}:
		default:
		}
	})
	passes := make(mtPasses, 1)
	outbox.OnMaintenance(d, passes.hook)
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	t.Cleanup(unblock) // before the stop
	passes.waitHeld(t, "the maintenance lease", "maintenance:gauges:fresh")

	attrs := mtTopicAttrs(topic)
	// awaitGauges waits for a read of the refresher that leaves the gauges
	// at want.
	awaitGauges := func(what string, want map[string]float64) {
		t.Helper()
		timeout := time.After(guard)
		got := map[string]float64{}
		for {
			rm := mtCollect(t, reader)
			ok := true
			for name, w := range want {
				v, points := mtValue(rm, name, attrs)
				got[name] = v
				ok = ok && points == 1 && v == w
			}
			if ok {
				return
			}
			select {
			case <-refreshed:
			case <-timeout:
				t.Fatalf("timed out waiting for the gauges %s: %v, want %v", what, got, want)
			}
		}
	}
	awaitGauges("while the publisher holds the events", map[string]float64{
		"outbox.pending.depth": 0, "outbox.processing.depth": 3, "outbox.dead.count": 0,
	})
	unblock()
	log.waitFor(t, "3 delivered", finalCount(outbox.StatusDelivered, 3))
	awaitGauges("after the deliveries", map[string]float64{
		"outbox.pending.depth": 0, "outbox.processing.depth": 0, "outbox.dead.count": 0, "outbox.pending.oldest_age": 0,
	})
}
