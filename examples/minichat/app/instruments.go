package app

import (
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/examples/minichat/events"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// tracker counts the dispatcher's outcomes for the run's events
// (DispatcherConfig.OnOutcome); events of other tenants, such as leftovers
// of an earlier run in a shared database, are not counted.
type tracker struct {
	tenants map[uuid.UUID]bool // read-only after newTracker

	mu                       sync.Mutex
	delivered, retried, dead int64
}

func newTracker(tenants []uuid.UUID) *tracker {
	t := &tracker{tenants: map[uuid.UUID]bool{}}
	for _, id := range tenants {
		t.tenants[id] = true
	}
	return t
}

// outcome is the OnOutcome hook. It runs on the dispatcher's completer
// goroutine: it only counts.
func (t *tracker) outcome(d outbox.Delivery, o outbox.Outcome) {
	if d.Namespace != events.Namespace || d.Topic != events.TopicUsageSnapshot || d.TenantID == nil ||
		!t.tenants[*d.TenantID] || o.LeaseLost {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case o.Status == outbox.StatusDelivered:
		t.delivered++
	case o.Status == outbox.StatusDead:
		t.dead++
	case o.Status == outbox.StatusPending && !o.Released:
		t.retried++ // a failed attempt, rescheduled (not an event given back unpublished)
	}
}

func (t *tracker) counts() (delivered, retried, dead int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.delivered, t.retried, t.dead
}

// latencies pairs each turn's finalisation commit with the collector's
// first sight of its event: commit-to-publish latency.
type latencies struct {
	mu          sync.Mutex
	committedAt map[uuid.UUID]time.Time
	seenAt      map[uuid.UUID]time.Time
}

func newLatencies() *latencies {
	return &latencies{committedAt: map[uuid.UUID]time.Time{}, seenAt: map[uuid.UUID]time.Time{}}
}

// committed is the chat module's OnCommitted hook.
func (l *latencies) committed(turnID uuid.UUID, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.committedAt[turnID] = at
}

// seen is the collector's OnFirstSeen hook.
func (l *latencies) seen(turnID uuid.UUID, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.seenAt[turnID]; !ok {
		l.seenAt[turnID] = at
	}
}

// percentiles returns p50 and p99 of commit-to-first-publish, and the
// number of turns measured. The dispatcher can pick an event up before
// Finalise has returned from its commit; that counts as 0.
func (l *latencies) percentiles() (p50, p99 time.Duration, n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var d []time.Duration
	for id, c := range l.committedAt {
		if s, ok := l.seenAt[id]; ok {
			d = append(d, max(0, s.Sub(c)))
		}
	}
	if len(d) == 0 {
		return 0, 0, 0
	}
	slices.Sort(d)
	at := func(q float64) time.Duration { return d[min(len(d)-1, int(q*float64(len(d))))] }
	return at(0.50), at(0.99), len(d)
}
