package outboxpg_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// denied fails the test unless err is SQLSTATE 42501 (insufficient
// privilege).
func denied(t *testing.T, what string, err error) {
	t.Helper()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Fatalf("%s: got %v, want permission denied (42501)", what, err)
	}
}

func mustExec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func rows(n int, ns, tp string) []driver.InsertRow {
	out := make([]driver.InsertRow, n)
	for i := range out {
		out[i] = driver.InsertRow{ID: uuid.Must(uuid.NewV7()), Namespace: ns, Topic: tp, Payload: []byte(`{"secret":"s3cr3t"}`)}
	}
	return out
}

// Each role does its job through the driver and gets 42501 for everything
// else.
func TestRolesLeastPrivilege(t *testing.T) {
	tdb := pgtest.NewDB(t)
	owner := open(t, tdb.Provider.Pool, driver.Options{})

	// Producer: enqueues one (a plain INSERT announcing its topic, with and
	// without a dedupe key; a duplicate through the function), a few (the
	// function) and many (COPY, with its announcement), but reads nothing
	// and writes nothing else.
	prodPool := tdb.LoginAs(t, outboxpg.RoleProducer)
	prod := open(t, prodPool, driver.Options{})
	key := "k1"
	one := rows(1, "test", "events")
	one[0].DedupeKey = &key
	if _, err := prod.Insert(ctx, prodPool, one, []string{topic}); err != nil {
		t.Fatalf("producer enqueue: %v", err)
	}
	dup := rows(1, "test", "events")
	dup[0].DedupeKey = &key
	if got, err := prod.Insert(ctx, prodPool, dup, nil); err != nil || !got[0].Duplicate || got[0].ID != one[0].ID {
		t.Fatalf("producer duplicate: %+v %v", got, err)
	}
	if _, err := prod.Insert(ctx, prodPool, rows(5, "test", "events"), nil); err != nil {
		t.Fatalf("producer batch: %v", err)
	}
	if _, err := prod.Insert(ctx, prodPool, rows(1, "test", "events"), []string{topic}); err != nil {
		t.Fatalf("producer enqueue without a dedupe key: %v", err)
	}
	if _, err := prod.Insert(ctx, prodPool, rows(100, "test", "events"), []string{topic}); err != nil {
		t.Fatalf("producer COPY batch: %v", err)
	}
	_, err := prodPool.Exec(ctx, "SELECT payload FROM modkit_outbox_events")
	denied(t, "producer SELECT payload", err)
	_, err = prodPool.Exec(ctx, "SELECT dedupe_key FROM modkit_outbox_events")
	denied(t, "producer SELECT dedupe_key", err)
	_, err = prodPool.Exec(ctx, `INSERT INTO modkit_outbox_events (id, namespace, topic, payload, status, locked_until)
		VALUES (gen_random_uuid(), 'test', 'events', '{}', 'processing', 'infinity')`)
	denied(t, "producer INSERT of a processing row", err)
	_, err = prodPool.Exec(ctx, "UPDATE modkit_outbox_events SET status = 'dead'")
	denied(t, "producer UPDATE", err)
	_, err = prod.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 1, MaxAttempts: 3, Worker: uuid.New(), Lease: time.Minute})
	denied(t, "producer claim", err)
	_, err = prod.List(ctx, driver.ListFilter{Limit: 10})
	denied(t, "producer list", err)

	// Dispatcher: claims, completes, sweeps; no table access, no enqueue,
	// no listing.
	dispPool := tdb.LoginAs(t, outboxpg.RoleDispatcher)
	disp := open(t, dispPool, driver.Options{})
	// A dispatcher's start asks which migrations are missing: a role that
	// may not read the migrations table is told nothing, without an error
	// (one in the server's log at every start).
	if missing, err := disp.(driver.MigrationChecker).MissingMigrations(ctx); err != nil || missing != nil {
		t.Fatalf("dispatcher role's missing migrations: %v %v, want none and no error", missing, err)
	}
	w := uuid.New()
	got, err := disp.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 3, MaxAttempts: 3, Worker: w, Lease: time.Minute})
	if err != nil || len(got) != 3 {
		t.Fatalf("dispatcher claim: %d, %v", len(got), err)
	}
	if ok := complete(t, disp, w, outcome(got[0], driver.Delivered), outcome(got[1], driver.Retry), outcome(got[2], driver.Dead)); !ok[0] || !ok[1] || !ok[2] {
		t.Fatalf("dispatcher complete: %v", ok)
	}
	// The outcomes it recorded are found by worker and lease token
	// (migration 0035): not under another token, nor for another worker.
	stale := outcome(got[0], driver.Delivered)
	stale.LeaseToken = uuid.New()
	asked := []driver.Outcome{outcome(got[0], driver.Delivered), outcome(got[1], driver.Retry), outcome(got[2], driver.Dead), stale}
	if rec, err := disp.(driver.OutcomeFinder).RecordedOutcomes(ctx, w, asked); err != nil || !slices.Equal(rec, []bool{true, true, true, false}) {
		t.Fatalf("dispatcher's recorded outcomes: %v, %v; want the three recorded, not the one under another token", rec, err)
	}
	if rec, err := disp.(driver.OutcomeFinder).RecordedOutcomes(ctx, uuid.New(), asked[:1]); err != nil || rec[0] {
		t.Fatalf("another worker's recorded outcomes: %v, %v; want none", rec, err)
	}
	if _, err := disp.Sweep(ctx, driver.SweepParams{Topics: []string{topic}, MaxAttempts: 3, Limit: 10}); err != nil {
		t.Fatalf("dispatcher sweep: %v", err)
	}
	if _, err := disp.Depth(ctx, []string{topic}); err != nil {
		t.Fatalf("dispatcher depth: %v", err)
	}
	// From a watermark (migration 0025), keeping the delivered event: a
	// cutoff comes back only from modkit_outbox_purge_from, not from the
	// fallback to modkit_outbox_purge.
	if res, err := disp.Purge(ctx, driver.PurgeParams{Topics: []string{topic}, Retention: time.Hour, Limit: 10, From: time.Now().Add(-2 * time.Hour)}); err != nil || res.Purged != 0 || res.Cutoff.IsZero() {
		t.Fatalf("dispatcher purge from a watermark: %+v, %v (want nothing purged, and a cutoff)", res, err)
	}
	_, err = dispPool.Exec(ctx, "UPDATE modkit_outbox_events SET status = 'dead' WHERE namespace = 'billing'")
	denied(t, "dispatcher UPDATE", err)
	_, err = dispPool.Exec(ctx, "DELETE FROM modkit_outbox_events")
	denied(t, "dispatcher DELETE", err)
	_, err = disp.Insert(ctx, dispPool, rows(1, "test", "events"), nil)
	denied(t, "dispatcher enqueue", err)
	_, err = disp.Replay(ctx, driver.ReplayParams{IDs: []uuid.UUID{got[2].ID}, By: "dispatcher"})
	denied(t, "dispatcher replay", err)
	_, err = disp.PurgeDead(ctx, driver.ReplayParams{IDs: []uuid.UUID{got[2].ID}, By: "dispatcher"})
	denied(t, "dispatcher purge of dead events", err)

	// Reader: stats, lists and history without payloads; nothing else.
	readPool := tdb.LoginAs(t, outboxpg.RoleReader)
	read := open(t, readPool, driver.Options{})
	listed, err := read.List(ctx, driver.ListFilter{Limit: 1000})
	if err != nil || len(listed) != 107 {
		t.Fatalf("reader list: %d events, %v", len(listed), err)
	}
	for _, e := range listed {
		if e.Payload != nil {
			t.Fatalf("reader saw a payload: %s", e.Payload)
		}
	}
	if e, err := read.Get(ctx, got[2].ID); err != nil || e.Payload != nil || e.Status != "dead" {
		t.Fatalf("reader get: %+v %v", e, err)
	}
	if h, err := read.History(ctx, got[2].ID); err != nil || len(h) != 1 || h[0].Outcome != "dead" {
		t.Fatalf("reader history: %+v %v", h, err)
	}
	if _, err := read.Stats(ctx); err != nil {
		t.Fatalf("reader stats: %v", err)
	}
	if b, err := read.Backlog(ctx); err != nil || len(b) == 0 {
		t.Fatalf("reader backlog: %+v, %v", b, err)
	}
	if _, err := read.Served(ctx); err != nil {
		t.Fatalf("reader served topics: %v", err)
	}
	if _, err := read.Series(ctx, driver.SeriesParams{Window: time.Hour, Bucket: time.Minute}); err != nil {
		t.Fatalf("reader series: %v", err)
	}
	settled, err := read.Settled(ctx, driver.SettledParams{Since: time.Now().Add(-time.Hour), Limit: 10})
	if err != nil || len(settled) != 2 || settled[0].Payload != nil {
		t.Fatalf("reader settled: %d events, %v (want the delivered and the dead one, without payloads)", len(settled), err)
	}
	afterFirst := driver.SettledParams{Since: time.Now().Add(-time.Hour), AfterUpdatedAt: settled[0].UpdatedAt, AfterID: settled[0].ID, Limit: 10}
	if page, err := read.Settled(ctx, afterFirst); err != nil || len(page) != 1 || page[0].ID != settled[1].ID || page[0].Payload != nil {
		t.Fatalf("reader settled after a cursor: %d events, %v (want the second one, without its payload)", len(page), err)
	}
	_, err = disp.Settled(ctx, afterFirst)
	denied(t, "dispatcher settled after a cursor", err)
	_, err = read.Insert(ctx, readPool, rows(1, "test", "events"), nil)
	denied(t, "reader enqueue", err)
	_, err = read.Replay(ctx, driver.ReplayParams{IDs: []uuid.UUID{got[2].ID}, By: "reader"})
	denied(t, "reader replay", err)
	_, err = read.PurgeDead(ctx, driver.ReplayParams{IDs: []uuid.UUID{got[2].ID}, By: "reader"})
	denied(t, "reader purge of dead events", err)
	_, err = readPool.Exec(ctx, "SELECT * FROM modkit_outbox_attempts")
	denied(t, "reader SELECT ledger", err)

	// Operator: payloads, replay (recorded with its session user), purge.
	opPool := tdb.LoginAs(t, outboxpg.RoleOperator)
	op := open(t, opPool, driver.Options{})
	if e, err := op.Get(ctx, got[2].ID); err != nil || !strings.Contains(string(e.Payload), "s3cr3t") {
		t.Fatalf("operator get: %+v %v", e, err)
	}
	if page, err := op.Settled(ctx, afterFirst); err != nil || len(page) != 1 || !strings.Contains(string(page[0].Payload), "s3cr3t") {
		t.Fatalf("operator settled after a cursor: %d events, %v (want the second one, with its payload)", len(page), err)
	}
	if b, err := op.Backlog(ctx); err != nil || len(b) == 0 {
		t.Fatalf("operator backlog: %+v, %v", b, err)
	}
	if _, err := op.Served(ctx); err != nil {
		t.Fatalf("operator served topics: %v", err)
	}
	ids, err := op.Replay(ctx, driver.ReplayParams{IDs: []uuid.UUID{got[2].ID}, By: "alice"})
	if err != nil || len(ids) != 1 {
		t.Fatalf("operator replay: %v %v", ids, err)
	}
	var opUser string
	if err := opPool.QueryRow(ctx, "SELECT session_user").Scan(&opUser); err != nil {
		t.Fatal(err)
	}
	h, err := owner.History(ctx, got[2].ID)
	if err != nil || len(h) != 2 || h[1].Outcome != "replayed" || h[1].Actor != opUser || !strings.Contains(h[1].Detail, "alice") {
		t.Fatalf("history after the operator's replay: %+v %v", h, err)
	}
	if res, err := op.Purge(ctx, driver.PurgeParams{Topics: []string{topic}, Retention: 0, Limit: 10, Recorded: true}); err != nil || res.Purged != 1 {
		t.Fatalf("operator purge: %d, %v", res.Purged, err)
	}
	if h, err := op.History(ctx, got[0].ID); err != nil || len(h) != 2 || h[1].Outcome != "purged" || h[1].Actor != opUser {
		t.Fatalf("history of the purged event: %+v %v", h, err)
	}
	_, err = op.Purge(ctx, driver.PurgeParams{Topics: []string{topic}, Retention: 0, Limit: 10})
	denied(t, "operator's unrecorded purge", err)
	// Dead again (as the owner), then purged by the operator, recorded.
	if _, err := tdb.Provider.Pool.Exec(ctx, "UPDATE modkit_outbox_events SET status = 'dead' WHERE id = $1", got[2].ID); err != nil {
		t.Fatal(err)
	}
	if ids, err := op.PurgeDead(ctx, driver.ReplayParams{IDs: []uuid.UUID{got[2].ID}, By: "alice"}); err != nil || len(ids) != 1 {
		t.Fatalf("operator purge of a dead event: %v, %v", ids, err)
	}
	if h, err := op.History(ctx, got[2].ID); err != nil || len(h) != 3 || h[2].Outcome != "purged" || h[2].Actor != opUser ||
		!strings.Contains(h[2].Detail, "alice") {
		t.Fatalf("history of the purged dead event: %+v %v", h, err)
	}
	_, err = opPool.Exec(ctx, "DELETE FROM modkit_outbox_events")
	denied(t, "operator DELETE", err)

	// The ledger refuses UPDATE, DELETE and TRUNCATE from every runtime
	// role (no privilege) and from the owner (the append-only trigger).
	for name, pool := range map[string]*pgxpool.Pool{"producer": prodPool, "dispatcher": dispPool, "reader": readPool, "operator": opPool} {
		for _, stmt := range []string{"UPDATE modkit_outbox_attempts SET detail = 'x'", "DELETE FROM modkit_outbox_attempts", "TRUNCATE modkit_outbox_attempts"} {
			_, err := pool.Exec(ctx, stmt)
			denied(t, name+": "+stmt, err)
		}
	}
	for _, stmt := range []string{"UPDATE modkit_outbox_attempts SET detail = 'x'", "DELETE FROM modkit_outbox_attempts", "TRUNCATE modkit_outbox_attempts"} {
		_, err := tdb.Provider.Pool.Exec(ctx, stmt)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "P0001" {
			t.Fatalf("owner: %s: got %v, want the append-only trigger's P0001", stmt, err)
		}
	}
}

