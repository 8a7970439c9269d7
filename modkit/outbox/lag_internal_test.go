package outbox

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// TestClaimSkew: each claim reads the database clock's lead over this
// process's from the lease it set (its end minus LeaseDuration is the
// database's clock at the claim's start), plus the time until the claim's
// statement started; the estimate is the smallest of the recent readings,
// and delivery.lag takes it off created_at.
func TestClaimSkew(t *testing.T) {
	local := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC) // this process's clock at a claim's start
	lease := 30 * time.Second
	d := &Dispatcher{c: &Client{}, cfg: DispatcherConfig{LeaseDuration: lease}}
	claim := func(skew, delay time.Duration) []driver.Claimed {
		dbAtStatement := local.Add(skew + delay)
		return []driver.Claimed{{CreatedAt: dbAtStatement.Add(-20 * time.Millisecond), LockedTill: dbAtStatement.Add(lease)}}
	}
	const skew = 5 * time.Second // the database's clock ahead
	for _, step := range []struct {
		delay, want time.Duration // the claim's delay until its statement, and the estimate after it
	}{
		{3 * time.Millisecond, skew + 3*time.Millisecond},
		{time.Millisecond, skew + time.Millisecond},
		{40 * time.Millisecond, skew + time.Millisecond}, // a wait for a connection does not inflate the estimate
	} {
		got, ok := d.claimSkew(claim(skew, step.delay), local)
		if !ok || got != step.want {
			t.Fatalf("after a claim delayed %v: skew %v (%v), want %v", step.delay, got, ok, step.want)
		}
	}
	// The reading of 1ms leaves the window after clockSkewReadings more
	// claims, so a change between the clocks is followed.
	for range clockSkewReadings {
		d.claimSkew(claim(-3*time.Second, 2*time.Millisecond), local)
	}
	if got, _ := d.claimSkew(claim(-3*time.Second, 2*time.Millisecond), local); got != -3*time.Second+2*time.Millisecond {
		t.Fatalf("after the database's clock moved 3s behind: skew %v, want %v", got, -3*time.Second+2*time.Millisecond)
	}

	// No estimate without an event, without a lease end, or under a test
	// clock (which sets leases but not created_at).
	if _, ok := d.claimSkew(nil, local); ok {
		t.Fatal("a skew from a claim of no event")
	}
	if _, ok := d.claimSkew([]driver.Claimed{{CreatedAt: local}}, local); ok {
		t.Fatal("a skew from a claim without a lease end")
	}
	d.c.cfg.Now = func() time.Time { return local.Add(time.Hour) }
	if _, ok := d.claimSkew(claim(skew, 0), local); ok {
		t.Fatal("a skew under a test clock")
	}
}

// delivery.lag runs from the event's enqueue to its publish's end, not to
// the recording of its outcome, which may come much later (the outcome
// write's wait for more results, a slow database, its retries).
func TestLagEndsAtThePublish(t *testing.T) {
	prev := otel.GetMeterProvider()
	t.Cleanup(func() { otel.SetMeterProvider(prev) })
	reader := sdkmetric.NewManualReader()
	otel.SetMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))
	reg, err := newRegistry(nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := newMetrics(&Dispatcher{reg: reg})
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now().Add(-time.Hour) // an outcome recorded an hour after its publish
	enqueued := started.Add(-3 * time.Second)
	m.observe(result{c: claimed{d: Delivery{Namespace: "test", Topic: "events"}, enqueued: enqueued}, started: started,
		elapsed: 500 * time.Millisecond}, Outcome{Status: StatusDelivered})
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name != "outbox.delivery.lag" {
				continue
			}
			h := mt.Data.(metricdata.Histogram[float64])
			if len(h.DataPoints) != 1 || h.DataPoints[0].Count != 1 || h.DataPoints[0].Sum != 3.5 {
				t.Fatalf("delivery.lag: %+v, want one value of 3.5s (enqueue to the publish's end)", h.DataPoints)
			}
			return
		}
	}
	t.Fatal("no outbox.delivery.lag recorded")
}
