package outboxamqp_test

import (
	"fmt"
	"testing"

	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxamqp"
)

// BenchmarkDispatch: events/s from committed events to broker confirms,
// persistent messages to a durable queue (run with -benchtime=10000x).
func BenchmarkDispatch(b *testing.B) {
	u := brokerURL(b)
	queue, _ := declareQueue(b, u)
	p := newPublisher(b, outboxamqp.Config{URL: u.String(), Route: toQueue(queue)})
	brokertest.BenchDispatch(b, p.For(brokertest.Topic))
}

// BenchmarkPublish: the publisher alone, 32 publishes in flight sharing
// one confirm channel, and 1 for comparison.
func BenchmarkPublish(b *testing.B) {
	for _, conc := range []int{1, 32} {
		b.Run(fmt.Sprintf("concurrency=%d", conc), func(b *testing.B) {
			u := brokerURL(b)
			queue, _ := declareQueue(b, u)
			p := newPublisher(b, outboxamqp.Config{URL: u.String(), Route: toQueue(queue)})
			brokertest.BenchPublish(b, conc, p.Publish)
		})
	}
}
