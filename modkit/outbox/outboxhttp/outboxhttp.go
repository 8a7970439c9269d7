// Package outboxhttp delivers outbox events as signed HTTP webhooks,
// following the Standard Webhooks scheme (https://www.standardwebhooks.com).
//
// Each event is one POST of its payload (Content-Type: application/json)
// with the headers
//
//	webhook-id:        the event id (the same on every redelivery: receivers de-duplicate on it)
//	webhook-timestamp: seconds since the Unix epoch when this attempt was signed
//	webhook-signature: "v1," + base64(HMAC-SHA256(secret, id + "." + timestamp + "." + body))
//
// the event headers (see below), and the event's own headers (the W3C
// trace context among them), except those that HTTP, the scheme or this
// package reserve (Content-Type, Content-Length, Host, hop-by-hop headers,
// webhook-* and outbox-*: an event's header of such a name is not sent)
// and the credentials (Authorization, Proxy-Authorization, Cookie): those
// of the endpoint (the URL's user and password, say) are the Publisher's
// to send, not an event's to replace or forward.
//
// # Event headers
//
// So that one endpoint can receive several topics, and check per-key
// order, every request also names its event (unless
// Config.OmitEventHeaders):
//
//	outbox-namespace:    the event's namespace
//	outbox-topic:        the event's topic
//	outbox-tenant:       the tenant id (a UUID), when the event has one
//	outbox-ordering-key: the ordering key, percent-encoded, when the event has one
//	outbox-ordering-seq: the event's place among the key's events (1, 2, …), with the key
//
// The ordering key is percent-encoded (RFC 3986) so that any key arrives
// unchanged: '%', space, control characters and every byte of a non-ASCII
// character are sent as %XX, other characters as themselves (a key of
// printable ASCII without '%' arrives as it is). Any percent-decoder
// restores it (url.PathUnescape, JavaScript's decodeURIComponent, Python's
// urllib.parse.unquote; not a form decoder, which reads '+' as a space).
// EventOf reads all five back, decoded. The sequence of a key increases
// from one delivered event to the next, but not always by one: an event
// purged or skipped while dead (Admin.PurgeDead, SkipHead) leaves its
// number out, and a dead one replayed after its key went on without it
// arrives after higher numbers. Check that it increases, per key, not
// that it is contiguous; and de-duplicate on the event id first, as a
// redelivery repeats a number.
//
// These headers are NOT signed: the Standard Webhooks signature covers
// webhook-id, webhook-timestamp and the body only, and stays so for
// receivers using any Standard Webhooks library. A valid signature proves
// the body came from the Publisher, not that these headers did: whoever
// can send (or replay) a signed request can change them. A receiver that
// must trust the tenant, the topic or the key should have them put in the
// payload when enqueueing.
//
// # Example
//
//	pub, err := outboxhttp.New(outboxhttp.Config{
//		Endpoint: "https://example.com/hooks/billing",
//		Secret:   "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
//	})
//	defer pub.Close()
//	d, _ := client.NewDispatcher(outbox.DispatcherConfig{}, pub.For(outbox.Topic{Namespace: "billing", Topic: "invoice_paid"}))
//
// # Receiving
//
// A Verifier checks the signature on the receiving side (any Standard
// Webhooks library does too): the three webhook-* headers present, the
// timestamp within 5 minutes (VerifierConfig.Tolerance) of the receiver's
// clock either way, one of the space-separated v1 signatures that of the
// id, timestamp and body under one of its secrets (several during a
// rotation), compared in constant time. Its Middleware does that for an
// http.Handler and answers 401 with the reason otherwise (which the
// Publisher takes as permanent); EventOf then reads the event headers:
//
//	v, err := outboxhttp.NewVerifier(outboxhttp.VerifierConfig{Secrets: []string{secret}})
//	http.Handle("/hooks/shop", v.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
//		ev, err := outboxhttp.EventOf(r.Header) // ev.ID to de-duplicate; ev.Topic, ev.OrderingKey, ev.Sequence
//		body, _ := io.ReadAll(r.Body)           // the payload, verified
//		…
//	})))
//
// # Outcomes
//
// A 2xx response is a delivery. Any other status is a *StatusError: 4xx
// other than 408, 421, 425 and 429 are wrapped in outbox.Permanent (the
// receiver refused the event; retrying sends the same thing again); those
// four, 3xx (redirects are not followed) and 5xx are retried, as are network errors
// and timeouts. Each request is bounded by Config.Timeout. A request that
// can never be sent fails permanently without one: a URL that is not
// absolute http or https with a host (New refuses such an Endpoint), or an
// event header net/http cannot send (a name that is not a token, such as
// x/trace, which the outbox accepts; a value with control characters), or
// one a receiver would not get as it was sent (a value that begins or ends
// with a space or tab, which HTTP drops as optional whitespace; two headers
// whose names differ by letter case alone, which HTTP reads as one).
//
// # Retry-After
//
// A response's Retry-After header (seconds or an HTTP date) is parsed into
// StatusError.RetryAfter, which the dispatcher honours: the retry waits at
// least that long (at most 24h), or its own backoff if that is longer.
package outboxhttp

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// The Standard Webhooks headers.
const (
	HeaderID        = "webhook-id"
	HeaderTimestamp = "webhook-timestamp"
	HeaderSignature = "webhook-signature"
)

