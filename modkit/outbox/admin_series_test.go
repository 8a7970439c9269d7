package outbox_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// TestSeries delivers events at two known instants of a test clock and
// checks the buckets, the per-topic split and the latency quantiles.
func TestSeries(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	clock := newTestClock()
	c := clientOn(t, pool, outbox.Config{Now: clock.Now})
	other := outbox.Topic{Namespace: "other", Topic: "t"}
	enqueueN(t, c, pool, 3)
	enqueueTopic(t, c, pool, other, 1)
	st := admStore(t, pool, "public", clock.Now)

	// 1 hour after enqueue: two test events delivered; one more 2 minutes
	// later with the other topic's event; the third test event dies.
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 2)...)
	first := clock.Now()
	clock.Advance(2 * time.Minute)
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 1, other)...)
	admKillAll(t, st)
	clock.Advance(time.Second)

	s, err := c.Admin().Series(ctx, outbox.SeriesQuery{Window: 10 * time.Minute, Bucket: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if !s.End.Equal(clock.Now().Truncate(time.Microsecond)) || s.Bucket != time.Minute || len(s.Total.Points) != 11 {
		t.Fatalf("window %v..%v bucket %v, %d points", s.Start, s.End, s.Bucket, len(s.Total.Points))
	}
	if s.Total.Delivered != 3 || len(s.Topics) != 2 || s.Topics[0].Topic != other || s.Topics[0].Delivered != 1 ||
		s.Topics[1].Topic != testTopic || s.Topics[1].Delivered != 2 {
		t.Fatalf("totals: %+v", s)
	}
	var nonZero []outbox.SeriesPoint
	for _, p := range s.Total.Points {
		if p.Delivered > 0 {
			nonZero = append(nonZero, p)
		}
	}
	if len(nonZero) != 2 || nonZero[0].Delivered != 2 || nonZero[1].Delivered != 1 ||
		!nonZero[0].Start.Equal(first.Truncate(time.Minute)) {
		t.Fatalf("buckets with deliveries: %+v (first delivery at %v)", nonZero, first)
	}
	// Enqueued at the database's now, about an hour before the test clock
	// (which started an hour ahead just before the enqueues).
	for _, p := range nonZero {
		if p.LatencyP50 < 59*time.Minute || p.LatencyMax > 2*time.Hour || p.LatencyP95 < p.LatencyP50 || p.LatencyMax < p.LatencyP95 {
			t.Fatalf("latency quantiles: %+v", p)
		}
	}

	for _, bad := range []outbox.SeriesQuery{{Window: -time.Minute}, {Bucket: time.Millisecond}, {Window: 24 * time.Hour, Bucket: time.Second}} {
		if _, err := c.Admin().Series(ctx, bad); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Errorf("Series(%+v) = %v, want ErrInvalidConfig", bad, err)
		}
	}
}

