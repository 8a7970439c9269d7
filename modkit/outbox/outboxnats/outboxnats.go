// Package outboxnats publishes outbox events to NATS JetStream.
//
// Each event becomes one JetStream message on a subject derived from its
// namespace and topic ("<namespace>.<topic>" unless Config.Subject says
// otherwise), with the payload as data, the event's headers as NATS
// headers, and the event id as Nats-Msg-Id. Nothing else of the event
// reaches the consumer: not its tenant, dedupe key, ordering key,
// sequence or creation time; a consumer that needs one must have it put in
// the headers or the payload when the event is enqueued. (Events of one
// ordering key are published one at a time, in order, but the key is not
// on the message.) JetStream drops a message whose
// Nats-Msg-Id it has already stored within the stream's duplicate window
// (Duplicates, two minutes by default), so an event that the outbox
// delivers again after a crash or a lost outcome is stored once as long as
// the redelivery falls inside that window: size the window to cover the
// dispatcher's LeaseDuration plus its retry backoff.
//
// # Example
//
//	nc, _ := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectBufSize(-1), nats.FlusherTimeout(5*time.Second))
//	js, _ := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
//	pub, _ := outboxnats.New(js, outboxnats.Config{})
//	d, _ := client.NewDispatcher(outbox.DispatcherConfig{}, pub.For(outbox.Topic{Namespace: "billing", Topic: "invoice_paid"}))
//
// # Acknowledgements and batching
//
// A publish returns nil only once JetStream has acknowledged the message
// (stored it in a stream). Messages are sent with the asynchronous
// publish API, so the dispatcher's concurrent publishes share the
// connection and their acknowledgements are awaited together instead of
// one round trip after another; each call still waits for its own ack (or
// its context's end) before it returns. Give the JetStream context a
// PublishAsyncTimeout (jetstream.WithPublishAsyncTimeout): nats.go keeps an
// acknowledgement that never comes pending until then, beyond the end of
// the publish that awaited it (a subject on which a plain subscriber
// suppresses the server's "no responders" answer, say), and once
// jetstream.WithPublishAsyncMaxPending of them (4,000 by default) are
// pending, every publish on the context fails with ErrTooManyStalledMsgs,
// every topic's.
//
// # Reconnecting
//
// A NATS connection gives up reconnecting after nats.MaxReconnects
// attempts (60 by default, two seconds apart) and is closed for good: each
// publish then fails, and every event is dead-lettered after its attempts,
// until the process restarts. New therefore refuses a connection that
// would give up within an hour, or that limits its attempts and spaces
// them with nats.CustomReconnectDelay (New cannot tell how long they
// last); connect with nats.MaxReconnects(-1).
//
// While the connection is down (reconnecting, or not connected yet with
// nats.RetryOnFailedConnect), Publish sends nothing and fails at once with
// ErrNotConnected, to retry. nats.go would otherwise keep the message in
// its reconnect buffer (nats.ReconnectBufSize, 8 MB by default) and send
// it once reconnected, whatever had become of the attempt meanwhile: timed
// out and retried, or dead-lettered and purged as an event that must never
// be published. A publish made just as the connection drops can still
// land in that buffer and be sent later, like a publish whose ack was
// lost; connect with nats.ReconnectBufSize(-1) to have nats.go refuse it
// instead (it then refuses every publish on the connection while
// reconnecting, which matters only to other users of the connection).
//
// nats.go writes to the socket without the publish's context: once its
// buffer is full, a publish (and every other one on the connection) waits
// for the write for up to the connection's FlusherTimeout, a minute by
// default, past the dispatcher's publish deadline (LeaseDuration less
// LeaseHeadroom, 25 s by default) if the network stalls. Give the
// connection a shorter one (nats.FlusherTimeout(5*time.Second), say).
//
// # Outages
//
// An outage fails each attempt at once, and the outbox dead-letters an
// event once its attempts are spent, however long the connection keeps
// reconnecting: with the dispatcher's defaults (MaxAttempts 10, Retry's
// BaseDelay 1s and MaxDelay 5m) the nine backoffs between them add up to
// about 4 to 9 minutes. To ride out longer outages, raise
// DispatcherConfig.MaxAttempts: each attempt past the tenth adds a
// backoff of Retry.MaxDelay/2 to Retry.MaxDelay (2½ to 5 minutes by
// default), so MaxAttempts 30 rides out at least 50 minutes; raising
// Retry.MaxDelay lengthens those backoffs, not the first nine (at most
// 256 s, under the default MaxDelay). Events dead-lettered by an outage
// can be replayed once it is over (Admin.ReplayDead). The dispatcher's
// Health reports a topic whose last three or more publishes failed, and
// the failed publishes show in its log, in the events' last_error (naming
// ErrNotConnected's "the NATS connection is down") and in the
// outbox.events.retried and outbox.events.dead metrics.
//
// # Failures
//
// A subject no stream listens on, a full stream, a lost connection or a
// missing ack are returned as errors to retry; an error met while the
// connection is down, or because it dropped, wraps ErrNotConnected and
// says so. A message over the server's
// maximum payload or its stream's maximum message size, or a subject that
// NATS refuses, is returned wrapped in outbox.Permanent, since no retry
// can change it. A subject with an empty token (the outbox's names may end
// in '.': "billing." / "x" gives "billing..x"), a wildcard token or white
// space is refused before sending, permanently too: no stream could store
// it, and the server's answer would be a timeout to retry. So is a publish
// to a sealed stream, which never takes a message again.
//
// A stream configured with NoAck stores messages without acknowledging
// them: every publish to it waits for its PublishAsyncTimeout (or its
// deadline) and fails, to be retried and in the end dead-lettered, though
// the message is stored. Do not publish to such a stream.
//
// # Headers
//
// The outbox hands a publisher an event's headers unchanged, and they
// reach the stream unchanged or the event is not published: nats.go trims
// the spaces and tabs at the start and end of a header value and turns the
// CR and LF characters inside one into spaces, and refuses header names
// with any of "()/,:;<=>?@[\]{}, all of which the outbox accepts. Publish
// refuses such an event before sending it, with a *HeaderError naming the
// header wrapped in outbox.Permanent, so that it is dead-lettered rather
// than stored altered; encode such values (base64, say) when enqueueing.
// Headers whose names begin with "Nats-" are left out (see Msg) and not
// checked.
package outboxnats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// Config configures a Publisher. The zero Config is valid.
type Config struct {
	// Subject maps an event to the subject it is published on. Default:
	// DefaultSubject.
	Subject func(d outbox.Delivery) string
}

