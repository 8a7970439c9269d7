package outboxhttp

import (
	"bytes"
	"cmp"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// ErrMissingHeader matches (errors.Is) a request without a header the
// receiver needs. The error names the header.
var ErrMissingHeader = errors.New("outboxhttp: missing header")

// ErrMalformedHeader matches (errors.Is) a request with a header whose
// value cannot be read. The error names the header and quotes the value.
var ErrMalformedHeader = errors.New("outboxhttp: malformed header")

// ErrSignatureMismatch matches (errors.Is) a request none of whose v1
// signatures is that of its webhook-id, webhook-timestamp and body under
// any of the Verifier's secrets.
var ErrSignatureMismatch = errors.New("outboxhttp: signature mismatch")

// ErrTimestampOutOfTolerance matches (errors.Is) a request whose
// webhook-timestamp is further from the receiver's clock than the
// Verifier's tolerance, before or after.
var ErrTimestampOutOfTolerance = errors.New("outboxhttp: webhook-timestamp out of tolerance")

// ToleranceDefault is how far a webhook-timestamp may be from the
// receiver's clock, before or after, when VerifierConfig.Tolerance is zero
// (the Standard Webhooks recommendation).
const ToleranceDefault = 5 * time.Minute

// MaxBodyBytesDefault bounds the body Verifier.Middleware reads when
// VerifierConfig.MaxBodyBytes is zero: above the outbox's default payload
// limit (1 MiB, outbox.Config.MaxPayloadBytes), with room for the spaces
// jsonb adds when it normalises a payload.
const MaxBodyBytesDefault = 4 << 20

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	// Secrets are the endpoint's secrets, each as Config.Secret takes it
	// (base64, with or without the "whsec_" prefix). A request signed
	// with any of them is accepted: to rotate, list the new secret beside
	// the old, give the Publisher the new one, then drop the old. At
	// least one.
	Secrets []string
	// Tolerance is how far webhook-timestamp may be from the receiver's
	// clock, before or after: it bounds how long a captured request can be
	// replayed. Default ToleranceDefault (5 minutes).
	Tolerance time.Duration
	// MaxBodyBytes bounds the body Middleware reads (a larger one is
	// answered 413). Default MaxBodyBytesDefault (4 MiB): raise it if the
	// publishing side raised outbox.Config.MaxPayloadBytes.
	MaxBodyBytes int64
	// Now is the clock of Middleware. Default time.Now.
	Now func() time.Time
}

// Verifier checks, on the receiving side, the Standard Webhooks signature
// of the requests a Publisher (or any Standard Webhooks sender) sends. It
// is safe for concurrent use.
type Verifier struct {
	signers   []*Signer
	tolerance time.Duration
	maxBody   int64
	now       func() time.Time
}

// NewVerifier returns a Verifier for cfg. Errors match
// outbox.ErrInvalidConfig.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	if len(cfg.Secrets) == 0 {
		return nil, fmt.Errorf("%w: outboxhttp: VerifierConfig.Secrets is empty; give the Publisher's secret", outbox.ErrInvalidConfig)
	}
	if cfg.Tolerance < 0 || cfg.MaxBodyBytes < 0 {
		return nil, fmt.Errorf("%w: outboxhttp: VerifierConfig.Tolerance (%v) and MaxBodyBytes (%d) must not be negative",
			outbox.ErrInvalidConfig, cfg.Tolerance, cfg.MaxBodyBytes)
	}
	v := &Verifier{tolerance: cmp.Or(cfg.Tolerance, ToleranceDefault), maxBody: cmp.Or(cfg.MaxBodyBytes, MaxBodyBytesDefault), now: cfg.Now}
	if v.now == nil {
		v.now = time.Now
	}
	for i, secret := range cfg.Secrets {
		s, err := NewSigner(secret)
		if err != nil {
			return nil, fmt.Errorf("VerifierConfig.Secrets[%d]: %w", i, err)
		}
		v.signers = append(v.signers, s)
	}
	return v, nil
}

// Verify checks a request's Standard Webhooks headers h and body (as
// received, before any decoding): webhook-id, webhook-timestamp and
// webhook-signature are present, the timestamp is within the tolerance of
// now, and one of the space-separated "v1,<base64>" signatures (others
// are ignored) is the HMAC-SHA256 of "id.timestamp.body" under one of the
// secrets, compared in constant time. It checks nothing else: not the
// event headers, which are not signed (see the package doc), nor whether
// the webhook-id was seen before (de-duplicate on it).
//
// Errors match ErrMissingHeader, ErrMalformedHeader (a timestamp that is
// not whole seconds, a webhook-signature without a well-formed v1
// signature), ErrTimestampOutOfTolerance or ErrSignatureMismatch.
func (v *Verifier) Verify(h http.Header, body []byte, now time.Time) error {
	id, ts := h.Get(HeaderID), h.Get(HeaderTimestamp)
	sigs := strings.Fields(strings.Join(h.Values(HeaderSignature), " "))
	switch {
	case id == "":
		return missing(HeaderID)
	case ts == "":
		return missing(HeaderTimestamp)
	case len(sigs) == 0:
		return missing(HeaderSignature)
	}
	secs, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return malformed(HeaderTimestamp, ts, "not whole seconds since the Unix epoch")
	}
	if off := now.Sub(time.Unix(secs, 0)); off > v.tolerance || off < -v.tolerance {
		when := "behind"
		if off < 0 {
			when = "ahead of"
		}
		return fmt.Errorf("%w: %s %s is %v %s this receiver's clock, more than the tolerance of %v: "+
			"check that both clocks are right (NTP), or the request is a replay", ErrTimestampOutOfTolerance, HeaderTimestamp, ts,
			off.Abs().Round(time.Second), when, v.tolerance)
	}
	macs := make([][]byte, len(v.signers))
	for i, s := range v.signers {
		macs[i] = s.mac(id, ts, body)
	}
	checked := false
	for _, sig := range sigs {
		// A proxy may merge two header lines into one, joined by ", ":
		// the first entry then ends with a comma that is not its own.
		version, b64, _ := strings.Cut(strings.TrimSuffix(sig, ","), ",")
		got, err := base64.StdEncoding.DecodeString(b64)
		if version != "v1" || err != nil || len(got) != sha256.Size {
			continue // another scheme's, or not one at all
		}
		checked = true
		for _, mac := range macs {
			if hmac.Equal(got, mac) {
				return nil
			}
		}
	}
	if !checked {
		return malformed(HeaderSignature, strings.Join(sigs, " "), `without a "v1,<base64 HMAC-SHA256>" signature, the only kind checked here`)
	}
	return fmt.Errorf("%w: no v1 signature in %s is that of %s, %s and the body under the %d secret(s) given: "+
		"check that the Verifier has the Publisher's secret (Config.Secret), and is given the body exactly as received",
		ErrSignatureMismatch, HeaderSignature, HeaderID, HeaderTimestamp, len(v.signers))
}

