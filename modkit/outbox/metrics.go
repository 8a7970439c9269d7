package outbox

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// MeterName is the OpenTelemetry instrumentation scope of the outbox
// metrics, taken from the global MeterProvider.
const MeterName = "github.com/modkit-go/modkit/modkit/outbox"

// metrics are the dispatcher's OpenTelemetry instruments:
//
//	outbox.events.delivered / retried / dead / released / lease_lost  (counters, by namespace and topic)
//	outbox.publish.duration        (histogram, seconds)
//	outbox.delivery.lag            (histogram, seconds from enqueue to publish success)
//	outbox.claim.errors, outbox.listener.reconnects (counters)
//	outbox.pending.depth, outbox.processing.depth, outbox.dead.count,
//	outbox.pending.oldest_age      (gauges, refreshed every SweepInterval)
type metrics struct {
	delivered, retried, dead, released, leaseLost metric.Int64Counter
	claimErrors, listenerReconnects               metric.Int64Counter
	publishDuration, lag                          metric.Float64Histogram

	d                              *Dispatcher
	pending, processing, deadCount atomic.Int64
	oldestAge                      atomic.Int64 // nanoseconds
}

func newMetrics(d *Dispatcher) (*metrics, error) {
	meter := otel.Meter(MeterName)
	m := &metrics{d: d}
	var errs []error
	counter := func(name, desc string) metric.Int64Counter {
		c, err := meter.Int64Counter(name, metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	m.delivered = counter("outbox.events.delivered", "Events published and acknowledged.")
	m.retried = counter("outbox.events.retried", "Publish failures rescheduled with backoff.")
	m.dead = counter("outbox.events.dead", "Events dead-lettered.")
	m.released = counter("outbox.events.released", "Claimed events given back unpublished (stop, lease nearly over).")
	m.leaseLost = counter("outbox.events.lease_lost", "Outcomes refused because the lease was lost.")
	m.claimErrors = counter("outbox.claim.errors", "Failed claim queries.")
	m.listenerReconnects = counter("outbox.listener.reconnects", "LISTEN connections lost and re-opened.")
	var err error
	m.publishDuration, err = meter.Float64Histogram("outbox.publish.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of publish calls."))
	errs = append(errs, err)
	m.lag, err = meter.Float64Histogram("outbox.delivery.lag", metric.WithUnit("s"),
		metric.WithDescription("Time from enqueue (transaction start) to successful publish."))
	errs = append(errs, err)
	gauge := func(name, desc string, v *atomic.Int64, scale float64) {
		_, err := meter.Float64ObservableGauge(name, metric.WithDescription(desc),
			metric.WithFloat64Callback(func(_ context.Context, o metric.Float64Observer) error {
				o.Observe(float64(v.Load()) * scale)
				return nil
			}))
		errs = append(errs, err)
	}
	gauge("outbox.pending.depth", "Pending events of the dispatcher's topics.", &m.pending, 1)
	gauge("outbox.processing.depth", "Leased events of the dispatcher's topics.", &m.processing, 1)
	gauge("outbox.dead.count", "Dead events of the dispatcher's topics.", &m.deadCount, 1)
	gauge("outbox.pending.oldest_age", "Seconds the oldest due pending event has waited.", &m.oldestAge, 1e-9)
	return m, errors.Join(errs...)
}

func (m *metrics) observe(o outcome, st Settlement) {
	ctx := context.Background()
	msg := o.res.Message
	attrs := metric.WithAttributes(attribute.String("namespace", msg.Namespace), attribute.String("topic", msg.Topic))
	if !o.started.IsZero() {
		m.publishDuration.Record(ctx, o.elapsed.Seconds(), attrs)
	}
	switch {
	case st.LeaseLost:
		m.leaseLost.Add(ctx, 1, attrs)
	case o.res.Release:
		m.released.Add(ctx, 1, attrs)
	case st.Status == StatusDelivered:
		m.delivered.Add(ctx, 1, attrs)
		m.lag.Record(ctx, time.Since(msg.CreatedAt).Seconds(), attrs)
	case st.Status == StatusDead:
		m.dead.Add(ctx, 1, attrs)
	default:
		m.retried.Add(ctx, 1, attrs)
	}
}

// refreshDepth reads the gauges' values; failures keep the old values.
func (m *metrics) refreshDepth(ctx context.Context) {
	var pending, processing, dead int64
	var oldest float64
	err := m.d.pool.QueryRow(ctx, m.d.store.sql.depth, m.d.keys).Scan(&pending, &processing, &dead, &oldest)
	if err != nil {
		return
	}
	m.pending.Store(pending)
	m.processing.Store(processing)
	m.deadCount.Store(dead)
	m.oldestAge.Store(int64(oldest * 1e9))
}