// The event headers, set on every request (see the package doc, "Event
// headers"). They are not signed.
const (
	// HeaderNamespace carries the event's namespace.
	HeaderNamespace = "outbox-namespace"
	// HeaderTopic carries the event's topic.
	HeaderTopic = "outbox-topic"
	// HeaderTenant carries the event's tenant id, when it has one.
	HeaderTenant = "outbox-tenant"
	// HeaderOrderingKey carries the event's ordering key, percent-encoded,
	// when it has one.
	HeaderOrderingKey = "outbox-ordering-key"
	// HeaderOrderingSeq carries the event's sequence among the events of
	// its ordering key (1, 2, …), when it has a key.
	HeaderOrderingSeq = "outbox-ordering-seq"
)

// idleConnsPerHost is how many idle connections the Publisher's own client
// keeps per host: more than the dispatcher's default Concurrency.
const idleConnsPerHost = 64

// TimeoutDefault bounds each request when Config.Timeout is zero.
const TimeoutDefault = 10 * time.Second

// Config configures a Publisher.
type Config struct {
	// Endpoint is the URL every event is POSTed to, unless URL is set.
	Endpoint string
	// URL maps an event to the URL it is POSTed to (per tenant, per topic,
	// …). Default: Endpoint for every event.
	URL func(d outbox.Delivery) string
	// Secret signs the requests: base64, optionally prefixed with
	// "whsec_" (the scheme advises 24 to 64 random bytes). Required.
	Secret string
	// Timeout bounds each request, the response body included. Default
	// TimeoutDefault (10s); the publish deadline also bounds it.
	Timeout time.Duration
	// Client sends the requests. Default: a client of its own (closed by
	// Close) that keeps up to 64 idle connections per host. A Client given
	// here is used through a copy that does not follow redirects either
	// (its Transport, Jar and Timeout are shared): a client that follows
	// them turns the POST into a GET on 301–303, whose 2xx would count as
	// a delivery of a payload that never arrived, and re-sends the signed
	// request to wherever a 307 or 308 points.
	Client *http.Client
	// Now is the clock of webhook-timestamp. Default time.Now.
	Now func() time.Time
	// OmitEventHeaders leaves the outbox-* headers out of every request
	// (see the package doc, "Event headers"): for an endpoint outside your
	// control, since proxies and logs keep headers more often than bodies
	// and an ordering key or tenant id may be such a service's business
	// only. The payload is then all the receiver has.
	OmitEventHeaders bool
}

