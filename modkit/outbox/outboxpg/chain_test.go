package outboxpg_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// insertKeyed enqueues n events of one ordering key, one at a time.
func insertKeyed(t *testing.T, s driver.Store, pool *pgxpool.Pool, key string, n int) []driver.InsertRow {
	t.Helper()
	rs := rows(n, "test", "events")
	for i := range rs {
		if key != "" {
			rs[i].OrderingKey = &key
		}
		if _, err := s.Insert(ctx, pool, rs[i:i+1], nil); err != nil {
			t.Fatal(err)
		}
	}
	return rs
}

func claimChains(t *testing.T, s driver.Store, limit int, chains []int, worker uuid.UUID) []driver.Claimed {
	t.Helper()
	got, err := s.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: limit, MaxAttempts: 3, Worker: worker,
		Lease: 30 * time.Second, Chains: chains})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// claimedSet indexes a claim by "key:seq" ("-" for an event without a
// key).
func claimedSet(got []driver.Claimed) map[string]driver.Claimed {
	out := map[string]driver.Claimed{}
	for _, c := range got {
		k := "-"
		if c.OrderingKey != nil {
			k = fmt.Sprintf("%s:%d", *c.OrderingKey, c.OrderingSeq)
		}
		out[k] = c
	}
	return out
}

func wantClaimed(t *testing.T, got []driver.Claimed, want ...string) {
	t.Helper()
	set := claimedSet(got)
	if len(got) != len(want) || len(set) != len(want) {
		t.Fatalf("claimed %d events %v, want %v", len(got), keysOf(set), want)
	}
	for _, w := range want {
		if _, ok := set[w]; !ok {
			t.Fatalf("claimed %v, want %v", keysOf(set), want)
		}
	}
}

func keysOf(m map[string]driver.Claimed) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// A claim with chains leases each key's head with its next events, in
// sequence, within the limit (each head with its chain, in head order); a
// chain ends at the first event that cannot be claimed now; without chains
// a key gives one event.
func TestClaimChains(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	a := insertKeyed(t, s, pool, "a", 5)
	insertKeyed(t, s, pool, "b", 2)
	insertKeyed(t, s, pool, "", 1)
	w := uuid.New()

	// Runs first: the first head's chain fills the limit before the next
	// head is taken.
	got := claimChains(t, s, 3, []int{5}, w)
	wantClaimed(t, got, "a:1", "a:2", "a:3")
	var back []driver.Outcome
	for _, c := range got {
		back = append(back, outcome(c, driver.Release))
	}
	complete(t, s, w, back...)

	// Without chains (nil, or a length of one), one event a key.
	wantClaimed(t, claim(t, s, 100, 3, w), "a:1", "b:1", "-")
	mustExec(t, pool, `UPDATE modkit_outbox_events SET status = 'pending', locked_by = NULL, locked_until = NULL, lease_token = NULL, attempts = 0`)

	// A chain stops at the first event that is not due: a:4 is waiting
	// for a retry, so a:5 stays behind it too.
	mustExec(t, pool, `UPDATE modkit_outbox_events SET next_attempt_at = now() + interval '1 hour' WHERE id = $1`, a[3].ID)
	got = claimChains(t, s, 100, []int{10}, w)
	wantClaimed(t, got, "a:1", "a:2", "a:3", "b:1", "b:2", "-")
	set := claimedSet(got)
	if set["a:2"].Attempts != 1 {
		t.Fatalf("a chain link counts its attempt: %+v", set["a:2"])
	}
	// Since migration 0021 a claim's events share its lease token, one
	// that no earlier claim drew.
	for k, c := range set {
		if c.LeaseToken != set["a:1"].LeaseToken || c.LeaseToken == back[0].LeaseToken {
			t.Fatalf("event %s leased under token %v, the claim's first %v, an earlier claim's %v; want the claim's own",
				k, c.LeaseToken, set["a:1"].LeaseToken, back[0].LeaseToken)
		}
	}

	// The head fails: the chain given back is held behind it again, so
	// a later claim neither takes it nor walks it.
	retry := outcome(set["a:1"], driver.Retry)
	retry.Delay = time.Hour
	settled := complete(t, s, w, retry, outcome(set["a:2"], driver.Release), outcome(set["a:3"], driver.Release),
		outcome(set["b:1"], driver.Delivered), outcome(set["b:2"], driver.Release), outcome(set["-"], driver.Delivered))
	for i, ok := range settled {
		if !ok {
			t.Fatalf("outcome %d not recorded", i)
		}
	}
	var held []bool
	for _, id := range []uuid.UUID{a[1].ID, a[2].ID} {
		var h bool
		var attempts int
		if err := pool.QueryRow(ctx, `SELECT held, attempts FROM modkit_outbox_events WHERE id = $1`, id).Scan(&h, &attempts); err != nil {
			t.Fatal(err)
		}
		if attempts != 0 {
			t.Fatalf("a chain link given back kept its attempt: %d", attempts)
		}
		held = append(held, h)
	}
	if !held[0] || !held[1] {
		t.Fatalf("chain links given back behind a failed head: held %v, want held", held)
	}
	// b:2 was given back in the call that delivered b:1: it is free.
	wantClaimed(t, claimChains(t, s, 100, []int{10}, w), "b:2")

	// The retried head comes back with its chain, up to the length asked.
	mustExec(t, pool, `UPDATE modkit_outbox_events SET next_attempt_at = now() WHERE ordering_key = 'a'`)
	got = claimChains(t, s, 100, []int{2}, w)
	wantClaimed(t, got, "a:1", "a:2")
	if set := claimedSet(got); set["a:1"].Attempts != 2 || set["a:2"].Attempts != 1 {
		t.Fatalf("attempts after a retry: head %d, link %d", set["a:1"].Attempts, set["a:2"].Attempts)
	}

	// An expired chain is repaired whole when its head is claimed again.
	for _, c := range got {
		expireLease(t, pool, c.ID)
	}
	again := claimChains(t, s, 100, []int{3}, uuid.New())
	wantClaimed(t, again, "a:1", "a:2", "a:3")
	for _, c := range again {
		if c.OrderingSeq <= 2 && !c.Repaired {
			t.Fatalf("an expired link was claimed without repair: %+v", c)
		}
	}
}

