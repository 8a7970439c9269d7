package outboxamqp_test

import (
	"encoding/json"
	"testing"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxamqp"
)

// BenchmarkPublish measures the publisher alone: 32 concurrent publishes
// (the dispatcher's default Concurrency), each awaiting its confirmation,
// of persistent messages to a durable queue.
func BenchmarkPublish(b *testing.B) {
	u := brokerURL(b)
	queue, _ := declareQueue(b, u)
	p := newPublisher(b, outboxamqp.Config{URL: u.String(), Route: toQueue(queue)})
	payload := json.RawMessage(`{"n":1,"padding":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}`)
	b.SetParallelism(32)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: payload}); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}
