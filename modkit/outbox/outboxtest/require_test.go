package outboxtest_test

import (
	"context"
	"encoding/json"
	"maps"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

var (
	ctx     = context.Background()
	placed  = outbox.Topic{Namespace: "shop", Topic: "order_placed"}
	shipped = outbox.Topic{Namespace: "shop", Topic: "order_shipped"}
)

type order struct {
	ID    string `json:"id"`
	Cents int    `json:"cents"`
}

func enqueue(t *testing.T, c *outbox.Client, r db.Runner, topic outbox.Topic, payload string, edit ...func(*outbox.Message)) {
	t.Helper()
	m := outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(payload)}
	for _, e := range edit {
		e(&m)
	}
	if _, err := c.Enqueue(ctx, r, m); err != nil {
		t.Fatal(err)
	}
}

func TestRequireEnqueued(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tenant := uuid.New()
	enqueue(t, c, pool, placed, `{"id":"o-1","cents":100}`)
	enqueue(t, c, pool, placed, `{"cents":250, "id":"o-2"}`, func(m *outbox.Message) {
		m.TenantID, m.DedupeKey = &tenant, outbox.Key(tenant.String()+"/o-2")
		m.OrderingKey, m.Headers = "order/o-2", map[string]string{"source": "checkout"}
	})

	if got := outboxtest.RequireEnqueued(t, c, placed); len(got) != 2 {
		t.Fatalf("all events of the topic: %d, want 2", len(got))
	}
	for name, m := range map[string]outboxtest.Matcher{
		"Payload":      outboxtest.Payload(order{ID: "o-2", Cents: 250}),
		"PayloadJSON":  outboxtest.PayloadJSON(`{"id": "o-2", "cents": 250.0}`),
		"PayloadWhere": outboxtest.PayloadWhere("cents above 200", func(o order) bool { return o.Cents > 200 }),
		"DedupeKey":    outboxtest.DedupeKey(tenant.String() + "/o-2"),
		"Tenant":       outboxtest.Tenant(tenant),
		"OrderingKey":  outboxtest.OrderingKey("order/o-2"),
		"Header":       outboxtest.Header("source", "checkout"),
	} {
		got := outboxtest.RequireEnqueued(t, c, placed, m)
		if len(got) != 1 || got[0].TenantID == nil || *got[0].TenantID != tenant {
			t.Errorf("%s: %+v, want the one event of o-2", name, got)
		}
	}
	outboxtest.RequireNotEnqueued(t, c, shipped)
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.Payload(order{ID: "o-3"}))
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.OrderingKey("order/o-1"))
	if got := outboxtest.RequireEnqueued(t, c, placed, outboxtest.OrderingKey("")); len(got) != 1 || got[0].OrderingKey != "" {
		t.Errorf("events without an ordering key: %+v, want the one of o-1", got)
	}
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.Header("source", "admin"))
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.Header("origin", ""))

	// Failures say what was looked for and what is there.
	msg := failure(t, func(t outboxtest.TB) {
		outboxtest.RequireEnqueued(t, c, placed, outboxtest.Payload(order{ID: "o-9", Cents: 1}))
	})
	for _, want := range []string{"shop/order_placed", `payload {"id":"o-9","cents":1}`, "2 other event(s)", `"o-1"`,
		`ordering_key="order/o-2" seq=1`, `headers={source: "checkout"}`} {
		if !strings.Contains(msg, want) {
			t.Errorf("RequireEnqueued's failure must mention %s: %q", want, msg)
		}
	}
	// A matcher that cannot match anything (a typo in its JSON, a value
	// JSON cannot encode) fails the assertion at once, negative ones too,
	// which it would otherwise pass whatever was enqueued.
	for name, m := range map[string]outboxtest.Matcher{
		"PayloadJSON":                 outboxtest.PayloadJSON(`{"id":"o-1"`),
		"Payload":                     outboxtest.Payload(func() {}),
		"Payload of JSON text":        outboxtest.Payload(`{"id":"o-1"}`),
		"Payload of JSON text, bytes": outboxtest.Payload([]byte(`{"id":"o-1"}`)),
		"Payload of JSON text, a defined byte type":   outboxtest.Payload(rawBytes(`{"id":"o-1"}`)),
		"Payload of JSON text, a defined string type": outboxtest.Payload(text(`{"id":"o-1"}`)),
		"Payload of JSON text, a *string":             outboxtest.Payload(ptr(`[{"id":"o-1"}]`)),
		"PayloadJSON with more after the value":       outboxtest.PayloadJSON(`{"id":"o-1"}}`),
		"PayloadJSON of two values":                   outboxtest.PayloadJSON(`{"id":"o-1"},{"id":"o-2"}`),
	} {
		msg := failure(t, func(t outboxtest.TB) { outboxtest.RequireNotEnqueued(t, c, placed, m) })
		if !strings.Contains(msg, "matcher") || strings.Contains(msg, "0x7b") { // bytes shown as text, not hex
			t.Errorf("RequireNotEnqueued with a broken %s matcher passed or said %q", name, msg)
		}
	}
	if msg := failure(t, func(t outboxtest.TB) { outboxtest.RequireEnqueued(t, c, shipped) }); !strings.Contains(msg, "the topic has none") {
		t.Errorf("RequireEnqueued on an empty topic: %q", msg)
	}
	msg = failure(t, func(t outboxtest.TB) { outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.Tenant(tenant)) })
	if !strings.Contains(msg, "1 event(s) of shop/order_placed") || !strings.Contains(msg, "o-2") {
		t.Errorf("RequireNotEnqueued's failure: %q", msg)
	}
}

