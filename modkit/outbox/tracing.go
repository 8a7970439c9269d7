package outbox

import (
	"context"
	"reflect"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The outbox carries the W3C trace context of an enqueue to its publish in
// the event's headers, and records an "outbox enqueue" (producer) and an
// "outbox publish" (consumer) span on the global TracerProvider, so that one
// trace covers the request that committed an event and every attempt to
// publish it. With no TracerProvider set, spans cost next to nothing and
// only a trace context already in ctx is carried.

// traceContext is the W3C Trace Context format (traceparent, tracestate),
// used whatever the global propagator is.
var traceContext propagation.TraceContext

// tracer returns the outbox's tracer of the global TracerProvider. It is
// looked up again only when the global provider changes (a provider set,
// or swapped by a test), since otel.Tracer takes a lock and a map lookup
// that cost a measurable share of a drain's client CPU when asked per
// event. A provider that cannot be compared (a struct holding a slice, or
// an interface field holding one, which reflect still calls comparable) is
// asked every time: such comparisons panic, so sameProvider recovers and
// says no.
func tracer() trace.Tracer {
	tp := otel.GetTracerProvider()
	if c := cachedTracer.Load(); c != nil && sameProvider(c.provider, tp) {
		return c.tracer
	}
	t := tp.Tracer(meterName)
	if reflect.TypeOf(tp).Comparable() && sameProvider(tp, tp) {
		cachedTracer.Store(&providerTracer{provider: tp, tracer: t})
	}
	return t
}

// sameProvider reports whether a == b, and false where comparing them
// panics (values of the same type holding something not comparable).
func sameProvider(a, b trace.TracerProvider) (same bool) {
	defer func() {
		if recover() != nil {
			same = false
		}
	}()
	return a == b
}

// providerTracer is a tracer and the provider it came from.
type providerTracer struct {
	provider trace.TracerProvider
	tracer   trace.Tracer
}

var cachedTracer atomic.Pointer[providerTracer]

// startEnqueueSpan starts the span of one Enqueue or EnqueueBatch call.
func startEnqueueSpan(ctx context.Context, destination string, count int) (context.Context, trace.Span) {
	attrs := []attribute.KeyValue{attribute.String("messaging.system", "modkit-outbox"), attribute.String("messaging.operation.type", "send")}
	if destination != "" {
		attrs = append(attrs, attribute.String("messaging.destination.name", destination))
	}
	if count > 1 {
		attrs = append(attrs, attribute.Int("messaging.batch.message_count", count))
	}
	return tracer().Start(ctx, "outbox enqueue", trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
}

// endSpan ends span, marking it failed with err's redacted text.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, SanitizeError(err, 512))
	}
	span.End()
}

// withTraceContext returns h plus ctx's trace context, unless ctx has none
// or h already carries one. h itself is never modified.
func withTraceContext(ctx context.Context, h map[string]string) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return h
	}
	if _, ok := traceParentKey(h); ok {
		return h
	}
	out := make(map[string]string, len(h)+2)
	for k, v := range h {
		out[k] = v
	}
	traceContext.Inject(ctx, propagation.MapCarrier(out))
	return out
}

// traceParentKey returns the key under which h holds a traceparent, in
// any letter case: a header copied from an http.Header as it is spells it
// Traceparent, and adding a traceparent beside it gave the event two
// (which outboxhttp refuses to send).
func traceParentKey(h map[string]string) (string, bool) {
	if _, ok := h["traceparent"]; ok {
		return "traceparent", true
	}
	return headerKeyFold(h, "traceparent")
}

// headerKeyFold returns the key of h equal to name in any letter case.
func headerKeyFold(h map[string]string, name string) (string, bool) {
	for k := range h {
		if len(k) == len(name) && strings.EqualFold(k, name) {
			return k, true
		}
	}
	return "", false
}

// publishSpanOptions are the start options of a topic's publish spans:
// the kind and the attributes that a sampler may look at. They are built
// once per registered topic.
func publishSpanOptions(t Topic) []trace.SpanStartOption {
	return []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
		attribute.String("messaging.system", "modkit-outbox"),
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.destination.name", t.key()))}
}

// startPublishSpan restores the enqueue's trace context from the event's
// headers into ctx and starts the span of one publish attempt under it,
// with opts from publishSpanOptions. The event's id and attempt are set on
// spans that record only: building them for every event cost about a
// tenth of a drain's client CPU with no TracerProvider set.
func startPublishSpan(ctx context.Context, m Delivery, opts []trace.SpanStartOption) (context.Context, trace.Span) {
	fromEvent := false
	if key, ok := traceParentKey(m.Headers); ok {
		carrier := propagation.MapCarrier(m.Headers)
		if key != "traceparent" {
			// The propagator reads the lower-case names only.
			carrier = propagation.MapCarrier{"traceparent": m.Headers[key]}
			if k, ok := headerKeyFold(m.Headers, "tracestate"); ok {
				carrier["tracestate"] = m.Headers[k]
			}
		}
		// Extracted on its own, so that a span context ctx already
		// carries is not taken for the event's when its header does not
		// parse.
		if sc := trace.SpanContextFromContext(traceContext.Extract(context.Background(), carrier)); sc.IsValid() {
			ctx, fromEvent = trace.ContextWithRemoteSpanContext(ctx, sc), true
		}
	}
	// Without the enqueue's trace context (none, or one that does not
	// parse), the span is a root: ctx may still carry a span context of
	// the process (the one Dispatcher.Start was called under, local or
	// remote), which is no parent of this event's publish.
	if !fromEvent && trace.SpanContextFromContext(ctx).IsValid() {
		opts = append(opts[:len(opts):len(opts)], trace.WithNewRoot())
	}
	ctx, span := tracer().Start(ctx, "outbox publish", opts...)
	if span.IsRecording() {
		span.SetAttributes(attribute.String("messaging.message.id", m.ID.String()),
			attribute.Int("modkit_outbox.attempt", m.Attempt))
	}
	return ctx, span
}
