package outbox_test

import (
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// guard bounds every wait on a signal: reaching it fails the test. It is a
// hang detector, not a performance assertion.
const guard = 2 * time.Minute

// outcomeLog collects OnOutcome callbacks and lets a test wait for a
// condition on them.
type outcomeLog struct {
	mu      sync.Mutex
	byID    map[uuid.UUID][]outbox.Outcome
	changed chan struct{}
}

func newOutcomeLog() *outcomeLog {
	return &outcomeLog{byID: map[uuid.UUID][]outbox.Outcome{}, changed: make(chan struct{}, 1)}
}

func (l *outcomeLog) hook(d outbox.Delivery, o outbox.Outcome) {
	l.mu.Lock()
	l.byID[d.ID] = append(l.byID[d.ID], o)
	l.mu.Unlock()
	select {
	case l.changed <- struct{}{}:
	default:
	}
}

// waitFor blocks until cond (called under the lock) holds.
func (l *outcomeLog) waitFor(t *testing.T, what string, cond func(map[uuid.UUID][]outbox.Outcome) bool) {
	t.Helper()
	timeout := time.After(guard)
	for {
		l.mu.Lock()
		ok := cond(l.byID)
		l.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-l.changed:
		case <-timeout:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// finalCount holds when at least n events' last outcome has status (and
// was recorded).
func finalCount(status outbox.Status, n int) func(map[uuid.UUID][]outbox.Outcome) bool {
	return func(m map[uuid.UUID][]outbox.Outcome) bool {
		c := 0
		for _, os := range m {
			if last := os[len(os)-1]; !last.LeaseLost && !last.Released && last.Status == status {
				c++
			}
		}
		return c >= n
	}
}

// allEnded holds when the last outcome of each of ids has status.
func allEnded(status outbox.Status, ids []uuid.UUID) func(map[uuid.UUID][]outbox.Outcome) bool {
	return func(m map[uuid.UUID][]outbox.Outcome) bool {
		for _, id := range ids {
			if os := m[id]; len(os) == 0 || os[len(os)-1].Status != status {
				return false
			}
		}
		return true
	}
}

func testConfig(log *outcomeLog) outbox.DispatcherConfig {
	return outbox.DispatcherConfig{
		LeaseDuration: 30 * time.Second,
		PollInterval:  50 * time.Millisecond,
		Retry:         outbox.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: 4 * time.Millisecond},
		MaxAttempts:   3,
		StopTimeout:   30 * time.Second,
		Logger:        quietLog,
		OnOutcome:     log.hook,
	}
}

// startDispatcher starts a dispatcher of c for pubs and stops it when the
// test ends.
func startDispatcher(t *testing.T, c *outbox.Client, cfg outbox.DispatcherConfig, pubs ...outbox.Publisher) *outbox.Dispatcher {
	t.Helper()
	d, err := c.NewDispatcher(cfg, pubs...)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return d
}

// clientWrappingStore returns a client on pool whose PostgreSQL store is
// passed through wrap (a test's store that changes some calls).
func clientWrappingStore(t *testing.T, pool *pgxpool.Pool, wrap func(driver.Store) driver.Store) *outbox.Client {
	t.Helper()
	c, err := outbox.New(wrappedDriver{Driver: outboxpg.New(pool), wrap: wrap}, outbox.Config{Logger: quietLog})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// wrappedDriver opens its Driver's store and hands it to wrap.
type wrappedDriver struct {
	driver.Driver
	wrap func(driver.Store) driver.Store
}

func (d wrappedDriver) Open(opts driver.Options) (driver.Store, error) {
	st, err := d.Driver.Open(opts)
	if err != nil {
		return nil, err
	}
	return d.wrap(st), nil
}