// TestSettled reads delivered and dead events in the order of their
// outcomes, from a point in time on.
func TestSettled(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	clock := newTestClock()
	c := clientOn(t, pool, outbox.Config{Now: clock.Now})
	ids := enqueueN(t, c, pool, 4)
	st := admStore(t, pool, "public", clock.Now)

	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 1)...)
	clock.Advance(time.Second)
	second := clock.Now()
	admKillAll(t, st) // claims the other three, leaving none pending
	clock.Advance(time.Second)
	if _, err := c.Enqueue(ctx, pool, msg(9)); err != nil { // pending: never settled
		t.Fatal(err)
	}

	all, err := c.Admin().Settled(ctx, time.Time{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 4 || all[0].ID != ids[0] || all[0].Status != outbox.StatusDelivered || all[3].Status != outbox.StatusDead {
		t.Fatalf("settled since the beginning: %v", admIDs(all))
	}
	later, err := c.Admin().Settled(ctx, second, 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(later) != 2 || later[0].Status != outbox.StatusDead {
		t.Fatalf("settled since %v, limit 2: %+v", second, later)
	}
	if _, err := c.Admin().Settled(ctx, second, 1001); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("limit 1001: %v", err)
	}
}

// TestSettledPage pages by (outcome time, id) through more than a page of
// outcomes recorded at one instant of the test clock, which Settled cannot
// page through by time: every event comes once, in order, and a page's
// cursor is refused by List and List's by SettledPage.
func TestSettledPage(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	clock := newTestClock()
	c := clientOn(t, pool, outbox.Config{Now: clock.Now})
	enqueueN(t, c, pool, 1200)
	st := admStore(t, pool, "public", clock.Now)

	// 1,200 outcomes at one instant (two claims, the clock standing still),
	// then three a second later.
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 600)...)
	admKillAll(t, st)
	first := clock.Now()
	clock.Advance(time.Second)
	enqueueN(t, c, pool, 3)
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 3)...)
	later := clock.Now()
	clock.Advance(time.Second)
	if _, err := c.Enqueue(ctx, pool, msg(9)); err != nil { // pending: never settled
		t.Fatal(err)
	}

	// By time alone the rows after the first thousand at one instant are
	// out of reach: reading again from the last time returns the same page.
	old, err := c.Admin().Settled(ctx, first, 1000)
	if err != nil || len(old) != 1000 || !old[999].UpdatedAt.Equal(first.Truncate(time.Microsecond)) {
		t.Fatalf("Settled: %d events, %v", len(old), err)
	}
	if again, err := c.Admin().Settled(ctx, old[999].UpdatedAt, 1000); err != nil || len(again) != 1000 || again[999].ID != old[999].ID {
		t.Fatalf("Settled from the last time read: %d events, %v", len(again), err)
	}

	var all []outbox.Event
	q := outbox.SettledQuery{Limit: 1000}
	for pages := 1; ; pages++ {
		page, err := c.Admin().SettledPage(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, page.Events...)
		if page.NextPage == "" {
			if pages != 2 {
				t.Fatalf("%d pages of 1,000 for 1,203 events, want 2", pages)
			}
			break
		}
		if pages == 1 && len(page.Events) != 1000 {
			t.Fatalf("first page: %d events, want 1000", len(page.Events))
		}
		q.After = page.NextPage
	}
	if len(all) != 1203 {
		t.Fatalf("paged through %d events, want the 1,203 settled", len(all))
	}
	seen := map[uuid.UUID]bool{}
	for i, e := range all {
		if seen[e.ID] {
			t.Fatalf("event %s returned twice", e.ID)
		}
		seen[e.ID] = true
		if e.Status != outbox.StatusDelivered && e.Status != outbox.StatusDead {
			t.Fatalf("event %s is %s", e.ID, e.Status)
		}
		if i > 0 {
			prev := all[i-1]
			if e.UpdatedAt.Before(prev.UpdatedAt) || (e.UpdatedAt.Equal(prev.UpdatedAt) && bytes.Compare(e.ID[:], prev.ID[:]) <= 0) {
				t.Fatalf("event %d (%v %s) is not after event %d (%v %s)", i, e.UpdatedAt, e.ID, i-1, prev.UpdatedAt, prev.ID)
			}
		}
	}
	if !all[1199].UpdatedAt.Equal(all[0].UpdatedAt) || all[1200].UpdatedAt.Equal(all[0].UpdatedAt) {
		t.Fatalf("outcome times: the first 1,200 should share one, the last three another: %v, %v, %v",
			all[0].UpdatedAt, all[1199].UpdatedAt, all[1200].UpdatedAt)
	}

	// Since bounds the pages; the default page size is 100.
	page, err := c.Admin().SettledPage(ctx, outbox.SettledQuery{Since: later})
	if err != nil || len(page.Events) != 3 || page.NextPage != "" || page.Events[0].ID != all[1200].ID {
		t.Fatalf("settled since %v: %v, next %q, %v", later, admIDs(page.Events), page.NextPage, err)
	}
	page, err = c.Admin().SettledPage(ctx, outbox.SettledQuery{})
	if err != nil || len(page.Events) != 100 || page.NextPage == "" {
		t.Fatalf("default page: %d events, next %q, %v", len(page.Events), page.NextPage, err)
	}
	next, err := c.Admin().SettledPage(ctx, outbox.SettledQuery{After: page.NextPage, Limit: 1})
	if err != nil || len(next.Events) != 1 || next.Events[0].ID != all[100].ID {
		t.Fatalf("after the default page: %v, %v (want %s)", admIDs(next.Events), err, all[100].ID)
	}

	// Bad input is refused.
	if _, err := c.Admin().SettledPage(ctx, outbox.SettledQuery{Limit: 1001}); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Errorf("limit 1001: %v", err)
	}
	if _, err := c.Admin().SettledPage(ctx, outbox.SettledQuery{Limit: -1}); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Errorf("limit -1: %v", err)
	}
	if _, err := c.Admin().SettledPage(ctx, outbox.SettledQuery{After: "garbage"}); !errors.Is(err, outbox.ErrInvalidCursor) {
		t.Errorf("cursor garbage: %v", err)
	}
	listed, err := c.Admin().List(ctx, outbox.EventFilter{Limit: 1})
	if err != nil || listed.NextPage == "" {
		t.Fatalf("list: %+v %v", listed, err)
	}
	if _, err := c.Admin().SettledPage(ctx, outbox.SettledQuery{After: listed.NextPage}); !errors.Is(err, outbox.ErrInvalidCursor) {
		t.Errorf("SettledPage with List's cursor: %v, want ErrInvalidCursor", err)
	}
	if _, err := c.Admin().List(ctx, outbox.EventFilter{After: page.NextPage}); !errors.Is(err, outbox.ErrInvalidCursor) {
		t.Errorf("List with SettledPage's cursor: %v, want ErrInvalidCursor", err)
	}
}
