package outbox

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
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

// A publish span is a child of the event's enqueue when the event carries
// its trace context, and a root otherwise, also when ctx carries a remote
// span context (a Start under a request's extracted context) or the
// event's traceparent does not parse.
func TestPublishSpanParent(t *testing.T) {
	prev := otel.GetTracerProvider()
	t.Cleanup(func() { otel.SetTracerProvider(prev) })
	rec := tracetest.NewSpanRecorder()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))

	process := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6},
		TraceFlags: trace.FlagsSampled, Remote: true})
	startCtx := trace.ContextWithRemoteSpanContext(context.Background(), process)
	const event = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	for _, c := range []struct {
		name    string
		headers map[string]string
		parent  string // hex span id, "" for a root
	}{
		{"the event's trace context", map[string]string{"traceparent": event}, "b7ad6b7169203331"},
		{"none", nil, ""},
		{"one that does not parse", map[string]string{"traceparent": "garbage"}, ""},
		{"spelt as an http.Header spells it", map[string]string{"Traceparent": event, "Tracestate": "k=v"}, "b7ad6b7169203331"},
	} {
		_, span := startPublishSpan(startCtx, Delivery{ID: uuid.New(), Headers: c.headers}, nil)
		span.End()
		spans := rec.Ended()
		got := spans[len(spans)-1].Parent()
		switch {
		case c.parent == "" && got.IsValid():
			t.Errorf("%s: the span's parent is %s (trace %s), want a root", c.name, got.SpanID(), got.TraceID())
		case c.parent != "" && got.SpanID().String() != c.parent:
			t.Errorf("%s: the span's parent is %s, want %s", c.name, got.SpanID(), c.parent)
		}
	}
}

// An event whose headers already carry a traceparent, in any letter case
// (Traceparent, copied from an http.Header), gets no second one: two that
// differ by case alone made outboxhttp refuse the event for good.
func TestTraceContextKeepsTheCallersTraceparent(t *testing.T) {
	span := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled})
	ctx := trace.ContextWithSpanContext(context.Background(), span)
	for _, h := range []map[string]string{
		{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		{"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		{"TRACEPARENT": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x-id": "1"},
	} {
		if got := withTraceContext(ctx, h); len(got) != len(h) {
			t.Errorf("headers %v became %v, want them as they were", h, got)
		}
	}
	if got := withTraceContext(ctx, map[string]string{"x-id": "1"}); !strings.Contains(got["traceparent"], span.TraceID().String()) {
		t.Errorf("headers without a traceparent became %v, want ctx's added", got)
	}
}
