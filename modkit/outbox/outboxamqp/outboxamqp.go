// Package outboxamqp publishes outbox events to RabbitMQ (AMQP 0-9-1)
// through github.com/rabbitmq/amqp091-go.
//
// Each event becomes one message, published with the mandatory flag to an
// exchange and routing key given by Config.Route (default: the default
// exchange "" and the routing key "<namespace>.<topic>", which delivers to
// the queue of that name). The message has the payload as body,
// content-type application/json, delivery mode persistent, message-id =
// the event id (the same on every redelivery: consumers de-duplicate on
// it), type "<namespace>.<topic>", timestamp = the event's creation, and
// the event's headers as AMQP headers, except any named CC or BCC: RabbitMQ
// reads those as more routing keys (sender-selected distribution), which
// an event must not be able to give, and closes the channel, failing every
// publish on it, when their value is not an array.
//
// # Example
//
//	pub, err := outboxamqp.New(outboxamqp.Config{URL: "amqp://guest:guest@localhost:5672/"})
//	defer pub.Close()
//	d, _ := client.NewDispatcher(outbox.DispatcherConfig{}, pub.For(outbox.Topic{Namespace: "billing", Topic: "invoice_paid"}))
//
// # Guarantees
//
// The channel is in confirm mode: a publish returns nil only once the
// broker has confirmed the message (for a persistent message on a durable
// queue, written it to disk). A message the broker could not route to any
// queue comes back (basic.return) and is reported as an *UnroutableError
// wrapped in outbox.Permanent, so the event is dead-lettered rather than
// silently dropped; replay it once its queue is bound. A route to an
// exchange that does not exist fails the publish, nothing sent, with an
// error matching ErrNoExchange, to retry: the exchange may yet be declared
// (see Connections). A negative confirmation, a lost connection or a
// closed channel is an error to retry; the error quotes the broker's
// reason for closing the channel. A message larger than the broker's
// max_message_size makes the broker close the channel, failing the other
// publishes on it (to retry); that message is wrapped in outbox.Permanent,
// so that it closes the channel once rather than on each of its attempts.
// A publish whose ctx has already ended sends nothing.
//
// # Connections
//
// The Publisher holds one connection and one confirm channel, opened on
// the first publish and opened again on the next publish after either
// closes (a network failure, a broker restart, a channel error).
// Publishes share the channel; their confirmations are awaited
// concurrently. So a channel error fails every publish in flight on it, of
// every topic the Publisher serves: they are retried, and those the broker
// had taken are published again (same message id).
//
// A publish to an exchange that does not exist would be such an error, on
// each attempt of its events. So the first publish to an exchange on a
// connection checks that the exchange exists (a passive declare, on a
// short-lived channel of its own: one round trip more per exchange per
// connection, none per publish; the default exchange "" is not checked).
// The publishes to that exchange meanwhile share the check, each waiting
// for it no longer than its ctx lasts. An exchange found is remembered
// until the connection closes. A missing one fails the publishes waiting
// for its check with ErrNoExchange, to retry, costing no other publish,
// and is not remembered: the next publish to it checks again. An exchange
// deleted after it was found is not noticed: a publish to it makes the
// broker close the shared channel, as above, failing the publishes in
// flight on it (to retry); the next connection has none remembered, and
// checks the exchange again.
//
// One connection attempt at a time is made, in the background: the
// publishes that need a connection wait for that attempt's outcome or
// the end of their ctx, whichever comes first (a publish whose ctx ends
// first fails with ctx's error, to retry). An attempt that fails is not
// remembered: the next publish makes another. Close waits for an attempt
// in progress and closes the connection it opened.
//
// A connection given up (its channel closed, a publish on it failed, or a
// retry must not share it with an abandoned publish of the same event) is
// closed in the background: closing waits for the broker's answer, which
// a broker that has stopped reading the socket (RabbitMQ blocks publishing
// connections during a memory or disk alarm) or a stalled network may
// hold back for long. Publishes meanwhile go on, on the next connection,
// and Close waits for these closes too, each for about 5s at most (see
// Close). A publish whose ctx ends while the client library still holds it
// (writing it, or queued on the channel behind a publish being written:
// the library writes without a deadline, so a broker whose socket buffers
// are full blocks it) gives its connection up at once, failing the other
// publishes waiting on that connection for their confirmation (to retry),
// instead of blocking them all until heartbeats fail (about 30s).
package outboxamqp

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// Config configures a Publisher.
type Config struct {
	// URL of the broker, e.g. "amqp://guest:guest@localhost:5672/".
	// Required unless Dial is set.
	URL string
	// Dial opens a connection. Default: amqp.DialConfig(URL) with a 5s
	// connection timeout (so that a dial to an unreachable broker ends
	// well within a publish deadline), a 10s heartbeat and the connection
	// name "modkit-outbox". The Publisher calls it in a goroutine of its
	// own, never twice at once; the publishes waiting for it give up at
	// the end of their ctx, but Close waits for it to return, so it must
	// end on its own (as a dial with a timeout does). A panic in it fails
	// the publishes waiting for it. Its connection should run over a
	// net.Conn, as amqp.Dial's do: the Publisher sets the socket's deadline
	// to end a publish stuck in its write and to bound a close the broker
	// does not answer.
	Dial func() (*amqp.Connection, error)
	// Route maps an event to the exchange and routing key it is
	// published with. Default: DefaultRoute.
	Route func(d outbox.Delivery) (exchange, key string)
}

