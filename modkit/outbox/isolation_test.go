package outbox_test

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// A publisher that ignores its context must cost other topics nothing: on
// topic A every publish hangs until the test ends; topic B's events all go
// through on the same dispatcher (Concurrency 2, 1s lease), none of A's
// events burns an attempt or dies, Health reads degraded while A hangs,
// Stop returns within its timeout and the dispatcher can be started again.
func TestStuckPublisherDoesNotStallOtherTopics(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	topicA := outbox.Topic{Namespace: "stuck", Topic: "a"}
	topicB := outbox.Topic{Namespace: "stuck", Topic: "b"}

	// A's publisher blocks until the test releases it, ignoring ctx.
	release := make(chan struct{})
	var hung sync.WaitGroup
	var hangs atomic.Int64
	t.Cleanup(func() { close(release); hung.Wait() }) // runs last: after the Stop below
	hang := func(context.Context, outbox.Delivery) error {
		hung.Add(1)
		defer hung.Done()
		hangs.Add(1)
		<-release
		return nil
	}
	var deliveredB atomic.Int64
	var awaited atomic.Pointer[uuid.UUID] // a B event whose delivery the test waits for
	awaitedDone := make(chan struct{}, 1)
	allB := make(chan struct{})
	const nB = 1000
	publishB := func(_ context.Context, d outbox.Delivery) error { return nil }

	// A's events first, so that the oldest-first claims meet them first.
	enqueueTopic(t, c, pool, topicA, 20)
	enqueueTopic(t, c, pool, topicB, nB)

	abandoned := make(chan struct{}, 1)
	var deadB atomic.Int64
	cfg := outbox.DispatcherConfig{
		Concurrency: 2, LeaseDuration: time.Second, PollInterval: 100 * time.Millisecond, MaxAttempts: 3,
		StopTimeout: 5 * time.Second, Logger: quietLog,
		OnOutcome: func(d outbox.Delivery, o outbox.Outcome) {
			switch {
			case o.Abandoned:
				select {
				case abandoned <- struct{}{}:
				default:
				}
			case d.Topic == topicB.Topic && o.Status == outbox.StatusDead:
				deadB.Add(1)
			case d.Topic == topicB.Topic && o.Status == outbox.StatusDelivered && !o.LeaseLost && !o.Released:
				if deliveredB.Add(1) == nB {
					close(allB)
				}
				if w := awaited.Load(); w != nil && *w == d.ID {
					awaitedDone <- struct{}{}
				}
			}
		},
	}
	d, err := c.NewDispatcher(cfg,
		outbox.Publisher{Topic: topicA, Publish: hang, Name: "hangs"},
		outbox.Publisher{Topic: topicB, Publish: publishB})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	recv(t, "a publish of topic A to be abandoned", abandoned)
	h := d.Health()
	if !h.Running || !h.Degraded || h.Abandoned < 1 || !strings.Contains(strings.Join(h.Problems, "\n"), topicA.String()) {
		t.Fatalf("health while A hangs: %+v", h)
	}
	recv(t, "all of B's events delivered", allB)
	if n := deadB.Load(); n != 0 {
		t.Fatalf("%d of B's events are dead", n)
	}
	if n := countRows(t, pool, "namespace = 'stuck' AND topic = 'b' AND status = 'delivered'"); n != nB {
		t.Fatalf("%d of B's %d events are delivered in the table", n, nB)
	}
	if n := countRows(t, pool, "namespace = 'stuck' AND topic = 'a' AND (status = 'dead' OR attempts > 1)"); n != 0 {
		t.Fatalf("%d of A's events died or used more than one attempt: the paused topic must claim nothing while it hangs", n)
	}

	// Stop returns within its timeout (ErrStopTimeout otherwise), although
	// A's publishes still hang.
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if h := d.Health(); h.Running {
		t.Fatalf("health after stop: %+v", h)
	}
	// A later Start works and delivers.
	if err := d.Start(ctx); err != nil {
		t.Fatalf("restart: %v", err)
	}
	more := uuid.Must(uuid.NewV7())
	awaited.Store(&more)
	if _, err := pool.Exec(ctx, `INSERT INTO modkit_outbox_events (id, namespace, topic, payload) VALUES ($1, 'stuck', 'b', '{}')`, more); err != nil {
		t.Fatal(err)
	}
	recv(t, "the restarted dispatcher to deliver a new event", awaitedDone)
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	if hangs.Load() == 0 {
		t.Fatal("topic A was never published")
	}
}

