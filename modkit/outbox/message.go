package outbox

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox/internal/dedupekey"
)

// Message is one event to enqueue.
type Message struct {
	// Namespace names the producing module, e.g. "mini-chat": 1 to 128
	// lower-case ASCII letters, digits, '.', '_' and '-', starting with a
	// letter or digit.
	Namespace string
	// Topic names the kind of event within the namespace, e.g.
	// "usage_snapshot"; the same form as Namespace.
	Topic string
	// TenantID is the tenant the event belongs to, nil for system events:
	// publishers see it (Delivery.TenantID) to route on, a dedupe key is
	// scoped to it, and operators filter by it. It does not partition
	// delivery: a topic's events go out oldest first whatever their
	// tenant, so one tenant's burst delays the other tenants' events of
	// that topic until it has drained (a trial: 100,000 events of one
	// tenant held 80 others' back about 65 s). Give a tenant that may
	// flood a topic a topic of its own.
	TenantID *uuid.UUID
	// DedupeKey makes Enqueue idempotent: while a row with the same
	// (Namespace, Topic, DedupeKey) exists, enqueueing again inserts nothing
	// and returns that row's id. nil for no deduplication; an empty key is an
	// error; at most 512 bytes of UTF-8 without NUL bytes, as stored (a
	// tenant prefix of 32 hex digits is stored hyphenated, 4 bytes longer).
	// When TenantID is also set, the key
	// must begin with the tenant id (hyphenated or 32 hex digits, any case)
	// followed by "/", so that one tenant's keys never collide with
	// another's; that prefix is stored in one spelling (lower-case,
	// hyphenated), so every spelling of a key finds the same row. A key
	// without a TenantID must not begin with a UUID and "/" (it would take
	// that tenant's key). The database enforces both. While another open
	// transaction has enqueued the same key, Enqueue waits for it to end
	// (the unique index's lock): it then returns that event when the other
	// committed (under REPEATABLE READ or SERIALIZABLE, ErrConflict
	// instead), or inserts when it rolled back; keep transactions that
	// enqueue a dedupe key short. Two transactions that each enqueue
	// several dedupe keys (in one EnqueueBatch or in several calls) can
	// therefore deadlock when they take them in opposite orders, as with
	// ordering keys below: enqueue a transaction's keys in one order.
	DedupeKey *string
	// OrderingKey, when set, orders the event among the events of its
	// (Namespace, Topic) with the same key (an account, a participant, an
	// aggregate id): they are published one at a time, in the order their
	// transactions committed. Only within one topic: events of another
	// topic with the same key are not ordered against them, so that an
	// order's order_paid may be published before its order_created. Give
	// events that must stay in order one topic (a field of the payload, or
	// a header, telling their kinds apart). The order comes from a per-key
	// sequence allocated in tx
	// (gap-free: a rolled-back transaction takes none). Producers of one
	// key wait for each other's transactions (under REPEATABLE READ or
	// SERIALIZABLE the second gets ErrConflict instead); producers of
	// different keys never do, but under SERIALIZABLE PostgreSQL's
	// predicate locks make concurrent transactions that enqueue ordered
	// events often fail at commit with a serialization failure (SQLSTATE
	// 40001, from Commit) even for different keys: retry them, or enqueue
	// ordered events from READ COMMITTED. As producers of one key wait,
	// two transactions that each enqueue several keys can deadlock when
	// they take them in opposite orders; the one PostgreSQL aborts gets
	// ErrConflict, so enqueue a transaction's keys in one order (sorted,
	// say). The database keeps a row per key ever used, after its events
	// are purged, until an operator prunes it (Admin.PruneSequences); a
	// key used again after that starts again at sequence 1. Many events of
	// one key in one
	// transaction go faster through one EnqueueBatch, which takes the key's
	// sequence once: each Enqueue takes it again, and a transaction's
	// repeated writes of one row slow each other down (about 0.5 s for
	// 1,000 Enqueues of one key in one transaction, 3 s for 4,000). At most
	// 256 bytes of UTF-8. Events without a key are not ordered (see the
	// package documentation).
	OrderingKey string
	// Headers is optional metadata carried to the publisher unchanged in
	// Delivery.Headers (correlation ids, content types): at most 64
	// entries and 16 KiB, names of printable ASCII without spaces, values
	// of UTF-8. Enqueue adds the W3C trace context of ctx (traceparent,
	// tracestate) unless Headers already has a traceparent (in any letter
	// case: Traceparent, as an http.Header spells it, counts); those two are
	// stored beyond the limits.
	Headers map[string]string
	// Payload is the event body: valid JSON of any kind (an object, an
	// array, a string, a number, true, false or null; TypedTopic's
	// producers write T's encoding), at most the configured size (1 MiB
	// unless Config.MaxPayloadBytes says otherwise).
	// The dispatcher hands it to the publisher unchanged (as jsonb
	// normalises it: key order and whitespace may differ, and numbers
	// come back as numeric prints them: 1e3 as 1000, 1.50 as 1.50).
	Payload json.RawMessage
}

