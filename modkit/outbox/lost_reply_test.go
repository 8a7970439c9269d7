package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// lostReplyStore records the first outcome write it is given, then fails
// it as if the connection had dropped after the commit, before the answer
// came back.
type lostReplyStore struct {
	driver.Store
	lost     atomic.Bool
	mu       sync.Mutex
	lostOnes []driver.Outcome // the outcomes of the write whose answer was lost
}

func (s *lostReplyStore) Complete(ctx context.Context, tx any, worker uuid.UUID, o []driver.Outcome) ([]bool, error) {
	settled, err := s.Store.Complete(ctx, tx, worker, o)
	if err != nil || tx != nil || !s.lost.CompareAndSwap(false, true) {
		return settled, err
	}
	s.mu.Lock()
	s.lostOnes = append(s.lostOnes, o...)
	s.mu.Unlock()
	return nil, errors.New("test: unexpected EOF (the connection dropped after the commit)")
}

func (s *lostReplyStore) RecordedOutcomes(ctx context.Context, worker uuid.UUID, o []driver.Outcome) ([]bool, error) {
	return s.Store.(driver.OutcomeFinder).RecordedOutcomes(ctx, worker, o)
}

// An outcome write that committed but whose answer was lost is tried
// again; the retry finds those leases ended by the first write and records
// nothing. The outcomes were recorded, so they are reported as recorded:
// they were reported as leases lost (OnOutcome's LeaseLost, the lease_lost
// metric and a warning that the events would be delivered again, which they
// were not). Deliveries and retries (a failing publish) alike.
func TestOutcomeWriteWhoseAnswerWasLost(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	store := &lostReplyStore{}
	fc := clientWrappingStore(t, pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	ids := enqueueN(t, c, pool, 20)
	var publishes sync.Map // event id → publishes
	outcomes := newOutcomeLog()
	startDispatcher(t, fc, testConfig(outcomes), outbox.Publisher{Topic: testTopic,
		Publish: func(_ context.Context, d outbox.Delivery) error {
			n, _ := publishes.LoadOrStore(d.ID, new(atomic.Int32))
			if n.(*atomic.Int32).Add(1) == 1 && strings.HasSuffix(string(d.Payload), `3}`) {
				return errors.New("test: first publish of the event fails")
			}
			return nil
		}})
	// An event retried in the write whose answer was lost may be delivered
	// before that write's retry reports the retry: each event's delivery
	// (or lost lease, which the old code reported) is looked for among its
	// reports, not last.
	outcomes.waitFor(t, "every event delivered", func(m map[uuid.UUID][]outbox.Outcome) bool {
		for _, id := range ids {
			if !slices.ContainsFunc(m[id], func(o outbox.Outcome) bool { return o.Status == outbox.StatusDelivered || o.LeaseLost }) {
				return false
			}
		}
		return true
	})

	store.mu.Lock()
	lost := store.lostOnes
	store.mu.Unlock()
	if len(lost) == 0 {
		t.Fatal("no outcome write had its answer lost")
	}
	outcomes.mu.Lock()
	defer outcomes.mu.Unlock()
	for _, o := range lost {
		reports := outcomes.byID[o.ID]
		if len(reports) == 0 || reports[0].LeaseLost {
			t.Errorf("event %s, whose outcome (kind %d) the write with the lost answer recorded: reported %+v, want it recorded", o.ID, o.Kind, reports)
		}
	}
	for id, reports := range outcomes.byID {
		for _, r := range reports {
			if r.LeaseLost {
				t.Errorf("event %s: lease reported lost (%+v); no lease ended", id, reports)
			}
		}
	}
}
