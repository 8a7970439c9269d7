package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// purgeCall is one Store.Purge of a dispatcher, as watchedStore saw it.
type purgeCall struct {
	from, cutoff time.Time
	cutShort     bool // reported as failed, as a pass cut short by its deadline is
}

// watchedStore is the real store, with the dispatcher's purges recorded;
// while cutShort is set, each purge runs and is then reported failed, as
// when a pass's deadline ends it after statements that deleted their
// whole limit.
type watchedStore struct {
	driver.Store
	mu       sync.Mutex
	calls    []purgeCall
	cutShort bool
}

func (s *watchedStore) Purge(ctx context.Context, p driver.PurgeParams) (driver.PurgeResult, error) {
	res, err := s.Store.Purge(ctx, p)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil && s.cutShort {
		res, err = driver.PurgeResult{Purged: res.Purged}, context.DeadlineExceeded
	}
	s.calls = append(s.calls, purgeCall{from: p.From, cutoff: res.Cutoff, cutShort: err != nil})
	return res, err
}

func (s *watchedStore) setCutShort(on bool) {
	s.mu.Lock()
	s.cutShort = on
	s.mu.Unlock()
}

func (s *watchedStore) log() []purgeCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]purgeCall(nil), s.calls...)
}

type watchedDriver struct {
	driver.Driver
	store *watchedStore
}

func (d *watchedDriver) Open(opts driver.Options) (driver.Store, error) {
	st, err := d.Driver.Open(opts)
	d.store = &watchedStore{Store: st}
	return d.store, err
}

// A dispatcher purges from a watermark after its first pass: each purge
// starts at the cutoff of the last one that completed minus the margin,
// the first from the oldest event; a purge cut short leaves the watermark
// where it was; and no event past its retention is left behind, one
// settled below the watermark within the margin (a late commit) included.
// One settled further below waits for the full walk (hourly), which the
// test does not reach.
func TestPurgeFromWatermark(t *testing.T) {
	clock := newTestClock()
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	drv := &watchedDriver{Driver: outboxpg.New(pool)}
	c, err := outbox.New(drv, outbox.Config{Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	st := drv.store

	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.SweepInterval = 200 * time.Millisecond // the test waits for passes that finished before their deadline
	cfg.Retention = time.Hour
	noop := outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	d, pass := startMaintained(t, c, cfg, noop)
	margin := outbox.PurgeMargin(d)
	if margin != 10*time.Minute {
		t.Fatalf("margin %v with a 30s lease, want the 10 minutes minimum", margin)
	}

	delivered := 0
	deliver := func(n int) {
		t.Helper()
		enqueueN(t, c, pool, n)
		delivered += n
		log.waitFor(t, "delivered", finalCount(outbox.StatusDelivered, delivered))
	}
	// dueLeft counts the delivered events past the retention, but for
	// those settled at or before not.
	dueLeft := func(not time.Time) int {
		return countRows(t, pool, "status = 'delivered' AND updated_at < $1 AND updated_at > $2", clock.Now().Add(-time.Hour), not)
	}

	deliver(10)
	pass.waitFinishedPasses(t, 2)
	clock.Advance(61 * time.Minute) // the ten are past the retention
	pass.waitFinishedPasses(t, 2)
	if n := dueLeft(time.Time{}); n != 0 {
		t.Fatalf("%d delivered events past the retention left", n)
	}

	// Two events committed late: settled below the watermark (the cutoff
	// of the last pass, now - 1h while the clock stands still), one within
	// the margin, one below it.
	deliver(2)
	watermark := clock.Now().Add(-time.Hour)
	lateWithin := watermark.Add(-margin / 2)
	lateBelow := watermark.Add(-2 * margin)
	setSettled(t, pool, lateWithin, 1)
	setSettled(t, pool, lateBelow, 1)
	pass.waitFinishedPasses(t, 2)
	if n := dueLeft(lateBelow); n != 0 {
		t.Fatalf("%d delivered events past the retention left, the one settled within the margin below the watermark among them", n)
	}
	if n := countRows(t, pool, "status = 'delivered' AND updated_at = $1", lateBelow); n != 1 {
		t.Fatalf("%d events settled below the watermark's margin left, want 1 (it waits for the hourly full walk; else the purge did not start at the watermark)", n)
	}

	// Passes cut short do not move the watermark, though the clock did.
	clock.Advance(5 * time.Minute)
	st.setCutShort(true)
	pass.waitFinishedPasses(t, 2)
	st.setCutShort(false)
	deliver(3)
	clock.Advance(61 * time.Minute)
	pass.waitFinishedPasses(t, 2)
	if n := dueLeft(lateBelow); n != 0 {
		t.Fatalf("%d delivered events past the retention left", n)
	}

	// Every purge started where the rule says.
	calls := st.log()
	var mark time.Time
	var fromMark, cut int
	for i, call := range calls {
		want := time.Time{}
		if !mark.IsZero() {
			want = mark.Add(-margin)
			fromMark++
		}
		if !call.from.Equal(want) {
			t.Fatalf("purge %d of %d started at %v, want %v (the last complete purge's cutoff %v, minus %v)", i, len(calls), call.from, want, mark, margin)
		}
		if call.cutShort {
			cut++
			continue
		}
		if call.cutoff.IsZero() {
			t.Fatalf("purge %d returned no cutoff", i)
		}
		mark = call.cutoff
	}
	if !calls[0].from.IsZero() || fromMark == 0 || cut == 0 {
		t.Fatalf("%d purges: the first from %v; %d from a watermark, %d cut short; want the first from the oldest event, some of each", len(calls), calls[0].from, fromMark, cut)
	}
}

// setSettled moves the outcome time of n delivered events settled at the
// test clock's latest time to at.
func setSettled(t *testing.T, pool *pgxpool.Pool, at time.Time, n int) {
	t.Helper()
	tag, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET updated_at = $1 WHERE id IN (
		SELECT id FROM modkit_outbox_events WHERE status = 'delivered'
		ORDER BY updated_at DESC, id LIMIT $2)`, at, n)
	if err != nil || tag.RowsAffected() != int64(n) {
		t.Fatalf("moved %d outcomes: %v", tag.RowsAffected(), err)
	}
}
