package outbox_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// A retry is claimed when it falls due, not at the next poll: the
// dispatcher arms a timer for the due time it recorded. Polling (hourly)
// and notifications are out of the picture, so only that timer can bring
// the second attempt before the test's guard (two minutes) runs out; and
// it must not come before the row's next_attempt_at.
func TestRetryClaimedWhenDue(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	id := enqueueN(t, c, tdb.Provider.Pool, 1)[0]
	attempts := make(chan time.Time, 2)
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.PollOnly = true
	cfg.LeaseDuration, cfg.PollInterval = 3*time.Hour, time.Hour
	cfg.Retry = outbox.RetryPolicy{BaseDelay: 400 * time.Millisecond, MaxDelay: 400 * time.Millisecond} // 200–400ms
	startDispatcher(t, c, cfg, outbox.Publisher{Topic: testTopic, Publish: func(_ context.Context, d outbox.Delivery) error {
		attempts <- time.Now()
		if d.Attempt == 1 {
			return errors.New("broker unavailable")
		}
		return nil
	}})
	log.waitFor(t, "delivery", finalCount(outbox.StatusDelivered, 1))
	<-attempts
	second := <-attempts
	e := get(t, c, id)
	if e.Attempts != 2 {
		t.Fatalf("event after delivery: %+v", e)
	}
	var retryIn time.Duration
	log.mu.Lock()
	retryIn = log.byID[id][0].RetryIn
	log.mu.Unlock()
	// next_attempt_at is the retry's due time by the database clock (the
	// same host's clock as the publisher's).
	late := second.Sub(e.NextAttemptAt)
	t.Logf("retry in %v; second attempt %v after its next_attempt_at", retryIn, late)
	if retryIn < 200*time.Millisecond || late < 0 {
		t.Fatalf("retry due in %v ran %v after its due time; want a delay of at least 200ms, and no attempt before it", retryIn, late)
	}
}

// A retry that falls due while its topic's lane has too little room to
// claim is claimed once the lane has room. The due time's wake-up was
// dropped when another topic's lane claimed in its round, and the retry
// waited for the poll (here past the test's guard: polls and
// notifications are off). The same holds for a notification's wake-up.
func TestDueRetryWaitsForItsLanesRoom(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	busy, idle := outbox.Topic{Namespace: "test", Topic: "busy"}, outbox.Topic{Namespace: "test", Topic: "idle"}
	retried := enqueueTopic(t, client, pool, busy, 1)[0]
	// One publish at a time and claims of 10: once the first attempt has
	// failed, the lane holds at most 1 + 2×10 events. The 17 after it
	// leave it too little room to claim (4, under half a claim), and its
	// last claim was not full, so nothing but a wake-up makes it claim
	// again.
	enqueueTopic(t, client, pool, busy, 17)
	gate := make(chan struct{})
	failedAt := make(chan time.Time, 1)
	second := make(chan struct{})
	publish := func(ctx context.Context, d outbox.Delivery) error {
		if d.ID == retried {
			if d.Attempt == 1 {
				failedAt <- time.Now()
				return errors.New("try again")
			}
			close(second)
			return nil
		}
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	cfg := withoutRechecks(testConfig(newOutcomeLog()))
	cfg.PollOnly, cfg.BatchSize = true, 10
	cfg.Retry = outbox.RetryPolicy{BaseDelay: time.Second, MaxDelay: time.Second} // due 0.5–1 s after the failure
	d, err := client.NewDispatcher(cfg, outbox.Publisher{Topic: busy, Publish: publish, Concurrency: 1},
		outbox.Publisher{Topic: idle, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	// The claimer's wake-ups and rounds, in its order.
	type step struct {
		due    bool
		topics []string
	}
	steps := make(chan step, 100)
	outbox.OnDueWake(d, func() { steps <- step{due: true} })
	outbox.OnClaimRound(d, func(topics []string) { steps <- step{topics: topics} })
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	opened := false
	t.Cleanup(func() {
		if !opened {
			close(gate)
		}
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	recv(t, "the first attempt's failure", failedAt)
	// The round after the due retry's wake-up. The busy lane, without
	// room, does not claim in it.
	for {
		if recv(t, "the wake-up for the due retry", steps).due {
			break
		}
	}
	if r := recv(t, "the round of claims when the retry fell due", steps); slices.Contains(r.topics, "test:busy") {
		t.Fatal("the busy lane had room when the retry fell due: the test needs it without")
	}
	close(gate) // the busy lane drains and has room
	opened = true
	recv(t, "the retry's second attempt", second)
}