// shortStrMax is the longest AMQP short string (exchange and queue names,
// routing keys, the type property), in bytes.
const shortStrMax = 255

// The default dial's settings.
const (
	dialTimeout = 5 * time.Second
	heartbeat   = 10 * time.Second
)

// DefaultRoute publishes to the default exchange ("") with the routing key
// "<namespace>.<topic>": the message goes to the queue of that name.
// AMQP carries routing keys of at most 255 bytes; a longer one (namespace
// and topic may have 128 bytes each) fails the publish permanently.
func DefaultRoute(d outbox.Delivery) (exchange, key string) { return "", d.Namespace + "." + d.Topic }

// UnroutableError is a message that the broker returned because no queue
// was bound to receive it (mandatory routing). Publish wraps it in
// outbox.Permanent.
type UnroutableError struct {
	// Exchange and RoutingKey the message was published with.
	Exchange, RoutingKey string
	// ReplyCode is the broker's reason code (312 NO_ROUTE).
	ReplyCode uint16
	// ReplyText is the broker's reason ("NO_ROUTE").
	ReplyText string
}

// Error names the route and the broker's reason.
func (e *UnroutableError) Error() string {
	return fmt.Sprintf("outboxamqp: message unroutable: exchange %q, routing key %q: %d %s", e.Exchange, e.RoutingKey, e.ReplyCode, e.ReplyText)
}

// ErrNotConfirmed is returned (wrapped) when a publish did not end with
// the broker's confirmation: a negative confirmation, the channel closed
// first, or the message was not sent at all (no connection, a message the
// adapter refuses, a ctx that ended first). So it does not tell whether
// the broker holds the message. The publish is retried, unless the error
// is also outbox.Permanent.
var ErrNotConfirmed = errors.New("outboxamqp: message not confirmed by the broker")

// ErrNoExchange is returned (wrapped, with ErrNotConfirmed) by a publish
// whose route names an exchange that does not exist on the broker. Nothing
// was sent. The publish is retried: the exchange may yet be declared (by
// another service, say); until then, declare it, or fix Config.Route.
var ErrNoExchange = errors.New("outboxamqp: no such exchange")

// ErrClosed is returned by Publish after Close.
var ErrClosed = errors.New("outboxamqp: publisher closed")