// RequireEnqueuedOnce fails when the event was enqueued twice, which
// RequireEnqueued passes, and returns the one event otherwise.
func TestRequireEnqueuedOnce(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueue(t, c, pool, placed, `{"id":"o-1","cents":100}`)
	enqueue(t, c, pool, placed, `{"id":"o-2","cents":100}`)
	enqueue(t, c, pool, placed, `{"id":"o-2","cents":100}`)
	if e := outboxtest.RequireEnqueuedOnce(t, c, placed, outboxtest.Payload(order{ID: "o-1", Cents: 100})); !strings.Contains(string(e.Payload), "o-1") {
		t.Errorf("RequireEnqueuedOnce returned %+v, want the event of o-1", e)
	}
	msg := failure(t, func(t outboxtest.TB) {
		outboxtest.RequireEnqueuedOnce(t, c, placed, outboxtest.Payload(order{ID: "o-2", Cents: 100}))
	})
	if !strings.Contains(msg, "2 events of shop/order_placed were enqueued") || !strings.Contains(msg, "want exactly one") {
		t.Errorf("RequireEnqueuedOnce of an event enqueued twice: %q", msg)
	}
	if msg := failure(t, func(t outboxtest.TB) { outboxtest.RequireEnqueuedOnce(t, c, shipped) }); !strings.Contains(msg, "the topic has none") {
		t.Errorf("RequireEnqueuedOnce on an empty topic: %q", msg)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	enqueue(t, c, tx, placed, `{"id":"o-3","cents":1}`)
	if e := outboxtest.RequireEnqueuedOnceTx(t, c, tx, placed, outboxtest.Payload(order{ID: "o-3", Cents: 1})); e.Namespace != "shop" {
		t.Errorf("RequireEnqueuedOnceTx returned %+v", e)
	}
}

type (
	rawBytes []byte
	text     string
)

func ptr(s string) *string { return &s }

// A dedupe key matches in any spelling of its tenant prefix, as the outbox
// stores one spelling; a string payload that merely starts with a bracket
// is a string, not JSON text.
func TestMatchersAsStored(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tenant := uuid.New()
	hex32 := strings.ReplaceAll(tenant.String(), "-", "")
	enqueue(t, c, pool, placed, `{"id":"o-1"}`, func(m *outbox.Message) {
		m.TenantID, m.DedupeKey = &tenant, outbox.Key(strings.ToUpper(hex32)+"/o-1")
	})
	for _, key := range []string{tenant.String() + "/o-1", hex32 + "/o-1", strings.ToUpper(tenant.String()) + "/o-1"} {
		if got := outboxtest.RequireEnqueued(t, c, placed, outboxtest.DedupeKey(key)); len(got) != 1 {
			t.Errorf("DedupeKey(%q): %d events, want 1", key, len(got))
		}
	}
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.DedupeKey(tenant.String()+"/o-2"))

	enqueue(t, c, pool, shipped, `"[WARN] disk full"`)
	outboxtest.RequireEnqueued(t, c, shipped, outboxtest.Payload("[WARN] disk full"))
}