// Middleware returns a handler that reads each request's body (at most
// MaxBodyBytes), verifies it (Verify, at the clock of Now) and calls next
// with the body restored, or answers without calling next: 401 with the
// reason when Verify refuses, 413 when the body is too large, 400 when it
// cannot be read. The Publisher takes those answers as permanent: the
// event is dead-lettered at once with the answer in its last error (fix
// the secret or the clock, then replay it).
func (v *Verifier) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, v.maxBody))
		var tooLarge *http.MaxBytesError
		switch {
		case errors.As(err, &tooLarge):
			http.Error(w, fmt.Sprintf("outboxhttp: the body exceeds %d bytes (VerifierConfig.MaxBodyBytes)", v.maxBody),
				http.StatusRequestEntityTooLarge)
			return
		case err != nil:
			http.Error(w, "outboxhttp: reading the body: "+err.Error(), http.StatusBadRequest)
			return
		}
		if err := v.Verify(r.Header, body, v.now()); err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
	})
}

// EventInfo names the event a webhook carries, as EventOf reads it from the
// request's headers.
type EventInfo struct {
	// ID is the event id (webhook-id): the same on every redelivery, so
	// receivers de-duplicate on it.
	ID uuid.UUID
	// Namespace and Topic are the event's topic.
	Namespace, Topic string
	// TenantID is the event's tenant; nil for an event without one.
	TenantID *uuid.UUID
	// OrderingKey is the event's ordering key, decoded ("" without one),
	// and Sequence the event's place among the key's events (1, 2, …; 0
	// without a key).
	OrderingKey string
	Sequence    int64
}

// EventOf reads the event a Publisher's request carries from its headers
// (webhook-id and the event headers: see the package doc), decoding the
// ordering key. It does not check the signature, and the event headers are
// not signed: verify the request first (Verifier), and trust these values
// no more than the package doc says.
//
// Errors match ErrMissingHeader (the request was not sent by a Publisher of
// this package, or a proxy dropped the header) or ErrMalformedHeader.
func EventOf(h http.Header) (EventInfo, error) {
	var ev EventInfo
	for _, name := range []string{HeaderID, HeaderNamespace, HeaderTopic} {
		if h.Get(name) == "" {
			return ev, missing(name)
		}
	}
	var err error
	if ev.ID, err = uuid.Parse(h.Get(HeaderID)); err != nil {
		return ev, malformed(HeaderID, h.Get(HeaderID), "not an outbox event id (a UUID)")
	}
	ev.Namespace, ev.Topic = h.Get(HeaderNamespace), h.Get(HeaderTopic)
	if v := h.Get(HeaderTenant); v != "" {
		tenant, err := uuid.Parse(v)
		if err != nil {
			return ev, malformed(HeaderTenant, v, "not a tenant id (a UUID)")
		}
		ev.TenantID = &tenant
	}
	key, seq := h.Get(HeaderOrderingKey), h.Get(HeaderOrderingSeq)
	switch {
	case key == "" && seq == "":
		return ev, nil
	case key == "":
		return ev, missing(HeaderOrderingKey)
	case seq == "":
		return ev, missing(HeaderOrderingSeq)
	}
	if ev.OrderingKey, err = url.PathUnescape(key); err != nil {
		return ev, malformed(HeaderOrderingKey, key, "not percent-encoded (RFC 3986)")
	}
	if ev.Sequence, err = strconv.ParseInt(seq, 10, 64); err != nil || ev.Sequence < 1 {
		return ev, malformed(HeaderOrderingSeq, seq, "not a sequence number (1, 2, …)")
	}
	return ev, nil
}

func missing(name string) error {
	return fmt.Errorf("%w %s: the request was not sent by an outboxhttp Publisher (or a Standard Webhooks sender, for webhook-*), "+
		"or a proxy on the way dropped the header", ErrMissingHeader, name)
}

func malformed(name, value, what string) error {
	if len(value) > 80 {
		value = value[:80] + "…" // a header can be long: keep logs readable
	}
	return fmt.Errorf("%w %s: %q is %s", ErrMalformedHeader, name, value, what)
}
