package outboxpg_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/migrations"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// These tests hold the PostgreSQL driver to the contract of driver.Store:
// what a claim takes, and that only the current lease holder can settle.

func TestMain(m *testing.M) { pgtest.Main(m) }

var ctx = context.Background()

const topic = "test:events"

func open(t *testing.T, pool *pgxpool.Pool, opts driver.Options) driver.Store {
	t.Helper()
	if opts.Schema == "" {
		opts.Schema = "public"
	}
	s, err := outboxpg.New(pool).Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func newStore(t *testing.T) (driver.Store, *pgtest.DB) {
	t.Helper()
	tdb := pgtest.NewDB(t)
	return open(t, tdb.Provider.Pool, driver.Options{}), tdb
}

// deliverNew enqueues n events of test/events, claims them and records
// their delivery; it returns the claims.
func deliverNew(t *testing.T, s driver.Store, pool *pgxpool.Pool, n int) []driver.Claimed {
	t.Helper()
	if _, err := s.Insert(ctx, pool, rows(n, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	w := uuid.New()
	got := claim(t, s, n, 3, w)
	outcomes := make([]driver.Outcome, len(got))
	for i, c := range got {
		outcomes[i] = outcome(c, driver.Delivered)
	}
	if done, err := s.Complete(ctx, nil, w, outcomes); err != nil || len(done) != n {
		t.Fatalf("delivered %d of %d: %v", len(done), n, err)
	}
	return got
}

func insertN(t *testing.T, s driver.Store, pool *pgxpool.Pool, ns, tp string, n int) []uuid.UUID {
	t.Helper()
	rows := make([]driver.InsertRow, n)
	ids := make([]uuid.UUID, n)
	for i := range rows {
		ids[i] = uuid.Must(uuid.NewV7())
		rows[i] = driver.InsertRow{ID: ids[i], Namespace: ns, Topic: tp, Payload: []byte(fmt.Sprintf(`{"n":%d}`, i))}
	}
	for i := range rows { // one by one: distinct created_at order
		if _, err := s.Insert(ctx, pool, rows[i:i+1], nil); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

func claim(t *testing.T, s driver.Store, limit, maxAttempts int, worker uuid.UUID) []driver.Claimed {
	t.Helper()
	got, err := s.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: limit, MaxAttempts: maxAttempts, Worker: worker, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func complete(t *testing.T, s driver.Store, worker uuid.UUID, outcomes ...driver.Outcome) []bool {
	t.Helper()
	settled, err := s.Complete(ctx, nil, worker, outcomes)
	if err != nil {
		t.Fatal(err)
	}
	return settled
}

func outcome(c driver.Claimed, kind driver.OutcomeKind) driver.Outcome {
	return driver.Outcome{ID: c.ID, LeaseToken: c.LeaseToken, Kind: kind, Error: "failed"}
}

func get(t *testing.T, s driver.Store, id uuid.UUID) driver.Event {
	t.Helper()
	e, err := s.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// expireLease moves an event's lease into the past without waiting.
func expireLease(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) {
	t.Helper()
	if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET locked_until = now() - interval '1 second' WHERE id = $1 AND status = 'processing'", id); err != nil {
		t.Fatal(err)
	}
}

func TestClaim(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	ids := insertN(t, s, pool, "test", "events", 5)
	// Another topic's event and a not-yet-due event must not be claimed.
	foreign := insertN(t, s, pool, "billing", "invoice", 1)[0]
	later := insertN(t, s, pool, "test", "events", 1)[0]
	if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET next_attempt_at = now() + interval '1 hour' WHERE id = $1", later); err != nil {
		t.Fatal(err)
	}
	worker := uuid.New()
	got := claim(t, s, 3, 3, worker)
	if len(got) != 3 {
		t.Fatalf("claimed %d, want 3 (the limit)", len(got))
	}
	for i, c := range got {
		if c.ID != ids[i] {
			t.Fatalf("claim order: got %s at %d, want %s (created_at, id order)", c.ID, i, ids[i])
		}
		e := get(t, s, c.ID)
		if e.Status != "processing" || e.Attempts != 1 || c.Attempts != 1 || e.LockedBy == nil || *e.LockedBy != worker ||
			e.LockedUntil == nil || !e.LockedUntil.Equal(c.LockedTill) || c.LeaseToken == uuid.Nil {
			t.Fatalf("claimed row: %+v / %+v", e, c)
		}
		if lease := e.LockedUntil.Sub(e.UpdatedAt); lease != 30*time.Second {
			t.Fatalf("lease %v, want exactly the 30s asked for, by the database clock", lease)
		}
	}
	rest := claim(t, s, 10, 3, worker)
	if len(rest) != 2 || rest[0].ID != ids[3] || rest[1].ID != ids[4] {
		t.Fatalf("second claim: %+v", rest)
	}
	if again := claim(t, s, 10, 3, worker); len(again) != 0 {
		t.Fatalf("leased events claimed again: %+v", again)
	}
	if e := get(t, s, foreign); e.Status != "pending" {
		t.Fatal("claimed another topic's event")
	}
	if e := get(t, s, later); e.Status != "pending" {
		t.Fatal("claimed an event before its next_attempt_at")
	}
}

func TestCompleteDeliveredIsTerminal(t *testing.T) {
	s, tdb := newStore(t)
	insertN(t, s, tdb.Provider.Pool, "test", "events", 1)
	w := uuid.New()
	c := claim(t, s, 1, 3, w)[0]
	if ok := complete(t, s, w, outcome(c, driver.Delivered)); !ok[0] {
		t.Fatal("ack under a live lease refused")
	}
	e := get(t, s, c.ID)
	if e.Status != "delivered" || e.LockedBy != nil || e.LockedUntil != nil {
		t.Fatalf("acked row: %+v", e)
	}
	if got := claim(t, s, 1, 3, uuid.New()); len(got) != 0 {
		t.Fatal("delivered event claimed again")
	}
	if ok := complete(t, s, w, outcome(c, driver.Delivered), outcome(c, driver.Retry)); ok[0] || ok[1] {
		t.Fatal("second ack or nack after ack accepted")
	}
	if e2 := get(t, s, c.ID); e2.Status != "delivered" || !e2.UpdatedAt.Equal(e.UpdatedAt) {
		t.Fatalf("stale ack/nack changed a delivered row: %+v", e2)
	}
}

// The stale-worker race: A claims, A's lease expires, B reclaims, A's
// outcome is refused and changes nothing; B's is recorded.
func TestFencingStaleWorker(t *testing.T) {
	a, tdb := newStore(t)
	pool := tdb.Provider.Pool
	b := open(t, tdb.NewPool(t), driver.Options{})
	insertN(t, a, pool, "test", "events", 1)
	workerA, workerB := uuid.New(), uuid.New()
	ca := claim(t, a, 1, 3, workerA)[0]

	expireLease(t, pool, ca.ID)
	// Expired but not yet reclaimed: A's lease is gone already.
	if ok := complete(t, a, workerA, outcome(ca, driver.Delivered)); ok[0] {
		t.Fatal("ack on an expired lease accepted")
	}
	cb := claim(t, b, 1, 3, workerB)
	if len(cb) != 1 || cb[0].ID != ca.ID || cb[0].Attempts != 2 || cb[0].LeaseToken == ca.LeaseToken {
		t.Fatalf("B's reclaim: %+v", cb)
	}
	before := get(t, a, ca.ID)
	for _, k := range []driver.OutcomeKind{driver.Delivered, driver.Retry, driver.Dead, driver.Release} {
		if ok := complete(t, a, workerA, outcome(ca, k)); ok[0] {
			t.Fatalf("stale A outcome %d accepted", k)
		}
	}
	// The token fences, not the worker: B's own id with a wrong token fails.
	forged := cb[0]
	forged.LeaseToken = uuid.New()
	if ok := complete(t, b, workerB, outcome(forged, driver.Delivered)); ok[0] {
		t.Fatal("outcome with a wrong token accepted")
	}
	if after := get(t, a, ca.ID); after.Status != "processing" || *after.LockedBy != workerB ||
		!after.UpdatedAt.Equal(before.UpdatedAt) || after.Attempts != 2 {
		t.Fatalf("stale worker changed the row: %+v", after)
	}
	// The worker fences too: A's id with B's live token fails.
	if ok := complete(t, a, workerA, outcome(cb[0], driver.Delivered)); ok[0] {
		t.Fatal("another worker's outcome under B's token accepted")
	}
	if ok := complete(t, b, workerB, outcome(cb[0], driver.Delivered)); !ok[0] {
		t.Fatal("B's ack refused")
	}
	if e := get(t, a, ca.ID); e.Status != "delivered" {
		t.Fatalf("after B's ack: %+v", e)
	}
}

func TestCompleteMixedOutcomes(t *testing.T) {
	s, tdb := newStore(t)
	insertN(t, s, tdb.Provider.Pool, "test", "events", 5)
	w := uuid.New()
	got := claim(t, s, 5, 3, w)
	stale := got[4]
	stale.LeaseToken = uuid.New()
	retry := outcome(got[1], driver.Retry)
	retry.Delay = 90 * time.Second
	ok := complete(t, s, w, outcome(got[0], driver.Delivered), retry, outcome(got[2], driver.Dead),
		outcome(got[3], driver.Release), outcome(stale, driver.Delivered))
	want := []string{"delivered", "pending", "dead", "pending"}
	for i, w := range want {
		if e := get(t, s, got[i].ID); !ok[i] || e.Status != w {
			t.Fatalf("outcome %d: settled %v, row %+v, want %s", i, ok[i], e, w)
		}
	}
	if e := get(t, s, got[1].ID); e.NextAttemptAt.Sub(e.UpdatedAt) != 90*time.Second || e.LastError == nil || *e.LastError != "failed" || e.Attempts != 1 {
		t.Fatalf("retry: %+v", e)
	}
	if e := get(t, s, got[3].ID); e.Attempts != 0 || e.LastError != nil || e.NextAttemptAt.After(e.UpdatedAt) {
		t.Fatalf("release must undo the attempt and be due at once: %+v", e)
	}
	if ok[4] || get(t, s, got[4].ID).Status != "processing" {
		t.Fatalf("wrong token must be refused and change nothing")
	}
}

// The owner's prune deletes the history of purged events finished before
// the cut-off, and nothing else: not the history of an event still in the
// table, nor rows finished after the cut-off (since migration 0013 it finds
// them without an index on finished_at).
func TestPruneAttempts(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	ledger := func() (rows int) {
		t.Helper()
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_attempts").Scan(&rows); err != nil {
			t.Fatal(err)
		}
		return rows
	}
	prune := func(before string) (n int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, "SELECT modkit_outbox_prune_attempts("+before+")").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	purged := deliverNew(t, s, pool, 3)
	if res, err := s.Purge(ctx, driver.PurgeParams{Topics: []string{topic}, Retention: 0, Limit: 10}); err != nil || res.Purged != 3 {
		t.Fatalf("purged %d of 3: %v", res.Purged, err)
	}
	kept := deliverNew(t, s, pool, 2) // delivered, not purged
	if got := ledger(); got != 5 {
		t.Fatalf("%d ledger rows, want 5", got)
	}
	if n := prune("now() - interval '1 hour'"); n != 0 {
		t.Fatalf("a prune of rows finished an hour ago deleted %d", n)
	}
	if n := prune("clock_timestamp() + interval '1 second'"); n != 3 {
		t.Fatalf("the prune deleted %d rows, want the 3 of the purged events", n)
	}
	for _, c := range purged {
		if h, err := s.History(ctx, c.ID); err != nil || len(h) != 0 {
			t.Fatalf("history of a purged, pruned event: %v, %v", h, err)
		}
	}
	for _, c := range kept {
		if h, err := s.History(ctx, c.ID); err != nil || len(h) != 1 {
			t.Fatalf("history of a kept event after the prune: %v, %v", h, err)
		}
	}
}

// An event named twice in one outcome write is settled once, by the first
// of its outcomes, with one ledger row.
func TestCompleteRepeatedID(t *testing.T) {
	s, tdb := newStore(t)
	insertN(t, s, tdb.Provider.Pool, "test", "events", 1)
	w := uuid.New()
	c := claim(t, s, 1, 3, w)[0]
	ok := complete(t, s, w, outcome(c, driver.Delivered), outcome(c, driver.Retry))
	if !ok[0] {
		t.Fatalf("settled %v, want the first outcome settled", ok)
	}
	if e := get(t, s, c.ID); e.Status != "delivered" {
		t.Fatalf("status %s, want delivered (the first outcome)", e.Status)
	}
	h, err := s.History(ctx, c.ID)
	if err != nil || len(h) != 1 || h[0].Outcome != "delivered" {
		t.Fatalf("history %+v (%v), want one delivered row", h, err)
	}
}

// A worker that crashes on the last allowed attempt leaves the row
// processing with attempts = max, which no claim picks up; Sweep
// dead-letters it, saying why, and leaves live leases alone.
func TestSweepExhausted(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	ids := insertN(t, s, pool, "test", "events", 2)
	c := claim(t, s, 1, 1, uuid.New())[0] // the "crashed" worker never settles it
	expireLease(t, pool, c.ID)
	if got := claim(t, s, 1, 1, uuid.New()); len(got) != 1 || got[0].ID != ids[1] {
		t.Fatalf("claim after the crash: %+v (the exhausted row must be skipped)", got)
	}
	sweep := driver.SweepParams{Topics: []string{topic}, MaxAttempts: 1, Limit: 10}
	swept, err := s.Sweep(ctx, sweep)
	if err != nil || len(swept) != 1 || swept[0].ID != c.ID || swept[0].Topic != topic {
		t.Fatalf("sweep: %v %v", swept, err)
	}
	e := get(t, s, c.ID)
	if e.Status != "dead" || e.LockedBy != nil || !strings.Contains(*e.LastError, "expired on the final attempt") {
		t.Fatalf("swept row: %+v", e)
	}
	if e := get(t, s, ids[1]); e.Status != "processing" {
		t.Fatalf("sweep touched a live lease: %+v", e)
	}
	if again, _ := s.Sweep(ctx, sweep); len(again) != 0 {
		t.Fatalf("second sweep: %v", again)
	}
}

// Several claimers never share an event.
func TestConcurrentClaimersNeverShareAnEvent(t *testing.T) {
	s0, tdb := newStore(t)
	ids := insertN(t, s0, tdb.Provider.Pool, "test", "events", 300)
	const workers = 4
	var mu sync.Mutex
	seen := map[uuid.UUID]uuid.UUID{}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		s, worker := open(t, tdb.NewPool(t), driver.Options{}), uuid.New()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				got, err := s.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 7, MaxAttempts: 3, Worker: worker, Lease: time.Minute})
				if err != nil {
					errs <- err
					return
				}
				if len(got) == 0 {
					return
				}
				mu.Lock()
				for _, c := range got {
					if prev, dup := seen[c.ID]; dup {
						mu.Unlock()
						errs <- fmt.Errorf("event %s claimed by %s and %s", c.ID, prev, worker)
						return
					}
					seen[c.ID] = worker
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(seen) != len(ids) {
		t.Fatalf("claimed %d distinct events of %d", len(seen), len(ids))
	}
}

// Claims and outcomes commit asynchronously by default, but only their own
// implicit transaction: the pooled session keeps its setting.
func TestAsyncCommitStaysInTheStatement(t *testing.T) {
	tdb := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := open(t, pool, driver.Options{})
	// The test cluster may run with synchronous_commit off; the session
	// asks for on, and must still have it afterwards.
	if _, err := pool.Exec(ctx, "SET synchronous_commit = on"); err != nil {
		t.Fatal(err)
	}
	insertN(t, s, pool, "test", "events", 3)
	w := uuid.New()
	got := claim(t, s, 10, 3, w)
	if len(got) != 3 {
		t.Fatalf("claimed %d", len(got))
	}
	complete(t, s, w, outcome(got[0], driver.Delivered))
	var setting string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if setting != "on" {
		t.Fatalf("synchronous_commit is %q on the session after a claim and an ack", setting)
	}
}

// With Options.Now the driver takes its time from the test clock: a claim
// leases until clock + lease, and a lease expires when the clock passes it.
func TestTestClock(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	at := time.Now().Add(24 * time.Hour).Truncate(time.Microsecond)
	s := open(t, pool, driver.Options{Now: func() time.Time { return at }})
	insertN(t, s, pool, "test", "events", 1)
	w := uuid.New()
	c := claim(t, s, 1, 3, w)[0]
	if !c.LockedTill.Equal(at.Add(30 * time.Second)) {
		t.Fatalf("lease until %v, want the test clock %v plus 30s", c.LockedTill, at)
	}
	if again := claim(t, s, 1, 3, uuid.New()); len(again) != 0 {
		t.Fatal("a live lease was claimed again")
	}
	at = at.Add(31 * time.Second)
	again := claim(t, s, 1, 3, uuid.New())
	if len(again) != 1 || again[0].Attempts != 2 {
		t.Fatalf("after the clock passed the lease: %+v", again)
	}
	if ok := complete(t, s, w, outcome(c, driver.Delivered)); ok[0] {
		t.Fatal("the expired lease's outcome was accepted")
	}
}

// Elect gives each role to one holder until its lease expires or it
// resigns.
func TestElect(t *testing.T) {
	tdb := pgtest.NewDB(t)
	at := time.Now().Truncate(time.Microsecond)
	s := open(t, tdb.Provider.Pool, driver.Options{Now: func() time.Time { return at }})
	a, b := uuid.New(), uuid.New()
	roles := []string{"maintenance:x:1", "maintenance:x:2"}
	elect := func(holder uuid.UUID, roles ...string) []string {
		t.Helper()
		held, err := s.Elect(ctx, driver.ElectParams{Roles: roles, Holder: holder, TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return held
	}
	if held := elect(a, roles[0]); len(held) != 1 {
		t.Fatalf("a: %v", held)
	}
	if held := elect(b, roles...); len(held) != 1 || held[0] != roles[1] {
		t.Fatalf("b took %v; only the free role was for it", held)
	}
	at = at.Add(30 * time.Second)
	if held := elect(a, roles...); len(held) != 1 || held[0] != roles[0] {
		t.Fatalf("a renewed %v", held)
	}
	at = at.Add(61 * time.Second) // b's lease has expired, a's renewed one has not
	if held := elect(a, roles...); len(held) != 2 {
		t.Fatalf("a after b's lease expired: %v", held)
	}
	if err := s.Resign(ctx, a, roles); err != nil {
		t.Fatal(err)
	}
	if held := elect(b, roles...); len(held) != 2 {
		t.Fatalf("b after a resigned: %v", held)
	}
}

func TestOpenRejectsBadSchema(t *testing.T) {
	if _, err := outboxpg.New(nil).Open(driver.Options{Schema: "public"}); err == nil {
		t.Fatal("nil pool accepted")
	}
	tdb := pgtest.NewDB(t)
	for _, bad := range []string{"", "Robert'); DROP TABLE x;--", "pg_catalog"} {
		if _, err := outboxpg.New(tdb.Provider.Pool).Open(driver.Options{Schema: bad}); err == nil {
			t.Errorf("schema %q accepted", bad)
		}
	}
}

// The gauges and the sweeper find each state through its own index
// (migration 0007): pending events, held ones among them, leases live and
// expired, and dead events are all counted, and every way of being due for
// the sweeper (an expired lease, a pending event out of attempts, held or
// not) is swept; delivered events are neither.
func TestDepthAndSweepReadEveryState(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	plain := insertN(t, s, pool, "test", "events", 5)
	keyed := insertKeyed(t, s, pool, "k", 2) // k:2 is held behind k:1
	w := uuid.New()
	got := claim(t, s, 4, 5, w) // plain[0:4], oldest first
	if len(got) != 4 || got[3].ID != plain[3] {
		t.Fatalf("claimed %+v, want the four oldest", got)
	}
	complete(t, s, w, outcome(got[0], driver.Delivered), outcome(got[1], driver.Dead))
	expireLease(t, pool, got[3].ID)

	depth := func() driver.DepthRow {
		t.Helper()
		rows, err := s.Depth(ctx, []string{topic})
		if err != nil || len(rows) != 1 {
			t.Fatalf("depth: %v %v", rows, err)
		}
		return rows[0]
	}
	if d := depth(); d.Pending != 3 || d.Processing != 2 || d.Dead != 1 || d.Stuck != 1 {
		t.Fatalf("depth %+v, want 3 pending (one held), 2 processing (one stuck), 1 dead", d)
	}

	mustExec(t, pool, `UPDATE modkit_outbox_events SET attempts = 5 WHERE id = ANY($1)`, []uuid.UUID{plain[4], keyed[1].ID})
	swept, err := s.Sweep(ctx, driver.SweepParams{Topics: []string{topic}, MaxAttempts: 5, Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	// k:2, out of attempts but behind k:1 (pending), could not have been
	// tried: it is given an attempt back rather than buried (migration
	// 0031), stays held, and is not reported (neither repaired nor dead).
	want := map[uuid.UUID]bool{got[3].ID: true, plain[4]: false} // id: repaired
	const wantSwept = "want the expired lease repaired and the exhausted event dead"
	if len(swept) != len(want) {
		t.Fatalf("swept %+v, %s", swept, wantSwept)
	}
	for _, sw := range swept {
		if repaired, ok := want[sw.ID]; !ok || sw.Repaired != repaired {
			t.Fatalf("swept %+v, %s", swept, wantSwept)
		}
	}
	if d := depth(); d.Pending != 3 || d.Processing != 1 || d.Dead != 2 || d.Stuck != 0 {
		t.Fatalf("depth after the sweep %+v, want 3 pending, 1 processing, 2 dead", d)
	}
	var attempts int
	var held bool
	if err := pool.QueryRow(ctx, `SELECT attempts, held FROM modkit_outbox_events WHERE id = $1`, keyed[1].ID).Scan(&attempts, &held); err != nil ||
		attempts != 4 || !held {
		t.Fatalf("k:2 after the sweep: %d attempts, held %v (%v); want 4, held", attempts, held, err)
	}
}

// On a schema without migration 0025 the dispatchers' purge still purges,
// from the oldest event through modkit_outbox_purge, and returns no
// cutoff, so that the dispatcher keeps walking from the oldest event; with
// it, a purge returns its cutoff and deletes only what it reaches from
// From on.
func TestPurgeWithoutMigration0025(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	deliverNew(t, s, pool, 3)
	// From a minute ahead: nothing reached, a cutoff returned.
	p := driver.PurgeParams{Topics: []string{topic}, Retention: 0, Limit: 2, From: time.Now().Add(time.Minute)}
	if res, err := s.Purge(ctx, p); err != nil || res.Purged != 0 || res.Cutoff.IsZero() {
		t.Fatalf("purge from a minute ahead: %+v, %v; want nothing purged, and a cutoff", res, err)
	}
	mustExec(t, pool, "DROP FUNCTION modkit_outbox_purge_from(text[], interval, int, timestamptz, timestamptz)")
	for _, want := range []int64{3, 2} { // the fallback, then the store remembering it
		if res, err := s.Purge(ctx, p); err != nil || res.Purged != want || !res.Cutoff.IsZero() {
			t.Fatalf("purge without migration 0025: %+v, %v; want %d purged from the oldest event, and no cutoff", res, err, want)
		}
		deliverNew(t, s, pool, 2)
	}
}

// TestBacklogWithoutMigration0027: on a schema without
// modkit_outbox_backlog, Backlog counts with modkit_outbox_stats and leaves
// the delivered events out, as the function would.
func TestBacklogWithoutMigration0027(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	deliverNew(t, s, pool, 3)
	if _, err := s.Insert(ctx, pool, rows(2, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	want := []driver.StatsRow{{Namespace: "test", Topic: "events", Status: "pending", Count: 2}}
	ignoreAge := func(r []driver.StatsRow) []driver.StatsRow {
		for i := range r {
			r[i].OldestDueAge = 0
		}
		return r
	}
	got, err := s.Backlog(ctx)
	if err != nil || !slices.Equal(ignoreAge(got), want) {
		t.Fatalf("backlog: %+v, %v; want %+v", got, err, want)
	}
	mustExec(t, pool, "DROP FUNCTION modkit_outbox_backlog(timestamptz)")
	for range 2 { // the fallback, then the store remembering it
		if got, err := s.Backlog(ctx); err != nil || !slices.Equal(ignoreAge(got), want) {
			t.Fatalf("backlog without migration 0027: %+v, %v; want %+v", got, err, want)
		}
	}
}

// A schema's channel is its name after "modkit_outbox.", cut to the 63
// bytes PostgreSQL allows a channel's name.
func TestNotifyChannel(t *testing.T) {
	long := strings.Repeat("s", 63)
	for schema, want := range map[string]string{
		"public": "modkit_outbox.public",
		long:     "modkit_outbox." + long[:49],
	} {
		if got := outboxpg.NotifyChannel(schema); got != want {
			t.Errorf("NotifyChannel(%q) = %q; want %q", schema, got, want)
		}
	}
}

// Migrate refuses a schema where PUBLIC may create objects before any
// migration runs: migration 0028 refused it only after 0001–0027 had
// created the outbox's tables and SECURITY DEFINER functions there. Once
// that is revoked, it migrates.
func TestMigrateRefusesAnOpenSchemaBeforeMigrating(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, "CREATE SCHEMA mk_open_first; GRANT CREATE ON SCHEMA mk_open_first TO PUBLIC"); err != nil {
		t.Fatal(err)
	}
	st := open(t, pool, driver.Options{Schema: "mk_open_first"})
	err := st.Migrate(ctx)
	if err == nil || !strings.Contains(err.Error(), "REVOKE CREATE ON SCHEMA mk_open_first FROM PUBLIC") ||
		!strings.Contains(err.Error(), "nothing was migrated") {
		t.Fatalf("Migrate of a schema PUBLIC may create in: %v, want it refused before migrating", err)
	}
	var objects int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = 'mk_open_first') + (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = 'mk_open_first')`).Scan(&objects); err != nil {
		t.Fatal(err)
	}
	if objects != 0 {
		t.Fatalf("%d tables or functions created in the refused schema, want none", objects)
	}
	if _, err := pool.Exec(ctx, "REVOKE CREATE ON SCHEMA mk_open_first FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatalf("Migrate once PUBLIC may no longer create in the schema: %v", err)
	}
}

// Migrate refuses a schema in which any login role other than the migrating
// one (not a superuser, not able to act as the migrating role) may create
// objects, not only PUBLIC and the outbox's roles: such a role could create
// a function the outbox's functions would call as their owner. Refused
// before anything is migrated; on a schema already migrated, Migrate (with
// nothing to apply) warns instead of failing an application that runs.
func TestMigrateRefusesASchemaAnotherRoleMayCreateIn(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	var other string
	if err := tdb.LoginAs(t, "").QueryRow(ctx, "SELECT current_user").Scan(&other); err != nil {
		t.Fatal(err)
	}
	grant := func(verb string) {
		t.Helper()
		q := fmt.Sprintf("GRANT CREATE ON SCHEMA mk_open_role TO %s", other)
		if verb == "REVOKE" {
			q = fmt.Sprintf("REVOKE CREATE ON SCHEMA mk_open_role FROM %s", other)
		}
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA mk_open_role"); err != nil {
		t.Fatal(err)
	}
	// Before the role is dropped (cleanups run last first), which its grant
	// would prevent.
	t.Cleanup(func() { _, _ = pool.Exec(ctx, "REVOKE CREATE ON SCHEMA mk_open_role FROM "+other) })
	grant("GRANT")
	var logs strings.Builder
	st := open(t, pool, driver.Options{Schema: "mk_open_role", Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	err := st.Migrate(ctx)
	if err == nil || !strings.Contains(err.Error(), "lets "+other+" create objects") || !strings.Contains(err.Error(), "nothing was migrated") {
		t.Fatalf("Migrate of a schema %s may create in: %v, want it refused before migrating", other, err)
	}
	var functions int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = 'mk_open_role'`).Scan(&functions); err != nil || functions != 0 {
		t.Fatalf("%d functions created in the refused schema (%v), want none", functions, err)
	}
	grant("REVOKE")
	if err := st.Migrate(ctx); err != nil {
		t.Fatalf("Migrate once only the migrating role may create in the schema: %v", err)
	}
	grant("GRANT")
	if err := st.Migrate(ctx); err != nil {
		t.Fatalf("Migrate of an up-to-date schema that was opened later: %v, want a warning only", err)
	}
	if !strings.Contains(logs.String(), "lets "+other+" create objects") {
		t.Fatalf("no warning for an up-to-date schema %s may create in; log:\n%s", other, logs.String())
	}
	// Another tool's run of migration 0037 refuses it too.
	requireFileRefuses(t, pool, "mk_open_role", "0037_outbox_schema_closed_to_every_other_role.up.sql", other)
}

// requireFileRefuses runs migration file name in schema, in a transaction
// rolled back afterwards, as another migration tool would, and fails t
// unless it refuses the schema (42501) naming role as one that may create
// objects in it.
func requireFileRefuses(t *testing.T, pool *pgxpool.Pool, schema, name, role string) {
	t.Helper()
	file, err := migrations.FS.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SET LOCAL search_path = "+schema); err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(ctx, string(file))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" || !strings.Contains(pgErr.Message, "lets "+role+" create objects") {
		t.Fatalf("%s on schema %s, which %s may create in: %v, want it refused (42501)", name, schema, role, err)
	}
}

// A login role that is a NOINHERIT member of a role that may create objects
// in the schema has no such right of its own, yet may SET ROLE to that role
// and create there a function the outbox's functions would call as their
// owner (a security review did, past the check above): Migrate refuses
// such a schema too, and so does migration 0040 run by another tool.
func TestMigrateRefusesASchemaANoinheritMemberMayCreateIn(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	suffix := strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	creator, member := "mk_creator_"+suffix, "mk_noinherit_"+suffix
	for _, q := range []string{
		"CREATE ROLE " + creator + " NOLOGIN",
		"CREATE ROLE " + member + " LOGIN NOINHERIT IN ROLE " + creator,
		"CREATE SCHEMA mk_noinherit",
		"GRANT CREATE ON SCHEMA mk_noinherit TO " + creator,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, "REVOKE CREATE ON SCHEMA mk_noinherit FROM "+creator)
		_, _ = pool.Exec(ctx, "DROP ROLE IF EXISTS "+member)
		_, _ = pool.Exec(ctx, "DROP ROLE IF EXISTS "+creator)
	})
	st := open(t, pool, driver.Options{Schema: "mk_noinherit", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	err := st.Migrate(ctx)
	if err == nil || !strings.Contains(err.Error(), "lets "+member+" create objects") || !strings.Contains(err.Error(), "nothing was migrated") {
		t.Fatalf("Migrate of a schema a NOINHERIT member of %s may create in: %v, want it refused, naming %s", creator, err, member)
	}
	requireFileRefuses(t, pool, "mk_noinherit", "0040_outbox_schema_closed_to_noinherit_members.up.sql", member)
}

// A login that holds only the outbox's roles may keep migrating at start
// (WithMigrations): on an up-to-date schema Migrate reads the migrations
// table and does nothing. It failed with "permission denied for table
// modkit_schema_migrations" (a user trial). With a migration to apply,
// it fails saying that the owner must migrate.
func TestMigrateAsARuntimeRole(t *testing.T) {
	tdb := pgtest.NewDB(t)
	for _, role := range []string{outboxpg.RoleProducer, outboxpg.RoleDispatcher, outboxpg.RoleOperator, outboxpg.RoleReader} {
		if err := open(t, tdb.LoginAs(t, role), driver.Options{}).Migrate(ctx); err != nil {
			t.Fatalf("Migrate of an up-to-date schema as a login in %s: %v", role, err)
		}
	}
	// As if 0041 were still to apply (its first statement, as most, needs
	// the owner).
	mustExec(t, tdb.Provider.Pool, "DELETE FROM modkit_schema_migrations WHERE version = 41")
	err := open(t, tdb.LoginAs(t, outboxpg.RoleDispatcher), driver.Options{}).Migrate(ctx)
	denied(t, "Migrate with a migration to apply, as a runtime login", err)
	if !strings.Contains(err.Error(), "this login may not migrate schema public, which has migrations to apply") ||
		!strings.Contains(err.Error(), "modkit-outbox migrate up") {
		t.Fatalf("Migrate with a migration to apply, as a runtime login: %v, want it to say the owner must migrate", err)
	}
}
