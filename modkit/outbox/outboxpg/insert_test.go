package outboxpg_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
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
	// Without an announcement the enqueue is a bare INSERT; its duplicate
	// takes the same way to the existing event.
	quietDup := rows(1, "test", "events")
	quietDup[0].DedupeKey = &key
	got, err = s.Insert(ctx, pool, quietDup, nil)
	if err != nil || len(got) != 1 || got[0].ID != first[0].ID || !got[0].Duplicate {
		t.Fatalf("duplicate without an announcement: %+v, %v; want the existing event %v", got, err, first[0].ID)
	}
	// The bare INSERT's row count through database/sql and bun too, and
	// the INSERT of an event without a dedupe key (no ON CONFLICT), which
	// announces its topic.
	for name, r := range map[string]db.Runner{"database/sql": db.SQL(tdb.Provider.SQL), "bun": db.SQL(tdb.Provider.Bun)} {
		keyless := rows(1, "test", "events")
		got, err := s.Insert(ctx, r, keyless, []string{topic})
		if err != nil || len(got) != 1 || got[0].ID != keyless[0].ID || got[0].Duplicate {
			t.Fatalf("%s: insert without a dedupe key: %+v, %v; want the new event %v", name, got, err, keyless[0].ID)
		}
		fresh := rows(1, "test", "events")
		freshKey := "fresh via " + name
		fresh[0].DedupeKey = &freshKey
		got, err = s.Insert(ctx, r, fresh, nil)
		if err != nil || len(got) != 1 || got[0].ID != fresh[0].ID || got[0].Duplicate {
			t.Fatalf("%s: insert: %+v, %v; want the new event %v", name, got, err, fresh[0].ID)
		}
		dup := rows(1, "test", "events")
		dup[0].DedupeKey = &key
		got, err = s.Insert(ctx, r, dup, nil)
		if err != nil || len(got) != 1 || got[0].ID != first[0].ID || !got[0].Duplicate {
			t.Fatalf("%s: duplicate: %+v, %v; want the existing event %v", name, got, err, first[0].ID)
		}
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
	if want := []string{topic, topic, topic, "test:end"}; !slices.Equal(heard, want) {
		t.Fatalf("notifications %q, want %q (the first insert and the two without a dedupe key; a duplicate, a rolled-back insert and an insert not asked to must not notify)", heard, want)
	}
	var events int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events").Scan(&events); err != nil {
		t.Fatal(err)
	}
	if events != 7 {
		t.Fatalf("%d events, want 7 (the first, two each through database/sql and bun, the quiet one and the marker)", events)
	}
	if e := get(t, s, quiet[0].ID); e.Status != "pending" || e.Attempts != 0 || e.LockedBy != nil {
		t.Fatalf("directly inserted event: %+v, want pending with no attempts", e)
	}
}

