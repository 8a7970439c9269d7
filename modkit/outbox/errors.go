package outbox

import (
	"github.com/modkit-go/modkit/modkit/outbox/driver"

	"errors"
	"fmt"
)

// ErrInvalidMessage matches (errors.Is) every validation failure of Enqueue
// and EnqueueBatch. Use errors.As with *ValidationError for the details. A
// message that fails validation writes nothing.
var ErrInvalidMessage = errors.New("outbox: invalid message")

// The specific validation failures; each also matches ErrInvalidMessage.
var (
	// ErrInvalidNamespace: Namespace is empty, longer than 128 bytes, has
	// characters outside lower-case ASCII letters, digits, '.', '_' and
	// '-', or does not start with a letter or digit.
	ErrInvalidNamespace = errors.New("outbox: invalid namespace")
	// ErrInvalidTopic: Topic breaks the same rule as a namespace.
	ErrInvalidTopic = errors.New("outbox: invalid topic")
	// ErrInvalidPayload: the payload is empty, not JSON, or JSON that
	// PostgreSQL's jsonb refuses (\u0000, unpaired surrogates, numbers out
	// of range).
	ErrInvalidPayload = errors.New("outbox: invalid payload")
	// ErrPayloadTooLarge: the payload exceeds Config.MaxPayloadBytes, or
	// its stored form the database's limit (see Config.MaxPayloadBytes).
	ErrPayloadTooLarge = errors.New("outbox: payload too large")
	// ErrInvalidDedupeKey: the key is empty, blank, too long (as stored),
	// not UTF-8 or holds a NUL byte.
	ErrInvalidDedupeKey = errors.New("outbox: invalid dedupe key")
	// ErrInvalidOrderingKey: the key is blank, longer than 256 bytes, not
	// UTF-8 or holds a NUL byte.
	ErrInvalidOrderingKey = errors.New("outbox: invalid ordering key")
	// ErrInvalidHeaders: a header name is empty, too long, or has a
	// character that is not printable ASCII or is a space (other
	// punctuation, such as ':' or '/', is allowed here, though a broker
	// adapter may refuse it: see the README's adapter table), a value is
	// not UTF-8 or holds a NUL byte, or the headers exceed 64 entries or
	// 16 KiB.
	ErrInvalidHeaders = errors.New("outbox: invalid headers")
	// ErrInvalidTenant: TenantID is the nil UUID.
	ErrInvalidTenant = errors.New("outbox: invalid tenant id")
	// ErrTenantMismatch: the message has both a tenant id and a dedupe key,
	// and the key does not begin with that tenant id followed by "/".
	ErrTenantMismatch = errors.New("outbox: dedupe key does not belong to the tenant")
)

// ValidationError says which field of which message was rejected and why.
type ValidationError struct {
	// Index of the message in an EnqueueBatch call; 0 for Enqueue.
	Index int
	// Field is the Message field at fault: "Namespace", "Topic", "Payload",
	// "DedupeKey", "TenantID", "OrderingKey" or "Headers".
	Field string
	// Kind is one of the specific sentinels above (ErrInvalidTopic, …).
	Kind error
	// Reason is a human sentence saying what is wrong and what is allowed.
	Reason string

	single bool // of one message (Enqueue, TypedTopic.Message): no index in the text
}

func (e *ValidationError) Error() string {
	if e.single {
		return fmt.Sprintf("%v: %s: %s", e.Kind, e.Field, e.Reason)
	}
	return fmt.Sprintf("%v: message %d: %s: %s", e.Kind, e.Index, e.Field, e.Reason)
}

// Unwrap lets errors.Is match both ErrInvalidMessage and the specific kind.
func (e *ValidationError) Unwrap() []error { return []error{ErrInvalidMessage, e.Kind} }

// ErrInvalidConfig matches every error of New, NewDispatcher and the
// Publisher checks caused by a bad setting; the message names the field and
// what it must be. Nothing was started. The Admin methods' refusals of bad
// arguments (a filter, a limit, an empty 'by', a series' window) match it
// too, and change nothing.
var ErrInvalidConfig = errors.New("outbox: invalid configuration")

// ErrDuplicatePublisher is returned when two publishers claim the same
// (namespace, topic). It also matches ErrInvalidConfig.
var ErrDuplicatePublisher = fmt.Errorf("%w: two publishers for one topic", ErrInvalidConfig)

// ErrNotFound is returned by Admin.Get for an unknown event id, and by
// Admin.SkipHead for an id that is not the dead head of an ordering key.
var ErrNotFound = errors.New("outbox: event not found")

// ErrInvalidCursor is returned by Admin.List (and by ReplayDead and
// PurgeDead by filter) for an EventFilter.After, and by Admin.SettledPage
// for a SettledQuery.After, that the same call did not produce (a List
// cursor is not a SettledPage cursor, nor the reverse). It also matches
// ErrInvalidConfig, as the Admin methods' other refusals of bad arguments
// do.
var ErrInvalidCursor = fmt.Errorf("%w: invalid page cursor: pass EventPage.NextPage unchanged", ErrInvalidConfig)

// ErrLeaseLost: an outcome was not recorded because the event is no longer
// leased to this dispatcher under the claim's token (the lease expired, and
// perhaps another dispatcher claimed the event again). Nothing was changed.
// A transactional handler (Publisher.HandleTx) whose lease is lost has its
// transaction rolled back; the database reports it as SQLSTATE P7002.
var ErrLeaseLost = driver.ErrLeaseLost

// ErrInvalidState: an outcome that a worker may not record (SQLSTATE
// P7003). Nothing was changed.
var ErrInvalidState = driver.ErrInvalidState

// ErrConflict is returned by Enqueue and EnqueueBatch when a concurrent
// transaction made this one impossible to finish as written: under
// REPEATABLE READ or SERIALIZABLE isolation, another transaction committed
// the same dedupe key after this one began (or the database aborted it with
// a serialization failure, SQLSTATE 40001), or the row holding the key was
// just purged; or the database broke a deadlock with another transaction
// by aborting this one (SQLSTATE 40P01: two transactions took ordering
// keys or dedupe keys in opposite orders; see Message.OrderingKey). The
// transaction is aborted; run the whole transaction again.
var ErrConflict = errors.New("outbox: enqueue conflicts with a concurrent transaction; retry the whole transaction")

// permanentError marks a publish failure that retrying cannot fix.
type permanentError struct{ err error }

func (p *permanentError) Error() string { return "permanent: " + p.err.Error() }
func (p *permanentError) Unwrap() error { return p.err }

// Permanent wraps a publish error to say "this event will never succeed"
// (malformed payload, rejected by the consumer's validation, …). The event is
// dead-lettered at once instead of being retried. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or any error it wraps, was marked with
// Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}