// Publisher publishes outbox events to RabbitMQ. It is safe for concurrent
// use.
type Publisher struct {
	dial  func() (*amqp.Connection, error)
	route func(outbox.Delivery) (string, string)

	mu      sync.Mutex
	sess    *session
	dialing *attempt // the connection attempt in progress, if any
	closed  bool
	// retiring counts the sessions given up and still closing (see
	// retire). Add is called with mu held before closed is set, so
	// Close's Wait comes after every Add.
	retiring sync.WaitGroup

	// sendWhenEnded makes a publish whose ctx has ended send its message
	// and abandon it at once: tests make abandoned publishes with it.
	sendWhenEnded bool
	// exchangeChecks counts the exchange checks started, for tests.
	exchangeChecks atomic.Int64
}

// attempt is one connection attempt. Its outcome, sess or err, is set
// before done is closed.
type attempt struct {
	done chan struct{}
	sess *session
	err  error
}

// session is one connection with its confirm channel and the reader of
// its returned messages.
type session struct {
	conn *amqp.Connection
	ch   *amqp.Channel
	// returns is unbuffered: the library hands a basic.return over before
	// it processes the confirmation that follows it, so once a
	// confirmation is in, the reader has taken that return.
	returns chan amqp.Return
	// barrier is received by the reader between returns: a send on it
	// completes only after the reader has recorded every return it took.
	barrier chan struct{}
	done    chan struct{} // closed when the reader exits

	mu       sync.Mutex
	returned map[string]amqp.Return // by message-id
	// abandoned marks the publishes abandoned on ctx before their
	// confirmation, by message-id: a return of theirs may still come, and
	// must not be taken for a later publish's. A mark is dropped when the
	// return comes, or once the confirmation has (see settle); a new
	// publish of a marked id goes to a new session (see Publish).
	abandoned map[string]*amqp.DeferredConfirmation
	// marks holds the same marks in the order of their publishes, for
	// settle; one whose return came stays until settle reaches it.
	marks []mark

	// closes receives the broker's reason when it closes the channel
	// (buffered: the library sends it before closing closes).
	closes     chan *amqp.Error
	reasonOnce sync.Once
	reason     *amqp.Error

	exMu sync.Mutex
	// exchanges holds the exchanges found on this connection, and those
	// being checked: a check that fails is removed (see exchangeExists).
	exchanges map[string]*check
	// exClosed is set by close, after which no check starts.
	exClosed bool
	checks   sync.WaitGroup // the checks' goroutines, which close waits for
}

// check is one passive declare of an exchange. Its outcome, err, is set
// before done is closed.
type check struct {
	done chan struct{}
	err  error
}

// closeReason returns the broker's reason for closing the channel, nil
// for a close without one (the Publisher's own, the connection's end).
// Call it only once the channel is closed: the library sets the channel
// closed before it hands the reason over, and then closes closes.
func (s *session) closeReason() *amqp.Error {
	s.reasonOnce.Do(func() { s.reason = <-s.closes })
	return s.reason
}

// mark is an abandoned publish: its message-id and confirmation.
type mark struct {
	id string
	dc *amqp.DeferredConfirmation
}

// New returns a Publisher. It connects on the first publish. Errors match
// outbox.ErrInvalidConfig.
func New(cfg Config) (*Publisher, error) {
	if cfg.Dial == nil {
		if cfg.URL == "" {
			return nil, fmt.Errorf("%w: outboxamqp: set URL or Dial", outbox.ErrInvalidConfig)
		}
		if _, err := amqp.ParseURI(cfg.URL); err != nil {
			return nil, fmt.Errorf("%w: outboxamqp: URL: %s", outbox.ErrInvalidConfig, uriError(cfg.URL, err))
		}
		url := cfg.URL
		cfg.Dial = func() (*amqp.Connection, error) {
			c := amqp.Config{Dial: amqp.DefaultDial(dialTimeout), Heartbeat: heartbeat, Properties: amqp.NewConnectionProperties()}
			c.Properties.SetClientConnectionName("modkit-outbox")
			return amqp.DialConfig(url, c)
		}
	}
	if cfg.Route == nil {
		cfg.Route = DefaultRoute
	}
	return &Publisher{dial: cfg.Dial, route: cfg.Route}, nil
}

