package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// The dispatcher reports its outcomes through the global MeterProvider.
func TestDispatcherMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	prev := otel.GetMeterProvider()
	otel.SetMeterProvider(provider)
	t.Cleanup(func() {
		otel.SetMeterProvider(prev)
		_ = provider.Shutdown(context.Background())
	})

	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	// Its own topic, so that dispatchers of tests running alongside do not
	// add to the counts.
	topic := outbox.Topic{Namespace: "metrics", Topic: "probe"}
	for _, payload := range []string{`{"ok":true}`, `{"ok":true}`, `{"ok":false}`} {
		if _, err := outbox.Enqueue(ctx, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(payload)}); err != nil {
			t.Fatal(err)
		}
	}
	log := newSettledLog()
	startDispatcher(t, pool, testConfig(log), outbox.Publisher{Topic: topic, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
		var body struct{ OK bool }
		if err := json.Unmarshal(m.Payload, &body); err != nil || !body.OK {
			return outbox.Permanent(errors.New("malformed"))
		}
		return nil
	}})
	log.waitFor(t, "2 delivered", finalCount(outbox.StatusDelivered, 2))
	log.waitFor(t, "1 dead", finalCount(outbox.StatusDead, 1))

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	ours := attribute.NewSet(attribute.String("namespace", topic.Namespace), attribute.String("topic", topic.Topic))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != outbox.MeterName {
			continue
		}
		for _, m := range sm.Metrics {
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range data.DataPoints {
					if dp.Attributes.Equals(&ours) {
						got[m.Name] += dp.Value
					}
				}
			case metricdata.Histogram[float64]:
				for _, dp := range data.DataPoints {
					if dp.Attributes.Equals(&ours) {
						got[m.Name] += int64(dp.Count)
					}
				}
			case metricdata.Gauge[float64]:
				got[m.Name] = int64(len(data.DataPoints))
			}
		}
	}
	want := map[string]int64{
		"outbox.events.delivered": 2,
		"outbox.events.dead":      1,
		"outbox.publish.duration": 3,
		"outbox.delivery.lag":     2,
	}
	for name, n := range want {
		if got[name] != n {
			t.Errorf("%s = %d, want %d (all: %v)", name, got[name], n, got)
		}
	}
	for _, gauge := range []string{"outbox.pending.depth", "outbox.dead.count", "outbox.pending.oldest_age"} {
		if got[gauge] == 0 {
			t.Errorf("gauge %s not reported (all: %v)", gauge, got)
		}
	}
}
