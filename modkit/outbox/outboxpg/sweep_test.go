package outboxpg_test

import (
	"testing"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Events the sweep gives an attempt back without a lease (held behind an
// undelivered event of their key, migration 0031) are not reported, yet
// count toward the batch: a batch of only such events ended the store's
// loop while an exhausted event was still due.
func TestSweepBatchOfGivenBackEventsGoesOn(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	insertKeyed(t, s, pool, "a", 4) // 2 to 4 held behind 1
	mustExec(t, pool, `UPDATE modkit_outbox_events SET attempts = 3 WHERE ordering_seq > 1`)
	ids := insertN(t, s, pool, "test", "events", 1)
	mustExec(t, pool, `UPDATE modkit_outbox_events SET attempts = 3 WHERE id = $1`, ids[0])
	swept, err := s.Sweep(ctx, driver.SweepParams{Topics: []string{topic}, MaxAttempts: 3, Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(swept) != 1 || swept[0].ID != ids[0] || swept[0].Repaired {
		t.Fatalf("swept %+v; want only the exhausted unkeyed event, dead", swept)
	}
	var status string
	if err := pool.QueryRow(ctx, `SELECT status FROM modkit_outbox_events WHERE id = $1`, ids[0]).Scan(&status); err != nil || status != "dead" {
		t.Fatalf("the exhausted event is %s (%v); want dead", status, err)
	}
}