// For returns the outbox.Publisher of topic, for NewDispatcher.
func (p *Publisher) For(topic outbox.Topic) outbox.Publisher {
	return outbox.Publisher{Topic: topic, Name: "outboxamqp " + topic.String(), Publish: p.Publish}
}

// Close closes the connection. If a connection attempt is in progress, it
// waits for it to end and closes the connection it opened; it also waits
// for the connections given up before to finish closing. Each close waits
// about 5s at most for the broker's answer (a broker that stopped reading
// its socket may not give one; one that still sends heartbeats meanwhile
// can make it wait until the client's next heartbeat fails to go out, up
// to 10s more); a close that was not answered is reported as Close's
// error, the connection closed all the same. Publishes after it fail with
// ErrClosed. Call it once the dispatchers using the Publisher have
// stopped.
func (p *Publisher) Close() error {
	p.mu.Lock()
	s, a := p.sess, p.dialing
	p.sess, p.closed = nil, true
	p.mu.Unlock()
	if a != nil {
		<-a.done // the attempt sees closed and closes what it opened
	}
	var err error
	if s != nil {
		err = s.close()
	}
	p.retiring.Wait()
	return err
}

// Message builds the AMQP message of d.
func (p *Publisher) Message(d outbox.Delivery) amqp.Publishing {
	m := amqp.Publishing{
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		MessageId:    d.ID.String(),
		Timestamp:    d.CreatedAt,
		Body:         d.Payload,
	}
	if t := d.Namespace + "." + d.Topic; len(t) <= shortStrMax {
		m.Type = t // a property of at most 255 bytes: left out rather than cut
	}
	if len(d.Headers) > 0 {
		m.Headers = make(amqp.Table, len(d.Headers))
		for k, v := range d.Headers {
			if !routingHeader(k) {
				m.Headers[k] = v
			}
		}
	}
	return m
}

// routingHeader reports whether RabbitMQ reads a header of that name as
// routing keys (sender-selected distribution): CC and BCC, as written.
func routingHeader(name string) bool { return name == "CC" || name == "BCC" }

// Publish sends d with the mandatory flag and waits for the broker's
// confirmation or the end of ctx (see the package doc for the outcomes). A
// publish that needs a connection waits for it no longer than ctx lasts.
func (p *Publisher) Publish(ctx context.Context, d outbox.Delivery) error {
	exchange, key := p.route(d)
	if len(exchange) > shortStrMax || len(key) > shortStrMax {
		// AMQP's short strings hold 255 bytes; the client would cut the
		// name silently and the message would go elsewhere.
		return outbox.Permanent(fmt.Errorf("%w: exchange %q, routing key %q: longer than %d bytes, which AMQP cannot carry",
			ErrNotConfirmed, exchange, key, shortStrMax))
	}
	s, err := p.session(ctx)
	if err != nil {
		return err
	}
	msg := p.Message(d)
	if s.settle(msg.MessageId) {
		// An earlier publish of this event on this session was abandoned,
		// and its return (if any) may still be on its way: on this
		// session it could pass for this publish's.
		p.drop(s)
		if s, err = p.session(ctx); err != nil {
			return err
		}
	}
	if err := p.exchangeExists(ctx, s, exchange, key); err != nil {
		return err
	}
	if ctx.Err() != nil && !p.sendWhenEnded {
		// Sent now, the message would be abandoned unconfirmed and sent
		// again by the retry: a duplicate for certain.
		return fmt.Errorf("%w: exchange %q, routing key %q: %w", ErrNotConfirmed, exchange, key, ended(ctx))
	}
	dc, err := s.publish(ctx, exchange, key, msg)
	if err != nil {
		p.drop(s)
		return fmt.Errorf("%w: exchange %q, routing key %q: %w", ErrNotConfirmed, exchange, key, err)
	}
	defer s.forget(msg.MessageId)
	select {
	case <-dc.Done():
	case <-ctx.Done():
		s.abandon(msg.MessageId, dc)
		return fmt.Errorf("%w: exchange %q, routing key %q: %w", ErrNotConfirmed, exchange, key, ended(ctx))
	}
	if !dc.Acked() {
		if s.ch.IsClosed() {
			p.drop(s)
			return channelClosedError(s.closeReason(), exchange, key, len(msg.Body))
		}
		return fmt.Errorf("%w: exchange %q, routing key %q: negative confirmation: the broker refused the message "+
			"(a queue it routes to is full and set to x-overflow reject-publish, or the broker could not store it)",
			ErrNotConfirmed, exchange, key)
	}
	if ret, ok := s.returnOf(msg.MessageId); ok {
		return outbox.Permanent(&UnroutableError{Exchange: ret.Exchange, RoutingKey: ret.RoutingKey, ReplyCode: ret.ReplyCode, ReplyText: ret.ReplyText})
	}
	return nil
}

