package outboxnats_test

import (
	"context"
	"testing"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxnats"
)

// BenchmarkDispatch: events/s from committed events to JetStream acks
// (run with -benchtime=10000x).
func BenchmarkDispatch(b *testing.B) {
	srv := startServer(b)
	js := connect(b, srv.ClientURL())
	createStream(b, js)
	brokertest.BenchDispatch(b, newPublisher(b, js, outboxnats.Config{}).For(brokertest.Topic))
}

// BenchmarkPublish: the publisher alone with 32 publishes in flight, its
// asynchronous publishes (acks awaited together) against the synchronous
// API (js.PublishMsg, one ack round trip per message) as the baseline.
func BenchmarkPublish(b *testing.B) {
	for _, mode := range []string{"async", "sync"} {
		b.Run(mode, func(b *testing.B) {
			srv := startServer(b)
			js := connect(b, srv.ClientURL())
			createStream(b, js)
			p := newPublisher(b, js, outboxnats.Config{})
			publish := p.Publish
			if mode == "sync" {
				publish = func(ctx context.Context, d outbox.Delivery) error {
					_, err := js.PublishMsg(ctx, p.Msg(d))
					return err
				}
			}
			brokertest.BenchPublish(b, 32, publish)
		})
	}
}
