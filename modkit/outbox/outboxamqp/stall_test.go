package outboxamqp_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxamqp"
)

// stallProxy is a TCP proxy in front of the broker whose open connections
// the test can stall: nothing more is forwarded on them, in either
// direction, and nothing is closed, as a client sees a broker that has
// stopped reading its socket (RabbitMQ blocks publishing connections
// during a memory or disk alarm) or a stalled network. Connections opened
// after Stall are forwarded. The proxy reports each connection.close and
// channel.close-ok a client sends.
type stallProxy struct {
	ln     net.Listener
	target string
	// closes receives a value for each connection.close a client sends.
	closes chan struct{}
	// channelsClosed receives a value for each channel.close-ok a client
	// sends: the client has taken the channel for closed before it sends
	// it.
	channelsClosed chan struct{}
	// filled receives a value for each frozen link that has read its
	// budget (see FreezeAfter).
	filled chan struct{}

	mu      sync.Mutex
	changed *sync.Cond // a flow, a link's stall or ended changed
	links   []*link
	ended   bool
	wg      sync.WaitGroup
}

// link is one proxied connection: the client's and the broker's side.
type link struct {
	down, up net.Conn
	stalled  bool
	// frozen: no more than budget more bytes are read from the client,
	// whose writes block once the sockets' buffers are full.
	frozen bool
	budget int
}

// flow is one direction of a link: what was read from its source and not
// yet written to its destination, and whether the source has ended.
type flow struct {
	pending [][]byte
	eof     bool
}

func newStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{ln: ln, target: target, closes: make(chan struct{}, 16), channelsClosed: make(chan struct{}, 16), filled: make(chan struct{}, 16)}
	p.changed = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *stallProxy) Addr() string { return p.ln.Addr().String() }

// Stall stops forwarding on the connections open now: what their ends
// send after it is held, not delivered, until Release.
func (p *stallProxy) Stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.links {
		l.stalled = true
	}
}

// FreezeAfter stops reading what the clients of the connections open now
// send once it has read n more bytes from each, as a broker that stopped
// reading its socket: once the sockets' buffers are full, a client's
// writes block. Each link that has read its n bytes reports on filled.
// Release ends it.
func (p *stallProxy) FreezeAfter(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.links {
		l.frozen, l.budget = true, n
	}
}

// Release delivers what was held and forwards again.
func (p *stallProxy) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.links {
		l.stalled, l.frozen = false, false
	}
	p.changed.Broadcast()
}

func (p *stallProxy) accept() {
	defer p.wg.Done()
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = down.Close()
			continue
		}
		l := &link{down: down, up: up}
		p.mu.Lock()
		if p.ended {
			p.mu.Unlock()
			_ = down.Close()
			_ = up.Close()
			return
		}
		p.links = append(p.links, l)
		p.wg.Add(4)
		p.mu.Unlock()
		toBroker, toClient := &flow{}, &flow{}
		go p.read(l, down, toBroker, &methodScanner{})
		go p.write(l, up, toBroker)
		go p.read(nil, up, toClient, nil)
		go p.write(l, down, toClient)
	}
}

// read queues what src sends on f until src ends, reporting the
// connection.close and channel.close-ok methods scan finds in it, if scan
// is set. It reads nothing while client, the link src is the client of
// (nil for a broker's side), is frozen.
func (p *stallProxy) read(client *link, src net.Conn, f *flow, scan *methodScanner) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		into := buf
		if client != nil {
			p.mu.Lock()
			for client.frozen && client.budget <= 0 && !p.ended {
				p.changed.Wait()
			}
			if client.frozen && !p.ended && client.budget < len(into) {
				into = into[:client.budget]
			}
			p.mu.Unlock()
		}
		n, err := src.Read(into)
		if client != nil && n > 0 {
			p.mu.Lock()
			if client.frozen && client.budget > 0 {
				if client.budget -= n; client.budget <= 0 {
					report(p.filled)
				}
			}
			p.mu.Unlock()
		}
		if n > 0 {
			chunk := bytes.Clone(into[:n])
			if scan != nil {
				for _, m := range scan.scan(chunk) {
					switch m {
					case connectionClose:
						report(p.closes)
					case channelCloseOk:
						report(p.channelsClosed)
					}
				}
			}
			p.mu.Lock()
			f.pending = append(f.pending, chunk)
			p.changed.Broadcast()
			p.mu.Unlock()
		}
		if err != nil {
			p.mu.Lock()
			f.eof = true
			p.changed.Broadcast()
			p.mu.Unlock()
			return
		}
	}
}