// DefaultSubject is "<namespace>.<topic>", e.g. "billing.invoice_paid".
// The outbox's names may contain '.', which NATS reads as a token
// separator: "a.b" / "c" gives "a.b.c", to be matched with wildcards
// accordingly.
func DefaultSubject(d outbox.Delivery) string { return d.Namespace + "." + d.Topic }

// Header names set on every message besides the event's own headers.
const (
	// HeaderMsgID carries the event id; JetStream de-duplicates on it.
	HeaderMsgID = jetstream.MsgIDHeader
)

// ErrNotAcknowledged is returned (wrapped) when JetStream did not
// acknowledge a message: the publish is retried unless the error is
// permanent.
var ErrNotAcknowledged = errors.New("outboxnats: message not acknowledged by JetStream")

// ErrNotConnected is returned (wrapped) when the NATS connection is down
// (reconnecting, not connected yet, draining or closed), to retry. Found
// down before sending, Publish sends nothing; lost before JetStream's ack
// came, the message may have been stored (the error then also wraps
// ErrNotAcknowledged). The error names the connection's status.
var ErrNotConnected = errors.New("the NATS connection is down")

// HeaderError is an event header that NATS cannot carry unchanged: a name
// it refuses, or a value it would alter. Publish returns it wrapped in
// outbox.Permanent without sending the message.
type HeaderError struct {
	// Name is the header's name.
	Name string
	// Reason says what NATS would do with the header.
	Reason string
}

// Error names the header, says what NATS would do with it and what to do
// instead. It leaves the value out, which may be confidential.
func (e *HeaderError) Error() string {
	return fmt.Sprintf("outboxnats: header %q: %s; the outbox carries headers unchanged, so the event is not published: "+
		"enqueue it with the header renamed, or its value encoded (base64, say)", e.Name, e.Reason)
}

// headerNameRefused lists the printable ASCII characters that nats.go
// refuses in header names and the outbox accepts.
const headerNameRefused = `"()/,:;<=>?@[\]{}`

// checkHeaders returns the *HeaderError of the first header of h, by name,
// that NATS would refuse or alter (names beginning with "Nats-" aside:
// Msg leaves them out), or nil.
func checkHeaders(h map[string]string) error {
	var bad *HeaderError
	for k, v := range h {
		if isJetStreamHeader(k) || (bad != nil && k > bad.Name) {
			continue
		}
		var reason string
		switch {
		case strings.ContainsAny(k, headerNameRefused):
			reason = "NATS refuses header names with any of these characters: " + strings.Join(strings.Split(headerNameRefused, ""), " ")
		case strings.ContainsAny(v, "\r\n"):
			reason = "NATS would turn the CR and LF characters in its value into spaces"
		case v != "" && (isSpaceOrTab(v[0]) || isSpaceOrTab(v[len(v)-1])):
			reason = "NATS would trim the spaces and tabs at the start and end of its value"
		default:
			continue
		}
		bad = &HeaderError{Name: k, Reason: reason}
	}
	if bad == nil {
		return nil
	}
	return bad
}