// The claimer takes no more than the lanes can start: with one slot per
// topic and a publisher that holds it, a topic's queue never grows past
// what it can start before the deadline, and nothing is claimed twice by
// the same dispatcher while it still holds it.
func TestClaimsBoundedByLaneRoom(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	topic := outbox.Topic{Namespace: "lanes", Topic: "slow"}
	gate := make(chan struct{})
	var mu sync.Mutex
	seen := map[uuid.UUID]int{}
	var calls atomic.Int64
	first := make(chan struct{})
	ids := enqueueTopic(t, c, pool, topic, 40)
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.Concurrency, cfg.BatchSize = 1, 10
	startDispatcher(t, c, cfg, outbox.Publisher{Topic: topic, Publish: func(ctx context.Context, d outbox.Delivery) error {
		mu.Lock()
		seen[d.ID]++
		mu.Unlock()
		if calls.Add(1) == 1 {
			close(first)
			<-gate // hold the only slot until the test has looked
		}
		return nil
	}})
	<-first
	// One publish running and, before any publish of the lane has
	// finished, at most one batch queued: the other events stay pending in
	// the table.
	if n := countRows(t, pool, "namespace = 'lanes' AND status = 'processing'"); n > 1+cfg.BatchSize {
		t.Fatalf("%d events claimed while one slot is busy; at most %d (one running, one batch queued)", n, 1+cfg.BatchSize)
	}
	close(gate)
	log.waitFor(t, "all delivered", finalCount(outbox.StatusDelivered, len(ids)))
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("event %s published %d times", id, n)
		}
	}
}

// A consumer that is down makes every publish run to its deadline, and the
// events queued behind those publishes cannot start before it. They go back
// unpublished, their attempt not counted; none is handed to the publisher
// on a context that has already ended, where it would fail at once and use
// up an attempt.
func TestQueuedEventsPastTheirDeadlineAreNotPublished(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	topic := outbox.Topic{Namespace: "late", Topic: "start"}
	enqueueTopic(t, c, tdb.Provider.Pool, topic, 300)

	var calls, late atomic.Int64
	down := func(ctx context.Context, _ outbox.Delivery) error {
		calls.Add(1)
		if ctx.Err() != nil {
			late.Add(1) // started after its publish deadline
		}
		<-ctx.Done() // the consumer never answers
		return ctx.Err()
	}
	const wantFailed = 6 // three deadlines' worth of the two slots' publishes
	var failed, released atomic.Int64
	enough := make(chan struct{})
	cfg := outbox.DispatcherConfig{
		Concurrency: 2, LeaseDuration: time.Second, PollInterval: 50 * time.Millisecond, MaxAttempts: 1000,
		Retry:       outbox.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: time.Millisecond},
		StopTimeout: 5 * time.Second, Logger: quietLog,
		OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
			switch {
			case o.Released:
				released.Add(1)
			case o.Status == outbox.StatusPending && !o.LeaseLost:
				if failed.Add(1) == wantFailed {
					close(enough)
				}
			}
		},
	}
	d := startDispatcher(t, c, cfg, outbox.Publisher{Topic: topic, Publish: down})
	recv(t, "publishes to fail at their deadline", enough)
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if n := late.Load(); n > 0 {
		t.Fatalf("%d of %d publishes started after their deadline, each charged an attempt; they should have gone back unpublished", n, calls.Load())
	}
	if released.Load() == 0 {
		t.Fatal("no event went back unpublished: nothing was queued behind the hung publishes, so the test proved nothing")
	}
}

// Topics whose publishes hang together cannot hold every slot: with
// Concurrency 8, topics A and B (four slots each by default) hang on every
// publish, and together they take seven slots, leaving the eighth to
// topic C, whose event is published while they still hang, not after
// their deadline. Once they return, the event of theirs that waited is
// delivered too.
func TestTopicsHungTogetherLeaveASlot(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	topicA := outbox.Topic{Namespace: "slots", Topic: "a"}
	topicB := outbox.Topic{Namespace: "slots", Topic: "b"}
	topicC := outbox.Topic{Namespace: "slots", Topic: "c"}

	release := make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // before the dispatcher's stop
	var running, most, ended atomic.Int64
	started := make(chan struct{}, 16)
	hang := func(ctx context.Context, _ outbox.Delivery) error {
		n := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		started <- struct{}{}
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			ended.Add(1)
			return ctx.Err()
		}
	}
	type seen struct{ running, ended int64 }
	publishedC := make(chan seen, 1)
	publishC := func(context.Context, outbox.Delivery) error {
		publishedC <- seen{running.Load(), ended.Load()}
		return nil
	}
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.Concurrency, cfg.LeaseDuration = 8, time.Minute
	startDispatcher(t, c, cfg,
		outbox.Publisher{Topic: topicA, Publish: hang},
		outbox.Publisher{Topic: topicB, Publish: hang},
		outbox.Publisher{Topic: topicC, Publish: publishC})

	enqueueTopic(t, c, pool, topicA, 4)
	enqueueTopic(t, c, pool, topicB, 4)
	for range 7 {
		recv(t, "seven hung publishes of A and B", started)
	}
	enqueueTopic(t, c, pool, topicC, 1)
	got := recv(t, "C's event published", publishedC)
	if got.ended != 0 || got.running != 7 {
		t.Fatalf("C's event was published with %d of A's and B's publishes running and %d ended at their deadline; "+
			"want it published beside seven hung publishes, none ended", got.running, got.ended)
	}
	releaseOnce.Do(func() { close(release) })
	log.waitFor(t, "all nine delivered", finalCount(outbox.StatusDelivered, 9))
	if m := most.Load(); m != 7 {
		t.Fatalf("at most %d of A's and B's publishes ran at once; want 7 (Concurrency 8, one slot kept for C)", m)
	}
}

