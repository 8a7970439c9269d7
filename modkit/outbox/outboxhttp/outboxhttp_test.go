package outboxhttp_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxhttp"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

var ctx = context.Background()

const (
	secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	urlEnv = "OUTBOXHTTP_TEST_URL" // the receiver, for the crash child
)

// receiver is a webhook endpoint that checks every request's Standard
// Webhooks signature (computed here independently of the package) and
// counts the accepted ones by webhook-id.
type receiver struct {
	t   testing.TB
	key []byte

	mu       sync.Mutex
	byID     map[uuid.UUID]int
	requests []*http.Request
	bodies   [][]byte
	rejected int
}

func newReceiver(t testing.TB) (*receiver, *httptest.Server) {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		t.Fatal(err)
	}
	r := &receiver{t: t, key: key, byID: map[uuid.UUID]int{}}
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	return r, srv
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if msg := rc.verify(r.Header, body); msg != "" {
		rc.mu.Lock()
		rc.rejected++
		rc.mu.Unlock()
		rc.t.Errorf("receiver: %s", msg)
		http.Error(w, msg, http.StatusUnauthorized)
		return
	}
	id := uuid.MustParse(r.Header.Get("webhook-id"))
	rc.mu.Lock()
	rc.byID[id]++
	rc.requests = append(rc.requests, r)
	rc.bodies = append(rc.bodies, body)
	rc.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

// verify checks the signature and the timestamp (within five minutes).
func (rc *receiver) verify(h http.Header, body []byte) string {
	id, ts, sigs := h.Get("webhook-id"), h.Get("webhook-timestamp"), h.Get("webhook-signature")
	secs, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return "bad webhook-timestamp " + ts
	}
	if d := time.Since(time.Unix(secs, 0)); d > 5*time.Minute || d < -5*time.Minute {
		return "webhook-timestamp out of tolerance"
	}
	mac := hmac.New(sha256.New, rc.key)
	mac.Write([]byte(id + "." + ts + "." + string(body)))
	want := mac.Sum(nil)
	for _, s := range strings.Fields(sigs) {
		v, sig, ok := strings.Cut(s, ",")
		if !ok || v != "v1" {
			continue
		}
		got, err := base64.StdEncoding.DecodeString(sig)
		if err == nil && hmac.Equal(got, want) {
			return ""
		}
	}
	return "no valid signature in " + sigs
}

func newPublisher(t testing.TB, cfg outboxhttp.Config) *outboxhttp.Publisher {
	t.Helper()
	if cfg.Secret == "" {
		cfg.Secret = secret
	}
	p, err := outboxhttp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// TestCrashChild is the dispatcher process of TestDeliveredThroughSIGKILL.
func TestCrashChild(t *testing.T) {
	brokertest.Child(t, func(t testing.TB) outbox.Publisher {
		return newPublisher(t, outboxhttp.Config{Endpoint: os.Getenv(urlEnv)}).For(brokertest.Topic)
	})
}

// TestDeliveredThroughSIGKILL delivers 10,000 events (3,000 under -race; BROKERTEST_EVENTS)
// as webhooks with a dispatcher process SIGKILLed a third of the way, then
// a survivor: every request is correctly signed, every event arrived, and
// one arrived twice only if the outbox published it more than once
// (receivers de-duplicate on webhook-id).
func TestDeliveredThroughSIGKILL(t *testing.T) {
	rc, srv := newReceiver(t)
	c, db := outboxtest.NewClient(t, outbox.Config{})
	n := brokertest.Events(t)
	ids := brokertest.Enqueue(t, c, db, n)

	calls := brokertest.RunCrash(t, c, db, n, brokertest.Crash{ChildTest: "TestCrashChild", Env: []string{urlEnv + "=" + srv.URL}},
		newPublisher(t, outboxhttp.Config{Endpoint: srv.URL}).For(brokertest.Topic))

	rc.mu.Lock()
	got := rc.byID
	for i, r := range rc.requests {
		var p struct{ N int }
		if err := json.Unmarshal(rc.bodies[i], &p); err != nil {
			t.Fatal(err)
		}
		if seq := r.Header.Get("x-seq"); seq != strconv.Itoa(p.N) {
			t.Fatalf("request %s: x-seq %q, body n %d", r.Header.Get("webhook-id"), seq, p.N)
		}
	}
	rc.mu.Unlock()
	brokertest.Check(t, ids, got, calls, false)
}

// TestSignatureVector reproduces the Standard Webhooks reference vector,
// with and without the whsec_ prefix.
func TestSignatureVector(t *testing.T) {
	for _, s := range []string{secret, strings.TrimPrefix(secret, "whsec_")} {
		signer, err := outboxhttp.NewSigner(s)
		if err != nil {
			t.Fatal(err)
		}
		got := signer.Sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, []byte(`{"test": 2432232314}`))
		if want := "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="; got != want {
			t.Errorf("secret %q: signature %s, want %s", s, got, want)
		}
	}
	for _, bad := range []string{"", "whsec_", "whsec_not base64!"} {
		if _, err := outboxhttp.New(outboxhttp.Config{Endpoint: "http://x", Secret: bad}); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Errorf("secret %q: got %v, want ErrInvalidConfig", bad, err)
		}
	}
	if _, err := outboxhttp.New(outboxhttp.Config{Secret: secret}); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Errorf("no endpoint: got %v, want ErrInvalidConfig", err)
	}
	for _, bad := range []string{"example.com/hook", "ftp://example.com/hook", "http://", "://x", "ftp://user:s3cr3t@example.com/", "http://user:s3cr3t@host:port/"} {
		_, err := outboxhttp.New(outboxhttp.Config{Endpoint: bad, Secret: secret})
		if !errors.Is(err, outbox.ErrInvalidConfig) || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("endpoint %q: got %v, want ErrInvalidConfig without the password", bad, err)
		}
	}
}

