package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// A dispatcher is ready only once a claim succeeds: while its claims fail
// (here they wait on a table lock until their deadline), Start waits and
// Health reports it starting and degraded by the failing claims; when a
// claim succeeds, Start returns and Health reports it running and healthy.
func TestHealthReadyAfterFirstClaim(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	cfg := testConfig(newOutcomeLog())
	cfg.LeaseDuration = time.Second // a claim gives up after LeaseHeadroom, 200ms
	d, err := c.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if h := d.Health(); h.State() != "stopped" || h.Running || h.Starting || h.Degraded {
		t.Fatalf("health before Start: %+v (%s)", h, h.State())
	}

	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, "LOCK TABLE modkit_outbox_events IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	started := make(chan error, 1)
	go func() { started <- d.Start(ctx) }()
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	eventually(t, "a failed claim reported", func() bool { return d.Health().Degraded })
	h := d.Health()
	if !h.Starting || h.Running || h.State() != "degraded" || !strings.Contains(strings.Join(h.Problems, "\n"), "claims failing") {
		t.Fatalf("health while claims fail before the first success: %+v (%s)", h, h.State())
	}
	// The error is in ClaimError, not quoted in Problems, which anyone
	// who sees the health may read.
	if h.ClaimError == nil || strings.Contains(strings.Join(h.Problems, "\n"), h.ClaimError.Error()) {
		t.Fatalf("health while claims fail: ClaimError %v, problems %q: want the error in ClaimError only", h.ClaimError, h.Problems)
	}
	select {
	case err := <-started:
		t.Fatalf("Start returned (%v) before any claim succeeded", err)
	default:
	}

	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := recv(t, "Start to return", started); err != nil {
		t.Fatalf("start: %v", err)
	}
	if h := d.Health(); !h.Running || h.Starting || h.Degraded || len(h.Problems) != 0 || h.ClaimError != nil || h.State() != "running" {
		t.Fatalf("health after the first claim: %+v (%s)", h, h.State())
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if h := d.Health(); h.State() != "stopped" {
		t.Fatalf("health after Stop: %+v (%s)", h, h.State())
	}
}

// failingCompleteStore fails every outcome write while failing is set.
type failingCompleteStore struct {
	driver.Store
	failing atomic.Bool
}

func (s *failingCompleteStore) Complete(ctx context.Context, tx any, worker uuid.UUID, o []driver.Outcome) ([]bool, error) {
	if s.failing.Load() {
		return nil, errors.New("test: outcome writes fail")
	}
	return s.Store.Complete(ctx, tx, worker, o)
}

// While outcome writes fail, events are published but never marked
// delivered (and are published again when their leases end): Health says
// so, and is healthy again once a write succeeds.
func TestHealthDegradedWhileOutcomeWritesFail(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	store := &failingCompleteStore{}
	store.failing.Store(true)
	fc := clientWrappingStore(t, tdb.Provider.Pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	id := enqueueN(t, c, tdb.Provider.Pool, 1)[0]
	outcomes := newOutcomeLog()
	d := startDispatcher(t, fc, testConfig(outcomes), outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	eventually(t, "failing outcome writes reported", func() bool { return d.Health().Degraded })
	if h := d.Health(); !h.Running || !strings.Contains(strings.Join(h.Problems, "\n"), "recording outcomes failing since") {
		t.Fatalf("health while outcome writes fail: %+v", h)
	}
	store.failing.Store(false)
	outcomes.waitFor(t, "the delivery recorded", func(m map[uuid.UUID][]outbox.Outcome) bool {
		return slices.ContainsFunc(m[id], func(o outbox.Outcome) bool { return o.Status == outbox.StatusDelivered })
	})
	if h := d.Health(); h.Degraded || len(h.Problems) > 0 {
		t.Fatalf("health after an outcome write succeeded: %+v", h)
	}
}