// A matcher that cannot judge an event no other matcher ruled out (its
// payload does not decode into the matcher's type) fails RequireNotEnqueued
// rather than passing it, and is named when RequireEnqueued finds nothing.
func TestMatcherThatCannotJudge(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueue(t, c, pool, placed, `{"id":"o-1","cents":"100"}`)
	o1 := outboxtest.PayloadWhere("order o-1", func(o order) bool { return o.ID == "o-1" })
	msg := failure(t, func(t outboxtest.TB) { outboxtest.RequireNotEnqueued(t, c, placed, o1) })
	if !strings.Contains(msg, "cannot tell") || !strings.Contains(msg, "does not decode into a outboxtest_test.order") {
		t.Errorf("RequireNotEnqueued with a payload that does not decode: %q", msg)
	}
	msg = failure(t, func(t outboxtest.TB) { outboxtest.RequireEnqueued(t, c, placed, o1) })
	if !strings.Contains(msg, "could not judge") {
		t.Errorf("RequireEnqueued with a payload that does not decode: %q", msg)
	}
	// Ruled out by another matcher first: nothing to judge.
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.Tenant(uuid.New()), o1)
}

// A Recorder's zero value works as NewRecorder's does.
func TestZeroRecorder(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	enqueue(t, c, tdb.Provider.Pool, placed, `{"id":"o-1"}`)
	var rec outboxtest.Recorder
	if got := outboxtest.Drain(t, c, rec.Publisher(placed)); len(got) != 1 {
		t.Fatalf("drained %d, want 1", len(got))
	}
	if got := rec.Wait(t, 1); len(got) != 1 {
		t.Fatalf("recorded %d, want 1", len(got))
	}
}

// Payloads compare as jsonb compares them: numbers by value, exactly, even
// beyond int64 and float64 (which took 18446744073709551615 for …614);
// JSON text in a json.RawMessage and a plain string payload still match.
func TestPayloadMatchesAsJSONB(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueue(t, c, pool, placed, `{"big":18446744073709551615,"ratio":1.50,"n":1e2}`)
	enqueue(t, c, pool, shipped, `"just a string"`)
	outboxtest.RequireEnqueued(t, c, placed, outboxtest.PayloadJSON(`{"n":100,"ratio":1.5,"big":18446744073709551615}`))
	outboxtest.RequireEnqueued(t, c, placed, outboxtest.Payload(json.RawMessage(`{"n":100.0,"ratio":15e-1,"big":18446744073709551615}`)))
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.PayloadJSON(`{"n":100,"ratio":1.5,"big":18446744073709551614}`))
	outboxtest.RequireEnqueued(t, c, shipped, outboxtest.Payload("just a string"))
	// A number beyond int64 is not the string of its digits, nor 1.5 "3/2".
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.PayloadJSON(`{"n":100,"ratio":1.5,"big":"18446744073709551615"}`))
	outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.PayloadJSON(`{"n":100,"ratio":"3/2","big":18446744073709551615}`))
}

