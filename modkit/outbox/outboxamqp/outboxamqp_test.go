package outboxamqp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxamqp"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

var ctx = context.Background()

// brokerURL is AMQP_URL, or the local RabbitMQ the project's machines run.
// The test is skipped when the broker cannot be reached.
func brokerURL(t testing.TB) *url.URL {
	t.Helper()
	raw := os.Getenv("AMQP_URL")
	if raw == "" {
		raw = "amqp://guest:guest@127.0.0.1:5672/"
	}
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatalf("AMQP_URL: %v", err)
	}
	c, err := net.DialTimeout("tcp", u.Host, 2*time.Second)
	if err != nil {
		t.Skipf("RabbitMQ is not reachable at %s (set AMQP_URL to run the outboxamqp tests against another broker): %v", u.Redacted(), err)
	}
	_ = c.Close()
	return u
}

// declareQueue declares a durable queue with a name of its own, deleted
// when the test ends, and returns the name and a channel for reading it.
func declareQueue(t testing.TB, u *url.URL) (string, *amqp.Channel) {
	t.Helper()
	return declareQueueWith(t, u, nil)
}

// declareQueueWith is declareQueue with the queue's arguments (x-max-length…).
func declareQueueWith(t testing.TB, u *url.URL, args amqp.Table) (string, *amqp.Channel) {
	t.Helper()
	conn, err := amqp.Dial(u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	name := "outboxamqp-test-" + uuid.NewString()
	if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(name, false, false, false) })
	return name, ch
}

// declareExchange declares a direct exchange with a name of its own,
// deleted when the test ends, that routes the key queue to the queue of
// that name.
func declareExchange(t testing.TB, ch *amqp.Channel, queue string) string {
	t.Helper()
	name := "outboxamqp-test-ex-" + uuid.NewString()
	if err := ch.ExchangeDeclare(name, amqp.ExchangeDirect, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(name, false, false) })
	if err := ch.QueueBind(queue, queue, name, false, nil); err != nil {
		t.Fatal(err)
	}
	return name
}

func newPublisher(t testing.TB, cfg outboxamqp.Config) *outboxamqp.Publisher {
	t.Helper()
	p, err := outboxamqp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return p
}

func toQueue(queue string) func(outbox.Delivery) (string, string) {
	return func(outbox.Delivery) (string, string) { return "", queue }
}

// routeTopic routes the events of topic to the queue key, the others to
// queue.
func routeTopic(topic, key, queue string) func(outbox.Delivery) (string, string) {
	return func(d outbox.Delivery) (string, string) {
		if d.Topic == topic {
			return "", key
		}
		return "", queue
	}
}

// readAll consumes every message in the queue.
func readAll(t testing.TB, ch *amqp.Channel, queue string) []amqp.Delivery {
	t.Helper()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]amqp.Delivery, 0, q.Messages)
	timeout := time.After(2 * time.Minute)
	for len(out) < q.Messages {
		select {
		case m, ok := <-msgs:
			if !ok {
				t.Fatalf("consumer closed after %d of %d messages", len(out), q.Messages)
			}
			out = append(out, m)
		case <-timeout:
			t.Fatalf("read %d of %d messages", len(out), q.Messages)
		}
	}
	return out
}

// TestDeliveredThroughConnectionCut delivers 10,000 events (3,000 under -race;
// BROKERTEST_EVENTS) through a proxy that cuts the broker connection a
// third and two thirds of the way: the publisher reconnects, the queue
// holds every event, and holds one more than once only if the outbox handed
// it to the publisher more than once (consumers de-duplicate on
// message-id).
func TestDeliveredThroughConnectionCut(t *testing.T) {
	u := brokerURL(t)
	queue, ch := declareQueue(t, u)
	proxy := brokertest.NewProxy(t, u.Host)
	via := *u
	via.Host = proxy.Addr()
	c, db := outboxtest.NewClient(t, outbox.Config{})
	n := brokertest.Events(t)
	ids := brokertest.Enqueue(t, c, db, n)

	calls := brokertest.NewCalls()
	pub := newPublisher(t, outboxamqp.Config{URL: via.String(), Route: toQueue(queue)})
	start := time.Now()
	brokertest.Delivered(t, c, pub.For(brokertest.Topic), calls, func(k int) {
		if k == n/3 || k == 2*n/3 {
			proxy.Cut()
			t.Logf("connection cut after %d publishes, %v", k, time.Since(start).Round(time.Millisecond))
		}
	})
	t.Logf("%d events delivered in %v", n, time.Since(start).Round(time.Millisecond))

	got := map[uuid.UUID]int{}
	for _, m := range readAll(t, ch, queue) {
		id, err := uuid.Parse(m.MessageId)
		if err != nil {
			t.Fatalf("message without an event id: %v", err)
		}
		got[id]++
		var p struct{ N int }
		if err := json.Unmarshal(m.Body, &p); err != nil {
			t.Fatal(err)
		}
		if seq, _ := m.Headers["x-seq"].(string); seq != strconv.Itoa(p.N) {
			t.Fatalf("message %s: x-seq %q, body n %d", id, seq, p.N)
		}
	}
	brokertest.Check(t, ids, got, calls, false)
}

