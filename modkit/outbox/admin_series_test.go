package outbox_test

import (
	"errors"
	"testing"
	"time"

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