// The Tx forms see the caller's uncommitted events, through any runner, in
// the client's schema; the plain forms see only committed ones.
func TestRequireEnqueuedTx(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{Schema: "shop_outbox"})
	p := tdb.Provider
	err := db.InTx(ctx, p.Pool, func(ctx context.Context, tx pgx.Tx) error {
		enqueue(t, c, tx, placed, `{"id":"o-1"}`)
		got := outboxtest.RequireEnqueuedTx(t, c, tx, placed, outboxtest.PayloadJSON(`{"id":"o-1"}`))
		if len(got) != 1 || got[0].Status != outbox.StatusPending || got[0].Attempts != 0 {
			t.Fatalf("uncommitted event seen from its transaction: %+v", got)
		}
		outboxtest.RequireNotEnqueued(t, c, placed)
		outboxtest.RequireNotEnqueuedTx(t, c, tx, shipped)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	outboxtest.RequireEnqueued(t, c, placed)

	bunTx, err := p.Bun.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	enqueue(t, c, db.SQL(bunTx), shipped, `{"id":"o-1"}`)
	outboxtest.RequireEnqueuedTx(t, c, db.SQL(bunTx), shipped)
	if err := bunTx.Rollback(); err != nil {
		t.Fatal(err)
	}
	outboxtest.RequireNotEnqueued(t, c, shipped)
}

// The Tx forms return the events as the plain forms do, headers, ordering
// key and sequence included, through pgx and database/sql alike (they came
// back empty).
func TestRequireEnqueuedTxReturnsWholeEvents(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	p := tdb.Provider
	m := outbox.Message{Namespace: placed.Namespace, Topic: placed.Topic, Payload: json.RawMessage(`{"id":"o-1"}`),
		Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, OrderingKey: "order-1"}
	err := db.InTx(ctx, p.Pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := c.Enqueue(ctx, tx, m); err != nil {
			return err
		}
		got := outboxtest.RequireEnqueuedTx(t, c, tx, placed)
		if len(got) != 1 || !maps.Equal(got[0].Headers, m.Headers) || got[0].OrderingKey != "order-1" || got[0].Sequence != 1 {
			t.Fatalf("pgx: %+v, want the headers, ordering key and sequence 1", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sqlTx, err := p.SQL.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sqlTx.Rollback() }()
	got := outboxtest.RequireEnqueuedTx(t, c, db.SQL(sqlTx), placed)
	want := outboxtest.RequireEnqueued(t, c, placed)
	if len(got) != 1 || len(want) != 1 || !maps.Equal(got[0].Headers, want[0].Headers) || got[0].OrderingKey != want[0].OrderingKey ||
		got[0].Sequence != want[0].Sequence {
		t.Fatalf("database/sql: %+v, want as RequireEnqueued: %+v", got, want)
	}
}

// A topic without a namespace or a topic (the zero Topic of an
// uninitialised TypedTopic, or one half filled in) fails every helper that
// takes one, saying so: events are listed by namespace and topic, an empty
// one standing for any, so RequireEnqueued passed on another topic's events
// and RequireNotEnqueuedTx passed whatever was enqueued.
func TestHelpersRefuseAnEmptyTopic(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueue(t, c, pool, placed, `{"id":"o-1"}`)
	var uninitialised outbox.TypedTopic[order]
	for _, tc := range []struct {
		name  string
		topic outbox.Topic
		want  string
	}{
		{"zero", uninitialised.Topic(), "topic is the zero outbox.Topic"},
		{"no topic", outbox.Topic{Namespace: placed.Namespace}, `topic "shop/" has an empty topic`},
		{"no namespace", outbox.Topic{Topic: placed.Topic}, `topic "/order_placed" has an empty namespace`},
	} {
		for name, helper := range map[string]func(outboxtest.TB){
			"RequireEnqueued":      func(t outboxtest.TB) { outboxtest.RequireEnqueued(t, c, tc.topic) },
			"RequireEnqueuedTx":    func(t outboxtest.TB) { outboxtest.RequireEnqueuedTx(t, c, pool, tc.topic) },
			"RequireNotEnqueued":   func(t outboxtest.TB) { outboxtest.RequireNotEnqueued(t, c, tc.topic) },
			"RequireNotEnqueuedTx": func(t outboxtest.TB) { outboxtest.RequireNotEnqueuedTx(t, c, pool, tc.topic) },
			"Drain":                func(t outboxtest.TB) { outboxtest.Drain(t, c, outboxtest.NewRecorder().Publisher(tc.topic)) },
		} {
			msg := failure(t, helper)
			if !strings.Contains(msg, tc.want) || !strings.Contains(msg, `outbox.Topic{Namespace: "shop", Topic: "order_placed"}`) {
				t.Errorf("%s with a topic of %s: failed with %q; want it to say %s and what to pass", name, tc.name, msg, tc.want)
			}
		}
	}
}

// A nil client fails every helper that takes one, saying so: it crashed
// the whole test binary with a nil pointer dereference.
func TestHelpersRefuseANilClient(t *testing.T) {
	tdb := outboxtest.NewDB(t)
	pool := tdb.Provider.Pool
	for name, helper := range map[string]func(outboxtest.TB){
		"RequireEnqueued":      func(t outboxtest.TB) { outboxtest.RequireEnqueued(t, nil, placed) },
		"RequireEnqueuedTx":    func(t outboxtest.TB) { outboxtest.RequireEnqueuedTx(t, nil, pool, placed) },
		"RequireNotEnqueued":   func(t outboxtest.TB) { outboxtest.RequireNotEnqueued(t, nil, placed) },
		"RequireNotEnqueuedTx": func(t outboxtest.TB) { outboxtest.RequireNotEnqueuedTx(t, nil, pool, placed) },
		"Drain":                func(t outboxtest.TB) { outboxtest.Drain(t, nil, outboxtest.NewRecorder().Publisher(placed)) },
	} {
		if msg := failure(t, helper); !strings.Contains(msg, "*outbox.Client is nil") {
			t.Errorf("%s with a nil client: failed with %q; want it to say the client is nil", name, msg)
		}
	}
}

// The zero Matcher fails the assertion, saying how to build one: it
// crashed the test binary with a nil pointer dereference.
func TestHelpersRefuseTheZeroMatcher(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueue(t, c, pool, placed, `{"id":"o-1"}`)
	for name, helper := range map[string]func(outboxtest.TB){
		"RequireEnqueued":      func(t outboxtest.TB) { outboxtest.RequireEnqueued(t, c, placed, outboxtest.Matcher{}) },
		"RequireEnqueuedTx":    func(t outboxtest.TB) { outboxtest.RequireEnqueuedTx(t, c, pool, placed, outboxtest.Matcher{}) },
		"RequireNotEnqueued":   func(t outboxtest.TB) { outboxtest.RequireNotEnqueued(t, c, placed, outboxtest.Matcher{}) },
		"RequireNotEnqueuedTx": func(t outboxtest.TB) { outboxtest.RequireNotEnqueuedTx(t, c, pool, placed, outboxtest.Matcher{}) },
		"RequireEnqueuedOnce":  func(t outboxtest.TB) { outboxtest.RequireEnqueuedOnce(t, c, placed, outboxtest.Matcher{}) },
	} {
		if msg := failure(t, helper); !strings.Contains(msg, "zero outboxtest.Matcher") || !strings.Contains(msg, "OrderingKey or Header") {
			t.Errorf("%s with the zero Matcher: failed with %q; want it to say the matcher is the zero value", name, msg)
		}
	}
}

// A client of the reader role sees no payloads or headers: the matchers
// that read them fail the assertion, saying so, rather than match nothing
// (RequireNotEnqueued would pass whatever was enqueued).
func TestMatchersOfHiddenPayloadsAndHeaders(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	enqueue(t, c, tdb.Provider.Pool, placed, `{"id":"o-1","cents":100}`, func(m *outbox.Message) {
		m.Headers = map[string]string{"source": "checkout"}
	})
	readerPool := (&pgtest.DB{Name: tdb.Name, DSN: tdb.DSN, Provider: tdb.Provider}).LoginAs(t, outboxpg.RoleReader)
	reader, err := outbox.New(outboxpg.New(readerPool), outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for name, m := range map[string]outboxtest.Matcher{
		"Payload": outboxtest.Payload(order{ID: "o-1", Cents: 100}),
		"Header":  outboxtest.Header("source", "admin"),
	} {
		msg := failure(t, func(t outboxtest.TB) { outboxtest.RequireNotEnqueued(t, reader, placed, m) })
		if !strings.Contains(msg, "hidden from the client's database role") {
			t.Errorf("RequireNotEnqueued with %s as a reader: %q, want it to fail saying the event is hidden", name, msg)
		}
	}
	if got := outboxtest.RequireEnqueued(t, reader, placed, outboxtest.OrderingKey("")); len(got) != 1 {
		t.Errorf("a matcher of what the reader sees: %d events, want 1", len(got))
	}
}
