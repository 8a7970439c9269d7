package outbox

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"
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
	// TenantID routes and partitions the event; nil for system events.
	TenantID *uuid.UUID
	// DedupeKey makes Enqueue idempotent: while a row with the same
	// (Namespace, Topic, DedupeKey) exists, enqueueing again inserts nothing
	// and returns that row's id. nil for no deduplication; an empty key is an
	// error; at most 512 bytes of UTF-8. When TenantID is also set, the key
	// must begin with the tenant id (hyphenated or 32 hex digits, any case)
	// followed by "/", so that one tenant's keys never collide with
	// another's.
	DedupeKey *string
	// Payload is the event body: valid JSON, at most the configured size
	// (1 MiB unless Config.MaxPayloadBytes says otherwise).
	// The dispatcher hands it to the publisher unchanged (as jsonb
	// normalises it: key order and whitespace may differ).
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
	if len(m.Payload) == 0 {
		return bad("Payload", ErrInvalidPayload, "empty; use a JSON value such as {} or null")
	}
	if len(m.Payload) > maxPayload {
		return bad("Payload", ErrPayloadTooLarge, "%d bytes, the limit is %d", len(m.Payload), maxPayload)
	}
	if !json.Valid(m.Payload) {
		return bad("Payload", ErrInvalidPayload, "not valid JSON")
	}
	if why := jsonbIncompatibility(m.Payload); why != "" {
		return bad("Payload", ErrInvalidPayload, "%s", why)
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
		if m.TenantID != nil && !keyBelongsToTenant(*k, *m.TenantID) {
			return bad("DedupeKey", ErrTenantMismatch, "%q must begin with the tenant id %s (or %s) followed by \"/\"",
				truncateForMessage(*k), hex32(*m.TenantID), m.TenantID.String())
		}
	}
	return nil
}

// keyBelongsToTenant: the key begins with the
// tenant id's hex form and "/". Both the 32-digit form and the hyphenated
// form are accepted, in any letter case.
func keyBelongsToTenant(key string, tenant uuid.UUID) bool {
	for _, n := range []int{32, 36} { // the two forms' lengths
		if len(key) > n && key[n] == '/' {
			id, err := uuid.Parse(key[:n]) // any letter case; n excludes the {…} and urn: forms
			return err == nil && id == tenant
		}
	}
	return false
}

func hex32(id uuid.UUID) string { return strings.ReplaceAll(id.String(), "-", "") }

func truncateForMessage(s string) string {
	if len(s) <= 80 {
		return s
	}
	return s[:80] + "…"
}
