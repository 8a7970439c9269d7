package outbox

import (
	"errors"
	"fmt"
)

// ErrInvalidMessage matches (errors.Is) every validation failure of Enqueue
// and EnqueueBatch. Use errors.As with *ValidationError for the details. A
// message that fails validation writes nothing.
var ErrInvalidMessage = errors.New("outbox: invalid message")

// The specific validation failures; each also matches ErrInvalidMessage.
var (
	ErrInvalidNamespace = errors.New("outbox: invalid namespace")
	ErrInvalidTopic     = errors.New("outbox: invalid topic")
	ErrInvalidPayload   = errors.New("outbox: invalid payload")
	ErrPayloadTooLarge  = errors.New("outbox: payload too large")
	ErrInvalidDedupeKey = errors.New("outbox: invalid dedupe key")
	ErrInvalidTenant    = errors.New("outbox: invalid tenant id")
	// ErrTenantMismatch: the message has both a tenant id and a dedupe key,
	// and the key does not begin with that tenant id followed by "/".
	ErrTenantMismatch = errors.New("outbox: dedupe key does not belong to the tenant")
)

// ValidationError says which field of which message was rejected and why.
type ValidationError struct {
	// Index of the message in an EnqueueBatch call; 0 for Enqueue.
	Index int
	// Field is the Message field at fault: "Namespace", "Topic", "Payload",
	// "DedupeKey" or "TenantID".
	Field string
	// Kind is one of the specific sentinels above (ErrInvalidTopic, …).
	Kind error
	// Reason is a human sentence saying what is wrong and what is allowed.
	Reason string
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("%v: message %d: %s: %s", e.Kind, e.Index, e.Field, e.Reason)
}

// Unwrap lets errors.Is match both ErrInvalidMessage and the specific kind.
func (e *ValidationError) Unwrap() []error { return []error{ErrInvalidMessage, e.Kind} }

// ErrLeaseLost is returned by Ack, Nack, Release and Complete when the caller
// no longer holds the event's lease: the lease expired (and perhaps another
// worker reclaimed the event), or the event was already completed. Nothing
// was changed. The right reaction is to log it and move on: never nack an
// event whose ack failed this way — whoever holds it now decides its fate.
var ErrLeaseLost = errors.New("outbox: lease lost: the event is no longer leased to this worker (lease expired or event already completed); nothing was changed")

// ErrNoTopics is returned by ClaimBatch when ClaimConfig.Topics is empty: a
// claimer must say which (namespace, topic) pairs it can publish, so that it
// never takes another service's events.
var ErrNoTopics = errors.New("outbox: ClaimConfig.Topics is empty: list the (namespace, topic) pairs this worker publishes")

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
