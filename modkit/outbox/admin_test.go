package outbox_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// killAll dead-letters every claimable test event.
func killAll(t *testing.T, s *outbox.Store) []outbox.ClaimedMessage {
	t.Helper()
	got := mustClaim(t, s, claimCfg(1000))
	results := make([]outbox.Result, len(got))
	for i, m := range got {
		results[i] = outbox.Result{Message: m, Err: outbox.Permanent(errors.New("poison"))}
	}
	if _, err := s.Complete(ctx, results); err != nil {
		t.Fatal(err)
	}
	return got
}

func TestStats(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueueN(t, pool, 5)
	got := mustClaim(t, s, claimCfg(3))
	s.Ack(ctx, got[0])
	s.Nack(ctx, got[1], outbox.Permanent(errors.New("x")))
	outbox.Enqueue(ctx, pool, outbox.Message{Namespace: "other", Topic: "t", Payload: []byte(`{}`)})
	pool.Exec(ctx, "UPDATE modkit_outbox_events SET next_attempt_at = now() - interval '1 hour' WHERE namespace = 'other'")

	st, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Topics) != 2 {
		t.Fatalf("topics: %+v", st.Topics)
	}
	other, test := st.Topics[0], st.Topics[1]
	if test.Topic != testTopic || test.Pending != 2 || test.Processing != 1 || test.Delivered != 1 || test.Dead != 1 {
		t.Fatalf("test topic: %+v", test)
	}
	if other.Pending != 1 || other.OldestDueAge < time.Hour || st.Total.OldestDueAge != other.OldestDueAge {
		t.Fatalf("other topic: %+v, total %+v", other, st.Total)
	}
	if st.Total.Pending != 3 || st.Total.Dead != 1 {
		t.Fatalf("total: %+v", st.Total)
	}
}

func TestListAndReplayDead(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tenant := uuid.New()
	for i := range 5 {
		m := msg(i)
		if i%2 == 0 {
			m.TenantID = &tenant
		}
		outbox.Enqueue(ctx, pool, m)
	}
	dead := killAll(t, s)
	if len(dead) != 5 {
		t.Fatalf("killed %d", len(dead))
	}

	// Paging: 2 + 2 + 1, oldest first, no overlap.
	var all []outbox.Event
	f := outbox.DeadFilter{Namespace: testTopic.Namespace, Topic: testTopic.Topic, Limit: 2}
	for pages := 0; ; pages++ {
		page, err := s.ListDead(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, page.Events...)
		if page.NextPage == "" {
			if pages != 2 {
				t.Fatalf("%d pages, want 3", pages+1)
			}
			break
		}
		f.After = page.NextPage
	}
	if len(all) != 5 {
		t.Fatalf("listed %d dead events, want 5", len(all))
	}
	for i, e := range all {
		if e.ID != dead[i].ID || e.Status != outbox.StatusDead || !strings.Contains(*e.LastError, "poison") {
			t.Fatalf("event %d: %+v", i, e)
		}
	}
	byTenant, err := s.ListDead(ctx, outbox.DeadFilter{TenantID: &tenant})
	if err != nil || len(byTenant.Events) != 3 {
		t.Fatalf("tenant filter: %d events, %v", len(byTenant.Events), err)
	}
	if page, _ := s.ListDead(ctx, outbox.DeadFilter{Namespace: "nope"}); len(page.Events) != 0 {
		t.Fatal("namespace filter ignored")
	}
	if _, err := s.ListDead(ctx, outbox.DeadFilter{After: "garbage!"}); !errors.Is(err, outbox.ErrInvalidCursor) {
		t.Fatalf("bad cursor: %v", err)
	}
	if _, err := s.ListDead(ctx, outbox.DeadFilter{Limit: 5000}); err == nil {
		t.Fatal("limit 5000 accepted")
	}

	// Replay two of them (and an id that is not dead: skipped).
	live := enqueueN(t, pool, 1)[0]
	replayed, err := s.ReplayDead(ctx, []uuid.UUID{dead[0].ID, dead[1].ID, live}, "alice@ops")
	if err != nil || len(replayed) != 2 {
		t.Fatalf("replay: %v %v", replayed, err)
	}
	e := get(t, s, dead[0].ID)
	if e.Status != outbox.StatusPending || e.Attempts != 0 || !strings.Contains(*e.LastError, "replayed by alice@ops at ") ||
		!strings.Contains(*e.LastError, "poison") {
		t.Fatalf("replayed row: %+v", e)
	}
	got := mustClaim(t, s, claimCfg(10))
	if len(got) != 3 { // two replayed + the live one
		t.Fatalf("claim after replay: %d events", len(got))
	}
	if _, err := s.ReplayDead(ctx, []uuid.UUID{dead[2].ID}, " "); err == nil {
		t.Fatal("replay without 'by' accepted")
	}
}

func TestPurgeDelivered(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, pool, 7)
	got := mustClaim(t, s, claimCfg(6))
	for _, m := range got[:5] {
		if err := s.Ack(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	s.Nack(ctx, got[5], outbox.Permanent(errors.New("x")))
	// Four of the five delivered rows are old.
	pool.Exec(ctx, "UPDATE modkit_outbox_events SET updated_at = now() - interval '2 hours' WHERE id = ANY($1)", ids[:4])
	pool.Exec(ctx, "UPDATE modkit_outbox_events SET updated_at = now() - interval '2 hours' WHERE id = $1", ids[5]) // dead, old

	n, err := s.PurgeDelivered(ctx, time.Hour, 3) // batches of 3: 3 + 1
	if err != nil || n != 4 {
		t.Fatalf("purged %d, %v; want 4", n, err)
	}
	if c := countRows(t, pool, "true"); c != 3 {
		t.Fatalf("%d rows left, want 3 (recent delivered, dead, pending)", c)
	}
	if c := countRows(t, pool, "id = ANY($1)", ids[:4]); c != 0 {
		t.Fatal("old delivered rows survived")
	}
	// The dedupe window ends with the row: after purging, the key is free.
	k, _ := outbox.Enqueue(ctx, pool, keyed(1, "once"))
	first := mustClaim(t, s, claimCfg(10))
	for _, m := range first {
		s.Ack(ctx, m)
	}
	pool.Exec(ctx, "UPDATE modkit_outbox_events SET updated_at = now() - interval '2 hours' WHERE id = $1", k.ID)
	s.PurgeDelivered(ctx, time.Hour, 0)
	again, err := outbox.Enqueue(ctx, pool, keyed(2, "once"))
	if err != nil || again.AlreadyEnqueued || again.ID == k.ID {
		t.Fatalf("re-enqueue after purge: %+v %v", again, err)
	}
	if _, err := s.PurgeDelivered(ctx, -time.Second, 0); err == nil {
		t.Fatal("negative retention accepted")
	}
}

func TestGetUnknown(t *testing.T) {
	s, _ := newStore(t, outbox.Config{})
	if _, err := s.Get(ctx, uuid.New()); !errors.Is(err, outbox.ErrEventNotFound) {
		t.Fatal(err)
	}
}
