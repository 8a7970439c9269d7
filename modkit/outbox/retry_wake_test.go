package outbox_test

import (
	"context"
	"errors"
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
