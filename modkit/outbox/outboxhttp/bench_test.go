package outboxhttp_test

import (
	"testing"

	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxhttp"
)

// BenchmarkDispatch: events/s from committed events to 2xx answers of an
// httptest receiver that checks every signature (run with
// -benchtime=10000x).
func BenchmarkDispatch(b *testing.B) {
	_, srv := newReceiver(b)
	brokertest.BenchDispatch(b, newPublisher(b, outboxhttp.Config{Endpoint: srv.URL}).For(brokertest.Topic))
}

// BenchmarkPublish: the publisher alone, 32 requests in flight.
func BenchmarkPublish(b *testing.B) {
	_, srv := newReceiver(b)
	brokertest.BenchPublish(b, 32, newPublisher(b, outboxhttp.Config{Endpoint: srv.URL}).Publish)
}
