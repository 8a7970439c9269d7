package outboxamqp_test

import (
	"fmt"
	"testing"

	"github.com/modkit-go/modkit/modkit/outbox"
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

// BenchmarkPublishToExchange is BenchmarkPublish through a direct exchange
// bound to the queue, rather than the default exchange: the route of a
// Config.Route that names an exchange.
func BenchmarkPublishToExchange(b *testing.B) {
	for _, conc := range []int{1, 32} {
		b.Run(fmt.Sprintf("concurrency=%d", conc), func(b *testing.B) {
			u := brokerURL(b)
			queue, ch := declareQueue(b, u)
			exchange := declareExchange(b, ch, queue)
			p := newPublisher(b, outboxamqp.Config{URL: u.String(), Route: func(outbox.Delivery) (string, string) { return exchange, queue }})
			brokertest.BenchPublish(b, conc, p.Publish)
		})
	}
}

// BenchmarkFirstPublishToExchange: the first publish of a new Publisher
// through a direct exchange, connection included (ns/op), which is what
// a reconnect costs.
func BenchmarkFirstPublishToExchange(b *testing.B) {
	u := brokerURL(b)
	queue, ch := declareQueue(b, u)
	exchange := declareExchange(b, ch, queue)
	cfg := outboxamqp.Config{URL: u.String(), Route: func(outbox.Delivery) (string, string) { return exchange, queue }}
	b.ResetTimer()
	for range b.N {
		p, err := outboxamqp.New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Publish(ctx, event()); err != nil {
			b.Fatal(err)
		}
		b.StopTimer() // the close is not part of the first publish
		if err := p.Close(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