// session returns the open session. If there is none or it closed, it
// waits for a connection attempt (starting one unless one is in progress)
// or the end of ctx, whichever comes first. No attempt is started for a
// ctx that has ended.
func (p *Publisher) session(ctx context.Context) (*session, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	if s := p.sess; s != nil && !s.ch.IsClosed() {
		p.mu.Unlock()
		return s, nil
	}
	a := p.dialing
	if a == nil {
		if ctx.Err() != nil {
			p.mu.Unlock()
			return nil, fmt.Errorf("%w: connect: %w", ErrNotConfirmed, ended(ctx))
		}
		if p.sess != nil {
			p.retire(p.sess)
		}
		a = &attempt{done: make(chan struct{})}
		p.dialing = a
		go p.connect(a)
	}
	p.mu.Unlock()
	select {
	case <-a.done:
		return a.sess, a.err
	case <-ctx.Done():
		return nil, fmt.Errorf("%w: connect: %w", ErrNotConfirmed, ended(ctx))
	}
}

// connect makes the connection attempt a. It runs without the
// Publisher's lock, so that publishes can give up waiting for it; a
// session it opens after Close is closed at once.
func (p *Publisher) connect(a *attempt) {
	defer close(a.done)
	s, err := p.open()
	p.mu.Lock()
	p.dialing = nil
	closed := p.closed
	if err == nil && !closed {
		p.sess = s
	}
	p.mu.Unlock()
	switch {
	case closed:
		if s != nil {
			_ = s.close()
		}
		a.err = ErrClosed
	case err != nil:
		a.err = fmt.Errorf("%w: connect: %w", ErrNotConfirmed, err)
	default:
		a.sess = s
	}
}

// exchangeExists returns nil once the exchange is known to exist on s's
// connection. The first publish to an exchange on a connection checks it
// with a passive declare on a channel of its own, as a publish to a
// missing exchange would make the broker close the shared channel,
// failing every publish on it. Concurrent publishes share the check,
// which runs in a goroutine of its own: a publish gives up waiting for it
// when its ctx ends (the check goes on, for the next publishes). An
// exchange found is remembered for the connection's life; one missing is
// checked again by the next publish. The default exchange needs no check.
func (p *Publisher) exchangeExists(ctx context.Context, s *session, exchange, key string) error {
	if exchange == "" {
		return nil
	}
	s.exMu.Lock()
	c := s.exchanges[exchange]
	if c == nil {
		var err error
		switch {
		case ctx.Err() != nil: // no check is started for it
			err = ended(ctx)
		case s.exClosed:
			err = amqp.ErrClosed
		}
		if err != nil {
			s.exMu.Unlock()
			return fmt.Errorf("%w: exchange %q, routing key %q: checking that the exchange exists: %w", ErrNotConfirmed, exchange, key, err)
		}
		c = &check{done: make(chan struct{})}
		s.exchanges[exchange] = c
		s.checks.Add(1)
		p.exchangeChecks.Add(1)
		go s.checkExchange(exchange, c)
	}
	s.exMu.Unlock()
	select {
	case <-c.done:
	default:
		select {
		case <-c.done:
		case <-ctx.Done():
			return fmt.Errorf("%w: exchange %q, routing key %q: checking that the exchange exists: %w", ErrNotConfirmed, exchange, key, ended(ctx))
		}
	}
	var amqpErr *amqp.Error
	switch {
	case c.err == nil:
		return nil
	case errors.As(c.err, &amqpErr) && amqpErr.Code == amqp.NotFound:
		return fmt.Errorf("%w: exchange %q, routing key %q: %w (the broker says %d %s): declare the exchange, or fix Config.Route; the publish is retried",
			ErrNotConfirmed, exchange, key, ErrNoExchange, amqpErr.Code, amqpErr.Reason)
	}
	return fmt.Errorf("%w: exchange %q, routing key %q: checking that the exchange exists: %w", ErrNotConfirmed, exchange, key, c.err)
}