// TestMessage: the properties of a delivered event's message.
func TestMessage(t *testing.T) {
	u := brokerURL(t)
	queue, ch := declareQueue(t, u)
	c, db := outboxtest.NewClient(t, outbox.Config{})
	res, err := c.Enqueue(ctx, db.Provider.Pool, outbox.Message{Namespace: "test", Topic: "events",
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
			// RabbitMQ would read these as routing keys, and close the
			// channel on a string: left out.
			"CC": "another-queue", "BCC": "another-queue"},
		Payload: json.RawMessage(`{"hello":"world"}`)})
	if err != nil {
		t.Fatal(err)
	}
	outboxtest.Drain(t, c, newPublisher(t, outboxamqp.Config{URL: u.String(), Route: toQueue(queue)}).For(brokertest.Topic))
	msgs := readAll(t, ch, queue)
	if len(msgs) != 1 {
		t.Fatalf("%d messages, want 1", len(msgs))
	}
	m := msgs[0]
	if m.MessageId != res.ID.String() || m.DeliveryMode != amqp.Persistent || m.ContentType != "application/json" ||
		m.Type != "test.events" || m.Timestamp.IsZero() || m.Headers["traceparent"] != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" {
		t.Errorf("message id %q mode %d type %q content-type %q timestamp %v headers %v",
			m.MessageId, m.DeliveryMode, m.Type, m.ContentType, m.Timestamp, m.Headers)
	}
	if _, ok := m.Headers["CC"]; ok || m.Headers["BCC"] != nil {
		t.Errorf("headers %v: CC and BCC must be left out", m.Headers)
	}
	var body map[string]string
	if err := json.Unmarshal(m.Body, &body); err != nil || body["hello"] != "world" {
		t.Errorf("body %s", m.Body)
	}
}

// TestUnroutableIsPermanent: a message no queue receives comes back and is
// a permanent failure naming the route, while the publisher goes on
// publishing routable messages.
func TestUnroutableIsPermanent(t *testing.T) {
	u := brokerURL(t)
	queue, ch := declareQueue(t, u)
	nowhere := "outboxamqp-test-nowhere-" + uuid.NewString()
	p := newPublisher(t, outboxamqp.Config{URL: u.String(), Route: routeTopic("lost", nowhere, queue)})
	for i := range 3 {
		err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "lost", Payload: json.RawMessage(`{}`)})
		var ue *outboxamqp.UnroutableError
		if !outbox.IsPermanent(err) || !errors.As(err, &ue) || ue.RoutingKey != nowhere || ue.ReplyCode != 312 {
			t.Fatalf("unroutable %d: got %v, want a permanent *UnroutableError with NO_ROUTE", i, err)
		}
		if err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatalf("routable %d: %v", i, err)
		}
	}
	if got := len(readAll(t, ch, queue)); got != 3 {
		t.Fatalf("%d routable messages in the queue, want 3", got)
	}
	// A routing key longer than AMQP's 255 bytes (the default route of a
	// 128-byte namespace and topic) would be cut short on the wire and go
	// to another queue: permanent instead, before anything is sent.
	dflt := newPublisher(t, outboxamqp.Config{URL: u.String()})
	err := dflt.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: strings.Repeat("a", 128), Topic: strings.Repeat("b", 128),
		Payload: json.RawMessage(`{}`)})
	var ue *outboxamqp.UnroutableError
	if !outbox.IsPermanent(err) || errors.As(err, &ue) || !strings.Contains(err.Error(), "255 bytes") {
		t.Fatalf("a 257-byte routing key: got %v, want a permanent error before sending (the broker returned the message sent with the key cut short)", err)
	}
}

