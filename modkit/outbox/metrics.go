package outbox

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// meterName is the OpenTelemetry instrumentation scope of the outbox
// metrics, taken from the global MeterProvider (see the package doc for the
// instruments).
const meterName = "github.com/modkit-go/modkit/modkit/outbox"

// metrics are the dispatcher's OpenTelemetry instruments; the package
// documentation lists them.
type metrics struct {
	delivered, retried, dead, released, leaseLost, abandoned, unrecorded metric.Int64Counter
	claimErrors, listenerReconnects                                      metric.Int64Counter
	claimBatches, claimedEvents, leaseRepairs, wakeups                   metric.Int64Counter
	publishDuration, lag                                                 metric.Float64Histogram

	pendingDepth, processingDepth, deadCount, oldestAge metric.Float64ObservableGauge
	stuckDepth                                          metric.Float64ObservableGauge
	degraded                                            metric.Int64ObservableGauge

	meter metric.Meter
	d     *Dispatcher

	mu    sync.Mutex
	depth []driver.DepthRow // of the topics this dispatcher leads
	// leading are the topics whose maintenance lease this dispatcher
	// holds: it reports their gauges. leadGen changes with them, so that a
	// read begun under an older lead is dropped.
	leading []string
	leadGen uint64
	// readSeq numbers the depth reads; stored is the newest one stored,
	// so that a slow read never overwrites a newer one.
	readSeq, stored uint64
	// changed is signalled (without blocking) when the depth may have
	// changed: a claim found events, an outcome was recorded, an enqueue
	// was announced, or the lead changed.
	changed chan struct{}
	// onRefresh, if set, is called after each read of the gauges by the
	// refresher (tests).
	onRefresh func()
}

// register registers the gauges' callback for one run of the dispatcher:
// only a running dispatcher reports them. (Each dispatcher registers its
// own callback: an observable instrument keeps only the callbacks given
// when it was first created.) Call the returned function when the run
// ends.
func (m *metrics) register() func() {
	m.setLeading(nil)
	reg, err := m.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		m.mu.Lock()
		for _, r := range m.depth {
			ns, topic, _ := strings.Cut(r.Topic, ":")
			attrs := m.topicAttrs(ns, topic)
			o.ObserveFloat64(m.pendingDepth, float64(r.Pending), attrs)
			o.ObserveFloat64(m.processingDepth, float64(r.Processing), attrs)
			o.ObserveFloat64(m.deadCount, float64(r.Dead), attrs)
			o.ObserveFloat64(m.oldestAge, r.OldestDueAge.Seconds(), attrs)
			o.ObserveFloat64(m.stuckDepth, float64(r.Stuck), attrs)
		}
		m.mu.Unlock()
		v := int64(0)
		if m.d.Health().Degraded {
			v = 1
		}
		o.ObserveInt64(m.degraded, v, metric.WithAttributes(attribute.String("worker_id", m.d.cfg.WorkerID.String())))
		return nil
	}, m.pendingDepth, m.processingDepth, m.deadCount, m.oldestAge, m.stuckDepth, m.degraded)
	if err != nil {
		m.d.log.Warn("could not register the outbox gauges", "error", err)
		return func() {}
	}
	return func() {
		_ = reg.Unregister()
		m.setLeading(nil)
	}
}

// The histograms' bucket boundaries, in seconds: a publish from a
// millisecond to a minute, a delivery's lag from a millisecond to an hour.
var (
	publishDurationBounds = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
	deliveryLagBounds     = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}
)

