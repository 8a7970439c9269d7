package outboxkafka_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxkafka"
)

// BenchmarkDispatch: events/s from committed events to Kafka acks, against
// the in-process kfake cluster (run with -benchtime=10000x), with
// franz-go's default linger (10ms) and with none.
func BenchmarkDispatch(b *testing.B) {
	for _, linger := range []time.Duration{10 * time.Millisecond, 0} {
		b.Run(fmt.Sprintf("linger=%v", linger), func(b *testing.B) {
			cluster := startCluster(b)
			cl := newClient(b, cluster.ListenAddrs(), kgo.ProducerLinger(linger))
			brokertest.BenchDispatch(b, newPublisher(b, cl, outboxkafka.Config{}).For(brokertest.Topic))
		})
	}
}

// BenchmarkPublish: the publisher alone. With 32 publishes in flight the
// client batches their records into shared produce requests; with 1, each
// record is a request of its own and waits out the linger.
func BenchmarkPublish(b *testing.B) {
	for _, linger := range []time.Duration{10 * time.Millisecond, 0} {
		for _, conc := range []int{1, 32} {
			b.Run(fmt.Sprintf("linger=%v/concurrency=%d", linger, conc), func(b *testing.B) {
				cluster := startCluster(b)
				cl := newClient(b, cluster.ListenAddrs(), kgo.ProducerLinger(linger))
				brokertest.BenchPublish(b, conc, newPublisher(b, cl, outboxkafka.Config{}).Publish)
			})
		}
	}
}