// TestPublishWithEndedContextSendsNothing: a publish whose ctx has already
// ended returns ctx's error and sends nothing. Sent, the message would be
// abandoned unconfirmed and sent again by the retry (a duplicate for
// certain), and it would be written without the guard that ends a stuck
// write with its ctx.
func TestPublishWithEndedContextSendsNothing(t *testing.T) {
	u := brokerURL(t)
	queue, ch := declareQueue(t, u)
	p := newPublisher(t, outboxamqp.Config{URL: u.String(), Route: toQueue(queue)})
	first, last := event(), event()
	if err := p.Publish(ctx, first); err != nil { // the connection is open
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := p.Publish(cancelled, event()); !errors.Is(err, context.Canceled) || !errors.Is(err, outboxamqp.ErrNotConfirmed) {
		t.Fatalf("a publish on an ended context: %v, want ErrNotConfirmed matching context.Canceled", err)
	}
	if err := p.Publish(ctx, last); err != nil {
		t.Fatal(err)
	}
	// The queue holds the first and the last, in order: nothing between.
	for _, want := range []outbox.Delivery{first, last} {
		msg, ok, err := ch.Get(queue, true)
		if err != nil || !ok || msg.MessageId != want.ID.String() {
			t.Fatalf("the queue's next message: %q (found %v, %v), want %s", msg.MessageId, ok, err, want.ID)
		}
	}
	if _, ok, err := ch.Get(queue, true); ok || err != nil {
		t.Fatalf("a third message in the queue (%v): the publish on an ended context was sent", err)
	}
}

// TestFullQueueRetried: a queue at its length limit with x-overflow
// reject-publish makes the broker refuse the message (a negative
// confirmation): an error to retry that says what the broker did, where it
// said "negative confirmation" alone.
func TestFullQueueRetried(t *testing.T) {
	u := brokerURL(t)
	full, _ := declareQueueWith(t, u, amqp.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"})
	p := newPublisher(t, outboxamqp.Config{URL: u.String(), Route: toQueue(full)})
	err := p.Publish(ctx, event())
	if !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) || !strings.Contains(err.Error(), "reject-publish") {
		t.Fatalf("publish to a full queue: %v, want ErrNotConfirmed to retry, saying the broker refused it", err)
	}
}

// TestMissingExchangeCostsOnlyItsEvents: on one Publisher, publishes to
// an exchange that does not exist, concurrent with publishes of another
// topic to a queue, fail with ErrNoExchange, to retry, naming the route and
// the broker's reason; the other topic's publishes all succeed, on the one
// connection and channel opened (a publish to a missing exchange would
// make the broker close the shared channel, failing the publishes in
// flight on it). Once the exchange is declared, the next publish to it
// succeeds: a missing exchange is not remembered.
func TestMissingExchangeCostsOnlyItsEvents(t *testing.T) {
	u := brokerURL(t)
	noLeaks(t)
	queue, ch := declareQueue(t, u)
	missing := "outboxamqp-test-missing-" + uuid.NewString()
	var dials atomic.Int32
	p := newPublisher(t, outboxamqp.Config{
		Dial: func() (*amqp.Connection, error) {
			dials.Add(1)
			return amqp.Dial(u.String())
		},
		Route: func(d outbox.Delivery) (string, string) {
			if d.Topic == "missing" {
				return missing, "x"
			}
			return "", queue
		}})
	if err := p.Publish(ctx, event()); err != nil { // the connection is open
		t.Fatal(err)
	}

	const workers, each = 16, 25 // publishes of each topic per worker
	var goodFailed, wrongErrors atomic.Int32
	var firstWrong atomic.Value
	var wg sync.WaitGroup
	for range workers {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for range each {
				if err := p.Publish(ctx, event()); err != nil {
					goodFailed.Add(1)
					firstWrong.CompareAndSwap(nil, "the good topic: "+err.Error())
				}
			}
		}()
		go func() {
			defer wg.Done()
			for range each {
				d := event()
				d.Topic = "missing"
				err := p.Publish(ctx, d)
				if !errors.Is(err, outboxamqp.ErrNoExchange) || !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) {
					wrongErrors.Add(1)
					firstWrong.CompareAndSwap(nil, fmt.Sprintf("the missing exchange: %v", err))
				}
			}
		}()
	}
	wg.Wait()
	if n, m := goodFailed.Load(), wrongErrors.Load(); n != 0 || m != 0 {
		t.Errorf("%d of %d publishes to the queue failed, %d of %d to the missing exchange did not fail with ErrNoExchange to retry; the first: %v",
			n, workers*each, m, workers*each, firstWrong.Load())
	}
	if got := dials.Load(); got != 1 {
		t.Errorf("%d connections opened, want 1: the missing exchange cost the shared channel", got)
	}
	if got, want := len(readAll(t, ch, queue)), 1+workers*each; got != want {
		t.Errorf("%d messages in the queue, want %d", got, want)
	}

	// The error names the route, the broker's reason (it goes to the
	// event's last_error) and what to do.
	d := event()
	d.Topic = "missing"
	err := p.Publish(ctx, d)
	for _, want := range []string{strconv.Quote(missing), `"x"`, "404", "no exchange", "declare the exchange", "Config.Route"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("the missing exchange's error %v does not say %s", err, want)
		}
	}

	// Declared (by another service, say), it is found on the next attempt.
	if err := ch.ExchangeDeclare(missing, amqp.ExchangeDirect, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(missing, false, false) })
	if err := ch.QueueBind(queue, "x", missing, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(ctx, d); err != nil {
		t.Fatalf("a publish once the exchange is declared: %v", err)
	}
	if got := dials.Load(); got != 1 {
		t.Errorf("%d connections opened, want 1", got)
	}
}