// The functions a migration replaced, kept under a _NNNN name so that its
// down migration can put them back, are callable by no outbox role: they
// may lack checks or fixes the current ones have.
func TestReplacedFunctionsOwnerOnly(t *testing.T) {
	tdb := pgtest.NewDB(t)
	var kept []string
	err := tdb.Provider.Pool.QueryRow(ctx, `SELECT coalesce(array_agg(p.oid::regprocedure::text ORDER BY 1), '{}')
		FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace AND p.proname ~ '^modkit_outbox_.*_[0-9]{4}$'`).Scan(&kept)
	if err != nil {
		t.Fatal(err)
	}
	// Migrations 0005 to 0011 kept thirteen, among them the complete
	// functions of 0008 (kept by 0009) and of 0009 (kept by 0011); fewer
	// means the query missed them.
	if !slices.Contains(kept, "modkit_outbox_complete_0008(uuid,uuid[],uuid[],text[],text[],bigint[],timestamp with time zone)") ||
		!slices.Contains(kept, "modkit_outbox_complete_0009(uuid,uuid[],uuid[],text[],text[],bigint[],timestamp with time zone)") || len(kept) < 13 {
		t.Fatalf("replaced functions found: %v", kept)
	}
	// The claims that modkit_outbox_claim_chained calls (migration 0010)
	// are the owner's too: a caller could pass them anything.
	internal := []string{
		"modkit_outbox_claim_plain(uuid,text[],integer,integer,interval,text[],timestamp with time zone)",
		"modkit_outbox_claim_chains(uuid,text[],integer,integer,interval,text[],integer[],timestamp with time zone)",
	}
	for _, role := range outboxpg.Roles {
		for i, fn := range append(kept, internal...) {
			var may bool
			if err := tdb.Provider.Pool.QueryRow(ctx, "SELECT has_function_privilege($1, $2::regprocedure, 'EXECUTE')", role, fn).Scan(&may); err != nil {
				t.Fatal(err)
			}
			switch {
			case may && i < len(kept):
				t.Errorf("%s may execute %s, a function kept only for the down migration", role, fn)
			case may:
				t.Errorf("%s may execute %s, which only modkit_outbox_claim_chained may call", role, fn)
			}
		}
	}
}