// write delivers f to dst whenever l is not stalled. Once f's source has
// ended and all of it is delivered, it closes both sides of l.
func (p *stallProxy) write(l *link, dst net.Conn, f *flow) {
	defer p.wg.Done()
	defer func() {
		_ = l.down.Close()
		_ = l.up.Close()
	}()
	for {
		p.mu.Lock()
		for !p.ended && (l.stalled || len(f.pending) == 0 && !f.eof) {
			p.changed.Wait()
		}
		if p.ended || len(f.pending) == 0 {
			p.mu.Unlock()
			return
		}
		chunk := f.pending[0]
		f.pending = f.pending[1:]
		p.mu.Unlock()
		if _, err := dst.Write(chunk); err != nil {
			return
		}
	}
}

// report sends on c unless its buffer is full.
func report(c chan<- struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

func (p *stallProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	p.ended = true
	for _, l := range p.links {
		_ = l.down.Close()
		_ = l.up.Close()
	}
	p.changed.Broadcast()
	p.mu.Unlock()
	p.wg.Wait()
}

// method is an AMQP method's class and method ids.
type method struct{ class, id uint16 }

var (
	connectionClose = method{10, 50}
	channelCloseOk  = method{20, 41}
)

// methodScanner reads the frames a client sends, from the protocol header
// on, for their methods.
type methodScanner struct {
	buf    []byte
	header bool
}

// scan adds b to what was read and returns the methods of the frames it
// completed.
func (s *methodScanner) scan(b []byte) (methods []method) {
	s.buf = append(s.buf, b...)
	if !s.header {
		if len(s.buf) < 8 { // "AMQP" 0 0 9 1
			return nil
		}
		s.buf, s.header = s.buf[8:], true
	}
	// A frame: type (1 byte, 1 for a method), channel (2), payload size
	// (4), payload, frame end (1). A method's payload begins with its
	// class and method ids.
	for len(s.buf) >= 7 {
		size := int(binary.BigEndian.Uint32(s.buf[3:7]))
		if len(s.buf) < 7+size+1 {
			break
		}
		if payload := s.buf[7 : 7+size]; s.buf[0] == 1 && size >= 4 {
			methods = append(methods, method{binary.BigEndian.Uint16(payload[0:2]), binary.BigEndian.Uint16(payload[2:4])})
		}
		s.buf = s.buf[7+size+1:]
	}
	return methods
}

// stallBound bounds the waits for publishes that must not wait for a
// stalled connection. It is shorter than the 30s (3 heartbeats of 10s)
// after which the client gives up on a stalled connection and whatever
// waited for it goes on: a publish that waits for the stalled connection
// fails the test instead of passing late. Not a performance assertion.
const stallBound = 10 * time.Second

// awaitWithin receives from c, failing t after d.
func awaitWithin[T any](t *testing.T, c <-chan T, d time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(d):
		t.Fatalf("still waiting for %s after %v", what, d)
		panic("unreachable")
	}
}

// stallRig is a Publisher connected through a stallProxy. Its first dial
// goes through at once; the next ones wait for the gate to open, if the
// rig has one.
type stallRig struct {
	p        *outboxamqp.Publisher
	proxy    *stallProxy
	openGate func()

	mu    sync.Mutex
	conns []*amqp.Connection // every connection the Publisher opened
}