// Key returns a pointer to key, for Message.DedupeKey.
func Key(key string) *string { return &key }

// Tenant returns a pointer to id, for Message.TenantID.
func Tenant(id uuid.UUID) *uuid.UUID { return &id }

// Enqueued is the outcome of enqueueing one message.
type Enqueued struct {
	// ID of the event: the new row, or the existing one for a duplicate.
	ID uuid.UUID
	// AlreadyEnqueued is true when a row with the same dedupe key existed,
	// so nothing was inserted.
	AlreadyEnqueued bool
}

// namePattern is the form of namespaces and topics: 1 to 128 characters, lower-case
// ASCII letters, digits, '.', '_' and '-', starting with a letter or digit.
const namePattern = `^[a-z0-9][a-z0-9._-]{0,127}$`

// validName reports whether s matches namePattern (without a regular
// expression: it runs for every message enqueued).
func validName(s string) bool {
	if len(s) == 0 || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case (c == '.' || c == '_' || c == '-') && i > 0:
		default:
			return false
		}
	}
	return true
}

func validate(i int, m *Message, maxPayload int) error {
	bad := func(field string, kind error, format string, args ...any) error {
		return &ValidationError{Index: i, Field: field, Kind: kind, Reason: fmt.Sprintf(format, args...)}
	}
	if !validName(m.Namespace) {
		return bad("Namespace", ErrInvalidNamespace, "%q does not match %s", m.Namespace, namePattern)
	}
	if !validName(m.Topic) {
		return bad("Topic", ErrInvalidTopic, "%q does not match %s", m.Topic, namePattern)
	}
	if k := m.OrderingKey; k != "" && (len(k) > orderingKeyMaxLen || strings.TrimSpace(k) == "" || !utf8.ValidString(k) || strings.ContainsRune(k, 0)) {
		return bad("OrderingKey", ErrInvalidOrderingKey, "%q: 1 to %d bytes of UTF-8, not blank, without NUL bytes", truncateForMessage(k), orderingKeyMaxLen)
	}
	if err := validHeaders(m.Headers); err != "" {
		return bad("Headers", ErrInvalidHeaders, "%s", err)
	}
	if len(m.Payload) == 0 {
		return bad("Payload", ErrInvalidPayload, "empty; use a JSON value such as {} or null")
	}
	if len(m.Payload) > maxPayload {
		return bad("Payload", ErrPayloadTooLarge, "%d bytes, the limit is %d", len(m.Payload), maxPayload)
	}
	valid, why, grows := checkPayload(m.Payload)
	switch {
	case !valid:
		return bad("Payload", ErrInvalidPayload, "not valid JSON (or nested more than %d deep)", jsonMaxDepth)
	case !utf8.Valid(m.Payload): // only strings can hold such bytes in valid JSON
		return bad("Payload", ErrInvalidPayload, "contains invalid UTF-8")
	case why != "":
		return bad("Payload", ErrInvalidPayload, "%s", why)
	case len(m.Payload)+grows > maxPayload:
		// jsonb keeps each number as numeric, which prints every digit:
		// each read of the event (every claim) would build the whole text.
		return bad("Payload", ErrPayloadTooLarge, "%d bytes as written, but %d as PostgreSQL prints its numbers in full "+
			"(1e6 as 1000000), and the limit is %d: write such numbers as strings", len(m.Payload), len(m.Payload)+grows, maxPayload)
	}
	if m.TenantID != nil && *m.TenantID == uuid.Nil {
		return bad("TenantID", ErrInvalidTenant, "the nil UUID; leave TenantID nil for events without a tenant")
	}
	if k := m.DedupeKey; k != nil {
		switch {
		case *k == "" || strings.TrimSpace(*k) == "":
			return bad("DedupeKey", ErrInvalidDedupeKey, "empty or blank; leave DedupeKey nil for no deduplication")
		case len(*k) > dedupeKeyMaxLen:
			return bad("DedupeKey", ErrInvalidDedupeKey, "%d bytes, the limit is %d", len(*k), dedupeKeyMaxLen)
		case !utf8.ValidString(*k) || strings.ContainsRune(*k, 0):
			return bad("DedupeKey", ErrInvalidDedupeKey, "must be valid UTF-8 without NUL bytes")
		}
		owner, n, prefixed := dedupekey.TenantPrefix(*k)
		switch {
		case m.TenantID != nil && prefixed && owner == *m.TenantID && len(*k)-n+36 > dedupeKeyMaxLen:
			// The prefix is stored hyphenated: 32 hex digits take 4 bytes more.
			return bad("DedupeKey", ErrInvalidDedupeKey, "%d bytes as stored, with its tenant prefix hyphenated (%d as given); the limit is %d",
				len(*k)-n+36, len(*k), dedupeKeyMaxLen)
		case m.TenantID != nil && (!prefixed || owner != *m.TenantID):
			return bad("DedupeKey", ErrTenantMismatch, "%q must begin with the tenant id %s (or %s) followed by \"/\"",
				truncateForMessage(*k), hex32(*m.TenantID), m.TenantID.String())
		case m.TenantID == nil && prefixed && owner == uuid.Nil:
			// No tenant may have the nil UUID (see above).
			return bad("DedupeKey", ErrTenantMismatch, "%q begins with the nil UUID and \"/\", the shape of a tenant's key, "+
				"and no tenant is the nil UUID: use a key that does not begin with a UUID and \"/\"", truncateForMessage(*k))
		case m.TenantID == nil && prefixed:
			return bad("DedupeKey", ErrTenantMismatch, "%q begins with tenant %s's prefix but TenantID is nil: "+
				"set TenantID to that tenant, or use a key that does not begin with a UUID and \"/\"",
				truncateForMessage(*k), owner)
		}
	}
	return nil
}