// TestExchangeCheckedOncePerConnection: concurrent first publishes to an
// exchange share one check, and later ones make none; the default
// exchange is not checked. An exchange deleted once found closes the
// shared channel on the next publish to it (an error to retry); the new
// connection forgets it, and checks it again.
func TestExchangeCheckedOncePerConnection(t *testing.T) {
	u := brokerURL(t)
	noLeaks(t)
	queue, ch := declareQueue(t, u)
	exchange := declareExchange(t, ch, queue)
	var dials atomic.Int32
	p := newPublisher(t, outboxamqp.Config{
		Dial: func() (*amqp.Connection, error) {
			dials.Add(1)
			return amqp.Dial(u.String())
		},
		Route: func(d outbox.Delivery) (string, string) {
			if d.Topic == "direct" {
				return "", queue
			}
			return exchange, queue
		}})
	direct := event()
	direct.Topic = "direct"
	if err := p.Publish(ctx, direct); err != nil {
		t.Fatal(err)
	}
	if got := outboxamqp.ExchangeChecks(p); got != 0 {
		t.Fatalf("%d exchange checks for the default exchange, want 0", got)
	}
	for round := range 2 {
		var wg sync.WaitGroup
		errs := make(chan error, 32)
		for range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- p.Publish(ctx, event())
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if got := outboxamqp.ExchangeChecks(p); got != 1 {
			t.Fatalf("round %d: %d exchange checks, want 1", round, got)
		}
	}

	if err := ch.ExchangeDelete(exchange, false, false); err != nil {
		t.Fatal(err)
	}
	err := p.Publish(ctx, event())
	if !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) || !strings.Contains(err.Error(), "404") {
		t.Fatalf("a publish to the exchange deleted since it was found: got %v, want ErrNotConfirmed to retry, with the broker's 404", err)
	}
	if err := p.Publish(ctx, event()); !errors.Is(err, outboxamqp.ErrNoExchange) {
		t.Fatalf("the next publish to the deleted exchange: got %v, want ErrNoExchange", err)
	}
	if got, checks := dials.Load(), outboxamqp.ExchangeChecks(p); got != 2 || checks != 2 {
		t.Fatalf("%d connections, %d exchange checks; want 2 and 2: the new connection checks the exchange again", got, checks)
	}
}

