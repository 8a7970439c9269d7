package main

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestAttributeDuplicates: the kill window takes in a delivery the server
// began after the killed process had died (issue 18) as long as it ran under
// the process's lease, and still calls a duplicate unexplained when no fault
// accounts for it, or when the first delivery was recorded as delivered
// before the fault (a resurrection that a kill of the same process after
// it had been taken for).
func TestAttributeDuplicates(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	if _, err := pool.Exec(ctx, soakDDL); err != nil {
		t.Fatal(err)
	}
	const lease = time.Second
	t0 := time.Now().Truncate(time.Millisecond)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	kill := func(pid int) incident { return incident{kind: "kill", pid: pid, begin: ms(0), end: ms(5)} }
	type delivery struct {
		pid               int
		leased            bool
		sent, started, at time.Time
		againAt           time.Time // the second delivery, by another process
	}
	cases := map[string]delivery{
		"kill":                          {pid: 100, leased: true, sent: ms(-10), started: ms(-5), at: ms(-5), againAt: ms(1000)},
		"kill, in flight":               {pid: 101, leased: true, sent: ms(-3), started: ms(20), at: ms(20), againAt: ms(1020)},
		"in flight, no lease":           {pid: 102, leased: false, sent: ms(-3), started: ms(20), at: ms(20), againAt: ms(1020)},
		"begun a lease after the death": {pid: 103, leased: true, sent: ms(-3), started: ms(1100), at: ms(1100), againAt: ms(2500)},
		"redelivered before the kill":   {pid: 104, leased: true, sent: ms(-1500), started: ms(-1500), at: ms(-1500), againAt: ms(-500)},
		"restart":                       {pid: 105, leased: true, sent: ms(59_900), started: ms(59_900), at: ms(59_900), againAt: ms(61_000)},
		// Recorded as delivered under its lease (the audit says so), then
		// delivered again: no kill or restart explains that.
		"delivered for good, then again": {pid: 106, leased: true, sent: ms(-10), started: ms(-5), at: ms(-5), againAt: ms(1000)},
	}
	incidents := []incident{kill(100), kill(101), kill(102), kill(103), kill(104), kill(106),
		{kind: "restart", begin: ms(60_000), end: ms(60_200)}}
	for name, d := range cases {
		id := uuid.New()
		var token *uuid.UUID
		if d.leased {
			tok := uuid.New()
			token = &tok
		}
		if name == "delivered for good, then again" {
			if _, err := pool.Exec(ctx, `INSERT INTO soak_audit VALUES ($1, 'delivered', $2, NULL, $3, NULL, $4)`,
				id, token, ms(900), ms(-4)); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := pool.Exec(ctx, `INSERT INTO soak_deliveries (event_id, lease_token, attempt, pid, sent_at, started_at, at)
			VALUES ($1, $2, 1, $3, $4, $5, $6), ($1, gen_random_uuid(), 2, 999, $7, $7, $7)`,
			id, token, d.pid, d.sent, d.started, d.at, d.againAt); err != nil {
			t.Fatal(err)
		}
	}
	r := &report{lease: lease}
	r.attributeDuplicates(ctx, pool, options{lease: lease}, incidents)
	got := [5]int{r.extraDeliveries, r.byKill, r.byKillInFlight, r.byRestart, r.unattributed}
	if want := [5]int{7, 2, 1, 1, 4}; got != want {
		t.Fatalf("extra, by kill, of which in flight, by restart, unexplained = %v, want %v; failures %q", got, want, r.failures)
	}
	if len(r.failures) != 1 {
		t.Fatalf("want one failure naming the unexplained duplicates, got %q", r.failures)
	}
}

// TestAuditJudgesLeasesByStatementTime: the audit judges a lease by the
// start of the statement that ended it, the clock the outbox's functions
// use, not by the start of its transaction. A lease that ended after its
// claimer's transaction began but before the claim statement did was
// expired for the claim; the soak had reported such reclaims as reclaims of
// a valid lease. A reclaim while the lease still runs is still caught, and
// so is a settlement under an ended lease, unless it is the sweeper's
// repair, which the ledger records as lease_expired.
func TestAuditJudgesLeasesByStatementTime(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	if _, err := pool.Exec(ctx, soakDDL); err != nil {
		t.Fatal(err)
	}
	leased := func() (id, token uuid.UUID) {
		id, token = uuid.Must(uuid.NewV7()), uuid.New()
		if _, err := pool.Exec(ctx, `INSERT INTO modkit_outbox_events (id, namespace, topic, payload, status, attempts, locked_by,
			locked_until, lease_token) VALUES ($1, 'soak', 'audit', '{}', 'processing', 1, gen_random_uuid(), now() + interval '1 hour', $2)`,
			id, token); err != nil {
			t.Fatal(err)
		}
		return id, token
	}
	ended, _ := leased()
	running, _ := leased()
	repaired, repairedToken := leased()
	settled, _ := leased()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	// Three leases end now, after the transaction began; the statements
	// below start after they ended.
	if _, err := tx.Exec(ctx, `UPDATE modkit_outbox_events SET locked_until = clock_timestamp() WHERE id = ANY($1)`,
		[]uuid.UUID{ended, repaired, settled}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []uuid.UUID{ended, running} {
		if _, err := tx.Exec(ctx, `UPDATE modkit_outbox_events SET lease_token = gen_random_uuid(),
			locked_until = statement_timestamp() + interval '1 second' WHERE id = $1`, id); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []uuid.UUID{repaired, settled} {
		if _, err := tx.Exec(ctx, `UPDATE modkit_outbox_events SET status = 'pending', locked_by = NULL, locked_until = NULL,
			lease_token = NULL WHERE id = $1`, id); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tx.Exec(ctx, `INSERT INTO modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, attempt,
		lease_token, finished_at, detail) VALUES ($1, 1, 'soak', 'audit', 'lease_expired', 1, $2, now(),
		'the lease expired before an outcome was recorded; repaired by the sweeper')`, repaired, repairedToken); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := verify(ctx, pool, options{lease: time.Second}, nil, nil)
	checkCounts(t, r, map[string]int{"reclaims of a valid lease": 1, "settlements under an expired lease": 1})
}

// checkCounts checks the report's counts named in want.
func checkCounts(t *testing.T, r *report, want map[string]int) {
	t.Helper()
	for _, c := range r.counts {
		if n, ok := want[c.what]; ok {
			if c.n != n {
				t.Errorf("%s: %d, want %d", c.what, c.n, n)
			}
			delete(want, c.what)
		}
	}
	if len(want) != 0 {
		t.Fatalf("checks missing from the report: %v", want)
	}
}

// Under Publisher.DeleteOnDelivery a delivered event leaves no row: the
// verifier finds its delivery in the ledger and audits the delete as a
// settlement. An event with neither a row nor a recorded deletion is lost,
// and a delete under an ended lease is caught like an update.
func TestVerifyFindsDeletedDeliveries(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	if _, err := pool.Exec(ctx, soakDDL); err != nil {
		t.Fatal(err)
	}
	// lease inserts an event processing under a lease that ends in ends,
	// enqueued and delivered downstream under that lease.
	lease := func(seq int, ends string) (id, token uuid.UUID) {
		id, token = uuid.Must(uuid.NewV7()), uuid.New()
		for _, st := range []struct {
			sql  string
			args []any
		}{
			{`INSERT INTO modkit_outbox_events (id, namespace, topic, payload, status, attempts, locked_by, locked_until, lease_token)
			VALUES ($1, 'soak', 'events', '{}', 'processing', 1, gen_random_uuid(), now() + $3::interval, $2)`, []any{id, token, ends}},
			{`INSERT INTO soak_enqueued (event_id, seq) VALUES ($1, $2)`, []any{id, seq}},
			{`INSERT INTO soak_deliveries (event_id, lease_token, attempt, pid, sent_at) VALUES ($1, $2, 1, 1, now())`, []any{id, token}},
		} {
			if _, err := pool.Exec(ctx, st.sql, st.args...); err != nil {
				t.Fatal(err)
			}
		}
		return id, token
	}
	// deliver deletes the event as the outcome write does, with its ledger row.
	deliver := func(id uuid.UUID) {
		if _, err := pool.Exec(ctx, `WITH d AS (DELETE FROM modkit_outbox_events WHERE id = $1 RETURNING id, lease_token, attempts)
			INSERT INTO modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, attempt, lease_token, finished_at, detail)
			SELECT id, 1, 'soak', 'events', 'delivered', attempts, lease_token, now(), 'deleted on delivery' FROM d`, id); err != nil {
			t.Fatal(err)
		}
	}
	ok, _ := lease(1, "1 hour")
	deliver(ok)
	late, _ := lease(2, "-1 second")
	deliver(late)
	lost, _ := lease(3, "1 hour")
	if _, err := pool.Exec(ctx, `DELETE FROM modkit_outbox_events WHERE id = $1`, lost); err != nil {
		t.Fatal(err)
	}

	r := verify(ctx, pool, options{lease: time.Second}, nil, nil)
	if r.delivered != 2 {
		t.Errorf("delivered: %d, want the 2 deletions the ledger records", r.delivered)
	}
	want := map[string]int{
		"healthy events not marked delivered":                     1,
		"enqueued events with neither a row nor a deletion":       1,
		"events with both a row and a deletion, or two deletions": 0,
		"settlements under an expired lease":                      1,
	}
	for _, c := range r.counts {
		if n, ok := want[c.what]; ok {
			if c.n != n {
				t.Errorf("%s: %d, want %d", c.what, c.n, n)
			}
			delete(want, c.what)
		}
	}
	if len(want) != 0 {
		t.Fatalf("checks missing from the report: %v", want)
	}
}

// TestVerifyAgainstTheProducersRecord: a commit the producers saw succeed
// that left no soak_enqueued row (lost with its event, which every other
// check would then miss) is a failure, and so is any change to an event
// already delivered or dead.
func TestVerifyAgainstTheProducersRecord(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	if _, err := pool.Exec(ctx, soakDDL); err != nil {
		t.Fatal(err)
	}
	id := uuid.Must(uuid.NewV7())
	for _, stmt := range []string{
		`INSERT INTO modkit_outbox_events (id, namespace, topic, payload) VALUES ($1, 'soak', 'v', '{}')`,
		`INSERT INTO soak_enqueued (event_id, seq) VALUES ($1, 1)`,
		`UPDATE modkit_outbox_events SET status = 'delivered' WHERE id = $1`,
		`UPDATE modkit_outbox_events SET status = 'pending' WHERE id = $1`,
	} {
		if _, err := pool.Exec(ctx, stmt, id); err != nil {
			t.Fatal(err)
		}
	}
	r := verify(ctx, pool, options{lease: time.Second}, nil, []int64{1, 2})
	checkCounts(t, r, map[string]int{"commits the producers saw that left no record (lost)": 1, "settled events changed afterwards": 1})
}