func newStallRig(t *testing.T, cfg outboxamqp.Config, gated bool) *stallRig {
	t.Helper()
	u := brokerURL(t)
	r := &stallRig{proxy: newStallProxy(t, u.Host), openGate: func() {}}
	via := *u
	via.Host = r.proxy.Addr()
	gate := make(chan struct{})
	if gated {
		r.openGate = sync.OnceFunc(func() { close(gate) })
	} else {
		close(gate)
	}
	var dials atomic.Int32
	cfg.Dial = func() (*amqp.Connection, error) {
		if dials.Add(1) > 1 {
			<-gate
		}
		// The default dial's settings.
		c, err := amqp.DialConfig(via.String(), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second), Heartbeat: 10 * time.Second})
		if err == nil {
			r.mu.Lock()
			r.conns = append(r.conns, c)
			r.mu.Unlock()
		}
		return c, err
	}
	r.p = newPublisher(t, cfg)
	// Runs before the publisher's Close, which waits for the broker to
	// answer the closes.
	t.Cleanup(r.release)
	return r
}

// release opens the gate and ends the stall.
func (r *stallRig) release() {
	r.openGate()
	r.proxy.Release()
}

// closeStalled calls Close while a connection is stalled, ends the stall
// once Close has closed the current connection, and checks that Close
// returns with all the want connections the Publisher opened closed.
func (r *stallRig) closeStalled(t *testing.T, want int) {
	t.Helper()
	closed := make(chan error, 1)
	go func() { closed <- r.p.Close() }()
	await(t, r.proxy.closes, "Close to close the current connection")
	r.release()
	if err := await(t, closed, "Close"); err != nil {
		t.Fatalf("close: %v", err)
	}
	r.checkClosed(t, want)
}

// checkClosed checks that the Publisher opened want connections and that
// Close has closed them all.
func (r *stallRig) checkClosed(t *testing.T, want int) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.conns) != want {
		t.Fatalf("%d connections opened, want %d", len(r.conns), want)
	}
	for i, c := range r.conns {
		if !c.IsClosed() {
			t.Errorf("connection %d left open after Close", i)
		}
	}
}

// TestStalledCloseBlocksNoPublish: a connection the publisher gives up
// while the broker does not answer on it (here: to retry an event whose
// earlier publish on it was abandoned) is closed without holding up other
// publishes. A publish meanwhile ends with its context, the next
// connection is opened and used while the close of the given-up one is
// still unanswered, and Close, once the broker answers, has closed every
// connection the publisher opened.
func TestStalledCloseBlocksNoPublish(t *testing.T) {
	noLeaks(t)
	queue, _ := declareQueue(t, brokerURL(t))
	// Until the gate opens, no connection is up while the test checks
	// that a publish ends with its context.
	r := newStallRig(t, outboxamqp.Config{Route: toQueue(queue)}, true)
	p := r.p
	outboxamqp.SendWhenContextEnded(p)

	if err := p.Publish(ctx, event()); err != nil {
		t.Fatal(err)
	}
	r.proxy.Stall()

	// A publish abandoned on its context: its confirmation cannot come.
	x := event()
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := p.Publish(cancelled, x); !errors.Is(err, context.Canceled) {
		t.Fatalf("a publish on a cancelled context: got %v, want an error matching context.Canceled", err)
	}
	// Its retry: the earlier publish's return could still come on this
	// connection, so the publisher gives it up and closes it. The broker
	// does not answer the close.
	retryCtx, cancelRetry := context.WithCancel(ctx)
	t.Cleanup(cancelRetry)
	retry := publishAsync(p, retryCtx, x)
	await(t, r.proxy.closes, "the publisher to close the stalled connection")

	// Another publish meanwhile ends with its context.
	yCtx, cancelY := context.WithCancel(ctx)
	t.Cleanup(cancelY)
	y := publishAsync(p, yCtx, event())
	cancelY()
	err := awaitWithin(t, y, stallBound, "a publish with a cancelled context while a stalled connection closes")
	if !errors.Is(err, context.Canceled) || !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) {
		t.Fatalf("a publish with a cancelled context: got %v, want ErrNotConfirmed to retry, matching context.Canceled", err)
	}
	cancelRetry()
	if err := awaitWithin(t, retry, stallBound, "the retry, its context cancelled"); !errors.Is(err, context.Canceled) {
		t.Fatalf("the retry, its context cancelled while waiting for a connection: got %v, want an error matching context.Canceled", err)
	}

	// The next connection opens and carries publishes while the close of
	// the stalled one is still unanswered.
	r.openGate()
	if err := awaitWithin(t, publishAsync(p, ctx, event()), stallBound, "a publish on the next connection"); err != nil {
		t.Fatalf("a publish on the next connection: %v", err)
	}
	r.closeStalled(t, 2)
}