// TestConfig: New needs a URL or Dial; Publish after Close fails.
func TestConfig(t *testing.T) {
	if _, err := outboxamqp.New(outboxamqp.Config{}); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Errorf("no URL: got %v", err)
	}
	if _, err := outboxamqp.New(outboxamqp.Config{URL: "http://x"}); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Errorf("bad URL: got %v", err)
	}
	// The error of a URL that does not parse names it without its password,
	// or any piece of it: also a password with a character that ends the
	// URL's authority (/ ? #), which the parser takes for the port or
	// the end of the URL and quotes, or a bad escape, which it quotes.
	for _, bad := range []string{"amqp://user:s3cr3t@host:notaport/", "amqps://user:s3cr3t@host/%zz",
		"amqp://user:s3cr3t/tail@host:5672/", "amqp://user:s3cr3t?tail@host:notaport/", "amqp://user:s3cr3t#tail@host/",
		"amqp://user:s3%zztail@host/", "amqp:/user:s3cr3t@host/%zz"} {
		_, err := outboxamqp.New(outboxamqp.Config{URL: bad})
		if !errors.Is(err, outbox.ErrInvalidConfig) || strings.Contains(err.Error(), "s3") || strings.Contains(err.Error(), "tail") ||
			!strings.Contains(err.Error(), "user:xxxxx@host") {
			t.Errorf("URL %q: got %v, want ErrInvalidConfig naming the URL without its password", bad, err)
		}
	}
	p, err := outboxamqp.New(outboxamqp.Config{URL: "amqp://127.0.0.1:1/"})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(ctx, outbox.Delivery{ID: uuid.New()}); !errors.Is(err, outboxamqp.ErrClosed) {
		t.Errorf("after Close: got %v", err)
	}
}

// The return of a publish abandoned on its context (unroutable then) is
// not taken for a later publish of the same event: once a queue is bound,
// the retry is routed and confirmed, not reported unroutable.
func TestAbandonedPublishReturnNotReused(t *testing.T) {
	u := brokerURL(t)
	other, ch := declareQueue(t, u)
	late := "outboxamqp-test-late-" + uuid.NewString()
	p := newPublisher(t, outboxamqp.Config{URL: u.String(), Route: routeTopic("late", late, other)})
	outboxamqp.SendWhenContextEnded(p)
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "late", Payload: json.RawMessage(`{}`)}
	// The connection is opened first: without one, a publish on a
	// cancelled context ends before anything is sent.
	if err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := p.Publish(cancelled, d); err == nil {
		t.Fatal("a publish on a cancelled context succeeded")
	}
	// A confirmed publish after it on the same channel: the broker sends
	// the first one's return, if any, before this confirmation.
	if err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(late, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(late, false, false, false) })
	if err := p.Publish(ctx, d); err != nil {
		t.Fatalf("the retry, routable now: %v", err)
	}
}

// guard bounds every wait on a signal; reaching it fails the test. It
// catches hangs and is not a performance assertion.
const guard = 2 * time.Minute

// noLeaks fails t if a goroutine started during it outlives it. Call it
// first, so that it runs after every other cleanup.
func noLeaks(t *testing.T) {
	t.Helper()
	opts := []goleak.Option{goleak.IgnoreCurrent()}
	t.Cleanup(func() { goleak.VerifyNone(t, opts...) })
}

func event() outbox.Delivery {
	return outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}
}

// publishAsync publishes d in a goroutine and returns its result's
// channel.
func publishAsync(p *outboxamqp.Publisher, ctx context.Context, d outbox.Delivery) <-chan error {
	res := make(chan error, 1)
	go func() { res <- p.Publish(ctx, d) }()
	return res
}

// await receives from c, failing t after guard.
func await[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(guard):
		t.Fatalf("still waiting for %s after %v", what, guard)
		panic("unreachable")
	}
}

// silentBroker accepts TCP connections and never answers the AMQP
// handshake: a dial to it stays in progress until the test closes the
// connection (or the dial's own timeout ends it). It counts the dials.
type silentBroker struct {
	ln       net.Listener
	accepted chan net.Conn
	dials    atomic.Int32
	wg       sync.WaitGroup
}

func newSilentBroker(t *testing.T) *silentBroker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &silentBroker{ln: ln, accepted: make(chan net.Conn, 64)}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.dials.Add(1)
			select {
			case b.accepted <- c:
			default:
				_ = c.Close()
			}
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		b.wg.Wait()
		close(b.accepted)
		for c := range b.accepted {
			_ = c.Close()
		}
	})
	return b
}