// A request that can never be sent fails permanently, without a request:
// a URL from Config.URL that is not absolute http(s), or an event header
// that net/http refuses (the outbox accepts names such as x/trace) or that
// a receiver would read changed (a space or tab at either end of a value).
func TestUnsendableIsPermanent(t *testing.T) {
	var target string
	p := newPublisher(t, outboxhttp.Config{URL: func(outbox.Delivery) string { return target }})
	for _, tc := range []struct {
		url     string
		headers map[string]string
	}{
		{"", nil},
		{"example.com/hook", nil},
		{"http://", nil},
		{"http://127.0.0.1:1/hook", map[string]string{"x/trace": "1"}},
		{"http://127.0.0.1:1/hook", map[string]string{"x-note": "two\nlines"}},
		{"http://127.0.0.1:1/hook", map[string]string{"x-note": " lead"}},
		{"http://127.0.0.1:1/hook", map[string]string{"x-note": "trail\t"}},
		{"http://127.0.0.1:1/hook", map[string]string{"x-tenant": "alpha", "X-Tenant": "beta"}}, // one HTTP header
	} {
		target = tc.url
		err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`), Headers: tc.headers})
		if !outbox.IsPermanent(err) {
			t.Errorf("URL %q, headers %v: got %v, want a permanent error", tc.url, tc.headers, err)
		}
	}
}

// TestRequest: a delivered event's request carries the payload, the
// scheme's headers and the event's headers (not those it may not set).
func TestRequest(t *testing.T) {
	rc, srv := newReceiver(t)
	c, db := outboxtest.NewClient(t, outbox.Config{})
	res, err := c.Enqueue(ctx, db.Provider.Pool, outbox.Message{Namespace: "test", Topic: "events",
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
			"x-custom": "yes", "x-inner": "a  b\tc", "webhook-id": "forged", "content-type": "text/plain",
			"Authorization": "Bearer from-the-event", "cookie": "session=from-the-event"},
		Payload: json.RawMessage(`{"hello":"world"}`)})
	if err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, outboxhttp.Config{URL: func(d outbox.Delivery) string {
		u, _ := url.Parse(srv.URL + "/hooks/" + d.Namespace + "/" + d.Topic)
		u.User = url.UserPassword("hook", "secret") // the endpoint's credentials, not the event's
		return u.String()
	}})
	outboxtest.Drain(t, c, p.For(brokertest.Topic))
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.requests) != 1 {
		t.Fatalf("%d requests, want 1", len(rc.requests))
	}
	r := rc.requests[0]
	if r.Method != http.MethodPost || r.URL.Path != "/hooks/test/events" {
		t.Errorf("%s %s, want POST /hooks/test/events", r.Method, r.URL.Path)
	}
	h := r.Header
	if h.Get("webhook-id") != res.ID.String() || h.Get("content-type") != "application/json" ||
		h.Get("x-custom") != "yes" || h.Get("x-inner") != "a  b\tc" || !strings.HasPrefix(h.Get("traceparent"), "00-4bf92f3577b34da6a3ce929d0e0e4736-") {
		t.Errorf("headers %v", h)
	}
	if user, pass, ok := r.BasicAuth(); !ok || user != "hook" || pass != "secret" || h.Get("cookie") != "" {
		t.Errorf("credentials: Authorization %q, Cookie %q; want the endpoint's basic auth and no cookie", h.Get("authorization"), h.Get("cookie"))
	}
	var body map[string]string
	if err := json.Unmarshal(rc.bodies[0], &body); err != nil || body["hello"] != "world" {
		t.Errorf("body %s", rc.bodies[0])
	}
}

// The delay a Retry-After date asks for is printed to the millisecond:
// the clock's nanoseconds made it "retry after 1m29.876543211s".
func TestRetryAfterPrintedToTheMillisecond(t *testing.T) {
	at := time.Date(2026, 11, 23, 12, 1, 30, 0, time.UTC)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", at.Format(http.TimeFormat))
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(srv.Close)
	now := time.Date(2026, 11, 23, 12, 0, 0, 123456789, time.UTC)
	p := newPublisher(t, outboxhttp.Config{URL: func(outbox.Delivery) string { return srv.URL }, Now: func() time.Time { return now }})
	err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)})
	if err == nil || !strings.Contains(err.Error(), "(retry after 1m29.877s)") {
		t.Fatalf("publish to a 503 with a Retry-After date: %v, want the delay to the millisecond", err)
	}
}

// TestStatuses: 2xx succeeds; 4xx other than 408, 421, 425 and 429 is
// permanent; those, 5xx and 3xx are retried; Retry-After is read in
// seconds (more than an int64 holds: the cap) and as
// a date.
func TestStatuses(t *testing.T) {
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		code, _ := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/"))
		if ra := r.URL.Query().Get("retry-after"); ra != "" {
			w.Header().Set("Retry-After", ra)
		}
		if code >= 300 && code < 400 {
			w.Header().Set("Location", "/200")
		}
		w.WriteHeader(code)
		_, _ = io.WriteString(w, "status body")
	}))
	t.Cleanup(srv.Close)
	var path string
	p := newPublisher(t, outboxhttp.Config{URL: func(outbox.Delivery) string { return srv.URL + path }, Now: func() time.Time { return now }})
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}
	cases := []struct {
		path       string
		ok, perm   bool
		retryAfter time.Duration
	}{
		{"/200", true, false, 0},
		{"/204", true, false, 0},
		{"/400", false, true, 0},
		{"/401", false, true, 0},
		{"/404", false, true, 0},
		{"/410", false, true, 0},
		{"/422", false, true, 0},
		{"/408", false, false, 0},
		{"/421", false, false, 0},
		{"/425", false, false, 0},
		{"/429?retry-after=99999999999999999999", false, false, 24 * time.Hour},
		{"/429?retry-after=7", false, false, 7 * time.Second},
		{"/503?retry-after=" + strings.ReplaceAll(now.Add(90*time.Second).Format(http.TimeFormat), " ", "%20"), false, false, 90 * time.Second},
		{"/500", false, false, 0},
		{"/302", false, false, 0},
	}
	for _, tc := range cases {
		path = tc.path
		err := p.Publish(ctx, d)
		if tc.ok {
			if err != nil {
				t.Errorf("%s: %v", tc.path, err)
			}
			continue
		}
		var se *outboxhttp.StatusError
		if !errors.As(err, &se) {
			t.Errorf("%s: got %v, want a *StatusError", tc.path, err)
			continue
		}
		if outbox.IsPermanent(err) != tc.perm || se.RetryAfter() != tc.retryAfter || se.Body != "status body" {
			t.Errorf("%s: %v: permanent %v retry-after %v; want %v %v", tc.path, err, outbox.IsPermanent(err), se.RetryAfter(), tc.perm, tc.retryAfter)
		}
	}
}

// A Config.Client that follows redirects (the http.Client default) does
// not follow them for the Publisher either: a 302 (which such a client
// turned into a GET of the Location, whose 200 counted as a delivery of a
// payload that never arrived) and a 307 (which re-sent the signed request)
// are StatusErrors to retry, and the receiver saw one POST each. The
// client given is left as it was.
func TestOwnClientDoesNotFollowRedirects(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path)
		mu.Unlock()
		if code, err := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/")); err == nil && code >= 300 {
			w.Header().Set("Location", "/elsewhere")
			w.WriteHeader(code)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	client := &http.Client{Timeout: 5 * time.Second}
	var path string
	p := newPublisher(t, outboxhttp.Config{URL: func(outbox.Delivery) string { return srv.URL + path }, Client: client})
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}
	for _, code := range []string{"302", "307"} {
		path = "/" + code
		err := p.Publish(ctx, d)
		var se *outboxhttp.StatusError
		if !errors.As(err, &se) || strconv.Itoa(se.StatusCode) != code || outbox.IsPermanent(err) {
			t.Fatalf("%s: %v, want a StatusError %s to retry", code, err, code)
		}
		if se.Location != srv.URL+"/elsewhere" || !strings.Contains(err.Error(), "a redirect to "+srv.URL+"/elsewhere, not followed") {
			t.Fatalf("%s: %v (Location %q), want it to say where the redirect pointed", code, err, se.Location)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{"POST /302", "POST /307"}; !slices.Equal(seen, want) {
		t.Fatalf("the receiver saw %q, want %q", seen, want)
	}
	if client.CheckRedirect != nil {
		t.Fatal("the Client given was changed")
	}
}

// TestTimeout: a receiver that does not answer within Timeout fails the
// publish with an error to retry.
func TestTimeout(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	p := newPublisher(t, outboxhttp.Config{Endpoint: srv.URL, Timeout: 50 * time.Millisecond})
	err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)})
	if !errors.Is(err, outboxhttp.ErrRequest) || !errors.Is(err, context.DeadlineExceeded) || outbox.IsPermanent(err) {
		t.Fatalf("got %v, want ErrRequest with DeadlineExceeded, to retry", err)
	}
}

// TestEventHeaders: every request names its event (namespace, topic, and
// the tenant, ordering key and sequence when it has them), the ordering
// key percent-encoded so that any key arrives (EventOf decodes it), and an
// event's own outbox-* headers do not replace them.
func TestEventHeaders(t *testing.T) {
	rc, srv := newReceiver(t)
	c, db := outboxtest.NewClient(t, outbox.Config{})
	tenant := uuid.New()
	const key = "clé 42\t%2F/+x\x01" // non-ASCII, space, tab, '%', '+', a control character
	forged := map[string]string{"outbox-topic": "forged", "Outbox-Ordering-Seq": "999", "OUTBOX-TENANT": tenant.String() + "0",
		"outbox-other": "reserved", "x-keep": "yes"}
	want := map[uuid.UUID]outboxhttp.EventInfo{}
	for _, m := range []outbox.Message{
		{TenantID: &tenant, OrderingKey: key, Headers: forged},
		{TenantID: &tenant, OrderingKey: key},
		{Headers: forged},
	} {
		m.Namespace, m.Topic, m.Payload = "test", "events", json.RawMessage(`{}`)
		res, err := c.Enqueue(ctx, db.Provider.Pool, m)
		if err != nil {
			t.Fatal(err)
		}
		ev := outboxhttp.EventInfo{ID: res.ID, Namespace: "test", Topic: "events", TenantID: m.TenantID, OrderingKey: m.OrderingKey}
		if m.OrderingKey != "" {
			ev.Sequence = int64(len(want) + 1)
		}
		want[res.ID] = ev
	}
	outboxtest.Drain(t, c, newPublisher(t, outboxhttp.Config{Endpoint: srv.URL}).For(brokertest.Topic))

	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.requests) != len(want) {
		t.Fatalf("%d requests, want %d", len(rc.requests), len(want))
	}
	for _, r := range rc.requests {
		h := r.Header
		got, err := outboxhttp.EventOf(h)
		if err != nil {
			t.Fatalf("EventOf(%v): %v", h, err)
		}
		if w := want[got.ID]; !reflect.DeepEqual(got, w) {
			t.Errorf("EventOf: %+v, want %+v", got, w)
		}
		if k := h.Get(outboxhttp.HeaderOrderingKey); got.OrderingKey != "" && k != "cl%C3%A9%2042%09%252F/+x%01" {
			t.Errorf("%s: %q, want the key percent-encoded as documented", outboxhttp.HeaderOrderingKey, k)
		}
		if h.Get("outbox-other") != "" || len(h.Values(outboxhttp.HeaderTopic)) != 1 || len(h.Values(outboxhttp.HeaderTenant)) > 1 {
			t.Errorf("an event's outbox-* header was sent: %v", h)
		}
		if got.OrderingKey == "" && (h.Get(outboxhttp.HeaderTenant) != "" || h.Get(outboxhttp.HeaderOrderingSeq) != "") {
			t.Errorf("an event without tenant or key: %v, want no %s or %s", h, outboxhttp.HeaderTenant, outboxhttp.HeaderOrderingSeq)
		}
	}
}

// TestEventOfRefuses: EventOf refuses a request without the headers it
// needs (ErrMissingHeader) or with values it cannot read
// (ErrMalformedHeader), naming the header.
func TestEventOfRefuses(t *testing.T) {
	valid := func() http.Header {
		h := http.Header{}
		h.Set(outboxhttp.HeaderID, uuid.NewString())
		h.Set(outboxhttp.HeaderNamespace, "test")
		h.Set(outboxhttp.HeaderTopic, "events")
		h.Set(outboxhttp.HeaderTenant, uuid.NewString())
		h.Set(outboxhttp.HeaderOrderingKey, "a%20b")
		h.Set(outboxhttp.HeaderOrderingSeq, "7")
		return h
	}
	if ev, err := outboxhttp.EventOf(valid()); err != nil || ev.OrderingKey != "a b" || ev.Sequence != 7 {
		t.Fatalf("EventOf: %+v, %v", ev, err)
	}
	for _, tc := range []struct {
		header, value string
		want          error
	}{
		{outboxhttp.HeaderID, "", outboxhttp.ErrMissingHeader},
		{outboxhttp.HeaderNamespace, "", outboxhttp.ErrMissingHeader},
		{outboxhttp.HeaderTopic, "", outboxhttp.ErrMissingHeader},
		{outboxhttp.HeaderOrderingKey, "", outboxhttp.ErrMissingHeader},
		{outboxhttp.HeaderOrderingSeq, "", outboxhttp.ErrMissingHeader},
		{outboxhttp.HeaderID, "msg_1", outboxhttp.ErrMalformedHeader},
		{outboxhttp.HeaderTenant, "acme", outboxhttp.ErrMalformedHeader},
		{outboxhttp.HeaderOrderingKey, "100%", outboxhttp.ErrMalformedHeader},
		{outboxhttp.HeaderOrderingKey, "%zz", outboxhttp.ErrMalformedHeader},
		{outboxhttp.HeaderOrderingSeq, "0", outboxhttp.ErrMalformedHeader},
		{outboxhttp.HeaderOrderingSeq, "x", outboxhttp.ErrMalformedHeader},
	} {
		h := valid()
		h.Set(tc.header, tc.value)
		_, err := outboxhttp.EventOf(h)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.header) {
			t.Errorf("%s %q: got %v, want %v naming the header", tc.header, tc.value, err, tc.want)
		}
	}
}

// Config.OmitEventHeaders leaves the outbox-* headers out (for an endpoint
// outside the service's control): the request carries the signature and
// the payload, as before they were added.
func TestOmitEventHeaders(t *testing.T) {
	tenant := uuid.New()
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", TenantID: &tenant, OrderingKey: "acct/7", Sequence: 3,
		Payload: json.RawMessage(`{}`)}
	for _, omit := range []bool{false, true} {
		p := newPublisher(t, outboxhttp.Config{Endpoint: "http://127.0.0.1:1/hooks", OmitEventHeaders: omit})
		req, err := p.Request(ctx, d)
		if err != nil {
			t.Fatal(err)
		}
		var named []string
		for name := range req.Header {
			if strings.HasPrefix(strings.ToLower(name), "outbox-") {
				named = append(named, name)
			}
		}
		if (len(named) == 0) != omit || req.Header.Get(outboxhttp.HeaderSignature) == "" {
			t.Errorf("OmitEventHeaders %v: event headers %v, signature %q", omit, named, req.Header.Get(outboxhttp.HeaderSignature))
		}
	}
}