// isSpaceOrTab reports whether b is one of the bytes nats.go trims from
// the ends of a header value (CR and LF aside, which it also replaces).
func isSpaceOrTab(b byte) bool { return b == ' ' || b == '\t' }

// isJetStreamHeader reports whether name begins with "Nats-", in any case.
func isJetStreamHeader(name string) bool {
	return len(name) >= 5 && strings.EqualFold(name[:5], "nats-")
}

// Publisher publishes outbox events to JetStream. It is safe for concurrent
// use and holds no resources of its own: close the NATS connection when
// done.
type Publisher struct {
	js      jetstream.JetStream
	nc      *nats.Conn // js's connection; nil if js does not tell
	subject func(outbox.Delivery) string
}

// New returns a Publisher that publishes through js. It refuses
// (ErrInvalidConfig) a connection that is closed or that gives up
// reconnecting within an hour (or may: one whose nats.CustomReconnectDelay
// spaces a limited number of attempts): either would dead-letter every
// event.
func New(js jetstream.JetStream, cfg Config) (*Publisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: outboxnats: the JetStream context is nil", outbox.ErrInvalidConfig)
	}
	if nc := js.Conn(); nc != nil {
		if nc.IsClosed() {
			return nil, fmt.Errorf("%w: outboxnats: the NATS connection is closed, and a closed connection never publishes again "+
				"(every event would be dead-lettered after its attempts): pass the JetStream context of an open connection, "+
				"and close it after the dispatcher has stopped", outbox.ErrInvalidConfig)
		}
		if reason := givesUp(nc.Opts); reason != "" {
			return nil, fmt.Errorf("%w: outboxnats: the NATS connection %s, and a closed connection never publishes again "+
				"(every event would be dead-lettered after its attempts): connect with nats.MaxReconnects(-1)", outbox.ErrInvalidConfig, reason)
		}
	}
	if cfg.Subject == nil {
		cfg.Subject = DefaultSubject
	}
	return &Publisher{js: js, nc: js.Conn(), subject: cfg.Subject}, nil
}

// givesUp says how a connection with options o may give up reconnecting
// within minReconnecting (and so be closed for good), or returns "".
func givesUp(o nats.Options) string {
	switch {
	case !o.AllowReconnect:
		return "does not reconnect (nats.NoReconnect)"
	case o.MaxReconnect < 0:
		return ""
	case o.CustomReconnectDelayCB != nil:
		// Its delays are the callback's: how long the attempts last cannot
		// be told from here.
		return fmt.Sprintf("gives up after %d reconnect attempts, spaced by its nats.CustomReconnectDelay callback, "+
			"so New cannot tell whether it keeps trying for an hour", o.MaxReconnect)
	case time.Duration(o.MaxReconnect)*o.ReconnectWait < minReconnecting:
		return fmt.Sprintf("gives up reconnecting within an hour (%d attempts %v apart)", o.MaxReconnect, o.ReconnectWait)
	}
	return ""
}

// minReconnecting is how long a connection must keep trying to reconnect
// for New to take it.
const minReconnecting = time.Hour

// For returns the outbox.Publisher of topic, for NewDispatcher.
func (p *Publisher) For(topic outbox.Topic) outbox.Publisher {
	return outbox.Publisher{Topic: topic, Name: "outboxnats " + topic.String(), Publish: p.Publish}
}

// Msg builds the JetStream message of d: its subject, payload, headers and
// Nats-Msg-Id. Event headers whose names begin with "Nats-" (any case) are
// left out: JetStream reads those as instructions (Nats-Rollup,
// Nats-Expected-*, Nats-TTL, …), which an event must not be able to give.
// Msg does not check the other headers; Publish refuses an event with one
// that NATS would refuse or alter (see HeaderError).
func (p *Publisher) Msg(d outbox.Delivery) *nats.Msg {
	m := nats.NewMsg(p.subject(d))
	m.Data = d.Payload
	for k, v := range d.Headers {
		if isJetStreamHeader(k) {
			continue
		}
		m.Header.Set(k, v)
	}
	m.Header.Set(HeaderMsgID, d.ID.String())
	return m
}