// A runtime role may not move the functions' clock (it could claim early or
// steal leases with it).
func TestTestClockOwnerOnly(t *testing.T) {
	tdb := pgtest.NewDB(t)
	dispPool := tdb.LoginAs(t, outboxpg.RoleDispatcher)
	disp := open(t, dispPool, driver.Options{Now: func() time.Time { return time.Now().Add(time.Hour) }})
	_, err := disp.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 1, MaxAttempts: 3, Worker: uuid.New(), Lease: time.Minute})
	denied(t, "dispatcher with a test clock", err)
}

// Objects that shadow the outbox's tables and functions, in a schema
// earlier on the caller's search_path or in pg_temp, change nothing the
// functions do.
func TestSearchPathShadowing(t *testing.T) {
	tdb := pgtest.NewDB(t)
	admin := tdb.Provider.Pool
	mustExec(t, admin, "CREATE SCHEMA evil")
	mustExec(t, admin, "CREATE TABLE evil.modkit_outbox_events (LIKE public.modkit_outbox_events INCLUDING ALL)")
	mustExec(t, admin, "CREATE TABLE evil.modkit_outbox_attempts (LIKE public.modkit_outbox_attempts)")
	mustExec(t, admin, `CREATE FUNCTION evil.modkit_outbox_clock(p_now timestamptz) RETURNS timestamptz
		LANGUAGE sql AS $$ SELECT 'infinity'::timestamptz $$`)
	mustExec(t, admin, `CREATE FUNCTION evil.gen_random_uuid() RETURNS uuid
		LANGUAGE sql AS $$ SELECT '00000000-0000-0000-0000-000000000001'::uuid $$`)
	mustExec(t, admin, "GRANT USAGE ON SCHEMA evil TO PUBLIC")
	mustExec(t, admin, "GRANT ALL ON ALL TABLES IN SCHEMA evil TO PUBLIC")

	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = "evil, pg_temp, public"
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "CREATE TEMP TABLE modkit_outbox_events (LIKE public.modkit_outbox_events INCLUDING ALL)")
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := open(t, pool, driver.Options{})
	if _, err := s.Insert(ctx, pool, rows(3, "test", "events"), nil); err != nil {
		t.Fatal(err)
	}
	// One event goes in by a plain INSERT, which runs as the caller, with
	// its announcement and without.
	for _, notify := range [][]string{{topic}, nil} {
		if _, err := s.Insert(ctx, pool, rows(1, "test", "events"), notify); err != nil {
			t.Fatal(err)
		}
	}
	w := uuid.New()
	got, err := s.Claim(ctx, driver.ClaimParams{Topics: []string{topic}, Limit: 3, MaxAttempts: 3, Worker: w, Lease: time.Minute})
	if err != nil || len(got) != 3 {
		t.Fatalf("claim: %d %v", len(got), err)
	}
	for _, c := range got {
		if c.LeaseToken == uuid.MustParse("00000000-0000-0000-0000-000000000001") || c.LockedTill.After(time.Now().Add(time.Hour)) {
			t.Fatalf("a shadowing function ran: %+v", c)
		}
	}
	complete(t, s, w, outcome(got[0], driver.Delivered))
	var real, shadow, temp, shadowLedger int
	if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM public.modkit_outbox_events),
		(SELECT count(*) FROM evil.modkit_outbox_events), (SELECT count(*) FROM evil.modkit_outbox_attempts)`).Scan(&real, &shadow, &shadowLedger); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_temp.modkit_outbox_events").Scan(&temp); err != nil {
		t.Fatal(err)
	}
	if real != 5 || shadow != 0 || temp != 0 || shadowLedger != 0 {
		t.Fatalf("rows: public %d, evil %d, temp %d, evil ledger %d; want 5, 0, 0, 0", real, shadow, temp, shadowLedger)
	}
}

// The rules of the message check (a function since migration 0020) mean
// what they say whatever the writer's search_path: a writer that puts its own
// btrim before pg_catalog's does not get a name with a space past the name
// rule.
func TestMessageCheckIgnoresTheWritersSearchPath(t *testing.T) {
	tdb := pgtest.NewDB(t)
	admin := tdb.Provider.Pool
	mustExec(t, admin, "CREATE SCHEMA evil")
	mustExec(t, admin, `CREATE FUNCTION evil.btrim(text, text) RETURNS text LANGUAGE sql AS $$ SELECT ''::text $$`)
	mustExec(t, admin, "GRANT USAGE ON SCHEMA evil TO PUBLIC")
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = "evil, pg_catalog, public"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var trimmed string
	if err := pool.QueryRow(ctx, "SELECT btrim('shop x', 'abc')").Scan(&trimmed); err != nil || trimmed != "" {
		t.Fatalf("the shadowing btrim is not in effect: %q %v", trimmed, err)
	}
	_, err = pool.Exec(ctx, `INSERT INTO modkit_outbox_events (id, namespace, topic, payload) VALUES (gen_random_uuid(), 'shop x', 't', '{}')`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != "modkit_outbox_events_name_pattern_check" {
		t.Fatalf("a namespace with a space, written with a shadowing btrim: %v, want a violation of modkit_outbox_events_name_pattern_check", err)
	}
}

// Store B cannot settle store A's lease, even with A's token: the batch
// path records nothing, and a single outcome in a transaction fails with
// ErrLeaseLost (SQLSTATE P7002). An outcome a worker may not record is
// ErrInvalidState (P7003).
func TestSettleChecksTheWorker(t *testing.T) {
	a, tdb := newStore(t)
	b := open(t, tdb.NewPool(t), driver.Options{})
	pool := tdb.Provider.Pool
	insertN(t, a, pool, "test", "events", 1)
	workerA, workerB := uuid.New(), uuid.New()
	ca := claim(t, a, 1, 3, workerA)[0]
	for _, k := range []driver.OutcomeKind{driver.Delivered, driver.Retry, driver.Dead, driver.Release} {
		if ok := complete(t, b, workerB, outcome(ca, k)); ok[0] {
			t.Fatalf("B recorded outcome %d under A's lease", k)
		}
	}
	err := b.InTx(ctx, func(ctx context.Context, tx any) error {
		_, err := b.Complete(ctx, tx, workerB, []driver.Outcome{outcome(ca, driver.Delivered)})
		return err
	})
	if !errors.Is(err, driver.ErrLeaseLost) {
		t.Fatalf("B's single outcome in a transaction: %v, want ErrLeaseLost", err)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "P7002" {
		t.Fatalf("want SQLSTATE P7002, got %v", err)
	}
	err = a.InTx(ctx, func(ctx context.Context, tx any) error {
		_, err := a.Complete(ctx, tx, workerA, []driver.Outcome{{ID: ca.ID, LeaseToken: ca.LeaseToken, Kind: driver.OutcomeKind(99)}})
		return err
	})
	if !errors.Is(err, driver.ErrInvalidState) {
		t.Fatalf("an invalid outcome: %v, want ErrInvalidState", err)
	}
	if e := get(t, a, ca.ID); e.Status != "processing" || *e.LockedBy != workerA {
		t.Fatalf("refused outcomes changed the event: %+v", e)
	}
	if h, _ := a.History(ctx, ca.ID); len(h) != 0 {
		t.Fatalf("refused outcomes left history: %+v", h)
	}
	err = a.InTx(ctx, func(ctx context.Context, tx any) error {
		_, err := a.Complete(ctx, tx, workerA, []driver.Outcome{outcome(ca, driver.Delivered)})
		return err
	})
	if err != nil {
		t.Fatalf("A's own outcome in a transaction: %v", err)
	}
}

// Every outcome appends one ledger row in the same write; lease repair (by
// a claim or the sweeper) appends lease_expired; replays and sweeps are
// recorded; attempt numbers are gap-free; last_error stays bounded however
// many sweeps and replays happen.
func TestLedger(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	id := insertN(t, s, pool, "test", "events", 1)[0]
	w1, w2 := uuid.New(), uuid.New()

	c := claim(t, s, 1, 3, w1)[0]
	complete(t, s, w1, driver.Outcome{ID: c.ID, LeaseToken: c.LeaseToken, Kind: driver.Retry, Error: "timeout"})
	mustExec(t, pool, "UPDATE modkit_outbox_events SET next_attempt_at = now() WHERE id = $1", id)
	claim(t, s, 1, 3, w1) // the second attempt, whose worker dies
	expireLease(t, pool, id)
	c2 := claim(t, s, 1, 3, w2)[0] // repairs w1's lease
	if !c2.Repaired || c2.Attempts != 3 {
		t.Fatalf("reclaim after expiry: %+v", c2)
	}
	expireLease(t, pool, id)
	swept, err := s.Sweep(ctx, driver.SweepParams{Topics: []string{topic}, MaxAttempts: 3, Limit: 10})
	if err != nil || len(swept) != 1 || swept[0].Repaired {
		t.Fatalf("sweep: %+v %v", swept, err)
	}
	h, err := s.History(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		outcome string
		attempt int
		worker  uuid.UUID
	}{{"retry", 1, w1}, {"lease_expired", 2, w1}, {"lease_expired", 3, w2}, {"swept", 0, uuid.Nil}}
	if len(h) != len(want) {
		t.Fatalf("history: %+v", h)
	}
	for i, w := range want {
		a := h[i]
		worker := uuid.Nil
		if a.Worker != nil {
			worker = *a.Worker
		}
		if a.No != i+1 || a.Outcome != w.outcome || a.Attempt != w.attempt || worker != w.worker {
			t.Fatalf("history row %d: %+v, want %+v", i, a, w)
		}
	}
	if h[0].Detail != "timeout" || h[0].ClaimedAt == nil || h[0].LeaseToken == nil {
		t.Fatalf("retry row: %+v", h[0])
	}

	// 30 replay/sweep cycles: history grows by two rows each, last_error
	// does not grow.
	for i := 0; i < 30; i++ {
		if _, err := s.Replay(ctx, driver.ReplayParams{IDs: []uuid.UUID{id}, By: "op"}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Sweep(ctx, driver.SweepParams{Topics: []string{topic}, MaxAttempts: 0, Limit: 10}); err != nil {
			t.Fatal(err)
		}
	}
	e := get(t, s, id)
	if e.Status != "dead" || e.LastError == nil || len(*e.LastError) > 4096 {
		t.Fatalf("after 30 cycles: status %s, last_error %d bytes", e.Status, len(*e.LastError))
	}
	h, _ = s.History(ctx, id)
	if len(h) != 4+60 {
		t.Fatalf("history after 30 cycles: %d rows, want 64", len(h))
	}
	for i, a := range h {
		if a.No != i+1 {
			t.Fatalf("attempt numbers not gap-free at %d: %+v", i, a)
		}
	}
}

// An event enqueued while its ordering predecessor settled may stay held
// (the settling statement could not see it); ReleaseHeld frees it, and
// until then the claim passes it by. It reads past keys whose held events
// must wait: here one enqueued first (a lower stream id) whose head is
// leased.
func TestReleaseHeld(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	waiting, key := "waiting", "acct"
	all := rows(4, "test", "events")
	for i := range all {
		all[i].OrderingKey = &waiting
		if i >= 2 {
			all[i].OrderingKey = &key
		}
		if _, err := s.Insert(ctx, pool, all[i:i+1], nil); err != nil {
			t.Fatal(err)
		}
	}
	w := uuid.New()
	first := claim(t, s, 10, 3, w)
	if len(first) != 2 || first[0].ID != all[0].ID || first[1].ID != all[2].ID || first[1].OrderingSeq != 1 || *first[1].OrderingKey != key {
		t.Fatalf("claim of two keys' events: %+v, want only their first", first)
	}
	// Settle acct's first behind the driver's back, as if its outcome had
	// committed before the second's enqueue: the second stays held.
	mustExec(t, pool, `UPDATE modkit_outbox_events SET status = 'delivered', locked_by = NULL, locked_until = NULL, lease_token = NULL WHERE id = $1`, all[2].ID)
	if again := claim(t, s, 10, 3, w); len(again) != 0 {
		t.Fatalf("a held event was claimed: %+v", again)
	}
	if n, err := s.ReleaseHeld(ctx, []string{topic}, nil, 100); err != nil || n != 1 {
		t.Fatalf("release held: %d, %v (want acct's second only: waiting's head is leased)", n, err)
	}
	if got := claim(t, s, 10, 3, w); len(got) != 1 || got[0].ID != all[3].ID || got[0].OrderingSeq != 2 {
		t.Fatalf("after the release: %+v", got)
	}
	if n, _ := s.ReleaseHeld(ctx, []string{topic}, nil, 100); n != 0 {
		t.Fatalf("a second release freed %d", n)
	}
}

// One outcome write may carry events of several claims, so of several lease
// tokens (since migration 0019 the kept deliveries under a token that at
// least eight of them share are one UPDATE, which fences every event in its
// WHERE clause; the others are locked first, as before). Every event is
// written under its own token or not at all: a delivery presented with
// another claim's token, or after its lease expired, changes nothing; the
// first outcome given for an event is the one recorded; each written event
// has one ledger row.
func TestCompleteAcrossLeaseTokens(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	insertN(t, s, pool, "test", "events", 22)
	worker := uuid.New()
	a := claim(t, s, 10, 5, worker)
	b := claim(t, s, 10, 5, worker)
	c := claim(t, s, 2, 5, worker) // too few to share a token: locked first
	if len(a) != 10 || len(b) != 10 || len(c) != 2 || a[0].LeaseToken == b[0].LeaseToken {
		t.Fatalf("claims of %d, %d and %d events, tokens %v and %v; want 10, 10 and 2 with their own tokens",
			len(a), len(b), len(c), a[0].LeaseToken, b[0].LeaseToken)
	}
	expireLease(t, pool, a[9].ID)
	wrongToken := outcome(a[8], driver.Delivered)
	wrongToken.LeaseToken = b[0].LeaseToken // among b's deliveries, under b's token
	var outcomes []driver.Outcome
	want := map[uuid.UUID]string{}
	for i, e := range b {
		kind, status := driver.Delivered, "delivered"
		if i == 1 {
			kind, status = driver.Retry, "pending"
		}
		outcomes = append(outcomes, outcome(e, kind))
		want[e.ID] = status
	}
	for _, e := range a[:8] {
		outcomes = append(outcomes, outcome(e, driver.Delivered))
		want[e.ID] = "delivered"
	}
	outcomes = append(outcomes,
		wrongToken,                      // another claim's token: refused
		outcome(a[9], driver.Delivered), // lease expired: refused
		outcome(a[0], driver.Dead),      // a second outcome for a[0]: the first wins
		outcome(c[0], driver.Delivered),
		outcome(c[1], driver.Delivered))
	want[a[8].ID], want[a[9].ID], want[c[0].ID], want[c[1].ID] = "processing", "processing", "delivered", "delivered"
	settled := complete(t, s, worker, outcomes...)
	for i, o := range outcomes {
		// Settled is per event: the second outcome for a[0] reports a[0]'s.
		if wantSettled := want[o.ID] != "processing"; settled[i] != wantSettled {
			t.Errorf("outcome %d (%v, kind %d): settled %v, want %v", i, o.ID, o.Kind, settled[i], wantSettled)
		}
	}
	claimed := map[uuid.UUID]driver.Claimed{}
	for _, e := range append(append(append([]driver.Claimed{}, a...), b...), c...) {
		claimed[e.ID] = e
	}
	for id, status := range want {
		e := get(t, s, id)
		h, err := s.History(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, r := range h {
			got = append(got, r.Outcome)
			if r.LeaseToken == nil || *r.LeaseToken != claimed[id].LeaseToken || r.Worker == nil || *r.Worker != worker || r.Attempt != 1 {
				t.Errorf("event %v: ledger row %+v, want its own lease token, the worker and attempt 1", id, r)
			}
		}
		wantHistory := []string{status}
		switch status {
		case "processing":
			wantHistory = nil
		case "pending":
			wantHistory = []string{"retry"}
		}
		if e.Status != status || !slices.Equal(got, wantHistory) {
			t.Errorf("event %v: status %s, history %v; want %s, %v", id, e.Status, got, status, wantHistory)
		}
	}
}
