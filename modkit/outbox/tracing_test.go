package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// Headers travel from the enqueue to the publisher, and the trace of the
// request that enqueued an event continues in its publish: one trace id
// from the request's span through the enqueue span to the publish span.
func TestHeadersAndTraceContext(t *testing.T) {
	rec, tp := recordSpans(t)

	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	reqCtx, request := tp.Tracer("test").Start(ctx, "POST /orders")
	m := msg(1)
	m.Headers = map[string]string{"x-correlation-id": "c-42"}
	res, err := client.Enqueue(reqCtx, pool, m)
	if err != nil {
		t.Fatal(err)
	}
	request.End()
	if m.Headers["traceparent"] != "" {
		t.Fatal("Enqueue modified the caller's Headers map")
	}

	type seen struct {
		trace   trace.TraceID
		parent  trace.SpanID
		headers map[string]string
	}
	got := make(chan seen, 1)
	startDispatcher(t, client, testConfig(newOutcomeLog()), outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, d outbox.Delivery) error {
		got <- seen{trace.SpanContextFromContext(ctx).TraceID(), trace.SpanContextFromContext(ctx).SpanID(), d.Headers}
		return nil
	}})
	p := recv(t, "the publish", got)
	want := request.SpanContext().TraceID()
	if p.trace != want {
		t.Fatalf("publish ran in trace %s, want the request's %s", p.trace, want)
	}
	if p.headers["x-correlation-id"] != "c-42" || !strings.Contains(p.headers["traceparent"], want.String()) {
		t.Fatalf("delivery headers: %v", p.headers)
	}
	if e := get(t, client, res.ID); e.Headers["x-correlation-id"] != "c-42" {
		t.Fatalf("Admin.Get headers: %v", e.Headers)
	}
	// The spans: enqueue under the request, publish under the enqueue.
	var enqueue, publish sdktrace.ReadOnlySpan
	eventually(t, "the publish span ended", func() bool {
		for _, s := range rec.Ended() {
			switch s.Name() {
			case "outbox enqueue":
				enqueue = s
			case "outbox publish":
				publish = s
			}
		}
		return enqueue != nil && publish != nil
	})
	if enqueue.Parent().SpanID() != request.SpanContext().SpanID() || enqueue.SpanKind() != trace.SpanKindProducer {
		t.Fatalf("enqueue span: parent %s kind %v, want the request's span %s, producer", enqueue.Parent().SpanID(), enqueue.SpanKind(), request.SpanContext().SpanID())
	}
	if publish.Parent().SpanID() != enqueue.SpanContext().SpanID() || publish.SpanContext().TraceID() != want ||
		publish.SpanContext().SpanID() != p.parent || publish.SpanKind() != trace.SpanKindConsumer {
		t.Fatalf("publish span: parent %s trace %s, want the enqueue span %s in trace %s", publish.Parent().SpanID(),
			publish.SpanContext().TraceID(), enqueue.SpanContext().SpanID(), want)
	}
	// A recording publish span carries the topic's attributes from its
	// start and the event's id and attempt.
	attrs := map[string]string{}
	for _, a := range publish.Attributes() {
		attrs[string(a.Key)] = a.Value.String()
	}
	for k, v := range map[string]string{
		"messaging.system": "modkit-outbox", "messaging.operation.type": "process",
		"messaging.destination.name": testTopic.Namespace + ":" + testTopic.Topic,
		"messaging.message.id":       res.ID.String(), "modkit_outbox.attempt": "1",
	} {
		if attrs[k] != v {
			t.Errorf("publish span attribute %s = %q, want %q (all: %v)", k, attrs[k], v, attrs)
		}
	}
}

func TestInvalidHeaders(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	for name, h := range map[string]map[string]string{
		"empty name":      {"": "v"},
		"space in name":   {"x y": "v"},
		"control in name": {"x\ny": "v"},
		"NUL in value":    {"x": "a\x00b"},
		"bad UTF-8":       {"x": "\xff"},
		"too big":         {"x": strings.Repeat("v", 17<<10)},
	} {
		m := msg(1)
		m.Headers = h
		if _, err := client.Enqueue(ctx, tdb.Provider.Pool, m); !errors.Is(err, outbox.ErrInvalidHeaders) || !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Errorf("%s: %v, want ErrInvalidHeaders", name, err)
		}
	}
	if n := countRows(t, tdb.Provider.Pool, "true"); n != 0 {
		t.Fatalf("%d rows written by refused enqueues", n)
	}
}

