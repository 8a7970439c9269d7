package outboxtest

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// WaitTimeout bounds Recorder.Wait and Drain: reaching it fails the test.
// It only catches hangs; nothing is expected to come near it. It is read
// by every test of the binary: change it in TestMain, before the tests
// run, not from a test (tests running in parallel would race on it).
var WaitTimeout = time.Minute

// Recorder is a capturing publisher: its Publishers record every call and
// succeed, or return what Fail says. It is safe for concurrent use; its
// zero value is ready to use, as NewRecorder's is.
type Recorder struct {
	// Fail, if set, decides each publish's result: return nil to succeed,
	// an error to have the dispatcher retry (or outbox.Permanent(err) to
	// dead-letter). Set it before the dispatcher starts. The dispatcher
	// calls it from several publishes at once, outside the Recorder's
	// lock: guard what it shares, such as a count of failures so far
	// (sync/atomic, or a mutex of its own).
	Fail func(d outbox.Delivery) error

	mu      sync.Mutex
	calls   []outbox.Delivery
	changed chan struct{}
}

// NewRecorder returns an empty Recorder.
func NewRecorder() *Recorder { return &Recorder{changed: make(chan struct{})} }

// Publisher returns a Publisher of topic that records each delivery.
func (r *Recorder) Publisher(topic outbox.Topic) outbox.Publisher {
	return outbox.Publisher{Topic: topic, Name: "outboxtest.Recorder " + topic.String(),
		Publish: func(_ context.Context, d outbox.Delivery) error {
			var err error
			if r.Fail != nil {
				err = r.Fail(d)
			}
			r.mu.Lock()
			defer r.mu.Unlock()
			r.calls = append(r.calls, d)
			close(r.changedLocked())
			r.changed = make(chan struct{})
			return err
		}}
}

// Deliveries returns every publish call recorded so far, in call order,
// failed attempts included (Delivery.Attempt tells them apart).
func (r *Recorder) Deliveries() []outbox.Delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// Wait blocks until at least n publish calls are recorded and returns
// them; it fails t after WaitTimeout.
func (r *Recorder) Wait(t TB, n int) []outbox.Delivery {
	t.Helper()
	timeout := time.NewTimer(WaitTimeout)
	defer timeout.Stop()
	for {
		r.mu.Lock()
		got, changed := slices.Clone(r.calls), r.changedLocked()
		r.mu.Unlock()
		if len(got) >= n {
			return got
		}
		select {
		case <-changed:
		case <-timeout.C:
			fatal(t, "waited %v for %d publish calls, got %d", WaitTimeout, n, len(got))
		}
	}
}

// changedLocked returns the channel closed at the next recorded call,
// making it in a Recorder not made by NewRecorder.
func (r *Recorder) changedLocked() chan struct{} {
	if r.changed == nil {
		r.changed = make(chan struct{})
	}
	return r.changed
}