// TestStalledClosedChannelDelaysNoConnect: a connection whose channel
// closed (here: by a publish to an exchange deleted since it was found,
// abandoned on its context so that it does not give the connection up
// itself) is given up by the next publish, which goes out on a new
// connection while the broker leaves the old one's close unanswered,
// instead of waiting for that close before dialling.
func TestStalledClosedChannelDelaysNoConnect(t *testing.T) {
	noLeaks(t)
	queue, ch := declareQueue(t, brokerURL(t))
	gone := "outboxamqp-test-gone-" + uuid.NewString()
	t.Cleanup(func() { _ = ch.ExchangeDelete(gone, false, false) })
	r := newStallRig(t, outboxamqp.Config{Route: func(d outbox.Delivery) (string, string) {
		if d.Topic == "gone" {
			return gone, "x"
		}
		return "", queue
	}}, false)
	p := r.p
	outboxamqp.SendWhenContextEnded(p)

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	conns := 1
	for abandoned := false; !abandoned; {
		if err := p.Publish(ctx, event()); err != nil {
			t.Fatal(err)
		}
		// The exchange is found on this connection, then deleted.
		if err := ch.ExchangeDeclare(gone, amqp.ExchangeDirect, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		found := event()
		found.Topic = "gone"
		if err := p.Publish(ctx, found); !errors.As(err, new(*outboxamqp.UnroutableError)) {
			t.Fatalf("a publish to the exchange, no queue bound: got %v, want it unroutable", err)
		}
		if err := ch.ExchangeDelete(gone, false, false); err != nil {
			t.Fatal(err)
		}
		d := event()
		d.Topic = "gone"
		switch err := p.Publish(cancelled, d); {
		case errors.Is(err, context.Canceled):
			abandoned = true
		case errors.Is(err, outboxamqp.ErrNotConfirmed) && conns < 10:
			// The channel closed before the publish looked at its
			// context, and the publish gave the connection up itself.
			// Again, on the next, once the proxy has reported this one.
			await(t, r.proxy.channelsClosed, "the broker to close the channel")
			await(t, r.proxy.closes, "the publisher to close the connection")
			conns++
		default:
			t.Fatalf("a publish to a deleted exchange on a cancelled context: got %v, want an error matching context.Canceled", err)
		}
	}
	await(t, r.proxy.channelsClosed, "the broker to close the channel")
	r.proxy.Stall()

	if err := awaitWithin(t, publishAsync(p, ctx, event()), stallBound, "a publish after the channel closed"); err != nil {
		t.Fatalf("a publish after the channel closed: %v", err)
	}
	await(t, r.proxy.closes, "the publisher to close the stalled connection")
	r.closeStalled(t, conns+1)
}

// TestStalledExchangeCheckEndsWithItsContext: a publish waiting for the
// check that its exchange exists, which a broker that stopped answering
// holds up, ends with its context, with an error to retry. The check goes
// on, and serves the next publish once the broker answers.
func TestStalledExchangeCheckEndsWithItsContext(t *testing.T) {
	noLeaks(t)
	queue, ch := declareQueue(t, brokerURL(t))
	exchange := declareExchange(t, ch, queue)
	r := newStallRig(t, outboxamqp.Config{Route: func(d outbox.Delivery) (string, string) {
		if d.Topic == "direct" {
			return "", queue
		}
		return exchange, queue
	}}, false)
	p := r.p
	direct := event()
	direct.Topic = "direct"
	if err := p.Publish(ctx, direct); err != nil { // the connection is open
		t.Fatal(err)
	}
	r.proxy.Stall()

	checkCtx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	res := publishAsync(p, checkCtx, event())
	for outboxamqp.ExchangeChecks(p) == 0 {
		select {
		case err := <-res:
			t.Fatalf("the publish ended before its exchange check began: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
	cancel()
	err := awaitWithin(t, res, stallBound, "a publish whose context ended during its exchange check")
	if !errors.Is(err, context.Canceled) || !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) {
		t.Fatalf("a publish whose context ended during its exchange check: got %v, want ErrNotConfirmed to retry, matching context.Canceled", err)
	}

	r.proxy.Release()
	if err := awaitWithin(t, publishAsync(p, ctx, event()), stallBound, "a publish once the broker answers"); err != nil {
		t.Fatalf("a publish once the broker answers: %v", err)
	}
	if got := outboxamqp.ExchangeChecks(p); got != 1 {
		t.Fatalf("%d exchange checks, want 1: the next publish shares the check begun", got)
	}
	r.mu.Lock()
	conns := len(r.conns)
	r.mu.Unlock()
	if conns != 1 {
		t.Fatalf("%d connections opened, want 1", conns)
	}
}

// TestStalledWriteEndsWithItsContext: a publish whose message the broker
// stops reading (its socket's buffers full, as when RabbitMQ blocks a
// publishing connection during a memory or disk alarm) ends with its
// context instead of blocking until heartbeats give the connection up
// (amqp091-go writes without a deadline and ignores the context): the
// connection is given up, and the next publish goes out on a new one.
func TestStalledWriteEndsWithItsContext(t *testing.T) {
	noLeaks(t)
	queue, _ := declareQueue(t, brokerURL(t))
	r := newStallRig(t, outboxamqp.Config{Route: toQueue(queue)}, false)
	p := r.p
	if err := p.Publish(ctx, event()); err != nil {
		t.Fatal(err)
	}
	// The proxy reads 1 MiB more of what the client sends, then nothing.
	r.proxy.FreezeAfter(1 << 20)

	// Far more than the sockets between the client and the proxy buffer.
	big := event()
	big.Payload = []byte(`"` + strings.Repeat("x", 64<<20) + `"`)
	bigCtx, cancelBig := context.WithCancel(ctx)
	t.Cleanup(cancelBig)
	blocked := publishAsync(p, bigCtx, big)
	// Once the proxy has read its mebibyte, the publish is writing the
	// message, and cannot finish: the rest is more than the sockets hold.
	await(t, r.proxy.filled, "the publish to write its first mebibyte")
	cancelBig()
	err := awaitWithin(t, blocked, stallBound, "a publish stuck writing to a broker that stopped reading, its context cancelled")
	if !errors.Is(err, context.Canceled) || !errors.Is(err, outboxamqp.ErrNotConfirmed) || outbox.IsPermanent(err) {
		t.Fatalf("a publish whose context ended during its write: got %v, want ErrNotConfirmed to retry, matching context.Canceled", err)
	}
	r.proxy.Release()
	if err := awaitWithin(t, publishAsync(p, ctx, event()), stallBound, "a publish on the next connection"); err != nil {
		t.Fatalf("a publish on the next connection: %v", err)
	}
	r.mu.Lock()
	conns := len(r.conns)
	r.mu.Unlock()
	if conns != 2 {
		t.Fatalf("%d connections opened, want 2 (the stuck one given up, a new one for the next publish)", conns)
	}
}

// TestStalledCloseEndsWithinItsWait: Close on a connection whose broker
// does not answer (stalled) gives up waiting for the answer after the
// close wait, reports that, and has closed the connection, instead of
// holding a service's shutdown until heartbeats fail (about 30s).
func TestStalledCloseEndsWithinItsWait(t *testing.T) {
	noLeaks(t)
	outboxamqp.SetCloseWait(t, 200*time.Millisecond)
	queue, _ := declareQueue(t, brokerURL(t))
	r := newStallRig(t, outboxamqp.Config{Route: toQueue(queue)}, false)
	if err := r.p.Publish(ctx, event()); err != nil {
		t.Fatal(err)
	}
	r.proxy.Stall()
	closed := make(chan error, 1)
	go func() { closed <- r.p.Close() }()
	await(t, r.proxy.closes, "Close to send the connection's close")
	err := awaitWithin(t, closed, stallBound, "Close, the broker not answering")
	if err == nil || !strings.Contains(err.Error(), "did not answer the close") {
		t.Fatalf("Close on a stalled broker: got %v, want an error saying the broker did not answer the close", err)
	}
	r.checkClosed(t, 1)
}
