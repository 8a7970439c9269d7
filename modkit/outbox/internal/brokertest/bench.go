package brokertest

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// BenchDispatch measures events/s from committed events to broker
// acknowledgements: b.N events are enqueued (and committed) first, then a
// dispatcher with the library's default Concurrency (32) and BatchSize 500
// delivers them all through pub; the figure is b.N over the time from its
// start to the last event recorded as delivered.
func BenchDispatch(b *testing.B, pub outbox.Publisher) {
	b.Helper()
	c, d := outboxtest.NewClient(b, outbox.Config{})
	Enqueue(b, c, d, b.N)
	ctx := context.Background()
	var done atomic.Int64
	all := make(chan struct{})
	cfg := Config(30*time.Second, func(_ outbox.Delivery, o outbox.Outcome) {
		if o.Status == outbox.StatusDelivered && !o.LeaseLost && done.Add(1) == int64(b.N) {
			close(all)
		}
	})
	cfg.BatchSize = 500
	cfg.PollInterval = 10 * time.Millisecond
	disp, err := c.NewDispatcher(cfg, pub)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	if err := disp.Start(ctx); err != nil {
		b.Fatal(err)
	}
	select {
	case <-all:
	case <-time.After(guard):
		b.Fatalf("%d of %d events delivered in %v", done.Load(), b.N, guard)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if err := disp.Stop(ctx); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "events/s")
}

// BenchPublish measures publish alone: concurrency goroutines call publish
// with fresh deliveries of a 128-byte payload until b.N calls are done.
func BenchPublish(b *testing.B, concurrency int, publish func(context.Context, outbox.Delivery) error) {
	b.Helper()
	payload := json.RawMessage(`{"n":1,"padding":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}`)
	ctx := context.Background()
	var next atomic.Int64
	errs := make(chan error, concurrency)
	b.ResetTimer()
	start := time.Now()
	for range concurrency {
		go func() {
			for next.Add(1) <= int64(b.N) {
				d := outbox.Delivery{ID: uuid.New(), Namespace: Topic.Namespace, Topic: Topic.Topic, Payload: payload,
					Attempt: 1, MaxAttempts: 1, CreatedAt: time.Now()}
				if err := publish(ctx, d); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range concurrency {
		if err := <-errs; err != nil {
			b.Error(err)
		}
	}
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "events/s")
}
