package outboxtest_test

import (
	"errors"
	"slices"
	"testing"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// Drain delivers every event of its publishers' topics, retries included,
// returns the successful publishes and leaves other topics alone.
func TestDrain(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	for _, id := range []string{"o-1", "o-2", "o-3"} {
		enqueue(t, c, pool, placed, `{"id":"`+id+`"}`)
	}
	enqueue(t, c, pool, shipped, `{"id":"o-1"}`)
	rec := outboxtest.NewRecorder()
	var flaky uuid.UUID
	rec.Fail = func(d outbox.Delivery) error {
		if string(d.Payload) == `{"id": "o-2"}` && d.Attempt == 1 {
			flaky = d.ID
			return errors.New("broker busy")
		}
		return nil
	}
	published := outboxtest.Drain(t, c, rec.Publisher(placed))
	if len(published) != 3 {
		t.Fatalf("published %d events, want 3: %+v", len(published), published)
	}
	calls := rec.Deliveries()
	if len(calls) != 4 {
		t.Fatalf("recorded %d publish calls, want 4 (one retry)", len(calls))
	}
	if i := slices.IndexFunc(published, func(d outbox.Delivery) bool { return d.ID == flaky }); i < 0 || published[i].Attempt != 2 {
		t.Fatalf("the retried event: %+v", published)
	}
	for _, e := range outboxtest.RequireEnqueued(t, c, placed) {
		if e.Status != outbox.StatusDelivered {
			t.Errorf("event %s is %s after Drain", e.ID, e.Status)
		}
	}
	if e := outboxtest.RequireEnqueued(t, c, shipped); e[0].Status != outbox.StatusPending {
		t.Fatalf("another topic's event was touched: %+v", e[0])
	}
	// Nothing left: Drain returns at once with nothing.
	if again := outboxtest.Drain(t, c, rec.Publisher(placed)); len(again) != 0 {
		t.Fatalf("second drain published %+v", again)
	}
}