// orderingKeyMaxLen is the longest OrderingKey, in bytes.
const orderingKeyMaxLen = 256

// Header limits.
const (
	headersMaxEntries = 64
	headersMaxBytes   = 16 << 10
	headerNameMaxLen  = 128
)

// validHeaders returns why h is not valid, or "".
func validHeaders(h map[string]string) string {
	if len(h) > headersMaxEntries {
		return fmt.Sprintf("%d entries, the limit is %d", len(h), headersMaxEntries)
	}
	size := 0
	for k, v := range h {
		size += len(k) + len(v)
		if k == "" || len(k) > headerNameMaxLen {
			return fmt.Sprintf("name %q: 1 to %d bytes", truncateForMessage(k), headerNameMaxLen)
		}
		for i := 0; i < len(k); i++ {
			if k[i] <= ' ' || k[i] >= 0x7f {
				return fmt.Sprintf("name %q: printable ASCII without spaces", truncateForMessage(k))
			}
		}
		if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
			return fmt.Sprintf("value of %q: UTF-8 without NUL bytes", k)
		}
	}
	if size > headersMaxBytes {
		return fmt.Sprintf("%d bytes, the limit is %d", size, headersMaxBytes)
	}
	return ""
}

// storedKey is the dedupe key as stored: a tenant's key with its prefix in
// the one canonical spelling (lower-case, hyphenated), so that every
// spelling of one key finds the same row. Call it on validated messages.
func storedKey(m *Message) *string {
	if m.DedupeKey == nil || m.TenantID == nil {
		return m.DedupeKey
	}
	var canonical [36]byte // m.TenantID.String(), without allocating it
	uuidText(&canonical, *m.TenantID)
	key := *m.DedupeKey
	_, n, _ := dedupekey.TenantPrefix(key)
	if n == len(canonical) && key[:n] == string(canonical[:]) {
		return m.DedupeKey // already in the canonical spelling, as most keys are
	}
	k := string(canonical[:]) + key[n:]
	return &k
}

// uuidText writes id's canonical text form (lower-case, hyphenated) to dst.
func uuidText(dst *[36]byte, id uuid.UUID) {
	const digits = "0123456789abcdef"
	j := 0
	for i, b := range id {
		if i == 4 || i == 6 || i == 8 || i == 10 {
			dst[j] = '-'
			j++
		}
		dst[j], dst[j+1] = digits[b>>4], digits[b&0x0f]
		j += 2
	}
}

func hex32(id uuid.UUID) string { return strings.ReplaceAll(id.String(), "-", "") }

func truncateForMessage(s string) string {
	if len(s) <= 80 {
		return s
	}
	return s[:80] + "…"
}

// orderingKey is the driver's form of an ordering key: nil for none.
func orderingKey(k string) *string {
	if k == "" {
		return nil
	}
	return &k
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func derefInt(n *int64) int64 {
	if n == nil {
		return 0
	}
	return *n
}