// EnqueueBatch stores headers on both of its paths: the function for small
// batches and COPY for large ones.
func TestBatchHeaders(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	for _, n := range []int{2, 70} {
		msgs := make([]outbox.Message, n)
		for i := range msgs {
			msgs[i] = msg(i)
			msgs[i].Headers = map[string]string{"n": strings.Repeat("x", i%3)}
		}
		res, err := client.EnqueueBatch(ctx, tdb.Provider.Pool, msgs)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range res {
			if e := get(t, client, r.ID); len(e.Headers) != 1 || e.Headers["n"] != msgs[i].Headers["n"] {
				t.Fatalf("batch of %d, event %d: headers %v, want %v", n, i, e.Headers, msgs[i].Headers)
			}
		}
	}
}

// retryLater is a publish error that asks for a delay, as an HTTP 429 with
// Retry-After does.
type retryLater time.Duration

func (r retryLater) Error() string             { return "rate limited" }
func (r retryLater) RetryAfter() time.Duration { return time.Duration(r) }

// A publish error's RetryAfter delays the retry at least that long, even
// beyond the backoff.
func TestRetryAfterHonoured(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	enqueueN(t, client, tdb.Provider.Pool, 1)
	log := newOutcomeLog()
	cfg := testConfig(log) // backoff of a few milliseconds
	startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error {
		return fmt.Errorf("webhook: %w", retryLater(time.Hour))
	}})
	var got outbox.Outcome
	log.waitFor(t, "the first failure", func(m map[uuid.UUID][]outbox.Outcome) bool {
		for _, os := range m {
			if len(os) > 0 {
				got = os[0]
				return true
			}
		}
		return false
	})
	if got.RetryIn != time.Hour || got.Status != outbox.StatusPending {
		t.Fatalf("outcome %+v, want a retry in 1h as the error asked", got)
	}
}

// A publish without the enqueue's trace context is a root span, even when
// the dispatcher was started under a span of the process: it became a
// child of that span, so every such publish piled into one trace that had
// ended long before.
func TestPublishSpanWithoutTraceContextIsARoot(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	// Enqueued before any TracerProvider is set: the event carries no
	// traceparent.
	res, err := client.Enqueue(ctx, tdb.Provider.Pool, msg(1))
	if err != nil {
		t.Fatal(err)
	}
	if e := get(t, client, res.ID); e.Headers["traceparent"] != "" {
		t.Fatalf("the event carries a trace context: %v", e.Headers)
	}
	rec, tp := recordSpans(t)
	startupCtx, startup := tp.Tracer("test").Start(ctx, "startup")
	defer startup.End()
	d, err := client.NewDispatcher(testConfig(newOutcomeLog()), outbox.Publisher{Topic: testTopic,
		Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(startupCtx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	var publish sdktrace.ReadOnlySpan
	eventually(t, "the publish span ended", func() bool {
		for _, s := range rec.Ended() {
			if s.Name() == "outbox publish" {
				publish = s
			}
		}
		return publish != nil
	})
	if publish.Parent().IsValid() || publish.SpanContext().TraceID() == startup.SpanContext().TraceID() {
		t.Fatalf("publish span: parent %v in trace %s, want a root span (the dispatcher was started in trace %s)",
			publish.Parent().SpanID(), publish.SpanContext().TraceID(), startup.SpanContext().TraceID())
	}
}

// A transactional handler whose lease ended before its commit delivered
// nothing (its transaction rolled back): its publish span ends with an
// error, not as a success.
func TestLostLeaseInTxSpanIsAnError(t *testing.T) {
	rec, _ := recordSpans(t)

	client, tdb := newClient(t, outbox.Config{})
	id := enqueueN(t, client, tdb.Provider.Pool, 1)[0]
	clock := newTestClock()
	outcomes := newOutcomeLog()
	cfg := testConfig(outcomes)
	startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{Now: clock.Now}), cfg, outbox.Publisher{Topic: testTopic,
		HandleTx: func(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
			if d.Attempt == 1 {
				clock.Advance(2 * cfg.LeaseDuration) // the lease ends before the delivered mark
			}
			return nil
		}})
	outcomes.waitFor(t, "the lost lease, then the delivery", func(m map[uuid.UUID][]outbox.Outcome) bool {
		return len(m[id]) == 2
	})
	statuses := map[int64]codes.Code{} // by attempt: the spans may end in either order
	for _, s := range rec.Ended() {
		if s.Name() != "outbox publish" {
			continue
		}
		for _, a := range s.Attributes() {
			if a.Key == "modkit_outbox.attempt" {
				statuses[a.Value.AsInt64()] = s.Status().Code
			}
		}
	}
	if len(statuses) != 2 || statuses[1] != codes.Error || statuses[2] == codes.Error {
		t.Fatalf("publish span statuses by attempt %v, want an error for attempt 1, whose lease ended, and none for attempt 2", statuses)
	}
}

// recordSpans makes the global TracerProvider one that records every span
// until the test ends, and returns its recorder and the provider.
func recordSpans(t *testing.T) (*tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(context.Background()) })
	return rec, tp
}