// An event whose every publish hangs, ignoring its context, is
// dead-lettered after MaxAttempts: each abandoned publish counts as a
// failed attempt. It went back without using one, so it was claimed again
// for ever (Trial L: 49 claims in 25 minutes, attempts at 0-1), and no
// operator command could remove a pending event.
func TestAnEventWhosePublishAlwaysHangsIsDeadLettered(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	ids := enqueueN(t, c, tdb.Provider.Pool, 2)
	poison := ids[0]
	// The hung calls return once the dispatcher has stopped (cleanups run
	// last first). Counted with an atomic, not a WaitGroup: a call's Add
	// has no order with the test's Wait (an abandonment is timed, not
	// signalled by the call), which the race detector reports.
	release, returned := make(chan struct{}), make(chan struct{}, 16)
	var hung atomic.Int64
	t.Cleanup(func() {
		close(release)
		for range hung.Load() {
			<-returned
		}
	})
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.LeaseDuration, cfg.LeaseHeadroom, cfg.PollInterval = time.Second, 500*time.Millisecond, 100*time.Millisecond
	logs := newLogCapture(slog.LevelWarn)
	cfg.Logger = logs.logger()
	startDispatcher(t, c, cfg, outbox.Publisher{Topic: testTopic, Concurrency: 4, // room for the 3 abandoned calls: no pause
		Publish: func(_ context.Context, d outbox.Delivery) error {
			if d.ID == poison {
				hung.Add(1)
				defer func() { returned <- struct{}{} }()
				<-release // deaf to ctx
			}
			return nil
		}})
	var outs []outbox.Outcome
	log.waitFor(t, "the poison event dead", func(m map[uuid.UUID][]outbox.Outcome) bool {
		outs = slices.Clone(m[poison])
		return len(outs) > 0 && outs[len(outs)-1].Status == outbox.StatusDead
	})
	if len(outs) != cfg.MaxAttempts {
		t.Fatalf("outcomes of the poison event: %+v; want %d, one per attempt", outs, cfg.MaxAttempts)
	}
	for i, o := range outs {
		if !o.Abandoned || o.Released || o.LeaseLost || !strings.Contains(o.Error, "outlived its deadline and was abandoned") ||
			(i < len(outs)-1) != (o.Status == outbox.StatusPending && o.RetryIn > 0) {
			t.Fatalf("outcome %d of the poison event: %+v; want an abandoned attempt that failed (retried, the last dead)", i+1, o)
		}
	}
	if e := get(t, c, poison); e.Status != outbox.StatusDead || e.Attempts != cfg.MaxAttempts || e.LastError == nil ||
		!strings.Contains(*e.LastError, "ignores its context") {
		t.Fatalf("the poison event: %+v; want dead after %d attempts, saying its publisher ignores its context", e, cfg.MaxAttempts)
	}
	log.waitFor(t, "the other event delivered", func(m map[uuid.UUID][]outbox.Outcome) bool {
		o := m[ids[1]]
		return len(o) > 0 && o[len(o)-1].Status == outbox.StatusDelivered
	})
	// Its death is logged as an error, as any dead-lettering is (it was
	// logged at debug level as "given back").
	if !slices.ContainsFunc(logs.records(), func(r logRecord) bool {
		return r.Msg == "event dead-lettered" && r.Attrs["event_id"] == poison.String()
	}) {
		t.Fatalf("no error logged for the poison event's death: %v", logs.records())
	}
}