// next waits for the next dial and returns its connection.
func (b *silentBroker) next(t *testing.T) net.Conn {
	t.Helper()
	return await(t, b.accepted, "a dial")
}

// TestConnectWaitEndsWithContext: while a connection attempt to a broker
// that does not answer is in progress, publishes that need the connection
// each give up as soon as their own context ends, one after another,
// with a retryable error matching the context's; no second attempt is
// made meanwhile. An attempt that fails is not remembered: the next
// publish makes another. No error quotes the URL's password.
func TestConnectWaitEndsWithContext(t *testing.T) {
	noLeaks(t)
	b := newSilentBroker(t)
	p := newPublisher(t, outboxamqp.Config{URL: "amqp://user:s3cr3t@" + b.ln.Addr().String() + "/"})
	check := func(what string, err error, want error) {
		t.Helper()
		if !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) || strings.Contains(err.Error(), "s3cr3t") {
			t.Fatalf("%s: got %v, want ErrNotConfirmed to retry, without the password", what, err)
		}
		if want != nil && !errors.Is(err, want) {
			t.Fatalf("%s: got %v, want an error matching %v", what, err, want)
		}
		if want == nil && errors.Is(err, context.Canceled) {
			t.Fatalf("%s: got %v, want the connection's error", what, err)
		}
	}

	// A publish with no deadline starts the attempt, which the broker
	// holds open.
	patient := publishAsync(p, ctx, event())
	first := b.next(t)

	// Publishes needing the connection meanwhile end with their context,
	// each on its own, while the attempt goes on. (Under a lock held
	// through the dial, each would wait for the dial, and then dial
	// again itself.)
	const n = 4
	var cancels [n]context.CancelFunc
	var results [n]<-chan error
	for i := range n {
		c, cancel := context.WithCancel(ctx)
		t.Cleanup(cancel)
		cancels[i], results[i] = cancel, publishAsync(p, c, event())
	}
	for i := range n {
		cancels[i]()
		check("publish "+strconv.Itoa(i)+", context cancelled during the attempt", await(t, results[i], "a cancelled publish"), context.Canceled)
	}
	if got := b.dials.Load(); got != 1 {
		t.Fatalf("%d dials while one was in progress, want 1", got)
	}

	// The broker hangs up: the attempt fails, and the publish waiting for
	// it has its error.
	_ = first.Close()
	check("the publish waiting for the failed attempt", await(t, patient, "the patient publish"), nil)

	// The failure is not remembered: the next publish dials again.
	again := publishAsync(p, ctx, event())
	_ = b.next(t).Close()
	check("the publish after a failed attempt", await(t, again, "the next publish"), nil)
	if got := b.dials.Load(); got != 2 {
		t.Fatalf("%d dials, want 2", got)
	}
}

// TestCloseDuringConnect: Close during a connection attempt waits for it,
// closes the connection it opened and fails the publish waiting for it
// with ErrClosed; nothing is left running.
func TestCloseDuringConnect(t *testing.T) {
	u := brokerURL(t)
	noLeaks(t)
	dialing, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	opened := make(chan *amqp.Connection, 1)
	var dials atomic.Int32
	p, err := outboxamqp.New(outboxamqp.Config{Dial: func() (*amqp.Connection, error) {
		if dials.Add(1) == 1 {
			close(dialing)
		}
		<-release
		c, err := amqp.Dial(u.String())
		if err == nil {
			opened <- c
		}
		return c, err
	}})
	if err != nil {
		t.Fatal(err)
	}
	patient := publishAsync(p, ctx, event())
	await(t, dialing, "the dial")
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	// Close has begun once a publish fails with ErrClosed (until then, a
	// publish on a cancelled context gives up waiting for the attempt).
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	closing := make(chan struct{})
	go func() {
		defer close(closing)
		for !errors.Is(p.Publish(cancelled, event()), outboxamqp.ErrClosed) {
			runtime.Gosched()
		}
	}()
	await(t, closing, "Close to take effect while a dial is in progress")
	releaseOnce.Do(func() { close(release) })

	if err := await(t, closed, "Close"); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := await(t, patient, "the publish waiting for the dial"); !errors.Is(err, outboxamqp.ErrClosed) {
		t.Fatalf("the publish waiting for the dial: got %v, want ErrClosed", err)
	}
	select {
	case c := <-opened:
		if !c.IsClosed() {
			t.Error("the connection opened after Close was left open")
			_ = c.Close()
		}
	default:
		t.Fatal("the dial did not open a connection")
	}
	if got := dials.Load(); got != 1 {
		t.Errorf("%d dials, want 1", got)
	}
}