func newMetrics(d *Dispatcher) (*metrics, error) {
	meter := otel.Meter(meterName)
	m := &metrics{changed: make(chan struct{}, 1)}
	var errs []error
	counter := func(name, desc string) metric.Int64Counter {
		c, err := meter.Int64Counter(name, metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	m.delivered = counter("outbox.events.delivered", "Events published and acknowledged.")
	m.retried = counter("outbox.events.retried", "Publish failures rescheduled with backoff.")
	m.dead = counter("outbox.events.dead", "Events dead-lettered.")
	m.released = counter("outbox.events.released", "Claimed events given back unpublished (stop, deadline passed while queued, publish abandoned).")
	m.leaseLost = counter("outbox.events.lease_lost", "Outcomes refused because the lease was lost.")
	m.unrecorded = counter("outbox.events.unrecorded", "Outcomes given up on unwritten (the database unavailable until the leases ended, or a stop ran out of time): their events are published again.")
	m.abandoned = counter("outbox.publish.abandoned", "Publish calls abandoned because they outlived their deadline or had not returned when a stop ran out of time.")
	m.claimErrors = counter("outbox.claim.errors", "Failed claim queries.")
	m.listenerReconnects = counter("outbox.listener.reconnects", "LISTEN connections lost and re-opened.")
	m.claimBatches = counter("outbox.claim.batches", "Claim queries that leased at least one event of the topic.")
	m.claimedEvents = counter("outbox.claim.events", "Events leased by claims.")
	m.leaseRepairs = counter("outbox.lease.repairs", "Expired leases repaired (by a claim or the sweeper): a dispatcher crashed or overran.")
	m.wakeups = counter("outbox.wakeups", "Enqueue notifications received for the topic (each may wake the claimer).")
	var err error
	// Bucket boundaries in seconds: the SDK's default ones (0, 5, 10, …
	// 10000) suit milliseconds, and put every publish and most lags in
	// the first bucket. A view of the application's MeterProvider may set
	// others.
	m.publishDuration, err = meter.Float64Histogram("outbox.publish.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of publish calls."), metric.WithExplicitBucketBoundaries(publishDurationBounds...))
	errs = append(errs, err)
	m.lag, err = meter.Float64Histogram("outbox.delivery.lag", metric.WithUnit("s"),
		metric.WithDescription("Time from enqueue (transaction start) to successful publish."),
		metric.WithExplicitBucketBoundaries(deliveryLagBounds...))
	errs = append(errs, err)
	float := func(name, desc string) metric.Float64ObservableGauge {
		g, err := meter.Float64ObservableGauge(name, metric.WithDescription(desc))
		errs = append(errs, err)
		return g
	}
	m.pendingDepth = float("outbox.pending.depth", "Pending events per topic.")
	m.processingDepth = float("outbox.processing.depth", "Leased events per topic.")
	m.deadCount = float("outbox.dead.count", "Dead events per topic.")
	m.oldestAge, err = meter.Float64ObservableGauge("outbox.pending.oldest_age", metric.WithUnit("s"),
		metric.WithDescription("Seconds the oldest due pending event of a topic has waited."))
	errs = append(errs, err)
	m.stuckDepth = float("outbox.stuck.depth", "Leased events per topic whose lease expired without an outcome (waiting for repair).")
	m.degraded, err = meter.Int64ObservableGauge("outbox.dispatcher.degraded",
		metric.WithDescription("1 while the dispatcher reports itself degraded (see Dispatcher.Health), else 0."))
	errs = append(errs, err)
	m.meter, m.d = meter, d
	return m, errors.Join(errs...)
}

// topicAttrs are the attributes of a topic's measurements.
func topicAttrs(t Topic) metric.MeasurementOption {
	return metric.WithAttributes(attribute.String("namespace", t.Namespace), attribute.String("topic", t.Topic))
}

// topicAttrs returns the attributes of the topic's measurements, built once
// per registered topic.
func (m *metrics) topicAttrs(namespace, topic string) metric.MeasurementOption {
	return m.d.reg.telemetryOf(Topic{namespace, topic}).attrs
}

func (m *metrics) observe(r result, o Outcome) {
	m.touch()
	ctx := context.Background()
	msg := r.c.d
	attrs := m.topicAttrs(msg.Namespace, msg.Topic)
	if !r.started.IsZero() && r.kind != abandoned {
		m.publishDuration.Record(ctx, r.elapsed.Seconds(), attrs)
	}
	switch {
	case o.LeaseLost:
		m.leaseLost.Add(ctx, 1, attrs)
	case o.Released:
		m.released.Add(ctx, 1, attrs)
	case o.Status == StatusDelivered:
		m.delivered.Add(ctx, 1, attrs)
		enqueued := r.c.enqueued
		if enqueued.IsZero() {
			enqueued = msg.CreatedAt
		}
		// To the publish's end, not to now: the outcome's write (its wait
		// for more results, the database, its retries) is not the
		// delivery's lag.
		delivered := time.Now()
		if !r.started.IsZero() {
			delivered = r.started.Add(r.elapsed)
		}
		m.lag.Record(ctx, delivered.Sub(enqueued).Seconds(), attrs)
	case o.Status == StatusDead:
		m.dead.Add(ctx, 1, attrs)
	default:
		m.retried.Add(ctx, 1, attrs)
	}
}

// observeClaim counts one claim's batch, events and repaired leases per
// topic.
func (m *metrics) observeClaim(got []driver.Claimed) {
	if len(got) == 0 {
		return
	}
	m.touch()
	ctx := context.Background()
	type counts struct{ events, repaired int64 }
	per := map[[2]string]*counts{}
	for _, c := range got {
		k := [2]string{c.Namespace, c.Topic}
		if per[k] == nil {
			per[k] = &counts{}
		}
		per[k].events++
		if c.Repaired {
			per[k].repaired++
		}
	}
	for k, n := range per {
		attrs := m.topicAttrs(k[0], k[1])
		m.claimBatches.Add(ctx, 1, attrs)
		m.claimedEvents.Add(ctx, n.events, attrs)
		if n.repaired > 0 {
			m.leaseRepairs.Add(ctx, n.repaired, attrs)
		}
	}
}

// observeWakeup counts a notification for topic ("namespace:topic").
func (m *metrics) observeWakeup(topic string) {
	m.touch()
	ns, t, _ := strings.Cut(topic, ":")
	m.wakeups.Add(context.Background(), 1, m.topicAttrs(ns, t))
}

// touch notes that the depth may have changed.
func (m *metrics) touch() {
	select {
	case m.changed <- struct{}{}:
	default:
	}
}

// setLeading records the topics whose gauges this dispatcher reports (those
// whose maintenance lease it holds); nil when it leads none. The values of
// topics no longer led are dropped.
func (m *metrics) setLeading(topics []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if slices.Equal(m.leading, topics) {
		return
	}
	m.leading = slices.Clone(topics)
	m.leadGen++
	m.depth = slices.DeleteFunc(slices.Clone(m.depth), func(r driver.DepthRow) bool { return !slices.Contains(topics, r.Topic) })
	if len(topics) > 0 {
		m.touch()
	}
}

// refreshDepth reads the gauges of the topics this dispatcher leads and
// reports whether it read any (false when it leads none or the read
// failed, and failed true for the latter). A failure drops the values
// read before, so that stale depths are not reported as current (an
// alert on the oldest event's age would stay quiet while events pile up),
// and is logged unless quiet.
func (m *metrics) refreshDepth(ctx context.Context, store driver.Store, quiet bool) (rows []driver.DepthRow, ok, failed bool) {
	m.mu.Lock()
	topics, gen := m.leading, m.leadGen
	m.readSeq++
	seq := m.readSeq
	m.mu.Unlock()
	if len(topics) == 0 {
		return nil, false, false
	}
	rows, err := store.Depth(ctx, topics)
	if err != nil {
		if ctx.Err() != nil {
			return nil, false, false // stopping, or a pass out of time: no news
		}
		m.mu.Lock()
		if gen == m.leadGen && seq > m.stored {
			m.depth, m.stored = nil, seq
		}
		m.mu.Unlock()
		if !quiet {
			m.d.log.Warn("reading the depth gauges failed; they are not reported until a read succeeds", "error", err)
		}
		return nil, false, true
	}
	// Topics with no live rows read zero rather than vanish.
	have := map[string]bool{}
	for _, r := range rows {
		have[r.Topic] = true
	}
	for _, t := range topics {
		if !have[t] {
			rows = append(rows, driver.DepthRow{Topic: t})
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if gen == m.leadGen && seq > m.stored {
		m.depth, m.stored = rows, seq
	}
	if !quiet && live(rows) {
		m.touch() // a maintenance pass found work: the refresher follows it
	}
	return rows, true, false
}

// live reports whether rows have pending or processing events.
func live(rows []driver.DepthRow) bool {
	return slices.ContainsFunc(rows, func(r driver.DepthRow) bool { return r.Pending > 0 || r.Processing > 0 })
}

// gaugeRefreshMin is the shortest time between two reads of the depth
// gauges by the refresher: they lag behind the table by about this much.
const gaugeRefreshMin = time.Second

// gaugeCostFactor: the refresher waits at least this many times as long as
// its last read took, so that on a table where counting is slow the gauges
// never take more than 1/gaugeCostFactor of a connection's time.
const gaugeCostFactor = 20

// refreshGauges keeps the depth gauges of the topics this dispatcher leads
// fresh between maintenance passes: while they have pending or processing
// events, it reads them every gaugeRefreshMin (or gaugeCostFactor times the
// read's duration, if longer); once they have none, it reads them only
// after this dispatcher claims, records an outcome or hears of an enqueue,
// or a maintenance pass finds them busy, so idle topics cost nothing. A
// failed read is not retried before the next change or maintenance pass
// (which logs the failure). It returns when ctx is cancelled.
func (m *metrics) refreshGauges(ctx context.Context, store driver.Store) {
	busy, wait := false, gaugeRefreshMin
	for {
		if !busy {
			select {
			case <-ctx.Done():
				return
			case <-m.changed:
			}
		}
		// At most one read per wait; it covers the changes made meanwhile.
		if !sleepCtx(ctx, wait) {
			return
		}
		select {
		case <-m.changed:
		default:
		}
		start := time.Now()
		rows, ok, _ := m.refreshDepth(ctx, store, true)
		wait = max(gaugeRefreshMin, gaugeCostFactor*time.Since(start))
		busy = ok && live(rows)
		if m.onRefresh != nil {
			m.onRefresh()
		}
	}
}