// StatusError is a response other than 2xx.
type StatusError struct {
	// StatusCode of the response.
	StatusCode int
	// Body holds the start of the response body (up to 512 bytes), for
	// logs.
	Body string
	// URL the request went to.
	URL string
	// Location is where a 3xx response pointed (its Location header, with
	// any password redacted): redirects are not followed (see
	// Config.Client), so point the publisher's URL there if it moved.
	Location string

	retryAfter time.Duration
}

// Error names the URL, the status, the delay asked for and the start of
// the body.
func (e *StatusError) Error() string {
	s := fmt.Sprintf("outboxhttp: %s answered %d %s", e.URL, e.StatusCode, http.StatusText(e.StatusCode))
	if e.Location != "" {
		s += fmt.Sprintf(" (a redirect to %s, not followed: if the receiver moved, point the publisher's URL there)", e.Location)
	}
	if e.retryAfter > 0 {
		s += fmt.Sprintf(" (retry after %v)", e.retryAfter.Round(time.Millisecond))
	}
	if e.Body != "" {
		s += ": " + e.Body
	}
	return s
}

// RetryAfter is the delay the response's Retry-After header asked for;
// zero when it had none (or an unreadable one).
func (e *StatusError) RetryAfter() time.Duration { return e.retryAfter }

// Permanent reports whether the status says that retrying cannot help: a
// 4xx other than 408 Request Timeout, 421 Misdirected Request (a proxy or
// CDN that took the connection for another host: another connection may
// do), 425 Too Early and 429 Too Many Requests.
func (e *StatusError) Permanent() bool {
	switch e.StatusCode {
	case http.StatusRequestTimeout, http.StatusMisdirectedRequest, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return e.StatusCode >= 400 && e.StatusCode < 500
}

// ErrRequest matches (errors.Is) failures to get any response: the
// connection, the timeout. They are retried.
var ErrRequest = errors.New("outboxhttp: request failed")

// Signer computes Standard Webhooks signatures with one secret.
type Signer struct{ key []byte }

// NewSigner decodes secret (base64, with or without the "whsec_" prefix).
// Errors match outbox.ErrInvalidConfig.
func NewSigner(secret string) (*Signer, error) {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		return nil, fmt.Errorf("%w: outboxhttp: Secret is not base64 (with an optional whsec_ prefix): %v", outbox.ErrInvalidConfig, err)
	}
	if len(key) == 0 {
		return nil, fmt.Errorf("%w: outboxhttp: Secret is empty", outbox.ErrInvalidConfig)
	}
	return &Signer{key: key}, nil
}

// Sign returns the webhook-signature value of a message: "v1," and the
// base64 HMAC-SHA256 of "id.timestamp.body".
func (s *Signer) Sign(id string, timestamp int64, body []byte) string {
	return "v1," + base64.StdEncoding.EncodeToString(s.mac(id, strconv.FormatInt(timestamp, 10), body))
}

// mac is the HMAC-SHA256 of "id.timestamp.body", timestamp as sent.
func (s *Signer) mac(id, timestamp string, body []byte) []byte {
	mac := hmac.New(sha256.New, s.key)
	mac.Write([]byte(id))
	mac.Write([]byte{'.'})
	mac.Write([]byte(timestamp))
	mac.Write([]byte{'.'})
	mac.Write(body)
	return mac.Sum(nil)
}

// Publisher POSTs outbox events as signed webhooks. It is safe for
// concurrent use.
type Publisher struct {
	signer  *Signer
	url     func(outbox.Delivery) string
	timeout time.Duration
	client  *http.Client
	owned   bool
	now     func() time.Time
	// eventHeaders: set the outbox-* headers (not Config.OmitEventHeaders).
	eventHeaders bool
}