// TestDialPanic: a Dial that panics fails the publish with an error to
// retry (it runs in the Publisher's goroutine, where the panic would end
// the program), and the next publish dials again.
func TestDialPanic(t *testing.T) {
	noLeaks(t)
	var dials atomic.Int32
	p := newPublisher(t, outboxamqp.Config{Dial: func() (*amqp.Connection, error) {
		dials.Add(1)
		panic("no broker today")
	}})
	for i := range 2 {
		err := p.Publish(ctx, event())
		if !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) || !strings.Contains(err.Error(), "no broker today") {
			t.Fatalf("publish %d: got %v, want ErrNotConfirmed to retry, naming the panic", i, err)
		}
	}
	if got := dials.Load(); got != 2 {
		t.Fatalf("%d dials, want 2", got)
	}

	// A panic with an error: the publish's error matches it.
	errNoBroker := errors.New("no broker today")
	withErr := newPublisher(t, outboxamqp.Config{Dial: func() (*amqp.Connection, error) { panic(errNoBroker) }})
	if err := withErr.Publish(ctx, event()); !errors.Is(err, outboxamqp.ErrNotConfirmed) || !errors.Is(err, errNoBroker) || outbox.IsPermanent(err) {
		t.Fatalf("a Dial panicking with an error: got %v, want ErrNotConfirmed to retry, matching the error", err)
	}
}

// TestAbandonedMarksSettled: the mark a publish abandoned on its context
// leaves on the connection goes once the broker has confirmed the message,
// so a long-lived connection does not keep one per abandoned publish; and
// a retry of such an event goes out on the same connection instead of a
// new one.
func TestAbandonedMarksSettled(t *testing.T) {
	u := brokerURL(t)
	queue, ch := declareQueue(t, u)
	var dials atomic.Int32
	p := newPublisher(t, outboxamqp.Config{Route: toQueue(queue), Dial: func() (*amqp.Connection, error) {
		dials.Add(1)
		return amqp.Dial(u.String())
	}})
	outboxamqp.SendWhenContextEnded(p)
	// The connection is opened first: without one, a publish on a
	// cancelled context ends before anything is sent.
	if err := p.Publish(ctx, event()); err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	const n = 20
	var abandoned []outbox.Delivery
	confirmed := 0 // before the publish looked at its context
	for len(abandoned) < n {
		if confirmed == 50*n {
			t.Fatalf("only %d publishes on a cancelled context were abandoned, %d confirmed", len(abandoned), confirmed)
		}
		d := event()
		switch err := p.Publish(cancelled, d); {
		case err == nil:
			confirmed++
		case errors.Is(err, context.Canceled):
			abandoned = append(abandoned, d)
		default:
			t.Fatal(err)
		}
	}
	guarded, stop := context.WithTimeout(ctx, guard)
	defer stop()
	if err := outboxamqp.AwaitAbandoned(guarded, p); err != nil {
		t.Fatalf("waiting for the confirmations of the abandoned publishes: %v", err)
	}
	if err := p.Publish(ctx, event()); err != nil {
		t.Fatal(err)
	}
	if ids, queued := outboxamqp.AbandonedMarks(p); ids != 0 || queued != 0 {
		t.Fatalf("%d abandoned publishes, all confirmed since: the session still holds %d marks (%d queued), want none", n, ids, queued)
	}
	for _, d := range abandoned {
		if err := p.Publish(ctx, d); err != nil {
			t.Fatalf("the retry of an abandoned publish: %v", err)
		}
	}
	if got := dials.Load(); got != 1 {
		t.Fatalf("%d dials, want 1: a retry of a publish abandoned and since confirmed opened a new connection", got)
	}
	if got, want := len(readAll(t, ch, queue)), 2+confirmed+2*n; got != want {
		t.Fatalf("%d messages in the queue, want %d", got, want)
	}
}
