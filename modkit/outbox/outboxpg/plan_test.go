package outboxpg_test

import (
	"context"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// An outcome write finds its events by id, never by walking the claim
// index, whatever the planner's costs: with statistics gathered mid-drain,
// a plan that walked an index of leased events for every outcome (the
// locked_until index, until migration 0014) made each call take hundreds of
// milliseconds (migration 0009). Since 0014 the claim index holds the leased
// events. Nested loops are turned off here, which makes a readable index of
// leased events the planner's pick; the function must not be able to.
func TestCompleteNeverWalksTheClaimIndex(t *testing.T) {
	s, tdb := newStore(t)
	const n, leased = 3000, 300
	if _, err := s.Insert(ctx, tdb.Provider.Pool, rows(n, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	w := uuid.New()
	got := claim(t, s, leased, 3, w)
	if len(got) != leased {
		t.Fatalf("claimed %d, want %d", len(got), leased)
	}
	mustExec(t, tdb.Provider.Pool, "ANALYZE modkit_outbox_events")

	// The transaction statistics read below must hold this call's scans
	// only.
	tx := ownTx(t, tdb)
	if _, err := tx.Exec(ctx, "SET LOCAL enable_nestloop = off"); err != nil {
		t.Fatal(err)
	}
	ids, tokens := make([]uuid.UUID, leased), make([]uuid.UUID, leased)
	outcomes, errs, delays := make([]string, leased), make([]*string, leased), make([]int64, leased)
	for i, c := range got {
		ids[i], tokens[i], outcomes[i] = c.ID, c.LeaseToken, "delivered"
	}
	var settled, scans int
	err := tx.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_complete($1, $2, $3, $4, $5, $6)",
		w, ids, tokens, outcomes, errs, delays).Scan(&settled)
	if err != nil || settled != leased {
		t.Fatalf("settled %d of %d: %v", settled, leased, err)
	}
	err = tx.QueryRow(ctx, "SELECT pg_stat_get_xact_numscans('modkit_outbox_events_claim_idx'::regclass)").Scan(&scans)
	if err != nil {
		t.Fatal(err)
	}
	if scans != 0 {
		t.Fatalf("the outcome write read the claim index %d time(s); it must look its events up by id", scans)
	}
}

// ownTx begins a transaction on a connection of its own, so that the
// transaction statistics (pg_stat_get_xact_*) it reads count its own
// statements only; it is rolled back and the connection closed when the
// test ends.
func ownTx(t *testing.T, tdb *pgtest.DB) pgx.Tx {
	t.Helper()
	conn, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(ctx) })
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(ctx) }) //nolint:errcheck // nothing the tests do is kept
	return tx
}

