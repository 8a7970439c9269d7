package outboxhttp

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"

	"github.com/google/uuid"
)

// ErrMissingHeader matches (errors.Is) a request without a header the
// receiver needs. The error names the header.
var ErrMissingHeader = errors.New("outboxhttp: missing header")

// ErrMalformedHeader matches (errors.Is) a request with a header whose
// value cannot be read. The error names the header and quotes the value.
var ErrMalformedHeader = errors.New("outboxhttp: malformed header")

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
	return fmt.Errorf("%w %s: %q is %s", ErrMalformedHeader, name, value, what)
}
