package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// mtScope is the instrumentation scope of the outbox's metrics.
const mtScope = "github.com/modkit-go/modkit/modkit/outbox"

// mtAbsorb installs a throwaway MeterProvider once per test binary. The
// global provider hands instruments made before the first
// otel.SetMeterProvider (by the dispatchers of earlier tests) over to the
// first provider set, and an SDK provider keeps only the callbacks of an
// observable instrument's first registration: without the throwaway, the
// gauges of those long-stopped dispatchers would stand in for the gauges of
// the first test to install a provider.
var mtAbsorb sync.Once

// mtInstall makes a new MeterProvider with a manual reader the global one
// (dispatchers take their meter from it when built) until the test ends.
func mtInstall(t *testing.T) *sdkmetric.ManualReader {
	t.Helper()
	mtAbsorb.Do(func() { otel.SetMeterProvider(sdkmetric.NewMeterProvider()) })
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	prev := otel.GetMeterProvider()
	otel.SetMeterProvider(provider)
	t.Cleanup(func() {
		otel.SetMeterProvider(prev)
		_ = provider.Shutdown(context.Background())
	})
	return reader
}

func mtCollect(t *testing.T, reader *sdkmetric.ManualReader) *metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	return &rm
}

// mtValue reads the outbox instrument name at the attribute set attrs: the
// sum of a counter, the count of a histogram, the value of a gauge; points
// is how many data points matched (0: not reported).
func mtValue(rm *metricdata.ResourceMetrics, name string, attrs attribute.Set) (value float64, points int) {
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != mtScope {
			continue
		}
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range data.DataPoints {
					if dp.Attributes.Equals(&attrs) {
						value, points = value+float64(dp.Value), points+1
					}
				}
			case metricdata.Histogram[float64]:
				for _, dp := range data.DataPoints {
					if dp.Attributes.Equals(&attrs) {
						value, points = value+float64(dp.Count), points+1
					}
				}
			case metricdata.Gauge[float64]:
				for _, dp := range data.DataPoints {
					if dp.Attributes.Equals(&attrs) {
						value, points = dp.Value, points+1
					}
				}
			case metricdata.Gauge[int64]:
				for _, dp := range data.DataPoints {
					if dp.Attributes.Equals(&attrs) {
						value, points = float64(dp.Value), points+1
					}
				}
			}
		}
	}
	return value, points
}

func mtTopicAttrs(t outbox.Topic) attribute.Set {
	return attribute.NewSet(attribute.String("namespace", t.Namespace), attribute.String("topic", t.Topic))
}

func mtWorkerAttrs(d *outbox.Dispatcher) attribute.Set {
	return attribute.NewSet(attribute.String("worker_id", d.Config().WorkerID.String()))
}

// mtPasses reports each maintenance pass of a dispatcher on a channel.
type mtPasses chan []string

func (p mtPasses) hook(held []string) {
	select {
	case p <- held:
	default: // the test is not waiting; it drains before it does
	}
}