// Publish sends d and waits for JetStream's acknowledgement or the end of
// ctx. A duplicate acknowledged as such (already stored under the same
// Nats-Msg-Id) is a success. An event with a header that NATS would refuse
// or alter is not sent: Publish returns its *HeaderError wrapped in
// outbox.Permanent.
func (p *Publisher) Publish(ctx context.Context, d outbox.Delivery) error {
	if err := checkHeaders(d.Headers); err != nil {
		return outbox.Permanent(err)
	}
	m := p.Msg(d)
	if !publishableSubject(m.Subject) {
		return outbox.Permanent(fmt.Errorf("outboxnats: subject %q, not sent: %w: an empty token, a wildcard or white space, "+
			"which no stream can store (Config.Subject maps the event's names to it)", m.Subject, nats.ErrBadSubject))
	}
	if err := ctx.Err(); err != nil { // a stopping dispatcher's: nothing to send
		return fmt.Errorf("%w: subject %q: %w", ErrNotAcknowledged, m.Subject, context.Cause(ctx))
	}
	// Not connected, nats.go would queue the message in its reconnect
	// buffer and send it once reconnected, whatever became of this attempt
	// meanwhile (timed out, retried, dead-lettered, purged): send nothing.
	if p.nc != nil {
		if st := p.nc.Status(); st != nats.CONNECTED {
			return notConnected(m.Subject, st)
		}
	}
	fut, err := p.js.PublishMsgAsync(m)
	if err != nil {
		return p.classify(m.Subject, err)
	}
	select {
	case <-fut.Ok():
		return nil
	case err := <-fut.Err():
		return p.classify(m.Subject, err)
	case <-ctx.Done():
		return fmt.Errorf("%w: subject %q: %w", ErrNotAcknowledged, m.Subject, context.Cause(ctx))
	}
}

// publishableSubject reports whether a message can be published on s:
// dot-separated tokens, none empty, none a wildcard (* or >), no white
// space.
func publishableSubject(s string) bool {
	for tok := range strings.SplitSeq(s, ".") {
		if tok == "" || tok == "*" || tok == ">" || strings.ContainsAny(tok, " \t\r\n") {
			return false
		}
	}
	return true
}

// notConnected is the error of a publish not sent because the connection's
// status is st, not CONNECTED.
func notConnected(subject string, st nats.Status) error {
	var what string
	switch st {
	case nats.CLOSED:
		what = "a closed connection never publishes again: close it only after the dispatcher has stopped"
	case nats.DRAINING_SUBS, nats.DRAINING_PUBS:
		what = "a draining connection is closing: drain it only after the dispatcher has stopped"
	default:
		what = "the attempt is retried after its backoff; check that the NATS server is up and reachable"
	}
	return fmt.Errorf("outboxnats: subject %q: %w (status %s): nothing was sent; %s", subject, ErrNotConnected, st, what)
}

// status is the connection's status, CONNECTED if js does not tell.
func (p *Publisher) status() nats.Status {
	if p.nc == nil {
		return nats.CONNECTED
	}
	return p.nc.Status()
}

// classify wraps the error of a message sent (or refused by nats.go) on
// subject: permanent when no retry can change it.
func (p *Publisher) classify(subject string, err error) error {
	if errors.Is(err, jetstream.ErrNoStreamResponse) {
		// The server answers "no responders" when no stream's subjects
		// take the subject; retried, as the stream may be created.
		err = fmt.Errorf("%w (does a stream capture this subject? check the streams' subjects, or Config.Subject)", err)
	}
	// An outage's errors ("server is disconnected", "outbound buffer limit
	// exceeded", "timeout waiting for ack", …) say that it is one.
	if st := p.status(); errors.Is(err, nats.ErrDisconnected) {
		err = fmt.Errorf("%w (it dropped before JetStream's ack came, so the message may be stored, and JetStream drops "+
			"the copy a retry sends within its duplicate window; status now %s): %w", ErrNotConnected, st, err)
	} else if st != nats.CONNECTED {
		err = fmt.Errorf("%w (status %s): %w", ErrNotConnected, st, err)
	}
	err = fmt.Errorf("%w: subject %q: %w", ErrNotAcknowledged, subject, err)
	if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum) ||
		errors.Is(err, nats.ErrBadSubject) || errors.Is(err, nats.ErrBadHeaderMsg) {
		return outbox.Permanent(err)
	}
	if errors.Is(err, errStreamSealed) {
		return outbox.Permanent(fmt.Errorf("%w (a sealed stream never stores a message again: have another stream capture "+
			"the subject, once the sealed one is deleted, or map the event elsewhere with Config.Subject; then replay the "+
			"dead event)", err))
	}
	return err
}

// errStreamSealed matches the JetStream API error of a publish to a sealed
// stream (JSStreamSealedErr, "invalid operation on sealed stream"), which
// jetstream does not export. A sealed stream cannot be unsealed.
var errStreamSealed = &jetstream.APIError{ErrorCode: 10109}