// checkExchange declares the exchange passively on a channel of its own,
// and records the outcome in c; a failure is not remembered.
func (s *session) checkExchange(exchange string, c *check) {
	defer s.checks.Done()
	ch, err := s.conn.Channel()
	if err == nil {
		// A missing exchange makes the broker close ch (404 NOT_FOUND).
		err = ch.ExchangeDeclarePassive(exchange, "", false, false, false, false, nil)
	}
	if err != nil {
		s.exMu.Lock()
		delete(s.exchanges, exchange)
		s.exMu.Unlock()
	}
	c.err = err
	close(c.done)
	if ch != nil && err == nil {
		_ = ch.Close()
	}
}

// channelClosedError is the error of a publish whose channel closed
// before its confirmation, for reason (nil when the broker gave none).
// The message that made the broker close the channel for its size (over
// max_message_size) is a permanent failure: every attempt of it would
// close the channel again, failing the publishes beside it.
func channelClosedError(reason *amqp.Error, exchange, key string, bodyLen int) error {
	if reason == nil {
		return fmt.Errorf("%w: exchange %q, routing key %q: the channel closed first", ErrNotConfirmed, exchange, key)
	}
	err := fmt.Errorf("%w: exchange %q, routing key %q: the broker closed the channel first: %d %s", ErrNotConfirmed, exchange, key, reason.Code, reason.Reason)
	if m := maxMessageSize.FindStringSubmatch(reason.Reason); reason.Code == amqp.PreconditionFailed && m != nil {
		if limit, perr := strconv.Atoi(m[1]); perr == nil && bodyLen > limit {
			return outbox.Permanent(fmt.Errorf("%w (this message's %d bytes are more than the broker's max_message_size: "+
				"raise it, or make the event smaller, then replay it)", err, bodyLen))
		}
	}
	return err
}

// maxMessageSize matches RabbitMQ's reason for closing a channel on a
// message larger than max_message_size, and captures the limit.
var maxMessageSize = regexp.MustCompile(`message size \d+ is larger than configured max size (\d+)`)

// publish sends msg on the session's channel (Publish sends nothing when
// ctx has ended, but in tests). amqp091-go ignores the
// context and writes without a deadline, so a publish written to a broker
// that has stopped reading its socket (a memory or disk alarm, a stalled
// network) would block, and every publish on the channel behind it, until
// heartbeats gave the connection up (about 30s). If ctx ends while the library still holds it (writing it, or
// waiting for the channel behind another publish being written), the
// connection is closed with a deadline in the past: the write fails at
// once, the publish returns its error, and the caller gives the session
// up. Publishes on the connection that were waiting for their
// confirmation fail too (ErrNotConfirmed, to be retried).
func (s *session) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) (*amqp.DeferredConfirmation, error) {
	if ctx.Err() != nil { // Publisher.sendWhenEnded: sent, then abandoned
		return s.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	}
	var writing atomic.Bool
	writing.Store(true)
	stop := context.AfterFunc(ctx, func() {
		if writing.Load() {
			_ = s.conn.CloseDeadline(time.Now())
		}
	})
	dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	writing.Store(false)
	stop()
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("%w (the write did not finish before it: %w)", ended(ctx), err)
	}
	return dc, err
}