// waitHeld waits for a pass whose held roles are want.
func (p mtPasses) waitHeld(t *testing.T, what string, want ...string) {
	t.Helper()
	timeout := time.After(guard)
	for {
		select {
		case held := <-p:
			if slices.Equal(held, want) {
				return
			}
		case <-timeout:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// awaitGauges waits until a maintenance pass holding role, begun after the
// call, leaves the depth gauges of attrs in reader at want, and returns that
// collection. A pass refreshes the gauges when it holds the lease and its
// queries finish within the pass's deadline; one that does not keeps the
// old values, so the next pass is awaited.
func (p mtPasses) awaitGauges(t *testing.T, role string, reader *sdkmetric.ManualReader, attrs attribute.Set,
	want map[string]float64) *metricdata.ResourceMetrics {
	t.Helper()
	for len(p) > 0 {
		<-p
	}
	timeout := time.After(guard)
	got := map[string]float64{}
	for passes := 0; ; {
		select {
		case held := <-p:
			if !slices.Equal(held, []string{role}) {
				continue
			}
			passes++
		case <-timeout:
			t.Fatalf("timed out waiting for the gauges of %v: %v, want %v", attrs, got, want)
		}
		// The first pass to report may have begun before the call; the
		// ones after it cannot.
		if passes < 2 {
			continue
		}
		rm := mtCollect(t, reader)
		ok := true
		for name, w := range want {
			v, points := mtValue(rm, name, attrs)
			got[name] = v
			ok = ok && points == 1 && v == w
		}
		if ok {
			return rm
		}
	}
}

// mtStartHooked builds a dispatcher of c, reports its maintenance passes on
// the returned channel, starts it and stops it when the test ends.
func mtStartHooked(t *testing.T, c *outbox.Client, cfg outbox.DispatcherConfig, pubs ...outbox.Publisher) (*outbox.Dispatcher, mtPasses) {
	t.Helper()
	d, err := c.NewDispatcher(cfg, pubs...)
	if err != nil {
		t.Fatal(err)
	}
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
	return d, passes
}

// The dispatcher reports its outcomes through the global MeterProvider,
// per (namespace, topic); the maintenance lease holder reports the depth
// gauges of its topics; publishes abandoned past their deadline are
// counted and make the dispatcher report itself degraded.
// mtBounds returns the bucket boundaries of the first data point of the
// histogram name in rm.
func mtBounds(rm *metricdata.ResourceMetrics, name string) []float64 {
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if h, ok := m.Data.(metricdata.Histogram[float64]); ok && sm.Scope.Name == mtScope && m.Name == name && len(h.DataPoints) > 0 {
				return h.DataPoints[0].Bounds
			}
		}
	}
	return nil
}

func TestDispatcherMetrics(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	// Topics of their own, so that dispatchers of tests running alongside
	// do not add to the counts.
	probe := outbox.Topic{Namespace: "metrics", Topic: "probe"}
	stuck := outbox.Topic{Namespace: "metrics", Topic: "stuck"}
	for _, payload := range []string{`{"ok":true}`, `{"ok":true}`, `{"ok":false}`, `{"retry":true}`} {
		if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: probe.Namespace, Topic: probe.Topic, Payload: []byte(payload)}); err != nil {
			t.Fatal(err)
		}
	}
	stuckID, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: stuck.Namespace, Topic: stuck.Topic, Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}

	// One MeterProvider for the test's dispatchers (each reports its own
	// gauges on it: TestGaugesOfTwoDispatchersInOneProcess).
	reader := mtInstall(t)
	// The probe's dispatcher: delivered, dead, and a retry an hour away
	// (pending, not due).
	log := newOutcomeLog()
	cfg := testConfig(log)
	// Short enough not to keep the test waiting, long enough for a pass to
	// finish inside its deadline (twice the interval).
	cfg.SweepInterval = 250 * time.Millisecond
	cfg.Retry = outbox.RetryPolicy{BaseDelay: time.Hour, MaxDelay: time.Hour}
	probeD, passes := mtStartHooked(t, c, cfg, outbox.Publisher{Topic: probe, Publish: func(ctx context.Context, d outbox.Delivery) error {
		var body struct{ OK, Retry bool }
		switch err := json.Unmarshal(d.Payload, &body); {
		case err != nil || body.Retry:
			return errors.New("try later")
		case !body.OK:
			return outbox.Permanent(errors.New("malformed"))
		}
		return nil
	}})

	// The stuck topic's dispatcher: its publisher ignores its context
	// until released, so its publishes are abandoned at their deadline.
	release := make(chan struct{})
	var releaseOnce sync.Once
	var calls sync.WaitGroup
	t.Cleanup(calls.Wait) // after the dispatcher stopped: every call returned
	stuckReader := mtInstall(t)
	stuckLog := newOutcomeLog()
	stuckCfg := outbox.DispatcherConfig{
		LeaseDuration: time.Second,
		PollInterval:  100 * time.Millisecond,
		StopTimeout:   30 * time.Second,
		Logger:        quietLog,
		OnOutcome:     stuckLog.hook,
	}
	stuckD := startDispatcher(t, c, stuckCfg, outbox.Publisher{Topic: stuck, Publish: func(context.Context, outbox.Delivery) error {
		calls.Add(1)
		defer calls.Done()
		<-release
		return nil
	}})
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before the dispatchers stop

	log.waitFor(t, "2 delivered", finalCount(outbox.StatusDelivered, 2))
	log.waitFor(t, "1 dead", finalCount(outbox.StatusDead, 1))
	log.waitFor(t, "1 retry", finalCount(outbox.StatusPending, 1))
	stuckLog.waitFor(t, "an abandoned publish", func(m map[uuid.UUID][]outbox.Outcome) bool {
		return slices.ContainsFunc(m[stuckID.ID], func(o outbox.Outcome) bool {
			return o.Abandoned && !o.Released && o.Status == outbox.StatusPending // its attempt failed, to retry
		})
	})
	ours, theirs := mtTopicAttrs(probe), mtTopicAttrs(stuck)
	// The gauges, from the lease holder's maintenance: the retry is pending
	// but not due.
	rm := passes.awaitGauges(t, "maintenance:metrics:probe", reader, ours, map[string]float64{
		"outbox.pending.depth":      1,
		"outbox.processing.depth":   0,
		"outbox.dead.count":         1,
		"outbox.pending.oldest_age": 0,
	})
	for name, want := range map[string]float64{
		"outbox.events.delivered":  2,
		"outbox.events.dead":       1,
		"outbox.events.retried":    1,
		"outbox.events.released":   0,
		"outbox.events.lease_lost": 0,
		"outbox.publish.abandoned": 0,
		"outbox.publish.duration":  4,
		"outbox.delivery.lag":      2,
	} {
		if got, _ := mtValue(rm, name, ours); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	// Second-scale buckets: the SDK's defaults (0, 5, 10, … 10000) put
	// every publish and most lags in the first one.
	for name, top := range map[string]float64{"outbox.publish.duration": 60, "outbox.delivery.lag": 3600} {
		if b := mtBounds(rm, name); len(b) == 0 || b[0] != 0.001 || b[len(b)-1] != top {
			t.Errorf("%s buckets %v, want from 0.001 s to %v s", name, b, top)
		}
	}
	if got, points := mtValue(rm, "outbox.dispatcher.degraded", mtWorkerAttrs(probeD)); points != 1 || got != 0 {
		t.Errorf("degraded of the healthy dispatcher: %v (%d points), want 0", got, points)
	}
	stuckRM := mtCollect(t, stuckReader)
	for _, name := range []string{"outbox.publish.abandoned", "outbox.events.retried"} {
		if got, _ := mtValue(stuckRM, name, theirs); got < 1 {
			t.Errorf("%s of the stuck topic = %v, want at least 1", name, got)
		}
	}
	for _, name := range []string{"outbox.events.delivered", "outbox.events.dead", "outbox.events.released", "outbox.events.lease_lost"} {
		if got, _ := mtValue(stuckRM, name, theirs); got != 0 {
			t.Errorf("%s of the stuck topic = %v, want 0", name, got)
		}
	}
	if got, points := mtValue(stuckRM, "outbox.dispatcher.degraded", mtWorkerAttrs(stuckD)); points != 1 || got != 1 {
		t.Errorf("degraded of the stuck dispatcher: %v (%d points), want 1", got, points)
	}
	if h := stuckD.Health(); !h.Degraded || h.Abandoned < 1 {
		t.Errorf("health of the stuck dispatcher: %+v", h)
	}

	// Released, the publisher returns and the event is delivered.
	unblock()
	stuckLog.waitFor(t, "the stuck event delivered", finalCount(outbox.StatusDelivered, 1))
}

