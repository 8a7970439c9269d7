package outboxhttp_test

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxhttp"
)

// otherSecret is a second secret, for rotations and wrong-secret cases.
const otherSecret = "whsec_c2Vjb25kIHNlY3JldCBvZiAyNCBieXRlcyE="

func newVerifier(t *testing.T, cfg outboxhttp.VerifierConfig) *outboxhttp.Verifier {
	t.Helper()
	if cfg.Secrets == nil {
		cfg.Secrets = []string{secret}
	}
	v, err := outboxhttp.NewVerifier(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// signed returns the Standard Webhooks headers of a message signed with
// secret.
func signed(t *testing.T, secret, id string, ts int64, body []byte) http.Header {
	t.Helper()
	s, err := outboxhttp.NewSigner(secret)
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{}
	h.Set(outboxhttp.HeaderID, id)
	h.Set(outboxhttp.HeaderTimestamp, strconv.FormatInt(ts, 10))
	h.Set(outboxhttp.HeaderSignature, s.Sign(id, ts, body))
	return h
}

// randomSig is a well-formed v1 signature that matches nothing.
func randomSig() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return "v1," + base64.StdEncoding.EncodeToString(b)
}

// TestVerify: what Sign signs, Verify accepts, under any of the secrets
// given and among other signatures; a request changed in its body, id or
// timestamp, signed with another secret, too old or too new, or with
// headers missing or unreadable is refused with the matching sentinel.
func TestVerify(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	id, body := uuid.NewString(), []byte(`{"order":42}`)
	ts := now.Unix()
	good := signed(t, secret, id, ts, body).Get(outboxhttp.HeaderSignature)
	v := newVerifier(t, outboxhttp.VerifierConfig{})

	// The Standard Webhooks reference vector.
	ref := http.Header{}
	ref.Set(outboxhttp.HeaderID, "msg_p5jXN8AQM9LWM0D4loKWxJek")
	ref.Set(outboxhttp.HeaderTimestamp, "1614265330")
	ref.Set(outboxhttp.HeaderSignature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=")
	if err := v.Verify(ref, []byte(`{"test": 2432232314}`), time.Unix(1614265330, 0)); err != nil {
		t.Errorf("the reference vector: %v", err)
	}

	for _, tc := range []struct {
		name    string
		secrets []string
		edit    func(h http.Header)
		body    string
		now     time.Time
		want    error
	}{
		{name: "signed", want: nil},
		{name: "secret without whsec_", secrets: []string{strings.TrimPrefix(secret, "whsec_")}},
		{name: "rotation: the old secret and the new", secrets: []string{otherSecret, secret}},
		{name: "another secret", secrets: []string{otherSecret}, want: outboxhttp.ErrSignatureMismatch},
		{name: "body changed", body: `{"order":43}`, want: outboxhttp.ErrSignatureMismatch},
		{name: "id changed", edit: func(h http.Header) { h.Set(outboxhttp.HeaderID, uuid.NewString()) }, want: outboxhttp.ErrSignatureMismatch},
		{name: "timestamp changed", edit: func(h http.Header) { h.Set(outboxhttp.HeaderTimestamp, strconv.FormatInt(ts-1, 10)) },
			want: outboxhttp.ErrSignatureMismatch},
		{name: "only wrong signatures", edit: func(h http.Header) { h.Set(outboxhttp.HeaderSignature, randomSig()+" "+randomSig()) },
			want: outboxhttp.ErrSignatureMismatch},
		{name: "one of several", edit: func(h http.Header) { h.Set(outboxhttp.HeaderSignature, randomSig()+" v1a,abc "+good+" v1,x") }},
		{name: "one of several header lines", edit: func(h http.Header) {
			h.Set(outboxhttp.HeaderSignature, randomSig())
			h.Add(outboxhttp.HeaderSignature, good)
		}},
		// Two lines a proxy merged into one, joined by ", " (an interop
		// check with the standardwebhooks npm library found this refused
		// with the good one first, which that library accepts).
		{name: "the first of two merged header lines", edit: func(h http.Header) { h.Set(outboxhttp.HeaderSignature, good+", "+randomSig()) }},
		{name: "as old as the tolerance", now: now.Add(outboxhttp.ToleranceDefault)},
		{name: "as new as the tolerance", now: now.Add(-outboxhttp.ToleranceDefault)},
		{name: "too old", now: now.Add(outboxhttp.ToleranceDefault + time.Second), want: outboxhttp.ErrTimestampOutOfTolerance},
		{name: "too new", now: now.Add(-outboxhttp.ToleranceDefault - time.Second), want: outboxhttp.ErrTimestampOutOfTolerance},
		{name: "no id", edit: func(h http.Header) { h.Del(outboxhttp.HeaderID) }, want: outboxhttp.ErrMissingHeader},
		{name: "no timestamp", edit: func(h http.Header) { h.Del(outboxhttp.HeaderTimestamp) }, want: outboxhttp.ErrMissingHeader},
		{name: "no signature", edit: func(h http.Header) { h.Set(outboxhttp.HeaderSignature, " ") }, want: outboxhttp.ErrMissingHeader},
		{name: "timestamp in milliseconds", edit: func(h http.Header) { h.Set(outboxhttp.HeaderTimestamp, strconv.FormatInt(ts, 10)+".000") },
			want: outboxhttp.ErrMalformedHeader},
		{name: "timestamp as a date", edit: func(h http.Header) { h.Set(outboxhttp.HeaderTimestamp, now.Format(time.RFC3339)) },
			want: outboxhttp.ErrMalformedHeader},
		{name: "signature not base64", edit: func(h http.Header) { h.Set(outboxhttp.HeaderSignature, "v1,not base64!") },
			want: outboxhttp.ErrMalformedHeader},
		{name: "signature without version", edit: func(h http.Header) { h.Set(outboxhttp.HeaderSignature, strings.TrimPrefix(good, "v1,")) },
			want: outboxhttp.ErrMalformedHeader},
		{name: "signature of another scheme only", edit: func(h http.Header) {
			h.Set(outboxhttp.HeaderSignature, "v1a,"+strings.TrimPrefix(good, "v1,"))
		}, want: outboxhttp.ErrMalformedHeader},
		{name: "signature too short", edit: func(h http.Header) {
			h.Set(outboxhttp.HeaderSignature, "v1,"+base64.StdEncoding.EncodeToString([]byte("short")))
		},
			want: outboxhttp.ErrMalformedHeader},
	} {
		h := signed(t, secret, id, ts, body)
		if tc.edit != nil {
			tc.edit(h)
		}
		verifier := v
		if tc.secrets != nil {
			verifier = newVerifier(t, outboxhttp.VerifierConfig{Secrets: tc.secrets})
		}
		b, at := body, now
		if tc.body != "" {
			b = []byte(tc.body)
		}
		if !tc.now.IsZero() {
			at = tc.now
		}
		err := verifier.Verify(h, b, at)
		if (tc.want == nil) != (err == nil) || !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
}

// TestVerifyTolerance: VerifierConfig.Tolerance replaces the default, and
// the error says by how much the timestamp is off and which way.
func TestVerifyTolerance(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	body := []byte(`{}`)
	v := newVerifier(t, outboxhttp.VerifierConfig{Tolerance: time.Minute})
	h := signed(t, secret, uuid.NewString(), now.Add(-2*time.Minute).Unix(), body)
	err := v.Verify(h, body, now)
	if !errors.Is(err, outboxhttp.ErrTimestampOutOfTolerance) || !strings.Contains(err.Error(), "2m0s behind") {
		t.Fatalf("2 minutes old, tolerance 1 minute: got %v, want ErrTimestampOutOfTolerance saying 2m0s behind", err)
	}
	if err := v.Verify(h, body, now.Add(-time.Minute)); err != nil {
		t.Fatalf("1 minute old: %v", err)
	}
}

// TestNewVerifierRefuses: no secret, a secret that is not base64 and a
// negative bound are configuration errors.
func TestNewVerifierRefuses(t *testing.T) {
	for _, cfg := range []outboxhttp.VerifierConfig{
		{},
		{Secrets: []string{secret, "whsec_not base64!"}},
		{Secrets: []string{secret}, Tolerance: -time.Second},
		{Secrets: []string{secret}, MaxBodyBytes: -1},
	} {
		if _, err := outboxhttp.NewVerifier(cfg); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Errorf("%+v: got %v, want ErrInvalidConfig", cfg, err)
		}
	}
}

// TestMiddleware: a Publisher's request passes the Middleware with its
// body intact and its event readable; one signed with another secret is
// answered 401 (the Publisher dead-letters it with the reason), one over
// MaxBodyBytes 413, and neither reaches the handler.
func TestMiddleware(t *testing.T) {
	type seen struct {
		body  string
		event outboxhttp.EventInfo
		err   error
	}
	got := make(chan seen, 4) // room for requests that should not reach it
	v := newVerifier(t, outboxhttp.VerifierConfig{MaxBodyBytes: 64})
	srv := httptest.NewServer(v.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		ev, err := outboxhttp.EventOf(r.Header)
		got <- seen{string(body), ev, err}
	})))
	t.Cleanup(srv.Close)

	tenant := uuid.New()
	d := outbox.Delivery{ID: uuid.New(), Namespace: "shop", Topic: "order_paid", TenantID: &tenant, OrderingKey: "client 7", Sequence: 3,
		Payload: json.RawMessage(`{"order":42}`)}
	if err := newPublisher(t, outboxhttp.Config{Endpoint: srv.URL}).Publish(ctx, d); err != nil {
		t.Fatal(err)
	}
	s := <-got
	want := outboxhttp.EventInfo{ID: d.ID, Namespace: "shop", Topic: "order_paid", TenantID: &tenant, OrderingKey: "client 7", Sequence: 3}
	if s.err != nil || s.body != `{"order":42}` || s.event.ID != want.ID || s.event.Topic != want.Topic || *s.event.TenantID != tenant ||
		s.event.OrderingKey != want.OrderingKey || s.event.Sequence != want.Sequence {
		t.Fatalf("the handler got body %s, event %+v (%v); want %+v", s.body, s.event, s.err, want)
	}

	err := newPublisher(t, outboxhttp.Config{Endpoint: srv.URL, Secret: otherSecret}).Publish(ctx, d)
	var se *outboxhttp.StatusError
	if !errors.As(err, &se) || se.StatusCode != http.StatusUnauthorized || !outbox.IsPermanent(err) || !strings.Contains(se.Body, "signature mismatch") {
		t.Fatalf("another secret: got %v, want a permanent 401 saying the signature does not match", err)
	}
	d.Payload = json.RawMessage(`{"pad":"` + strings.Repeat("x", 64) + `"}`)
	err = newPublisher(t, outboxhttp.Config{Endpoint: srv.URL}).Publish(ctx, d)
	if !errors.As(err, &se) || se.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("a body over MaxBodyBytes: got %v, want 413", err)
	}
	select {
	case s := <-got:
		t.Fatalf("a refused request reached the handler: %+v", s)
	default:
	}
	resp, err := http.Post(srv.URL, "application/json", bytes.NewReader([]byte(`{}`)))
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(msg), "missing header webhook-id") {
		t.Fatalf("an unsigned request: %d %s, want 401 naming the missing header", resp.StatusCode, msg)
	}
}