// The table's check on event names (migration 0017, written without regular
// expressions so that updates do not pay for them) accepts exactly the
// names of the pattern the client validates against: every string of up to
// three characters from a set of edge characters, lengths around the limit,
// and a corpus of random ones, as namespace and as topic.
func TestNameCheckMatchesPattern(t *testing.T) {
	_, tdb := newStore(t)
	pool := tdb.Provider.Pool
	pattern := regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,127}$`) // outbox's namePattern
	edge := []string{"", "a", "z", "0", "9", ".", "_", "-", "A", "Z", " ", "/", ":", "é", "\n", "`", "{", "@", "[", "^", "$", `\`, "*", "\x7f"}
	var names []string
	for _, a := range edge {
		for _, b := range edge {
			for _, c := range edge {
				names = append(names, a+b+c)
			}
		}
	}
	for n := 125; n <= 130; n++ {
		long := strings.Repeat("a", n)
		names = append(names, long, "-"+long, long+"é", long[:n-1]+"A")
	}
	rnd := rand.New(rand.NewPCG(1, 2))
	r := []rune("abcxyz0189._-AZ /é")
	for range 2000 {
		b := make([]rune, rnd.IntN(12))
		for i := range b {
			b[i] = r[rnd.IntN(len(r))]
		}
		names = append(names, string(b))
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `CREATE FUNCTION pg_temp.accepts(p_namespace text, p_topic text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO modkit_outbox_events (id, namespace, topic, payload) VALUES (gen_random_uuid(), p_namespace, p_topic, '{}');
    RETURN true;
EXCEPTION WHEN check_violation THEN
    RETURN false;
END $$`); err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(ctx, `SELECT n, pg_temp.accepts(n, 'ok'), pg_temp.accepts('ok', n) FROM unnest($1::text[]) AS n`, names)
	if err != nil {
		t.Fatal(err)
	}
	checked, valid := 0, 0
	for rows.Next() {
		var name string
		var asNamespace, asTopic bool
		if err := rows.Scan(&name, &asNamespace, &asTopic); err != nil {
			t.Fatal(err)
		}
		want := pattern.MatchString(name)
		if asNamespace != want || asTopic != want {
			t.Errorf("%q: the table accepts it as namespace %v, as topic %v; the pattern says %v", name, asNamespace, asTopic, want)
		}
		checked++
		if want {
			valid++
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if checked != len(names) || valid == 0 || valid == checked {
		t.Fatalf("checked %d of %d names, %d valid: the corpus must hold both kinds", checked, len(names), valid)
	}
}

// The checks on the message columns hold for new events and are not
// evaluated again by claims and outcomes (migration 0018), which never change
// those columns. So a payload limit lowered below events already enqueued
// refuses new events over it, while the events already there are still
// claimed, retried and delivered: before 0018, the claim's update of such an
// event broke the check and failed the whole claim.
func TestLoweredPayloadLimitLeavesEnqueuedEventsDeliverable(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	// 3,000 random letters: stored uncompressed, so the event stays over the
	// lowered limit as stored (a repetitive payload would be compressed
	// under it).
	rnd := rand.New(rand.NewPCG(3, 4))
	letters := make([]byte, 3000)
	for i := range letters {
		letters[i] = byte('a' + rnd.IntN(26))
	}
	big := `{"text":"` + string(letters) + `"}`
	first := driver.InsertRow{ID: uuid.Must(uuid.NewV7()), Namespace: "test", Topic: "events", Payload: []byte(big)}
	if _, err := s.Insert(ctx, pool, []driver.InsertRow{first}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "SELECT modkit_outbox_set_payload_limit(2048)"); err != nil {
		t.Fatal(err)
	}
	second := driver.InsertRow{ID: uuid.Must(uuid.NewV7()), Namespace: "test", Topic: "events", Payload: []byte(big)}
	_, err := s.Insert(ctx, pool, []driver.InsertRow{second}, nil)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != "modkit_outbox_events_payload_size_check" {
		t.Fatalf("an event over the lowered limit: %v, want a check violation of modkit_outbox_events_payload_size_check", err)
	}

	worker := uuid.New()
	got := claim(t, s, 10, 5, worker)
	if len(got) != 1 || got[0].ID != first.ID {
		t.Fatalf("claimed %+v, want the event enqueued before the limit was lowered", got)
	}
	if settled := complete(t, s, worker, outcome(got[0], driver.Retry)); !slices.Equal(settled, []bool{true}) {
		t.Fatalf("retry recorded: %v, want [true]", settled)
	}
	got = claim(t, s, 10, 5, worker)
	if len(got) != 1 || got[0].ID != first.ID {
		t.Fatalf("claimed %+v after the retry, want the same event", got)
	}
	if settled := complete(t, s, worker, outcome(got[0], driver.Delivered)); !slices.Equal(settled, []bool{true}) {
		t.Fatalf("delivery recorded: %v, want [true]", settled)
	}
	if e := get(t, s, first.ID); e.Status != "delivered" || e.Attempts != 2 {
		t.Fatalf("event after delivery: status %s, %d attempts; want delivered after 2", e.Status, e.Attempts)
	}
}