// A chain's deliveries, written in one call under the claim's shared lease
// token (one UPDATE for the token since migrations 0019 and 0021), let the
// key's next event into the claim and no other; presented by another
// worker, or under a token the claim did not draw, they change nothing.
func TestChainDeliveredUnderItsToken(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	insertKeyed(t, s, pool, "c", 14)
	w := uuid.New()
	first := claimChains(t, s, 100, []int{10}, w)
	wantClaimed(t, first, "c:1", "c:2", "c:3", "c:4", "c:5", "c:6", "c:7", "c:8", "c:9", "c:10")

	// Another worker, and this worker under a token no claim drew.
	var foreign, stale []driver.Outcome
	for _, c := range first {
		foreign = append(foreign, outcome(c, driver.Delivered))
		o := outcome(c, driver.Delivered)
		o.LeaseToken = uuid.New()
		stale = append(stale, o)
	}
	for name, try := range map[string]func() []bool{
		"another worker":   func() []bool { return complete(t, s, uuid.New(), foreign...) },
		"an unknown token": func() []bool { return complete(t, s, w, stale...) },
	} {
		for i, ok := range try() {
			if ok {
				t.Fatalf("%s: delivery %d recorded", name, i)
			}
		}
	}

	var outcomes []driver.Outcome
	for _, c := range first {
		outcomes = append(outcomes, outcome(c, driver.Delivered))
	}
	for i, ok := range complete(t, s, w, outcomes...) {
		if !ok {
			t.Fatalf("delivery %d of the chain not recorded", i)
		}
	}
	var delivered, ledger int
	var held []bool
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'delivered'),
		array_agg(held ORDER BY ordering_seq) FILTER (WHERE status = 'pending') FROM modkit_outbox_events`).Scan(&delivered, &held); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM modkit_outbox_attempts WHERE outcome = 'delivered'`).Scan(&ledger); err != nil {
		t.Fatal(err)
	}
	if delivered != 10 || ledger != 10 || len(held) != 4 || held[0] || !held[1] || !held[2] || !held[3] {
		t.Fatalf("after the chain's deliveries: %d delivered, %d ledger rows, pending held %v; want 10, 10, [false true true true]",
			delivered, ledger, held)
	}
	wantClaimed(t, claimChains(t, s, 100, []int{10}, w), "c:11", "c:12", "c:13", "c:14")
}

