package outbox

import (
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"
)

// sliceProvider is a TracerProvider whose type cannot be compared (it holds
// a slice): comparing two of them as interfaces panics.
type sliceProvider struct {
	embedded.TracerProvider
	names []string
}

func (p sliceProvider) Tracer(name string, _ ...trace.TracerOption) trace.Tracer {
	return noop.NewTracerProvider().Tracer(name)
}

// wrappedProvider is a TracerProvider of a type reflect calls comparable,
// whose values may hold one that is not.
type wrappedProvider struct{ trace.TracerProvider }

// The tracer cache follows the global provider as it is swapped, and a
// provider of a type that cannot be compared is asked every time instead
// of making the cache's comparison panic.
func TestTracerFollowsTheGlobalProvider(t *testing.T) {
	prev := otel.GetTracerProvider()
	t.Cleanup(func() { otel.SetTracerProvider(prev) })

	for range 2 {
		otel.SetTracerProvider(sliceProvider{names: []string{"a"}})
		_ = tracer()
		otel.SetTracerProvider(sliceProvider{names: []string{"b"}})
		_ = tracer() // panics if the first one was cached
	}
	// A wrapper whose type reflect calls comparable (an interface field)
	// around such a provider: comparing two panicked inside Enqueue and
	// publish.
	for range 2 {
		otel.SetTracerProvider(wrappedProvider{sliceProvider{names: []string{"a"}}})
		_ = tracer()
		otel.SetTracerProvider(wrappedProvider{sliceProvider{names: []string{"b"}}})
		_ = tracer()
	}
	first, second := noop.NewTracerProvider(), noop.NewTracerProvider()
	otel.SetTracerProvider(first)
	if got, want := tracer(), first.Tracer(meterName); got != want {
		t.Fatalf("tracer() = %v, want the global provider's %v", got, want)
	}
	otel.SetTracerProvider(second)
	if c := cachedTracer.Load(); c == nil || c.provider != trace.TracerProvider(first) {
		t.Fatalf("cache after one call: %+v, want the first provider", c)
	}
	_ = tracer()
	if c := cachedTracer.Load(); c == nil || c.provider != trace.TracerProvider(second) {
		t.Fatalf("cache after the provider changed: %+v, want the second provider", c)
	}
}