// New returns a Publisher for cfg. Errors match outbox.ErrInvalidConfig.
func New(cfg Config) (*Publisher, error) {
	signer, err := NewSigner(cfg.Secret)
	if err != nil {
		return nil, err
	}
	if cfg.URL == nil {
		if cfg.Endpoint == "" {
			return nil, fmt.Errorf("%w: outboxhttp: set Endpoint or URL", outbox.ErrInvalidConfig)
		}
		if err := checkURL(cfg.Endpoint); err != nil {
			return nil, fmt.Errorf("%w: Endpoint: %w", outbox.ErrInvalidConfig, err)
		}
		endpoint := cfg.Endpoint
		cfg.URL = func(outbox.Delivery) string { return endpoint }
	}
	if cfg.Timeout < 0 {
		return nil, fmt.Errorf("%w: outboxhttp: Timeout is %v; it must not be negative", outbox.ErrInvalidConfig, cfg.Timeout)
	}
	p := &Publisher{signer: signer, url: cfg.URL, timeout: cfg.Timeout, client: cfg.Client, now: cfg.Now, eventHeaders: !cfg.OmitEventHeaders}
	if p.timeout == 0 {
		p.timeout = TimeoutDefault
	}
	if p.now == nil {
		p.now = time.Now
	}
	if p.client == nil {
		p.owned = true
		tr := http.DefaultTransport.(*http.Transport).Clone()
		// The dispatcher publishes concurrently, mostly to one host: keep
		// a connection per publish in flight instead of the default two.
		tr.MaxIdleConnsPerHost = idleConnsPerHost
		p.client = &http.Client{Transport: tr}
	} else {
		c := *p.client
		p.client = &c
	}
	// A redirect is the response: a 3xx StatusError, retried.
	p.client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return p, nil
}

// Close closes the idle connections of the Publisher's own client (not
// those of a Config.Client). Call it once the dispatchers using it have
// stopped.
func (p *Publisher) Close() {
	if p.owned {
		p.client.CloseIdleConnections()
	}
}

// For returns the outbox.Publisher of topic, for NewDispatcher.
func (p *Publisher) For(topic outbox.Topic) outbox.Publisher {
	return outbox.Publisher{Topic: topic, Name: "outboxhttp " + topic.String(), Publish: p.Publish}
}

// reserved are the header names an event's headers may not set.
var reserved = map[string]bool{
	"content-type": true, "content-length": true, "host": true, "connection": true, "keep-alive": true,
	"transfer-encoding": true, "te": true, "trailer": true, "upgrade": true, "expect": true,
	"proxy-authorization": true, "proxy-connection": true, "authorization": true, "cookie": true,
}

// Request builds the signed request of d, timestamped now.
func (p *Publisher) Request(ctx context.Context, d outbox.Delivery) (*http.Request, error) {
	target := p.url(d)
	if err := checkURL(target); err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(d.Payload))
	if err != nil {
		return nil, fmt.Errorf("outboxhttp: URL %q: %w", target, err)
	}
	for k, v := range d.Headers {
		if lk := strings.ToLower(k); !reserved[lk] && !strings.HasPrefix(lk, "webhook-") && !strings.HasPrefix(lk, "outbox-") {
			if !sendableHeader(k, v) {
				return nil, fmt.Errorf("outboxhttp: header %q of event %s cannot be sent over HTTP unchanged (its name must be a token, "+
					"its value free of control characters and of spaces or tabs at either end; change or encode it, e.g. base64)", k, d.ID)
			}
			// HTTP header names are case-insensitive, the outbox's are
			// not: two that differ by case alone would become one.
			if _, dup := req.Header[http.CanonicalHeaderKey(k)]; dup {
				return nil, fmt.Errorf("outboxhttp: headers of event %s differ by letter case alone (%q is one of them), "+
					"which HTTP cannot tell apart; one would be lost: give them distinct names", d.ID, k)
			}
			req.Header.Set(k, v)
		}
	}
	id := d.ID.String()
	ts := p.now().Unix()
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(HeaderID, id)
	req.Header.Set(HeaderTimestamp, strconv.FormatInt(ts, 10))
	req.Header.Set(HeaderSignature, p.signer.Sign(id, ts, d.Payload))
	if p.eventHeaders {
		setEventHeaders(req.Header, d)
	}
	return req, nil
}