// heldOf returns the state of each event of key by its sequence: its status,
// after "held " when it is held.
func heldOf(t *testing.T, pool *pgxpool.Pool, key string) map[int64]string {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT ordering_seq, CASE WHEN held THEN 'held ' ELSE '' END || status
		FROM modkit_outbox_events WHERE ordering_key = $1`, key)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[int64]string{}
	for rows.Next() {
		var seq int64
		var state string
		if err := rows.Scan(&seq, &state); err != nil {
			t.Fatal(err)
		}
		out[seq] = state
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// wantStates fails the test unless the states of heldOf are want, in
// sequence order from 1, and no more.
func wantStates(t *testing.T, got map[int64]string, want ...string) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("states by sequence %v, want %q", got, want)
	}
	for i, w := range want {
		if got[int64(i+1)] != w {
			t.Fatalf("states by sequence %v, want %q", got, want)
		}
	}
}

// The links of a chain stay held while leased (migration 0021: their claim
// then writes no index entry); the depth gauge counts them as in flight. A
// delivery clears held; a release, or a retry or dead outcome of a held
// link, leaves an event held exactly while its predecessor is undelivered,
// counting the deliveries of the same call, so that a link retried or dead
// behind a delivered event is not held (a held retry would never be claimed
// again).
func TestChainLinksStayHeldWhileLeased(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	insertKeyed(t, s, pool, "h", 6)
	w := uuid.New()
	first := claimSet(t, claimChains(t, s, 100, []int{4}, w), "h:1", "h:2", "h:3", "h:4")
	wantStates(t, heldOf(t, pool, "h"), "processing", "held processing", "held processing", "held processing",
		"held pending", "held pending")
	rows, err := s.Depth(ctx, []string{topic})
	if err != nil || len(rows) != 1 || rows[0].Processing != 4 || rows[0].Pending != 2 {
		t.Fatalf("depth %+v %v, want 4 processing and 2 pending", rows, err)
	}

	retry := outcome(first["h:3"], driver.Retry)
	retry.Delay = 0
	complete(t, s, w, outcome(first["h:1"], driver.Delivered), outcome(first["h:2"], driver.Delivered), retry,
		outcome(first["h:4"], driver.Release))
	wantStates(t, heldOf(t, pool, "h"), "delivered", "delivered", "pending", "held pending", "held pending", "held pending")

	second := claimSet(t, claimChains(t, s, 100, []int{4}, w), "h:3", "h:4", "h:5", "h:6")
	if second["h:3"].Attempts != 2 || second["h:4"].Attempts != 1 {
		t.Fatalf("attempts: h:3 %d, h:4 %d; want 2 and 1", second["h:3"].Attempts, second["h:4"].Attempts)
	}
	complete(t, s, w, outcome(second["h:3"], driver.Delivered), outcome(second["h:4"], driver.Dead),
		outcome(second["h:5"], driver.Release), outcome(second["h:6"], driver.Release))
	wantStates(t, heldOf(t, pool, "h"), "delivered", "delivered", "delivered", "dead", "held pending", "held pending")
	blocked, err := s.BlockedKeys(ctx, 10)
	if err != nil || len(blocked) != 1 || blocked[0].Waiting != 2 {
		t.Fatalf("blocked keys %+v %v, want h, two events waiting", blocked, err)
	}
}

// A chain whose dispatcher died, taken over by claims without chains and no
// sweep: each delivery frees the next link, still leased under the dead
// claim and held, and the next claim takes it as an expired lease, so the
// key goes on in order, one event a claim, and every link's ledger records
// the lease that expired.
func TestDeadChainTakenOverWithoutChains(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	insertKeyed(t, s, pool, "p", 3)
	for _, c := range claimSet(t, claimChains(t, s, 100, []int{3}, uuid.New()), "p:1", "p:2", "p:3") {
		expireLease(t, pool, c.ID)
	}
	w := uuid.New()
	for seq := 1; seq <= 3; seq++ {
		key := fmt.Sprintf("p:%d", seq)
		got := claimSet(t, claim(t, s, 100, 5, w), key)
		if !got[key].Repaired {
			t.Fatalf("%s claimed without repairing the expired lease: %+v", key, got[key])
		}
		complete(t, s, w, outcome(got[key], driver.Delivered))
	}
	wantStates(t, heldOf(t, pool, "p"), "delivered", "delivered", "delivered")
	var expired int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM modkit_outbox_attempts WHERE outcome = 'lease_expired'`).Scan(&expired); err != nil || expired != 3 {
		t.Fatalf("lease_expired ledger rows: %d %v, want 3", expired, err)
	}
}

// claimSet checks a claim's events by "key:seq" and indexes them.
func claimSet(t *testing.T, got []driver.Claimed, want ...string) map[string]driver.Claimed {
	t.Helper()
	wantClaimed(t, got, want...)
	return claimedSet(got)
}

// A claim whose chain lengths do not match its topics is refused.
func TestClaimChainsMismatch(t *testing.T) {
	s, _ := newStore(t)
	_, err := s.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 1, MaxAttempts: 3, Worker: uuid.New(),
		Lease: time.Second, Chains: []int{2, 3}})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "22023" {
		t.Fatalf("claim with two chain lengths for one topic: %v, want 22023", err)
	}
}