// ended is the error of a ctx that has ended: ctx.Err(), and its cause
// when that is another error.
func ended(ctx context.Context) error {
	err := ctx.Err()
	if cause := context.Cause(ctx); cause != nil && cause != err {
		return fmt.Errorf("%w: %w", err, cause)
	}
	return err
}

func (p *Publisher) open() (*session, error) {
	conn, err := p.dialSafely()
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.CloseDeadline(time.Now().Add(closeWait))
		return nil, err
	}
	s := &session{conn: conn, ch: ch, returns: make(chan amqp.Return), barrier: make(chan struct{}),
		done: make(chan struct{}), returned: map[string]amqp.Return{}, abandoned: map[string]*amqp.DeferredConfirmation{},
		exchanges: map[string]*check{}}
	ch.NotifyReturn(s.returns)
	s.closes = ch.NotifyClose(make(chan *amqp.Error, 1))
	go s.readReturns()
	return s, nil
}

// dialSafely calls the Dial function, turning a panic into an error (that
// wraps the panic's value if it is an error): it runs in a goroutine of
// the Publisher's, where a panic would end the program.
func (p *Publisher) dialSafely() (conn *amqp.Connection, err error) {
	defer func() {
		if r := recover(); r != nil {
			if e, ok := r.(error); ok {
				conn, err = nil, fmt.Errorf("outboxamqp: Dial panicked: %w", e)
			} else {
				conn, err = nil, fmt.Errorf("outboxamqp: Dial panicked: %v", r)
			}
		}
	}()
	return p.dial()
}

// closeWait bounds how long closing a connection waits for the broker's
// answer: a broker that has stopped reading its socket may not answer
// before heartbeats fail (about 30s), longer than a service's shutdown
// may take. (A variable for the tests.)
var closeWait = 5 * time.Second

// close closes the session's connection, waiting for the broker's answer
// no longer than closeWait, and waits for its return reader to exit. An
// already closed connection is no error.
func (s *session) close() error {
	deadline := time.Now().Add(closeWait)
	err := s.conn.CloseDeadline(deadline)
	<-s.done
	s.exMu.Lock()
	s.exClosed = true
	s.exMu.Unlock()
	s.checks.Wait() // each ends with the connection
	switch {
	case err == nil || errors.Is(err, amqp.ErrClosed):
		return nil
	case !time.Now().Before(deadline):
		return fmt.Errorf("outboxamqp: the broker did not answer the close of its connection within %v (closed without its answer): %w", closeWait, err)
	}
	return err
}

// drop gives s up if it is still the current session, so that the next
// publish opens another (see retire).
func (p *Publisher) drop(s *session) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.sess == s {
		p.retire(s)
	}
}

// retire unsets s, the current session, and closes it in a goroutine of
// its own, which Close waits for. Closing waits for the broker's
// close-ok, which a broker that has stopped reading the socket (blocked
// by a resource alarm, or behind a stalled network) may not send before
// the close gives up (closeWait): under p.mu, every publish would wait
// for it whatever its ctx; ahead of the next connection attempt, the
// publishes waiting for that attempt would. Call it with p.mu held and p not closed.
func (p *Publisher) retire(s *session) {
	p.sess = nil
	p.retiring.Add(1)
	go func() {
		defer p.retiring.Done()
		_ = s.close()
	}()
}

// readReturns records returned messages until the channel closes (which
// closes returns).
func (s *session) readReturns() {
	defer close(s.done)
	for {
		select {
		case r, ok := <-s.returns:
			if !ok {
				return
			}
			s.mu.Lock()
			if _, ok := s.abandoned[r.MessageId]; ok {
				delete(s.abandoned, r.MessageId) // the return of an abandoned publish
			} else {
				s.returned[r.MessageId] = r
			}
			s.mu.Unlock()
		case <-s.barrier:
		}
	}
}