// setEventHeaders names d's event in h (see the package doc, "Event
// headers").
func setEventHeaders(h http.Header, d outbox.Delivery) {
	h.Set(HeaderNamespace, d.Namespace)
	h.Set(HeaderTopic, d.Topic)
	if d.TenantID != nil {
		h.Set(HeaderTenant, d.TenantID.String())
	}
	if d.OrderingKey != "" {
		h.Set(HeaderOrderingKey, encodeKey(d.OrderingKey))
		h.Set(HeaderOrderingSeq, strconv.FormatInt(d.Sequence, 10))
	}
}

// encodeKey percent-encodes the bytes of an ordering key that a header
// value cannot carry unchanged (space, control characters, non-ASCII), and
// '%' itself so that decoding is unambiguous.
func encodeKey(k string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := range len(k) {
		if c := k[i]; c == '%' || c <= ' ' || c >= 0x7f {
			b.Write([]byte{'%', hex[c>>4], hex[c&0xf]})
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}

// Publish POSTs d and classifies the response (see the package doc).
func (p *Publisher) Publish(ctx context.Context, d outbox.Delivery) error {
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	req, err := p.Request(ctx, d)
	if err != nil {
		return outbox.Permanent(err) // the URL or a header cannot be used, now or later
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRequest, err)
	}
	defer resp.Body.Close()
	head, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // so the connection can be reused
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return nil
	}
	serr := &StatusError{StatusCode: resp.StatusCode, Body: strings.TrimSpace(string(head)), URL: req.URL.Redacted(),
		retryAfter: parseRetryAfter(resp.Header.Get("Retry-After"), p.now())}
	if resp.StatusCode >= 300 && resp.StatusCode < 400 {
		if loc, err := resp.Location(); err == nil {
			serr.Location = loc.Redacted()
		}
	}
	if serr.Permanent() {
		return outbox.Permanent(serr)
	}
	return serr
}

// parseRetryAfter reads delay-seconds or an HTTP date; zero if neither.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	secs, err := strconv.ParseInt(v, 10, 64)
	if errors.Is(err, strconv.ErrRange) && !strings.HasPrefix(v, "-") {
		secs, err = math.MaxInt64, nil // more seconds than an int64 holds: capped below
	}
	if err == nil {
		if secs <= 0 {
			return 0
		}
		return time.Duration(min(secs, int64(24*time.Hour/time.Second))) * time.Second
	}
	if at, err := http.ParseTime(v); err == nil && at.After(now) {
		return at.Sub(now)
	}
	return 0
}

// checkURL refuses a URL a request cannot be sent to: one that does not
// parse, or is not absolute http or https with a host.
// Its messages leave the URL's password out (New's errors are not redacted
// the way the dispatcher redacts publish errors).
func checkURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err // its message quotes the URL, credentials and all
		}
		return fmt.Errorf("outboxhttp: the URL does not parse: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("outboxhttp: URL %q is not an absolute http or https URL with a host", u.Redacted())
	}
	return nil
}

// sendableHeader reports whether net/http sends the header name: value
// and a receiver reads the value as sent: a name of token characters and a
// value without control characters but tab, and without space or tab at
// either end (optional whitespace, which receivers drop; RFC 9110 5.5).
// (The outbox accepts more, such as x/trace.)
func sendableHeader(name, value string) bool {
	if name == "" {
		return false
	}
	for i := range len(name) {
		if b := name[i]; b <= ' ' || b >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, b) >= 0 {
			return false
		}
	}
	if value != strings.Trim(value, " \t") {
		return false
	}
	for i := range len(value) {
		if b := value[i]; (b < ' ' && b != '\t') || b == 0x7f {
			return false
		}
	}
	return true
}