// A chained claim locks about the heads it keeps, not one head per key up
// to its limit: until it commits, another claim takes the keys it did not
// keep. (It locks twice as many heads as fit, to fill up when another
// claim holds some of them.)
func TestClaimChainsLeavesOtherKeysToOtherClaims(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	var keys []string
	for k := range 10 {
		keys = append(keys, fmt.Sprintf("k%d", k))
		insertKeyed(t, s, pool, keys[k], 10)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	got, err := tx.Query(ctx, `SELECT ordering_key || ':' || ordering_seq
		FROM modkit_outbox_claim_chained($1, $2, 20, 3, '30 seconds', NULL, '{10}')`, uuid.New(), []string{topic})
	if err != nil {
		t.Fatal(err)
	}
	first, err := pgx.CollectRows(got, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(first) != 20 || first[0] != "k0:1" || first[10] != "k1:1" {
		t.Fatalf("the first claim took %v, want k0's and k1's events", first)
	}

	// Uncommitted, it holds k0 and k1, and the heads of k2 and k3 as its
	// margin; the rest are free.
	second := claimChains(t, s, 100, []int{10}, uuid.New())
	var want []string
	for _, k := range keys[4:] {
		for seq := 1; seq <= 10; seq++ {
			want = append(want, fmt.Sprintf("%s:%d", k, seq))
		}
	}
	wantClaimed(t, second, want...)
}

// The sweeper puts the rest of an expired run back held behind its head,
// as a claim's repair or an outcome write would, so that claims do not walk
// it before its turn; the head comes back with its run.
func TestSweepHoldsTheRestOfAnExpiredRun(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	insertKeyed(t, s, pool, "a", 3)
	got := claimChains(t, s, 10, []int{3}, uuid.New())
	wantClaimed(t, got, "a:1", "a:2", "a:3")
	for _, c := range got {
		expireLease(t, pool, c.ID)
	}
	swept, err := s.Sweep(ctx, driver.SweepParams{Topics: []string{topic}, MaxAttempts: 5, Limit: 10})
	if err != nil || len(swept) != 3 {
		t.Fatalf("sweep: %+v %v, want the run's three events repaired", swept, err)
	}
	for _, c := range got {
		var held bool
		if err := pool.QueryRow(ctx, `SELECT held FROM modkit_outbox_events WHERE id = $1`, c.ID).Scan(&held); err != nil {
			t.Fatal(err)
		}
		if want := c.OrderingSeq > 1; held != want {
			t.Fatalf("a:%d after the sweep: held %v, want %v", c.OrderingSeq, held, want)
		}
	}
	wantClaimed(t, claimChains(t, s, 10, []int{3}, uuid.New()), "a:1", "a:2", "a:3")
}

// Letting a held event into the claim passes over a row another session
// has locked instead of waiting for it (migration 0042): a delivery's
// outcome write and ReleaseHeld return at once, the locked successor stays
// held, and ReleaseHeld lets it in once the lock is gone. Both waited for
// the lock: a trial's one row lock stalled every dispatcher's claims, of
// every topic, for as long as it was held.
func TestHeldReleasesSkipLockedRows(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	rs := insertKeyed(t, s, pool, "acct", 2)
	w := uuid.New()
	first := claim(t, s, 10, 3, w)
	if len(first) != 1 || first[0].ID != rs[0].ID {
		t.Fatalf("claim of a key's two events: %+v, want its first only", first)
	}
	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, "SELECT 1 FROM modkit_outbox_events WHERE id = $1 FOR UPDATE", rs[1].ID); err != nil {
		t.Fatal(err)
	}
	guard, cancel := context.WithTimeout(ctx, time.Minute) // a hang guard: without 0042 both calls wait for the lock
	defer cancel()
	if settled, err := s.Complete(guard, nil, w, []driver.Outcome{outcome(first[0], driver.Delivered)}); err != nil || len(settled) != 1 || !settled[0] {
		t.Fatalf("the delivery of the first, its successor locked by another session: %v, %v", settled, err)
	}
	if n, err := s.ReleaseHeld(guard, []string{topic}, nil, 100); err != nil || n != 0 {
		t.Fatalf("release held while the successor is locked: %d, %v; want 0 (passed over)", n, err)
	}
	if got := claim(t, s, 10, 3, w); len(got) != 0 {
		t.Fatalf("claimed while the successor is locked and held: %+v", got)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := s.ReleaseHeld(ctx, []string{topic}, nil, 100); err != nil || n != 1 {
		t.Fatalf("release held once the lock is gone: %d, %v; want 1", n, err)
	}
	if got := claim(t, s, 10, 3, w); len(got) != 1 || got[0].ID != rs[1].ID {
		t.Fatalf("after the release: %+v, want the second event", got)
	}
}
