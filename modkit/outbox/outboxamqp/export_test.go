package outboxamqp

import (
	"context"
	"time"
)

// AwaitAbandoned waits until every publish abandoned on p's current
// session has its confirmation (or the channel closed), or ctx ends.
func AwaitAbandoned(ctx context.Context, p *Publisher) error {
	p.mu.Lock()
	s := p.sess
	p.mu.Unlock()
	if s == nil {
		return nil
	}
	s.mu.Lock()
	marks := append([]mark(nil), s.marks...)
	s.mu.Unlock()
	for _, m := range marks {
		select {
		case <-m.dc.Done():
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// AbandonedMarks returns how many marks of abandoned publishes p's current
// session holds: by message-id, and in its queue.
func AbandonedMarks(p *Publisher) (ids, queued int) {
	p.mu.Lock()
	s := p.sess
	p.mu.Unlock()
	if s == nil {
		return 0, 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.abandoned), len(s.marks)
}

// SetCloseWait sets how long closing a connection waits for the broker's
// answer, until the test ends.
func SetCloseWait(t interface{ Cleanup(func()) }, d time.Duration) {
	old := closeWait
	closeWait = d
	t.Cleanup(func() { closeWait = old })
}

// SendWhenContextEnded makes p's publishes whose ctx has ended send their
// message and abandon it at once (a publish sends nothing then), for tests
// of abandoned publishes.
func SendWhenContextEnded(p *Publisher) { p.sendWhenEnded = true }

// ExchangeChecks returns how many exchange checks (passive declares) p has
// started.
func ExchangeChecks(p *Publisher) int64 { return p.exchangeChecks.Load() }