// Only the holder of a topic's maintenance lease reports the topic's depth
// gauges; when it stops, the dispatcher that takes the lease over reports
// them. (That the stopped one then reports nothing is not checked: see the
// stale gauges it keeps, reported to the maintainers.)
func TestDispatcherMetricsGaugesFollowMaintenanceLease(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	topic := outbox.Topic{Namespace: "metrics", Topic: "leased"}
	role := "maintenance:metrics:leased"
	for i := range 3 {
		if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{}`)}); err != nil {
			t.Fatalf("enqueue %d: %v", i, err)
		}
	}
	if dead := admKillAll(t, admStore(t, pool, "public", nil), topic); len(dead) != 3 {
		t.Fatalf("killed %d", len(dead))
	}
	pub := outbox.Publisher{Topic: topic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	log := newOutcomeLog()
	ours := mtTopicAttrs(topic)
	gauges := map[string]float64{"outbox.pending.depth": 0, "outbox.processing.depth": 0, "outbox.dead.count": 3, "outbox.pending.oldest_age": 0}
	// Each dispatcher meters into a provider of its own. The first renews
	// its lease every second (it lasts three); the second asks four times
	// as often.
	readerA := mtInstall(t)
	cfgA := testConfig(log)
	cfgA.SweepInterval = time.Second
	a, passesA := mtStartHooked(t, c, cfgA, pub)
	passesA.waitHeld(t, "the first dispatcher's lease", role)
	readerB := mtInstall(t)
	cfgB := testConfig(log)
	cfgB.SweepInterval = 250 * time.Millisecond
	b, passesB := mtStartHooked(t, c, cfgB, pub)
	passesB.waitHeld(t, "a pass of the second dispatcher without the lease")

	passesA.awaitGauges(t, role, readerA, ours, gauges)
	rmB := mtCollect(t, readerB)
	for name := range gauges {
		if got, points := mtValue(rmB, name, ours); points != 0 {
			t.Errorf("the dispatcher without the lease reports %s = %v", name, got)
		}
	}
	if got, points := mtValue(rmB, "outbox.dispatcher.degraded", mtWorkerAttrs(b)); points != 1 || got != 0 {
		t.Errorf("degraded of the running follower: %v (%d points), want 0", got, points)
	}

	// The leader stops and resigns; the other takes over at its next pass
	// and reports the gauges.
	if err := a.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	passesB.awaitGauges(t, role, readerB, ours, gauges)
	if _, points := mtValue(mtCollect(t, readerA), "outbox.dispatcher.degraded", mtWorkerAttrs(a)); points != 0 {
		t.Errorf("a stopped dispatcher reports outbox.dispatcher.degraded")
	}
}

// Claims size themselves: draining a backlog, they start small and grow,
// so the drain takes far fewer claims than claims of the starting size
// would, and none takes more than BatchSize.
func TestClaimSizeAdapts(t *testing.T) {
	reader := mtInstall(t)
	client, tdb := newClient(t, outbox.Config{})
	const n, start = 4000, 32
	enqueueN(t, client, tdb.Provider.Pool, n)
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.BatchSize = 500
	startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	log.waitFor(t, "the backlog delivered", finalCount(outbox.StatusDelivered, n))
	rm := mtCollect(t, reader)
	attrs := mtTopicAttrs(testTopic)
	claims, _ := mtValue(rm, "outbox.claim.batches", attrs)
	events, _ := mtValue(rm, "outbox.claim.events", attrs)
	if events != n {
		t.Fatalf("%v events claimed, want %d", events, n)
	}
	// Claims of the starting size would take n/start = 125; growing
	// claims of up to 500 take about a dozen (room permitting).
	if claims < n/500 || claims > n/start/3 {
		t.Fatalf("%v claims for %d events; want between %d and %d", claims, n, n/500, n/start/3)
	}
	t.Logf("%v claims for %d events", claims, n)
}

// A leader whose elections start failing (here the election function is
// gone) stops reporting its topics' gauges once its lease has run out:
// another dispatcher may lead them by then, and both reported them (or the
// failed one reported frozen values).
func TestGaugesStopWhenTheLeaseRunsOutUnrenewed(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	topic := outbox.Topic{Namespace: "metrics", Topic: "unrenewed"}
	role := "maintenance:metrics:unrenewed"
	if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	reader := mtInstall(t)
	cfg := testConfig(newOutcomeLog())
	cfg.SweepInterval = 100 * time.Millisecond
	_, passes := mtStartHooked(t, c, cfg, outbox.Publisher{Topic: topic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	passes.waitHeld(t, "the lease", role)
	ours := mtTopicAttrs(topic)
	eventually(t, "the gauges reported", func() bool {
		_, points := mtValue(mtCollect(t, reader), "outbox.dead.count", ours)
		return points == 1
	})
	if _, err := pool.Exec(ctx, `ALTER FUNCTION modkit_outbox_elect(text[], uuid, interval, timestamptz) RENAME TO modkit_outbox_elect_gone`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `ALTER FUNCTION modkit_outbox_elect_gone(text[], uuid, interval, timestamptz) RENAME TO modkit_outbox_elect`)
	})
	eventually(t, "the gauges no longer reported", func() bool {
		_, points := mtValue(mtCollect(t, reader), "outbox.dead.count", ours)
		return points == 0
	})
}
