package outboxpg_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// One event without an ordering key goes in by a plain INSERT: it announces
// its topic when asked and only when it inserted, a duplicate comes back as
// the existing event (through the enqueue function) and announces nothing,
// and inside a transaction that rolls back it leaves nothing behind.
// Notifications arrive in commit order, so a duplicate that wrongly
// notified would be seen before the marker.
func TestInsertOne(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	conn, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "LISTEN "+outboxpg.NotifyChannel); err != nil {
		t.Fatal(err)
	}

	key := "k1"
	first := rows(1, "test", "events")
	first[0].DedupeKey = &key
	got, err := s.Insert(ctx, pool, first, []string{topic})
	if err != nil || len(got) != 1 || got[0].ID != first[0].ID || got[0].Duplicate {
		t.Fatalf("insert: %+v, %v; want the new event %v", got, err, first[0].ID)
	}
	dup := rows(1, "test", "events")
	dup[0].DedupeKey = &key
	got, err = s.Insert(ctx, pool, dup, []string{topic})
	if err != nil || len(got) != 1 || got[0].ID != first[0].ID || !got[0].Duplicate {
		t.Fatalf("duplicate: %+v, %v; want the existing event %v", got, err, first[0].ID)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Insert(ctx, tx, rows(1, "test", "events"), []string{topic}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	quiet := rows(1, "test", "quiet")
	if _, err := s.Insert(ctx, pool, quiet, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Insert(ctx, pool, rows(1, "test", "end"), []string{"test:end"}); err != nil {
		t.Fatal(err)
	}

	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var heard []string
	for len(heard) == 0 || heard[len(heard)-1] != "test:end" {
		n, err := conn.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("after %q: %v", heard, err)
		}
		heard = append(heard, n.Payload)
	}
	if want := []string{topic, "test:end"}; !slices.Equal(heard, want) {
		t.Fatalf("notifications %q, want %q (a duplicate, a rolled-back insert and an insert not asked to must not notify)", heard, want)
	}
	var events int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events").Scan(&events); err != nil {
		t.Fatal(err)
	}
	if events != 3 {
		t.Fatalf("%d events, want 3 (the first, the quiet one and the marker)", events)
	}
	if e := get(t, s, quiet[0].ID); e.Status != "pending" || e.Attempts != 0 || e.LockedBy != nil {
		t.Fatalf("directly inserted event: %+v, want pending with no attempts", e)
	}
}
