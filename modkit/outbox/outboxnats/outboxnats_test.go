package outboxnats_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxnats"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

var ctx = context.Background()

const (
	streamName = "TEST"
	urlEnv     = "OUTBOXNATS_TEST_URL" // the in-process server, for the crash child
)

// startServer runs an in-process nats-server with JetStream, shut down when
// the test ends.
func startServer(t testing.TB, opts ...func(*server.Options)) *server.Server {
	t.Helper()
	o := &server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoSigs: true, NoLog: true}
	for _, f := range opts {
		f(o)
	}
	s, err := server.NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		t.Fatal("nats-server did not start")
	}
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s
}

// connect opens a JetStream context on url, closed when the test ends.
func connect(t testing.TB, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// createStream makes the stream that stores "test.>".
func createStream(t testing.TB, js jetstream.JetStream) jetstream.Stream {
	t.Helper()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName, Subjects: []string{"test.>"},
		Storage: jetstream.MemoryStorage, Duplicates: 2 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func newPublisher(t testing.TB, js jetstream.JetStream, cfg outboxnats.Config) *outboxnats.Publisher {
	t.Helper()
	p, err := outboxnats.New(js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// readAll reads every message of the stream.
func readAll(t testing.TB, js jetstream.JetStream, s jetstream.Stream) []jetstream.Msg {
	t.Helper()
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(ctx, streamName, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	for uint64(len(out)) < info.State.Msgs {
		// As many as are left, so that it returns once they came rather
		// than at FetchMaxWait.
		batch, err := cons.Fetch(int(min(info.State.Msgs-uint64(len(out)), 1000)), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for m := range batch.Messages() {
			out = append(out, m)
		}
		if err := batch.Error(); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// TestCrashChild is the dispatcher process of TestDeliveredThroughSIGKILL.
func TestCrashChild(t *testing.T) {
	brokertest.Child(t, func(t testing.TB) outbox.Publisher {
		return newPublisher(t, connect(t, os.Getenv(urlEnv)), outboxnats.Config{}).For(brokertest.Topic)
	})
}

// TestDeliveredThroughSIGKILL delivers 10,000 events (3,000 under -race; BROKERTEST_EVENTS)
// with a dispatcher process SIGKILLed a third of the way, then a survivor:
// the stream holds each event exactly once, the redeliveries dropped by
// Nats-Msg-Id.
func TestDeliveredThroughSIGKILL(t *testing.T) {
	srv := startServer(t)
	js := connect(t, srv.ClientURL())
	stream := createStream(t, js)
	c, db := outboxtest.NewClient(t, outbox.Config{})
	n := brokertest.Events(t)
	ids := brokertest.Enqueue(t, c, db, n)

	calls := brokertest.RunCrash(t, c, db, n, brokertest.Crash{ChildTest: "TestCrashChild", Env: []string{urlEnv + "=" + srv.ClientURL()}},
		newPublisher(t, js, outboxnats.Config{}).For(brokertest.Topic))

	got := map[uuid.UUID]int{}
	for _, m := range readAll(t, js, stream) {
		id, err := uuid.Parse(m.Headers().Get(outboxnats.HeaderMsgID))
		if err != nil {
			t.Fatalf("message without an event id: %v", err)
		}
		got[id]++
		checkSeq(t, m)
	}
	brokertest.Check(t, ids, got, calls, true)
}

// TestDeliveredThroughConnectionCut delivers 10,000 events (3,000 under -race;
// BROKERTEST_EVENTS) through a proxy that cuts the NATS connection a third
// and two thirds of the way: the client reconnects, the acks pending at
// the cut fail (nats.ErrDisconnected) and are retried, and the stream
// holds each event exactly once.
func TestDeliveredThroughConnectionCut(t *testing.T) {
	srv := startServer(t)
	stream := createStream(t, connect(t, srv.ClientURL()))
	proxy := brokertest.NewProxy(t, srv.Addr().String())
	nc, err := nats.Connect("nats://"+proxy.Addr(), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})) // the cut's write errors are expected
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	c, db := outboxtest.NewClient(t, outbox.Config{})
	n := brokertest.Events(t)
	ids := brokertest.Enqueue(t, c, db, n)

	calls := brokertest.NewCalls()
	brokertest.Delivered(t, c, newPublisher(t, js, outboxnats.Config{}).For(brokertest.Topic), calls, func(k int) {
		if k == n/3 || k == 2*n/3 {
			proxy.Cut()
		}
	})
	if nc.Stats().Reconnects < 2 {
		t.Errorf("%d reconnects, want 2", nc.Stats().Reconnects)
	}
	got := map[uuid.UUID]int{}
	for _, m := range readAll(t, connect(t, srv.ClientURL()), stream) {
		got[uuid.MustParse(m.Headers().Get(outboxnats.HeaderMsgID))]++
	}
	brokertest.Check(t, ids, got, calls, true)
}

// checkSeq checks that the message's x-seq header belongs to its payload.
func checkSeq(t *testing.T, m jetstream.Msg) {
	t.Helper()
	var p struct{ N int }
	if err := json.Unmarshal(m.Data(), &p); err != nil {
		t.Fatal(err)
	}
	if seq := m.Headers().Get("x-seq"); seq != jsonInt(p.N) {
		t.Fatalf("message %s: x-seq %q, payload n %d", m.Headers().Get(outboxnats.HeaderMsgID), seq, p.N)
	}
}

func jsonInt(n int) string { b, _ := json.Marshal(n); return string(b) }

// TestMessage: subject, payload, headers (the trace context included) and
// Nats-Msg-Id of a delivered event, under the default and a custom subject.
func TestMessage(t *testing.T) {
	srv := startServer(t)
	js := connect(t, srv.ClientURL())
	stream := createStream(t, js)
	c, db := outboxtest.NewClient(t, outbox.Config{})
	tenant := uuid.New()
	res, err := c.Enqueue(ctx, db.Provider.Pool, outbox.Message{Namespace: "test", Topic: "events", TenantID: &tenant,
		Headers: map[string]string{"content-type": "application/json", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		Payload: json.RawMessage(`{"hello":"world"}`)})
	if err != nil {
		t.Fatal(err)
	}
	other := outbox.Topic{Namespace: "test", Topic: "custom"}
	res2, err := c.Enqueue(ctx, db.Provider.Pool, outbox.Message{Namespace: other.Namespace, Topic: other.Topic, Payload: json.RawMessage(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	custom := newPublisher(t, js, outboxnats.Config{Subject: func(d outbox.Delivery) string { return "test.by-tenant." + d.Topic }})
	outboxtest.Drain(t, c, newPublisher(t, js, outboxnats.Config{}).For(brokertest.Topic), custom.For(other))

	msgs := readAll(t, js, stream)
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d messages, want 2", len(msgs))
	}
	bySubject := map[string]jetstream.Msg{}
	for _, m := range msgs {
		bySubject[m.Subject()] = m
	}
	m, ok := bySubject["test.events"]
	if !ok {
		t.Fatalf("no message on test.events; subjects: %v", bySubject)
	}
	h := m.Headers()
	if h.Get("Nats-Msg-Id") != res.ID.String() || h.Get("content-type") != "application/json" ||
		!strings.HasPrefix(h.Get("traceparent"), "00-4bf92f3577b34da6a3ce929d0e0e4736-") {
		t.Errorf("headers %v; want the event id, content-type and traceparent", h)
	}
	if string(m.Data()) != `{"hello": "world"}` && string(m.Data()) != `{"hello":"world"}` {
		t.Errorf("data %s", m.Data())
	}
	if m2, ok := bySubject["test.by-tenant.custom"]; !ok || m2.Headers().Get("Nats-Msg-Id") != res2.ID.String() {
		t.Errorf("custom subject: got subjects %v", bySubject)
	}
}

// TestRedeliveryDropped: publishing the same delivery again stores nothing
// new and succeeds.
func TestRedeliveryDropped(t *testing.T) {
	srv := startServer(t)
	js := connect(t, srv.ClientURL())
	stream := createStream(t, js)
	p := newPublisher(t, js, outboxnats.Config{})
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Attempt: 1}
	for attempt := 1; attempt <= 3; attempt++ {
		d.Attempt = attempt
		if err := p.Publish(ctx, d); err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("stream holds %d messages, want 1", info.State.Msgs)
	}
}

// TestFailures: no stream for the subject is retried; a payload over the
// server's limit is permanent.
func TestFailures(t *testing.T) {
	srv := startServer(t, func(o *server.Options) { o.MaxPayload = 1024 })
	js := connect(t, srv.ClientURL())
	createStream(t, js)
	p := newPublisher(t, js, outboxnats.Config{})

	err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "nostream", Topic: "events", Payload: json.RawMessage(`{}`)})
	if err == nil || outbox.IsPermanent(err) || !errors.Is(err, outboxnats.ErrNotAcknowledged) ||
		!strings.Contains(err.Error(), "does a stream capture this subject?") {
		t.Errorf("no stream: got %v, want an error to retry that asks whether a stream captures the subject", err)
	}
	big := json.RawMessage(`"` + strings.Repeat("x", 2000) + `"`)
	err = p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: big})
	if !outbox.IsPermanent(err) {
		t.Errorf("payload over the limit: got %v, want a permanent error", err)
	}
	// Under the server's limit, over its stream's maximum message size:
	// refused on every attempt, permanent too (it was retried until dead).
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 256}); err != nil {
		t.Fatal(err)
	}
	err = p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "small", Topic: "events",
		Payload: json.RawMessage(`"` + strings.Repeat("x", 500) + `"`)})
	if !outbox.IsPermanent(err) {
		t.Errorf("payload over the stream's maximum message size: got %v, want a permanent error", err)
	}
	// A header name NATS cannot carry (the outbox accepts it) fails the
	// same way on every attempt: permanent.
	err = p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`),
		Headers: map[string]string{"x/trace": "1"}})
	if !outbox.IsPermanent(err) || !strings.Contains(err.Error(), `any of these characters: " ( ) / ,`) ||
		!strings.Contains(err.Error(), "header renamed") {
		t.Errorf("a header name NATS refuses: got %v, want a permanent error listing the characters one by one", err)
	}
	// Subjects no stream can store (the server would not answer: a
	// timeout, retried until dead): permanent, before sending.
	for _, d := range []outbox.Delivery{
		{Namespace: "test.", Topic: "events"}, // test..events
		{Namespace: "test", Topic: "events."}, // test.events.
	} {
		d.ID, d.Payload = uuid.New(), json.RawMessage(`{}`)
		if err := p.Publish(ctx, d); !outbox.IsPermanent(err) || !errors.Is(err, nats.ErrBadSubject) ||
			errors.Is(err, outboxnats.ErrNotAcknowledged) || !strings.Contains(err.Error(), "not sent") {
			t.Errorf("subject of %s/%s: got %v, want a permanent ErrBadSubject saying it was not sent", d.Namespace, d.Topic, err)
		}
	}
	// A sealed stream never takes a message again (it cannot be unsealed):
	// permanent. It was retried until dead.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "SEALED", Subjects: []string{"sealed.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.UpdateStream(ctx, jetstream.StreamConfig{Name: "SEALED", Subjects: []string{"sealed.>"}, Sealed: true}); err != nil {
		t.Fatal(err)
	}
	err = p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "sealed", Topic: "events", Payload: json.RawMessage(`{}`)})
	if !outbox.IsPermanent(err) || !strings.Contains(err.Error(), "sealed") {
		t.Errorf("a sealed stream: got %v, want a permanent error saying it is sealed", err)
	}
	wild := newPublisher(t, js, outboxnats.Config{Subject: func(outbox.Delivery) string { return "test.*" }})
	if err := wild.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}); !outbox.IsPermanent(err) {
		t.Errorf("a wildcard subject: got %v, want a permanent error", err)
	}
}