// sync returns once the reader has recorded every return it took.
func (s *session) sync() {
	select {
	case s.barrier <- struct{}{}:
	case <-s.done:
	}
}

// returnOf reports whether the message came back unroutable. Call it after
// the message's confirmation.
func (s *session) returnOf(id string) (amqp.Return, bool) {
	s.sync()
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.returned[id]
	return r, ok
}

// abandon records that the publish of id, confirmed by dc, was abandoned
// before its confirmation, and drops any return already recorded for it.
func (s *session) abandon(id string, dc *amqp.DeferredConfirmation) {
	s.mu.Lock()
	s.abandoned[id] = dc
	s.marks = append(s.marks, mark{id: id, dc: dc})
	delete(s.returned, id)
	s.mu.Unlock()
}

// settle drops the marks of abandoned publishes whose confirmation has
// come (or whose channel closed), oldest first up to the first still
// awaited, and reports whether a publish of id was abandoned on this
// session and its return may still come. Without it a long-lived
// session would keep a mark for every abandoned publish that was routed.
func (s *session) settle(id string) (abandoned bool) {
	s.mu.Lock()
	var confirmed []mark
	for _, m := range s.marks {
		if !isDone(m.dc) {
			break
		}
		confirmed = append(confirmed, m)
	}
	if len(confirmed) == 0 {
		_, abandoned = s.abandoned[id]
		s.mu.Unlock()
		return abandoned
	}
	s.mu.Unlock()
	// The client hands a message's return to the reader before it takes
	// the message's confirmation: once the reader has recorded what it
	// took (dropped it, for the mark), no return of these publishes can
	// come.
	s.sync()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range confirmed {
		// A concurrent settle may have dropped some, from the front.
		if len(s.marks) == 0 || s.marks[0].dc != m.dc {
			continue
		}
		s.marks[0] = mark{}
		s.marks = s.marks[1:]
		if s.abandoned[m.id] == m.dc {
			delete(s.abandoned, m.id)
		}
	}
	_, abandoned = s.abandoned[id]
	return abandoned
}

// isDone reports whether dc has its confirmation, positive or negative.
func isDone(dc *amqp.DeferredConfirmation) bool {
	select {
	case <-dc.Done():
		return true
	default:
		return false
	}
}

// forget drops the record of a message's return, if any.
func (s *session) forget(id string) {
	s.mu.Lock()
	delete(s.returned, id)
	s.mu.Unlock()
}

// uriError describes err, the parse error of the URL raw, without raw's
// password. The parser's message quotes the URL, password and all, and
// pieces of it, such as what it took for the port: in a password with a
// character that ends the URL's authority (/ ? #), the password's
// beginning. So the message is that of the URL with its password
// replaced, which quotes no piece of the password; if that URL parses,
// the fault is in the part replaced, and the message says so. (That part
// may be more than the password: "amqp://host:port/v@x" has none, but
// cannot be told from "amqp://user:pass/word@x".)
func uriError(raw string, err error) string {
	redacted := redactPassword(raw)
	if redacted == raw {
		return err.Error() // no password
	}
	if _, err := amqp.ParseURI(redacted); err != nil {
		return err.Error()
	}
	return fmt.Sprintf("parse %q: the part hidden as xxxxx does not parse (a password's reserved characters, such as / ? # @ %%, must be percent-encoded)", redacted)
}

// redactPassword replaces the password of a URL's user information with
// "xxxxx", also in a URL that does not parse. The user information is
// taken to end at the URL's last "@", past the first "/", "?" or "#",
// which a password that is not percent-encoded may hold.
func redactPassword(raw string) string {
	scheme, rest, ok := strings.Cut(raw, ":")
	if !ok {
		return raw
	}
	slashes := len(rest) - len(strings.TrimLeft(rest, "/"))
	prefix := scheme + ":" + rest[:slashes]
	rest = rest[slashes:]
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return raw
	}
	user, _, hasPassword := strings.Cut(rest[:at], ":")
	if !hasPassword {
		return raw
	}
	return prefix + user + ":xxxxx" + rest[at:]
}