// A claim's update of an event is heap-only (HOT): no index reads a column
// it changes, and pages keep room for the new versions (migration 0014). A
// delivery is not: the event leaves the claim index for the settled index.
// Nor, since migration 0038, is a retry: the claim index reads
// next_attempt_at, so that claims pass over waiting retries without reading
// their rows (TestClaimPassesOverWaitingRetries).
func TestClaimIsAHeapOnlyUpdate(t *testing.T) {
	s, tdb := newStore(t)
	if _, err := s.Insert(ctx, tdb.Provider.Pool, rows(100, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	// The transaction statistics read below must hold this transaction's
	// updates only.
	tx := ownTx(t, tdb)
	updates := func() (all, hot int64) {
		t.Helper()
		err := tx.QueryRow(ctx, `SELECT pg_stat_get_xact_tuples_updated('modkit_outbox_events'::regclass),
			pg_stat_get_xact_tuples_hot_updated('modkit_outbox_events'::regclass)`).Scan(&all, &hot)
		if err != nil {
			t.Fatal(err)
		}
		return all, hot
	}

	const claimed = 10
	w := uuid.New()
	var ids, tokens []uuid.UUID
	rs, err := tx.Query(ctx, "SELECT id, lease_token FROM modkit_outbox_claim($1, $2, $3, 3, interval '30 seconds', NULL)",
		w, []string{"test:events"}, claimed)
	if err != nil {
		t.Fatal(err)
	}
	for rs.Next() {
		var id, token uuid.UUID
		if err := rs.Scan(&id, &token); err != nil {
			t.Fatal(err)
		}
		ids, tokens = append(ids, id), append(tokens, token)
	}
	if err := rs.Err(); err != nil || len(ids) != claimed {
		t.Fatalf("claimed %d of %d: %v", len(ids), claimed, err)
	}
	if all, hot := updates(); all != claimed || hot != claimed {
		t.Fatalf("the claim of %d events made %d updates, %d of them HOT; want all %d HOT", claimed, all, hot, claimed)
	}

	// Half retried, half delivered.
	outcomes, errs, delays := make([]string, claimed), make([]*string, claimed), make([]int64, claimed)
	reason := "unavailable"
	for i := range outcomes {
		outcomes[i], errs[i], delays[i] = "delivered", nil, 0
		if i%2 == 0 {
			outcomes[i], errs[i], delays[i] = "retry", &reason, 1000
		}
	}
	var settled int
	err = tx.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_complete($1, $2, $3, $4, $5, $6)",
		w, ids, tokens, outcomes, errs, delays).Scan(&settled)
	if err != nil || settled != claimed {
		t.Fatalf("settled %d of %d: %v", settled, claimed, err)
	}
	all, hot := updates()
	if all != 2*claimed || hot != claimed {
		t.Fatalf("after %d retries and %d deliveries: %d updates, %d HOT; want %d and %d (the claim's only)",
			claimed/2, claimed/2, all, hot, 2*claimed, claimed)
	}
}

// A claim passes over the events waiting for their retries inside the
// claim index, reading neither their entries' rows nor counting them among
// what it read (migration 0038): it read every one of them, so that a topic
// whose retries piled up (a downstream outage) slowed every claim of every
// topic in proportion (a trial: 40,000 waiting events, claims of 49,397
// entries each, p50 from commit to publish 86 ms against 5.7 ms).
func TestClaimPassesOverWaitingRetries(t *testing.T) {
	for name, chains := range map[string][]int32{"without chains": nil, "with chains": {10}} {
		t.Run(name, func(t *testing.T) { claimPassesOverWaitingRetries(t, chains) })
	}
}

func claimPassesOverWaitingRetries(t *testing.T, chains []int32) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	const waiting, due = 2000, 5
	if _, err := s.Insert(ctx, pool, rows(waiting, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	// As a retry's outcome leaves them: pending, due in an hour.
	mustExec(t, pool, "UPDATE modkit_outbox_events SET attempts = 1, next_attempt_at = now() + interval '1 hour'")
	if _, err := s.Insert(ctx, pool, rows(due, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	mustExec(t, pool, "VACUUM ANALYZE modkit_outbox_events")
	tx := ownTx(t, tdb)
	// The claim with chains plans each call for its arguments, and on a
	// table this small may read it whole rather than walk an index (as it
	// did before 0038); what is checked here is the walk.
	if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
		t.Fatal(err)
	}
	var claimed int64
	err := tx.QueryRow(ctx, `SELECT count(*) FROM modkit_outbox_claim_chained($1, $2, 100, 3, '1 minute', NULL, $3)`,
		uuid.New(), []string{topic}, chains).Scan(&claimed)
	if err != nil || claimed != due {
		t.Fatalf("claimed %d of the %d due events: %v", claimed, due, err)
	}
	if read := tableReads(t, tx, "modkit_outbox_events"); read > 10*due {
		t.Fatalf("the claim of %d due events behind %d waiting retries read %d rows and index entries; want a few per claimed event",
			due, waiting, read)
	}
}

// A claim leases the events it locked by row address (migration 0022): the
// statement that locks them walks the claim index, and the one that leases
// them reaches each by its ctid, so the claim never descends the primary
// key (one descent an event took 5-11% of a claim's time).
func TestClaimLeasesByRowAddress(t *testing.T) {
	s, tdb := newStore(t)
	const n, claimed = 60, 40
	if _, err := s.Insert(ctx, tdb.Provider.Pool, rows(n, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	// The transaction statistics read below must hold this claim's scans
	// only.
	tx := ownTx(t, tdb)
	w := uuid.New()
	var leased, tokens int
	err := tx.QueryRow(ctx, `SELECT count(*), count(DISTINCT c.lease_token)
	FROM modkit_outbox_claim($1, $2, $3, 3, interval '30 seconds', NULL) AS c`,
		w, []string{"test:events"}, claimed).Scan(&leased, &tokens)
	if err != nil || leased != claimed || tokens != 1 {
		t.Fatalf("claimed %d events under %d tokens, want %d under 1: %v", leased, tokens, claimed, err)
	}
	var pkeyScans, tuples int64
	err = tx.QueryRow(ctx, `SELECT pg_stat_get_xact_numscans('modkit_outbox_events_pkey'::regclass),
		pg_stat_get_xact_tuples_updated('modkit_outbox_events'::regclass)`).Scan(&pkeyScans, &tuples)
	if err != nil {
		t.Fatal(err)
	}
	if pkeyScans != 0 {
		t.Fatalf("the claim read the primary key %d time(s); it must lease the events it locked by row address", pkeyScans)
	}
	if tuples != claimed {
		t.Fatalf("the claim updated %d rows, want the %d it leased", tuples, claimed)
	}
}

// The statements of the enqueue and dispatch paths are never compiled to
// machine code (migration 0009), not even on a server that would compile
// every statement: JIT compilation costs 100 ms and more, and these
// statements run in about a millisecond. (With the server's defaults, a
// claim's estimate passed jit_above_cost once enough delivered rows were
// kept, and a dispatcher at 2,000 events/s fell behind for good.)
// auto_explain reports every statement the functions run, with "JIT:" in
// the plan of one that was compiled.
func TestDispatchPathRunsWithoutJIT(t *testing.T) {
	tdb := pgtest.NewDB(t)
	var available bool
	if err := tdb.Provider.Pool.QueryRow(ctx, "SELECT pg_jit_available()").Scan(&available); err != nil {
		t.Fatal(err)
	}
	if !available {
		t.Skip("this PostgreSQL server has no JIT (pg_jit_available() is false): nothing to compile")
	}
	var super bool
	if err := tdb.Provider.Pool.QueryRow(ctx, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&super); err != nil {
		t.Fatal(err)
	}
	if !super {
		t.Skip("LOAD 'auto_explain' needs a superuser; the test database's role is not one")
	}
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var compiled []string
	var plans int
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		// Only the statements the functions run: they carry the function
		// in their context. (The caller's own statement, the function
		// call, runs under the session's settings.)
		if n.Where == "" || !strings.Contains(n.Message, "plan:") {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		plans++
		if strings.Contains(n.Message, "JIT:") {
			compiled = append(compiled, n.Message)
		}
	}
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `LOAD 'auto_explain';
			SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on;
			SET client_min_messages = log; SET jit = on; SET jit_above_cost = 0`)
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := open(t, pool, driver.Options{})

	one := rows(1, "test", "events")
	key := "k"
	one[0].OrderingKey = &key
	if _, err := s.Insert(ctx, pool, one, []string{topic}); err != nil {
		t.Fatal(err)
	}
	// Three rows: the enqueue_many function (COPY takes larger batches).
	if _, err := s.Insert(ctx, pool, rows(3, "test", "events"), []string{topic}); err != nil {
		t.Fatal(err)
	}
	w := uuid.New()
	got, err := s.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 10, MaxAttempts: 3, Worker: w,
		Lease: time.Minute, Chains: []int{4}})
	if err != nil || len(got) != 4 {
		t.Fatalf("claim: %d events, %v", len(got), err)
	}
	// And a claim without chains (migration 0010's modkit_outbox_claim_plain).
	if _, err := s.Insert(ctx, pool, rows(1, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	if plain, err := s.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 10, MaxAttempts: 3, Worker: w,
		Lease: time.Minute}); err != nil || len(plain) != 1 {
		t.Fatalf("claim without chains: %d events, %v", len(plain), err)
	}
	outcomes := make([]driver.Outcome, len(got))
	for i, c := range got {
		outcomes[i] = outcome(c, driver.Delivered)
	}
	if _, err := s.Complete(ctx, nil, w, outcomes[1:]); err != nil {
		t.Fatal(err)
	}
	if err := s.InTx(ctx, func(ctx context.Context, tx any) error {
		_, err := s.Complete(ctx, tx, w, outcomes[:1])
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Sweep(ctx, driver.SweepParams{Topics: []string{topic}, MaxAttempts: 3, Limit: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ReleaseHeld(ctx, []string{topic}, nil, 10); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Depth(ctx, []string{topic}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Elect(ctx, driver.ElectParams{Roles: []string{topic}, Holder: w, TTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if err := s.Resign(ctx, w, []string{topic}); err != nil {
		t.Fatal(err)
	}
	for _, recorded := range []bool{false, true} {
		if _, err := s.Purge(ctx, driver.PurgeParams{Topics: []string{topic}, Retention: 0, Limit: 10, Recorded: recorded}); err != nil {
			t.Fatal(err)
		}
	}

	mu.Lock()
	defer mu.Unlock()
	if plans < 10 {
		t.Fatalf("auto_explain reported %d plans of the functions' statements; the test sees too little", plans)
	}
	if len(compiled) > 0 {
		t.Fatalf("%d of %d statements of the enqueue and dispatch functions were compiled with JIT; the first:\n%s",
			len(compiled), plans, compiled[0])
	}
}

// A claim without chains runs on plans cached for the connection (migration
// 0010), and plans cached while the table was empty stay index-driven once
// it is full: the claim reads the due events in index order and updates
// them by id. (A single statement cached that way joined the locked events
// to the table the wrong way round and read every row of the table for
// each claim, until the next ANALYZE.) The bound is on the rows and index
// entries the claim reads (the transaction's statistics): a few per event
// claimed, against one per row of the table.
func TestClaimPlanCachedOnAnEmptyTable(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	analyzeEmpty(t, pool, "modkit_outbox_events")
	conn, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	claimOn := func(limit int) (claimed, read int64) {
		t.Helper()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck // committed below
		err = tx.QueryRow(ctx, `SELECT count(*) FROM modkit_outbox_claim_chained($1, $2, $3, 3, '1 minute', NULL, NULL)`,
			uuid.New(), []string{topic}, limit).Scan(&claimed)
		if err != nil {
			t.Fatal(err)
		}
		return claimed, readAndCommit(t, tx)
	}

	// Plans made on an empty table's statistics: the table is analyzed
	// empty, and the first claims (one finds nothing, one finds 5) cache
	// the plans of the due-event lookup and of the update. (The expired
	// leases' ledger insert reads no table.)
	if n, _ := claimOn(5); n != 0 {
		t.Fatalf("claimed %d from an empty table", n)
	}
	if _, err := s.Insert(ctx, pool, rows(5, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	if n, _ := claimOn(5); n != 5 {
		t.Fatalf("claimed %d of 5", n)
	}

	readsOnAFullTable(t, s, pool, "a claim", claimOn)
}

// Outcome writes run on plans cached for the connection too (migration
// 0011): plans cached while the table was nearly empty must still find the
// settled events by id and update them by row address once the table is
// full, reading a few rows or index entries per outcome.
func TestCompletePlanCachedOnAnEmptyTable(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	analyzeEmpty(t, pool, "modkit_outbox_events")
	conn, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	w := uuid.New()
	completeOn := func(got []driver.Claimed) (settled, read int64) {
		t.Helper()
		n := len(got)
		ids, tokens := make([]uuid.UUID, n), make([]uuid.UUID, n)
		outcomes, errs, delays := make([]string, n), make([]*string, n), make([]int64, n)
		for i, c := range got {
			ids[i], tokens[i], outcomes[i] = c.ID, c.LeaseToken, "delivered"
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck // committed below
		err = tx.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_complete($1, $2, $3, $4, $5, $6)",
			w, ids, tokens, outcomes, errs, delays).Scan(&settled)
		if err != nil {
			t.Fatal(err)
		}
		return settled, readAndCommit(t, tx)
	}

	// Plans made while the table holds 5 events (analyzed empty).
	if _, err := s.Insert(ctx, pool, rows(5, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	if n, _ := completeOn(claim(t, s, 5, 3, w)); n != 5 {
		t.Fatalf("settled %d of 5", n)
	}

	readsOnAFullTable(t, s, pool, "an outcome write", func(limit int) (int64, int64) {
		return completeOn(claim(t, s, limit, 3, w))
	})
}

// The enqueue of one event runs on plans cached for the connection too
// (migration 0012). Plans cached while the tables were empty must still find
// a duplicate by its dedupe key, an ordered event's predecessor by stream
// and sequence, and the key's sequence row by its key once the tables are
// full, reading a few rows or index entries per enqueue: 22 for the five
// below. (With sequential and bitmap scans allowed, the plans cached this
// way read 200,085.)
func TestEnqueuePlanCachedOnAnEmptyTable(t *testing.T) {
	_, tdb := newStore(t)
	pool := tdb.Provider.Pool
	analyzeEmpty(t, pool, "modkit_outbox_events", "modkit_outbox_sequences")
	conn, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	type enqueue struct {
		key, orderingKey *string
		duplicate        bool
	}
	str := func(s string) *string { return &s }
	enqueueOn := func(calls []enqueue) (read int64) {
		t.Helper()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck // committed below
		for _, c := range calls {
			var duplicate bool
			err := tx.QueryRow(ctx, `SELECT duplicate FROM modkit_outbox_enqueue($1, 'test', 'events', NULL, $2, '{}', false, NULL, $3)`,
				uuid.Must(uuid.NewV7()), c.key, c.orderingKey).Scan(&duplicate)
			if err != nil {
				t.Fatal(err)
			}
			if duplicate != c.duplicate {
				t.Fatalf("enqueue of key %v, ordering key %v: duplicate %v, want %v", c.key, c.orderingKey, duplicate, c.duplicate)
			}
		}
		read = tableReads(t, tx, "modkit_outbox_events") + tableReads(t, tx, "modkit_outbox_sequences")
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return read
	}

	// Plans made on empty tables: each statement of the function runs once
	// (a new event, a key's first and second events, a duplicate, a
	// duplicate of an ordered event, which gives its sequence back).
	enqueueOn([]enqueue{
		{key: str("a")},
		{orderingKey: str("first")},
		{orderingKey: str("first")},
		{key: str("a"), duplicate: true},
		{key: str("a"), orderingKey: str("first"), duplicate: true},
	})

	// 20,000 events with dedupe keys and 20,000 ordering keys with an event each.
	const n = 20000
	mustExec(t, pool, `INSERT INTO modkit_outbox_events (id, namespace, topic, dedupe_key, payload)
		SELECT gen_random_uuid(), 'test', 'events', 'key-' || i, '{}' FROM generate_series(1, $1) AS i`, n)
	mustExec(t, pool, `INSERT INTO modkit_outbox_sequences (namespace, topic, ordering_key, last_seq)
		SELECT 'test', 'events', 'stream-' || i, 1 FROM generate_series(1, $1) AS i`, n)
	mustExec(t, pool, `INSERT INTO modkit_outbox_events (id, namespace, topic, payload, ordering_key, ordering_seq, ordering_stream)
		SELECT gen_random_uuid(), namespace, topic, '{}', ordering_key, 1, stream_id FROM modkit_outbox_sequences
		WHERE ordering_key LIKE 'stream-%'`)

	calls := []enqueue{
		{key: str("b")},
		{orderingKey: str("stream-7")},
		{orderingKey: str("new-stream")},
		{key: str("key-9"), duplicate: true},
		{key: str("key-10"), orderingKey: str("stream-8"), duplicate: true},
	}
	read := enqueueOn(calls)
	if bound := int64(10 * len(calls)); read > bound {
		t.Fatalf("%d enqueues into tables of %d events and %d ordering keys read %d rows and index entries (bound %d): "+
			"a cached plan reads a table instead of the rows the enqueue names", len(calls), 2*n, n, read, bound)
	}
	t.Logf("%d enqueues into tables of %d events and %d ordering keys: %d rows and index entries read", len(calls), 2*n, n, read)
}

// analyzeEmpty gathers the statistics of the (empty) tables that the plans
// a test caches are costed from, and turns the tables' autovacuum off, so
// that no ANALYZE replaces those plans before the test has filled the
// tables and checked what the plans read.
func analyzeEmpty(t *testing.T, pool *pgxpool.Pool, tables ...string) {
	t.Helper()
	for _, table := range tables {
		mustExec(t, pool, "ALTER TABLE "+table+" SET (autovacuum_enabled = false)")
		mustExec(t, pool, "ANALYZE "+table)
	}
}

// readsOnAFullTable adds 40,000 pending events, then has op handle 5 and
// then 500 of them (op returns how many it handled and how many rows and
// index entries it read), and fails unless op handled them all reading at
// most 4 per event plus 100: a cached plan that reads the table instead
// reads every row.
func readsOnAFullTable(t *testing.T, s driver.Store, pool *pgxpool.Pool, what string, op func(limit int) (n, read int64)) {
	t.Helper()
	const pending = 40000
	if _, err := s.Insert(ctx, pool, rows(pending, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	for _, limit := range []int{5, 500} {
		n, read := op(limit)
		if n != int64(limit) {
			t.Fatalf("%s handled %d of %d events", what, n, limit)
		}
		if bound := int64(4*limit + 100); read > bound {
			t.Fatalf("%s of %d events in a table of %d read %d rows and index entries (bound %d): "+
				"its cached plan reads the table instead of the events it handles", what, n, pending, read, bound)
		}
		t.Logf("%s of %d events in a table of %d: %d rows and index entries read", what, n, pending, read)
	}
}

// readAndCommit returns what the transaction read from the events table
// (tableReads), and commits it.
func readAndCommit(t *testing.T, tx pgx.Tx) int64 {
	t.Helper()
	read := tableReads(t, tx, "modkit_outbox_events")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return read
}

// tableReads returns how many rows the transaction read from table by
// sequential scans plus the entries it read from the table's indexes (the
// transaction's statistics).
func tableReads(t *testing.T, tx pgx.Tx, table string) int64 {
	t.Helper()
	var read int64
	err := tx.QueryRow(ctx, `SELECT pg_stat_get_xact_tuples_returned($1::regclass)
		+ coalesce((SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid))::bigint
		   FROM pg_index WHERE indrelid = $1::regclass), 0)`, table).Scan(&read)
	if err != nil {
		t.Fatal(err)
	}
	return read
}

// The reads of settled events (Admin.Settled, Admin.SettledPage, which the
// CLI's tail calls every second) find them in the settled index, delivered
// and dead alike, and never read the whole table: until migration 0023 they
// filtered on status and updated_at, which no index has held since 0014.
// Sequential scans are turned off here so that the small table's costs do
// not decide.
func TestSettledReadsTheSettledIndex(t *testing.T) {
	s, tdb := newStore(t)
	if _, err := s.Insert(ctx, tdb.Provider.Pool, rows(40, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	w := uuid.New()
	got := claim(t, s, 40, 3, w)
	var outcomes []driver.Outcome
	for i, c := range got {
		kind := driver.Delivered
		if i%4 == 0 {
			kind = driver.Dead
		}
		outcomes = append(outcomes, outcome(c, kind))
	}
	complete(t, s, w, outcomes...)
	mustExec(t, tdb.Provider.Pool, "ANALYZE modkit_outbox_events")

	for _, q := range []string{
		"SELECT count(*) FROM modkit_outbox_settled(now() - interval '1 hour', 1000)",
		"SELECT count(*) FROM modkit_outbox_settled_page(now() - interval '1 hour', NULL, NULL, 1000)",
		"SELECT count(*) FROM modkit_outbox_settled_page(NULL, '-infinity', '00000000-0000-0000-0000-000000000000', 1000)",
	} {
		tx := ownTx(t, tdb)
		if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
			t.Fatal(err)
		}
		var n, seq, idx int
		if err := tx.QueryRow(ctx, q).Scan(&n); err != nil || n != len(got) {
			t.Fatalf("%s: %d events, want %d: %v", q, n, len(got), err)
		}
		err := tx.QueryRow(ctx, `SELECT pg_stat_get_xact_numscans('modkit_outbox_events'::regclass),
			pg_stat_get_xact_numscans('modkit_outbox_events_settled_idx'::regclass)`).Scan(&seq, &idx)
		if err != nil {
			t.Fatal(err)
		}
		if seq != 0 || idx == 0 {
			t.Errorf("%s: %d sequential scans of the events and %d of the settled index; want none and some", q, seq, idx)
		}
	}
}

// keepDelivered fills the table as a retention leaves it: n delivered
// events of two topics, enqueued over the last three hours (in pairs that
// share an enqueue time) and delivered 1 to 50 seconds later, two of them
// delivered an hour from now (a test clock's outcomes), and a few events in
// each other state: pending (due or not), leased, dead, and the events of
// an ordering key held behind its dead head, one of them leased and one
// dead. A tenth have a tenant. It returns the database's time, which the
// times above are relative to.
func keepDelivered(t *testing.T, pool *pgxpool.Pool, n int) time.Time {
	t.Helper()
	var now time.Time
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	insert := func(label string, n int, from, step time.Duration) {
		t.Helper()
		mustExec(t, pool, `INSERT INTO modkit_outbox_events (id, namespace, topic, tenant_id, payload, created_at, next_attempt_at)
			SELECT gen_random_uuid(), 'test', CASE WHEN i % 3 = 0 THEN 'other' ELSE 'events' END,
				CASE WHEN i % 10 = 0 THEN '11111111-1111-1111-1111-111111111111'::uuid END,
				jsonb_build_object($4::text, i), $1::timestamptz + (i / 2) * $2::float8 * interval '1 second',
				$1::timestamptz + (i / 2) * $2::float8 * interval '1 second'
			FROM generate_series(1, $3::int) AS i`, now.Add(from), step.Seconds(), n, label)
	}
	// The delivered events.
	insert("kept", n, -3*time.Hour, 3*time.Hour/time.Duration(n/2+1))
	mustExec(t, pool, `UPDATE modkit_outbox_events SET status = 'delivered', attempts = 1, ledger_seq = 1,
		updated_at = created_at + (1 + (payload->>'kept')::int % 50) * interval '1 second'`)
	mustExec(t, pool, `UPDATE modkit_outbox_events SET updated_at = $1::timestamptz + interval '1 hour'
		WHERE (payload->>'kept')::int IN (7, 8)`, now)
	// Pending, of which 10 not yet due; leased; dead: enqueued in the last
	// 40 minutes, among the last of the delivered events.
	insert("live", 60, -40*time.Minute, 20*time.Second)
	mustExec(t, pool, `UPDATE modkit_outbox_events SET next_attempt_at = $1::timestamptz + interval '10 minutes', attempts = 1
		WHERE (payload->>'live')::int % 6 = 1`, now)
	mustExec(t, pool, `UPDATE modkit_outbox_events SET status = 'processing', attempts = 1, locked_by = gen_random_uuid(),
		lease_token = gen_random_uuid(), claimed_at = $1::timestamptz, locked_until = $1::timestamptz + interval '1 minute'
		WHERE (payload->>'live')::int % 6 = 2`, now)
	mustExec(t, pool, `UPDATE modkit_outbox_events SET status = 'dead', attempts = 3, ledger_seq = 3, last_error = 'gave up',
		updated_at = created_at + interval '5 minutes'
		WHERE (payload->>'live')::int % 6 = 3`)
	// An ordering key of 6 events: its head dead, the rest held behind it,
	// the third leased (a link of a chain) and the fourth dead.
	mustExec(t, pool, `WITH q AS (
			INSERT INTO modkit_outbox_sequences (namespace, topic, ordering_key, last_seq) VALUES ('test', 'events', 'k', 6)
			RETURNING stream_id)
		INSERT INTO modkit_outbox_events (id, namespace, topic, payload, created_at, ordering_key, ordering_seq, ordering_stream, held)
		SELECT gen_random_uuid(), 'test', 'events', jsonb_build_object('seq', s), $1::timestamptz - interval '30 minutes' + s * interval '1 minute',
			'k', s, q.stream_id, s > 1
		FROM q CROSS JOIN generate_series(1, 6) AS s`, now)
	mustExec(t, pool, `UPDATE modkit_outbox_events SET status = 'dead', attempts = 3, last_error = 'gave up', updated_at = created_at
		WHERE ordering_key = 'k' AND ordering_seq IN (1, 4)`)
	mustExec(t, pool, `UPDATE modkit_outbox_events SET status = 'processing', attempts = 1, locked_by = gen_random_uuid(),
		lease_token = gen_random_uuid(), claimed_at = $1::timestamptz, locked_until = $1::timestamptz + interval '1 minute'
		WHERE ordering_key = 'k' AND ordering_seq = 3`, now)
	// As autovacuum leaves it: the delivered events' entries of the claim
	// index, made when they were enqueued, gone.
	mustExec(t, pool, "VACUUM ANALYZE modkit_outbox_events")
	return now
}

// resultOf returns the rows q returns, in order, each as its values.
func resultOf(t *testing.T, tx pgx.Tx, q string, args ...any) [][]any {
	t.Helper()
	rs, err := tx.Query(ctx, q, args...)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	out, err := pgx.CollectRows(rs, func(r pgx.CollectableRow) ([]any, error) { return r.Values() })
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return out
}

// scansOf reads the transaction's statistics: the sequential scans of the
// events table, and the scans of each named index of it.
func scansOf(t *testing.T, tx pgx.Tx, indexes ...string) (seq int64, idx []int64) {
	t.Helper()
	if err := tx.QueryRow(ctx, "SELECT pg_stat_get_xact_numscans('modkit_outbox_events'::regclass)").Scan(&seq); err != nil {
		t.Fatal(err)
	}
	for _, name := range indexes {
		var n int64
		if err := tx.QueryRow(ctx, "SELECT pg_stat_get_xact_numscans($1::regclass)", name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		idx = append(idx, n)
	}
	return seq, idx
}

// seriesBefore is modkit_outbox_series as migration 0004 wrote it, which
// filtered on status and updated_at ($1 the window, $2 the bucket, $3 the
// clock).
const seriesBefore = `WITH w AS (
        SELECT coalesce($3::timestamptz, now()) AS now,
            date_bin($2::interval, coalesce($3::timestamptz, now()) - $1::interval, timestamptz 'epoch') AS start)
    SELECT w.now, e.namespace, e.topic, date_bin($2::interval, e.updated_at, timestamptz 'epoch') AS bucket,
        count(*),
        percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
        percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
        max(extract(epoch FROM e.updated_at - e.created_at))::float8
    FROM modkit_outbox_events e CROSS JOIN w
    WHERE e.status = 'delivered' AND e.updated_at >= w.start AND e.updated_at <= w.now
    GROUP BY GROUPING SETS ((w.now, bucket), (w.now, e.namespace, e.topic, bucket))
    ORDER BY bucket, e.namespace NULLS FIRST, e.topic NULLS FIRST`

// The delivery series (Admin.Series, the dashboard's chart on every load of
// its overview) reads the window's deliveries from the settled index, and
// never the whole table: until migration 0024 it filtered on status and
// updated_at, which no index holds, and took 300 ms a call with 1,000,000
// delivered events kept, whatever the window held. It returns what the
// statement it replaced returns, for every window, bucket and clock tried.
// Sequential scans are turned off so that the small table's costs do not
// decide.
func TestSeriesReadsTheSettledIndex(t *testing.T) {
	_, tdb := newStore(t)
	const kept = 2000
	now := keepDelivered(t, tdb.Provider.Pool, kept)

	tx := ownTx(t, tdb)
	if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
		t.Fatal(err)
	}
	var buckets int
	err := tx.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_series('10 minutes', '1 minute', $1)", now).Scan(&buckets)
	if err != nil || buckets == 0 {
		t.Fatalf("the series of the last 10 minutes has %d rows: %v", buckets, err)
	}
	seq, idx := scansOf(t, tx, "modkit_outbox_events_settled_idx")
	read := tableReads(t, tx, "modkit_outbox_events")
	if seq != 0 || idx[0] == 0 || read > kept/4 {
		t.Errorf("the series of the last 10 minutes made %d sequential scans of the events and %d of the settled index, "+
			"and read %d rows and index entries of a table keeping %d delivered events; want no sequential scan, "+
			"a range of the settled index, and the window's events only", seq, idx[0], read, kept)
	}
	t.Logf("the series of the last 10 minutes read %d rows and index entries of a table keeping %d delivered events", read, kept)

	// The same rows as before, for every window, bucket and clock (planned
	// with sequential scans allowed: with them turned off, each statement
	// that must read the table is costed high enough to be compiled).
	if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = on"); err != nil {
		t.Fatal(err)
	}
	var compared, rows int
	for _, window := range []string{"0", "10 minutes", "1 hour", "3 hours", "5 hours"} {
		for _, bucket := range []string{"1 second", "1 minute", "7 minutes", "1 hour"} {
			for _, clock := range []*time.Time{nil, ptr(now.Add(-time.Hour)), ptr(now.Add(2 * time.Hour))} {
				want := resultOf(t, tx, seriesBefore, window, bucket, clock)
				got := resultOf(t, tx, `SELECT * FROM modkit_outbox_series($1, $2, $3)`, window, bucket, clock)
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("the series of %s by %s at %v:\n got %v\nwant %v", window, bucket, clock, got, want)
				}
				compared, rows = compared+1, rows+len(want)
			}
		}
	}
	t.Logf("%d series compared with the statement they replace, %d rows", compared, rows)
}

func ptr[T any](v T) *T { return &v }

// listBefore is modkit_outbox_list_rows as migration 0004 wrote it, which
// read every row whatever the status ($1 to $10 its parameters: payloads,
// status, namespace, topic, tenant, created after, created before, the
// cursor's time and id, limit).
const listBefore = `SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN $1::boolean THEN e.payload END, e.status,
        e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
        CASE WHEN $1::boolean THEN e.headers END, e.ordering_key, e.ordering_seq
    FROM modkit_outbox_events e
    WHERE ($2::text IS NULL OR e.status = $2::text)
      AND ($3::text IS NULL OR e.namespace = $3::text)
      AND ($4::text IS NULL OR e.topic = $4::text)
      AND ($5::uuid IS NULL OR e.tenant_id = $5::uuid)
      AND ($6::timestamptz IS NULL OR e.created_at >= $6::timestamptz)
      AND ($7::timestamptz IS NULL OR e.created_at < $7::timestamptz)
      AND ($8::timestamptz IS NULL OR (e.created_at, e.id) > ($8::timestamptz, $9::uuid))
    ORDER BY e.created_at, e.id
    LIMIT $10::int`

// The lists of pending, leased and dead events (Admin.List, the dashboard's
// and the CLI's lists, and Admin.ReplayDead by filter) read the indexes
// that hold those events, and never the whole table: until migration 0024
// every list read every row and sorted them by enqueue time, 220-260 ms a
// page with 1,000,000 delivered events kept. Lists of every status or of
// delivered events still read the table (no index holds events by enqueue
// time). For every status, filter, cursor and limit tried, a list returns
// what the statement it replaced returns. Sequential scans are turned off
// so that the small table's costs do not decide.
func TestListReadsTheIndexesOfItsStatus(t *testing.T) {
	_, tdb := newStore(t)
	pool := tdb.Provider.Pool
	const kept = 2000
	now := keepDelivered(t, pool, kept)

	for _, c := range []struct {
		status, q string
		indexes   []string
	}{
		{"pending", "SELECT count(*) FROM modkit_outbox_list('pending', NULL, NULL, NULL, NULL, NULL, NULL, NULL, 100)",
			[]string{"modkit_outbox_events_claim_idx", "modkit_outbox_events_held_idx"}},
		{"processing", "SELECT count(*) FROM modkit_outbox_list_payloads('processing', NULL, NULL, NULL, NULL, NULL, NULL, NULL, 100)",
			[]string{"modkit_outbox_events_claim_idx", "modkit_outbox_events_held_idx"}},
		{"dead", "SELECT count(*) FROM modkit_outbox_list('dead', 'test', NULL, NULL, NULL, NULL, NULL, NULL, 100)",
			[]string{"modkit_outbox_events_settled_idx"}},
		{"dead", "SELECT count(*) FROM modkit_outbox_replay_filter('dead', NULL, NULL, NULL, NULL, NULL, NULL, NULL, 10000, 'test')",
			[]string{"modkit_outbox_events_settled_idx"}},
	} {
		var want int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events WHERE status = $1", c.status).Scan(&want); err != nil {
			t.Fatal(err)
		}
		tx := ownTx(t, tdb)
		if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
			t.Fatal(err)
		}
		var n int
		if err := tx.QueryRow(ctx, c.q).Scan(&n); err != nil || n != want {
			t.Fatalf("%s: %d events, want %d: %v", c.q, n, want, err)
		}
		seq, idx := scansOf(t, tx, c.indexes...)
		read := tableReads(t, tx, "modkit_outbox_events")
		for i, name := range c.indexes {
			if idx[i] == 0 {
				t.Errorf("%s: no scan of %s", c.q, name)
			}
		}
		if seq != 0 || read > kept/4 {
			t.Errorf("%s: %d sequential scans of the events, %d rows and index entries read in a table keeping %d delivered events; "+
				"want none, and the %d %s events and their neighbours in the indexes only", c.q, seq, read, kept, want, c.status)
		}
		t.Logf("%s: %d events, %d rows and index entries read", c.q, n, read)
	}

	// The same rows as before, in the same order, for every input tried: each
	// filter alone and together, a first page and the pages after it (by a
	// cursor with and without its id).
	tx := ownTx(t, tdb)
	tenant := uuid.MustParse("11111111-1111-1111-1111-111111111111")
	var compared, rows int
	for _, status := range []any{nil, "pending", "processing", "dead", "delivered", "bogus"} {
		for _, ns := range []any{nil, "test"} {
			for _, topic := range []any{nil, "events"} {
				for _, tn := range []any{nil, tenant} {
					for _, after := range []any{nil, now.Add(-2 * time.Hour)} {
						for _, before := range []any{nil, now.Add(-20 * time.Minute)} {
							for _, limit := range []int{3, 1000} {
								payloads := compared%2 == 0
								args := []any{payloads, status, ns, topic, tn, after, before, nil, nil, limit}
								first := sameList(t, tx, args)
								rows += len(first)
								compared++
								if len(first) < 2 {
									continue
								}
								at, id := first[1][12], first[1][0]
								for _, cursor := range [][2]any{{at, id}, {at, nil}} {
									args[7], args[8] = cursor[0], cursor[1]
									rows += len(sameList(t, tx, args))
									compared++
								}
							}
						}
					}
				}
			}
		}
	}
	t.Logf("%d lists compared with the statement they replace, %d rows", compared, rows)
}

// sameList fails the test unless modkit_outbox_list_rows returns what
// listBefore returns for args, and returns it.
func sameList(t *testing.T, tx pgx.Tx, args []any) [][]any {
	t.Helper()
	want := resultOf(t, tx, listBefore, args...)
	got := resultOf(t, tx, `SELECT * FROM modkit_outbox_list_rows($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)`, args...)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("list %v:\n got %v\nwant %v", args, got, want)
	}
	return want
}

// The dispatchers' purge from a watermark (migration 0025) reads the
// settled index from the watermark on: another topic's delivered events
// kept past the cutoff (a longer retention, or kept forever), which the
// purge from the oldest event walks through on every pass, are not read.
// From NULL, it deletes exactly what modkit_outbox_purge deletes.
func TestPurgeFromReadsPastTheWatermarkOnly(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	// 2,000 events of an audit topic kept forever, delivered two to three
	// hours ago; of the purged topic, 20 delivered two and a half hours
	// ago (below the watermark), 20 from 75 to 61 minutes ago (past the
	// one-hour retention, above the watermark) and 20 half an hour ago
	// (within it).
	mustExec(t, pool, `INSERT INTO modkit_outbox_events (id, namespace, topic, payload, status, attempts, ledger_seq, created_at, updated_at)
		SELECT gen_random_uuid(), 'test', tp, '{}', 'delivered', 1, 1, at, at
		FROM (SELECT 'audit' AS tp, now() - interval '2 hours' - i * interval '1 second' AS at FROM generate_series(1, 2000) AS i
			UNION ALL SELECT 'events', now() - interval '150 minutes' - i * interval '1 second' FROM generate_series(1, 20) AS i
			UNION ALL SELECT 'events', now() - interval '61 minutes' - i * interval '40 seconds' FROM generate_series(1, 20) AS i
			UNION ALL SELECT 'events', now() - interval '30 minutes' - i * interval '1 second' FROM generate_series(1, 20) AS i) AS e`)
	mustExec(t, pool, "ANALYZE modkit_outbox_events")

	// Each purge in a transaction of its own, rolled back: how many events
	// it deleted, how many entries of the settled index it read, and the
	// events of the purged topic left.
	purge := func(q string) (n, read int, left []string) {
		t.Helper()
		tx := ownTx(t, tdb)
		if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		err := tx.QueryRow(ctx, `SELECT pg_stat_get_xact_tuples_returned('modkit_outbox_events_settled_idx'::regclass),
			(SELECT coalesce(array_agg(id::text ORDER BY id), '{}') FROM modkit_outbox_events WHERE topic = 'events')`).Scan(&read, &left)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(ctx); err != nil { // its locks would hide the rows from the next purge
			t.Fatal(err)
		}
		return n, read, left
	}
	n, read, _ := purge(`SELECT purged FROM modkit_outbox_purge_from('{test:events}', '1 hour', 1000, now() - interval '75 minutes')`)
	if n != 20 || read > 100 {
		t.Errorf("purge from the watermark: %d events deleted, %d index entries read; want the 20 above it, and not the 2,000 kept ones", n, read)
	}
	n, read, _ = purge(`SELECT modkit_outbox_purge('{test:events}', '1 hour', 1000)`)
	if n != 40 || read < 2000 {
		t.Errorf("purge from the oldest event: %d events deleted, %d index entries read; want 40, and the 2,000 kept ones read (else this test shows nothing)", n, read)
	}

	// From NULL: the same events go as with modkit_outbox_purge, and the
	// cutoff is the clock minus the retention.
	_, _, leftOld := purge(`SELECT modkit_outbox_purge('{test:events}', '1 hour', 1000)`)
	_, _, leftNew := purge(`SELECT purged FROM modkit_outbox_purge_from('{test:events}', '1 hour', 1000, NULL)`)
	if len(leftOld) != 20 || !slices.Equal(leftOld, leftNew) {
		t.Errorf("from NULL, %d events left, against %d by modkit_outbox_purge (want the same 20)", len(leftNew), len(leftOld))
	}
	var cutoff, want time.Time
	err := pool.QueryRow(ctx, `SELECT cutoff, '2026-01-01T12:00:00Z'::timestamptz - interval '1 hour'
		FROM modkit_outbox_purge_from('{test:events}', '1 hour', 1000, NULL, '2026-01-01T12:00:00Z')`).Scan(&cutoff, &want)
	if err != nil || !cutoff.Equal(want) {
		t.Errorf("cutoff at a test clock: %v, %v; want %v", cutoff, err, want)
	}
}

// The backlog's reads (Admin.Backlog and Unserved, the dispatchers' gauges
// and sweeps) keep to the claim, held and settled indexes whatever the
// planner's costs (migration 0043). With millions of delivered events kept
// and a few hundred thousand pending, the planner preferred a sequential
// scan of the whole table for all three, on every sweep and gauge read of
// every dispatcher. The session's costs here make a sequential scan the
// cheaper plan by far, as that table's statistics did.
func TestBacklogReadsKeepToTheIndexes(t *testing.T) {
	_, tdb := newStore(t)
	pool := tdb.Provider.Pool
	const kept = 2000
	keepDelivered(t, pool, kept)

	for _, q := range []string{
		"SELECT count(*) FROM modkit_outbox_backlog()",
		"SELECT count(*) FROM modkit_outbox_depth('{test:events,test:other}')",
		"SELECT count(*) FROM modkit_outbox_sweep('{test:events,test:other}', 3, 100)",
	} {
		tx := ownTx(t, tdb)
		for _, set := range []string{"SET LOCAL seq_page_cost = 0.001", "SET LOCAL random_page_cost = 1000",
			"SET LOCAL cpu_index_tuple_cost = 10"} {
			if _, err := tx.Exec(ctx, set); err != nil {
				t.Fatal(err)
			}
		}
		var n int
		if err := tx.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		seq, idx := scansOf(t, tx, "modkit_outbox_events_claim_idx")
		read := tableReads(t, tx, "modkit_outbox_events")
		if seq != 0 || idx[0] == 0 || read > kept/4 {
			t.Errorf("%s: %d sequential scans of the events, %d of the claim index, %d rows and index entries read in a table "+
				"keeping %d delivered events; want none, some, and the backlog's events and their neighbours only", q, seq, idx[0], read, kept)
		}
		t.Logf("%s: %d rows, %d rows and index entries read", q, n, read)
	}
}