// An event's headers cannot give JetStream instructions: names beginning
// with Nats- are left out, and Nats-Msg-Id is the event's id.
func TestEventHeadersCannotControlJetStream(t *testing.T) {
	srv := startServer(t)
	p := newPublisher(t, connect(t, srv.ClientURL()), outboxnats.Config{})
	id := uuid.New()
	m := p.Msg(outbox.Delivery{ID: id, Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`),
		Headers: map[string]string{"Nats-Rollup": "all", "nats-expected-stream": "other", "Nats-Msg-Id": "forged", "x-kept": "1"}})
	if m.Header.Get("Nats-Rollup") != "" || m.Header.Get("Nats-Expected-Stream") != "" || len(m.Header.Values("nats-expected-stream")) != 0 ||
		m.Header.Get(outboxnats.HeaderMsgID) != id.String() || len(m.Header.Values(outboxnats.HeaderMsgID)) != 1 || m.Header.Get("x-kept") != "1" {
		t.Fatalf("headers of the message: %v", m.Header)
	}
}

// TestHeadersCarriedUnchanged: header values that NATS carries as they
// are (inner spaces and tabs, other control characters, non-ASCII, empty)
// are read back unchanged from the stream; an event with a header that
// NATS would alter (spaces or tabs at either end of its value, CR or LF
// in it) or refuse (a name with '/') is not published but fails
// permanently with a *HeaderError naming that header.
func TestHeadersCarriedUnchanged(t *testing.T) {
	srv := startServer(t)
	js := connect(t, srv.ClientURL())
	stream := createStream(t, js)
	p := newPublisher(t, js, outboxnats.Config{})

	carried := map[string]string{"x-inner": "in  side", "x-tab": "a\tb", "x-vt": "\v", "x-ff": "\f", "x-ctl": "x\x01y\x7f",
		"x-utf8": "é ü", "x-nbsp": "\u00a0nbsp\u00a0", "x-empty": "", "x-colon": "a: b"}
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Headers: carried}
	if err := p.Publish(ctx, d); err != nil {
		t.Fatalf("headers NATS carries unchanged: %v", err)
	}

	refused := []struct {
		headers map[string]string
		name    string // the header the error names
	}{
		{map[string]string{"x-lead": " v"}, "x-lead"},
		{map[string]string{"x-trail": "v "}, "x-trail"},
		{map[string]string{"x-tab": "\tv"}, "x-tab"},
		{map[string]string{"x-tab": "v\t"}, "x-tab"},
		{map[string]string{"x-blank": " "}, "x-blank"},
		{map[string]string{"x-crlf": "a\r\nb"}, "x-crlf"},
		{map[string]string{"x-lf": "a\nb"}, "x-lf"},
		{map[string]string{"x-cr": "a\rb"}, "x-cr"},
		{map[string]string{"x/trace": "1"}, "x/trace"},
		// Of several, the first by name; good headers beside them change nothing.
		{map[string]string{"x-ok": "1", "x-b": " b", "x-a": "a\n", "x-c": "c "}, "x-a"},
	}
	for _, tc := range refused {
		err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Headers: tc.headers})
		var herr *outboxnats.HeaderError
		if !outbox.IsPermanent(err) || !errors.As(err, &herr) || herr.Name != tc.name || !strings.Contains(err.Error(), strconv.Quote(tc.name)) {
			t.Errorf("headers %q: got %v, want a permanent *HeaderError naming %q", tc.headers, err, tc.name)
		}
	}

	msgs := readAll(t, js, stream)
	if len(msgs) != 1 {
		t.Fatalf("stream holds %d messages, want the one whose headers NATS carries", len(msgs))
	}
	h := msgs[0].Headers()
	for k, v := range carried {
		if got := h.Values(k); len(got) != 1 || got[0] != v {
			t.Errorf("header %s: read back %q, published %q", k, got, v)
		}
	}
}

// New refuses a connection that gives up reconnecting within an hour (the
// nats.Connect default: 60 attempts, 2s apart): closed after a short
// outage, it never published again, and every event was dead-lettered
// after its attempts until the process restarted.
func TestNewRefusesAConnectionThatGivesUp(t *testing.T) {
	srv := startServer(t)
	for _, tc := range []struct {
		name string
		opts []nats.Option
		ok   bool
	}{
		{"the defaults", nil, false},
		{"ten attempts a minute apart", []nats.Option{nats.MaxReconnects(10), nats.ReconnectWait(time.Minute)}, false},
		{"no reconnecting", []nats.Option{nats.NoReconnect()}, false},
		{"for ever", []nats.Option{nats.MaxReconnects(-1)}, true},
		{"two hours of attempts", []nats.Option{nats.MaxReconnects(3600), nats.ReconnectWait(2 * time.Second)}, true},
		// The callback's delays cannot be known: New says so.
		{"ten attempts a custom delay apart", []nats.Option{nats.MaxReconnects(10),
			nats.CustomReconnectDelay(func(int) time.Duration { return time.Hour })}, false},
		{"for ever, a custom delay apart", []nats.Option{nats.MaxReconnects(-1),
			nats.CustomReconnectDelay(func(int) time.Duration { return time.Second })}, true},
	} {
		nc, err := nats.Connect(srv.ClientURL(), tc.opts...)
		if err != nil {
			t.Fatal(err)
		}
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		_, err = outboxnats.New(js, outboxnats.Config{})
		nc.Close()
		if tc.ok && err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		if !tc.ok && (!errors.Is(err, outbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "nats.MaxReconnects(-1)")) {
			t.Errorf("%s: %v, want ErrInvalidConfig saying to reconnect for ever", tc.name, err)
		}
		// What it says of the connection is true.
		if custom := strings.Contains(tc.name, "custom"); !tc.ok && custom != strings.Contains(fmt.Sprint(err), "nats.CustomReconnectDelay") {
			t.Errorf("%s: %v, want the custom delay named only when there is one", tc.name, err)
		}
	}

	// A connection already closed, whatever its options, never publishes.
	nc, err := nats.Connect(srv.ClientURL(), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	if _, err := outboxnats.New(js, outboxnats.Config{}); !errors.Is(err, outbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "is closed") {
		t.Errorf("a closed connection: %v, want ErrInvalidConfig saying it is closed", err)
	}
}

// A publish whose context has ended sends nothing: a stopping dispatcher's
// publishes were sent, and their outcomes dropped.
func TestPublishWithEndedContextSendsNothing(t *testing.T) {
	js := connect(t, startServer(t).ClientURL())
	s := createStream(t, js)
	p := newPublisher(t, js, outboxnats.Config{})
	ended, cancel := context.WithCancel(ctx)
	cancel()
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}
	if err := p.Publish(ended, d); !errors.Is(err, context.Canceled) || outbox.IsPermanent(err) {
		t.Fatalf("publish with an ended context: %v, want context.Canceled to retry", err)
	}
	// A publish after it: the stream holds that one only.
	d2 := d
	d2.ID = uuid.New()
	if err := p.Publish(ctx, d2); err != nil {
		t.Fatal(err)
	}
	if msgs := readAll(t, js, s); len(msgs) != 1 || msgs[0].Headers().Get(outboxnats.HeaderMsgID) != d2.ID.String() {
		t.Fatalf("the stream holds %d message(s); want only the second publish", len(msgs))
	}
}

// waitStatus receives from ch, a nc.StatusChanged channel, until want.
func waitStatus(t *testing.T, ch chan nats.Status, want nats.Status) {
	t.Helper()
	failsafe := time.After(time.Minute) // a hang's bound, not a timing assertion
	for {
		select {
		case st := <-ch:
			if st == want {
				return
			}
		case <-failsafe:
			t.Fatalf("the connection never became %s", want)
		}
	}
}

// A publish while the connection is down sends nothing: it fails at once
// with ErrNotConnected, to retry, and the stream does not hold the event
// once the server is back. nats.go used to queue it in its reconnect
// buffer and send it on reconnecting, after the attempt had failed on an
// ack timeout, or after the event had been dead-lettered and purged.
func TestPublishWhileDisconnectedSendsNothing(t *testing.T) {
	dir := t.TempDir()
	srv := startServer(t, func(o *server.Options) { o.StoreDir = dir })
	port := srv.Addr().(*net.TCPAddr).Port
	nc, err := nats.Connect(srv.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	status := nc.StatusChanged(nats.RECONNECTING, nats.CONNECTED)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	// On disk, to outlive the server's restart.
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName, Subjects: []string{"test.>"}, Storage: jetstream.FileStorage})
	if err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, js, outboxnats.Config{})
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Attempt: 1}
	if err := p.Publish(ctx, d); err != nil { // the async reply subscription is made, as in a running dispatcher
		t.Fatal(err)
	}

	srv.Shutdown()
	srv.WaitForShutdown()
	waitStatus(t, status, nats.RECONNECTING)
	lost := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Attempt: 1}
	err = p.Publish(ctx, lost)
	if !errors.Is(err, outboxnats.ErrNotConnected) || outbox.IsPermanent(err) ||
		!strings.Contains(err.Error(), "RECONNECTING") || !strings.Contains(err.Error(), "nothing was sent") {
		t.Errorf("publish while reconnecting: %v, want ErrNotConnected to retry, naming the status and saying nothing was sent", err)
	}

	startServer(t, func(o *server.Options) { o.StoreDir, o.Port = dir, port })
	waitStatus(t, status, nats.CONNECTED)
	// Acknowledged, this one is stored after anything the reconnect
	// flushed before it on the same connection.
	after := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Attempt: 1}
	if err := p.Publish(ctx, after); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range readAll(t, js, stream) {
		ids = append(ids, m.Headers().Get(outboxnats.HeaderMsgID))
	}
	if want := []string{d.ID.String(), after.ID.String()}; !slices.Equal(ids, want) {
		t.Fatalf("the stream holds %v, want %v (the publish made while reconnecting is %s)", ids, want, lost.ID)
	}
}

// A connection made with nats.RetryOnFailedConnect that has not connected
// yet: a publish fails with ErrNotConnected, not with nats.go's "headers
// not supported by this server" (it has no server INFO yet).
func TestPublishBeforeFirstConnectSendsNothing(t *testing.T) {
	srv := startServer(t)
	url := srv.ClientURL()
	srv.Shutdown()
	srv.WaitForShutdown()
	nc, err := nats.Connect(url, nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, js, outboxnats.Config{})
	err = p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Attempt: 1})
	if !errors.Is(err, outboxnats.ErrNotConnected) || outbox.IsPermanent(err) {
		t.Fatalf("publish before the first connect: %v, want ErrNotConnected to retry", err)
	}
}

// A publish whose ack was pending when the connection dropped fails with
// an error, to retry, that says the connection is down (nats.go's own is
// "server is disconnected").
func TestAckLostToOutageSaysConnectionDown(t *testing.T) {
	srv := startServer(t)
	// A plain subscriber that never answers stands in for a stream whose
	// ack the outage cuts off.
	sub, err := nats.Connect(srv.ClientURL(), nats.NoReconnect())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	received := make(chan struct{}, 1)
	if _, err := sub.Subscribe("silent.events", func(*nats.Msg) { received <- struct{}{} }); err != nil {
		t.Fatal(err)
	}
	if err := sub.Flush(); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, connect(t, srv.ClientURL()), outboxnats.Config{})
	done := make(chan error, 1)
	go func() {
		done <- p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "silent", Topic: "events", Payload: json.RawMessage(`{}`), Attempt: 1})
	}()
	<-received
	srv.Shutdown()
	err = <-done
	if !errors.Is(err, outboxnats.ErrNotConnected) || !errors.Is(err, nats.ErrDisconnected) || outbox.IsPermanent(err) ||
		!strings.Contains(err.Error(), "the NATS connection is down") {
		t.Fatalf("ack lost to an outage: %v, want an error to retry saying the NATS connection is down", err)
	}
}
