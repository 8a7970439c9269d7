package db_test

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
	"testing/fstest"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func tableExists(t *testing.T, pool *pgxpool.Pool, qualified string) bool {
	t.Helper()
	var ok bool
	if err := pool.QueryRow(context.Background(), "SELECT to_regclass($1) IS NOT NULL", qualified).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

func TestMigratorUpDownStatusInSchema(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_alt", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	all := m.Migrations()
	if len(all) == 0 {
		t.Fatal("no embedded migrations")
	}

	applied, err := m.Up(ctx)
	if err != nil || len(applied) != len(all) {
		t.Fatalf("first Up: applied %d of %d, err %v", len(applied), len(all), err)
	}
	if !tableExists(t, pool, "mk_alt.modkit_outbox_events") {
		t.Fatal("Up did not create mk_alt.modkit_outbox_events")
	}
	again, err := m.Up(ctx)
	if err != nil || len(again) != 0 {
		t.Fatalf("second Up must be a no-op: applied %d, err %v", len(again), err)
	}
	st, err := m.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st {
		if !s.Applied || s.AppliedAt.IsZero() {
			t.Fatalf("status after Up: %+v", s)
		}
	}

	reverted, err := m.Down(ctx, len(all)+5)
	if err != nil || len(reverted) != len(all) {
		t.Fatalf("Down: reverted %d of %d, err %v", len(reverted), len(all), err)
	}
	if tableExists(t, pool, "mk_alt.modkit_outbox_events") {
		t.Fatal("Down left mk_alt.modkit_outbox_events behind")
	}
	st, _ = m.Status(ctx)
	for _, s := range st {
		if s.Applied {
			t.Fatalf("status after Down: %+v", s)
		}
	}
	if _, err := m.Down(ctx, 0); err == nil {
		t.Fatal("Down(0) must be rejected")
	}
	// The public schema, migrated by the harness, was not touched.
	if !tableExists(t, pool, "public.modkit_outbox_events") {
		t.Fatal("migrating mk_alt touched public")
	}
}

func TestMigratorConcurrent(t *testing.T) {
	ctx := context.Background()
	tdb := pgtest.NewDB(t)
	const n = 8
	var wg sync.WaitGroup
	results := make([]int, n)
	errs := make([]error, n)
	for i := range n {
		pool := tdb.NewPool(t) // separate pools, like separate processes
		wg.Add(1)
		go func() {
			defer wg.Done()
			m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_conc", Logger: quiet})
			if err != nil {
				errs[i] = err
				return
			}
			applied, err := m.Up(ctx)
			results[i], errs[i] = len(applied), err
		}()
	}
	wg.Wait()
	total := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("migrator %d: %v", i, errs[i])
		}
		total += results[i]
	}
	m, _ := db.NewMigrator(tdb.Provider.Pool, db.MigratorConfig{Schema: "mk_conc", Logger: quiet})
	if want := len(m.Migrations()); total != want {
		t.Fatalf("%d concurrent migrators applied %d migrations in all, want exactly %d", n, total, want)
	}
}

func TestMigratorFailedMigrationRollsBack(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	fsys := fstest.MapFS{
		"0001_first.up.sql":    {Data: []byte("CREATE TABLE first_t (id int);")},
		"0001_first.down.sql":  {Data: []byte("DROP TABLE first_t;")},
		"0002_broken.up.sql":   {Data: []byte("CREATE TABLE second_t (id int);\nSELECT no_such_function();")},
		"0002_broken.down.sql": {Data: []byte("DROP TABLE second_t;")},
	}
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_fail", FS: fsys, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	applied, err := m.Up(ctx)
	if err == nil {
		t.Fatal("Up with a broken migration must fail")
	}
	if !strings.Contains(err.Error(), "at line 2, column 8 of the file") { // where no_such_function is
		t.Errorf("the error does not say where in the file it is: %v", err)
	}
	if len(applied) != 1 || applied[0].Version != 1 {
		t.Fatalf("applied %+v, want only 0001", applied)
	}
	if !tableExists(t, pool, "mk_fail.first_t") || tableExists(t, pool, "mk_fail.second_t") {
		t.Fatal("0001 must stay applied and 0002's partial work must be rolled back")
	}
	st, _ := m.Status(ctx)
	if !st[0].Applied || st[1].Applied {
		t.Fatalf("status: %+v", st)
	}
}

// A migration file that ends the migrator's transaction itself (a COMMIT,
// as tools that wrap each file in BEGIN … COMMIT want) fails with
// ErrTransactionInMigration and is not recorded, where it was reported as
// "failed and was rolled back" while its first part stayed committed. An
// empty file is a migration that does nothing: it was refused as missing.
func TestMigratorFileThatCommits(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	fsys := fstest.MapFS{
		"0001_empty.up.sql":     {Data: nil},
		"0001_empty.down.sql":   {Data: nil},
		"0002_commits.up.sql":   {Data: []byte("BEGIN;\nCREATE TABLE a_t (id int);\nCOMMIT;\nSELECT no_such_function();")},
		"0002_commits.down.sql": {Data: []byte("DROP TABLE a_t;")},
	}
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_commits", FS: fsys, Logger: quiet})
	if err != nil {
		t.Fatalf("a set with empty files: %v", err)
	}
	applied, err := m.Up(ctx)
	if !errors.Is(err, db.ErrTransactionInMigration) || strings.Contains(err.Error(), "rolled back") {
		t.Fatalf("Up of a file with a COMMIT: %v; want ErrTransactionInMigration, not a roll-back", err)
	}
	if len(applied) != 1 || applied[0].Version != 1 {
		t.Fatalf("applied %+v, want only 0001", applied)
	}
	if st, err := m.Status(ctx); err != nil || !st[0].Applied || st[1].Applied {
		t.Fatalf("status: %+v, %v; want 0001 recorded and 0002 not", st, err)
	}
	// A file whose last statement commits, without an error after it.
	m, err = db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_commits_last", Logger: quiet, FS: fstest.MapFS{
		"0001_commits.up.sql":   {Data: []byte("CREATE TABLE b_t (id int); COMMIT;")},
		"0001_commits.down.sql": {Data: []byte("DROP TABLE b_t;")},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); !errors.Is(err, db.ErrTransactionInMigration) {
		t.Fatalf("Up of a file ending in COMMIT: %v; want ErrTransactionInMigration", err)
	}
	if st, err := m.Status(ctx); err != nil || st[0].Applied {
		t.Fatalf("status: %+v, %v; want 0001 not recorded", st, err)
	}
	// COMMIT AND CHAIN and ROLLBACK AND CHAIN leave the connection in a
	// (new) transaction: such a migration was recorded as applied though
	// its work was undone, or done partly outside the schema.
	for i, body := range []string{
		"CREATE TABLE c_t (id int); ROLLBACK AND CHAIN;",
		"CREATE TABLE d_t (id int); COMMIT AND CHAIN; CREATE TABLE d2_t (id int);",
	} {
		schema := fmt.Sprintf("mk_chain_%d", i)
		m, err = db.NewMigrator(pool, db.MigratorConfig{Schema: schema, Logger: quiet, FS: fstest.MapFS{
			"0001_chains.up.sql":   {Data: []byte(body)},
			"0001_chains.down.sql": {Data: nil},
		}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Up(ctx); !errors.Is(err, db.ErrTransactionInMigration) || !strings.Contains(err.Error(), "AND CHAIN") {
			t.Fatalf("Up of %q: %v; want ErrTransactionInMigration naming AND CHAIN", body, err)
		}
		if st, err := m.Status(ctx); err != nil || st[0].Applied {
			t.Fatalf("%q: status %+v, %v; want 0001 not recorded", body, st, err)
		}
	}
}

// A migration file that changes its session (SET search_path, as pg_dump's
// output does with set_config, or a lock_timeout) leaves the pool's
// connections as they were: the migrator's connection was given back to
// the pool, and the application's next queries on it ran with the file's
// settings ("relation does not exist").
func TestMigratorLeavesNoSessionSettings(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	if _, err := pool.Exec(ctx, "CREATE TABLE public.app_notes (id int)"); err != nil {
		t.Fatal(err)
	}
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_session", Logger: quiet, FS: fstest.MapFS{
		"0001_dump.up.sql": {Data: []byte("SELECT pg_catalog.set_config('search_path', '', false);\n" +
			"SET lock_timeout = '1ms';\nCREATE TABLE mk_session.widgets (id int);")},
		"0001_dump.down.sql": {Data: []byte("DROP TABLE mk_session.widgets;")},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	// Every connection the pool holds: each must see the defaults.
	conns := make([]*pgxpool.Conn, 0, pool.Stat().MaxConns())
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range pool.Stat().MaxConns() {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		var lockTimeout string
		if err := c.QueryRow(ctx, "SHOW lock_timeout").Scan(&lockTimeout); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Exec(ctx, "INSERT INTO app_notes VALUES (1)"); err != nil || lockTimeout != "0" {
			t.Fatalf("a pooled connection after the migration: insert into app_notes: %v; lock_timeout %s; want the session's defaults", err, lockTimeout)
		}
	}
}

// Two migration sets sharing one migrations table: the second sees the
// first's versions as its own and, before this check, applied nothing and
// said nothing, so the app started without its tables. Now every call
// fails with ErrMigrationConflict, naming the table, and changes nothing.
// A Down by a program that knows fewer migrations than the database has
// applied is refused too: it would revert an older one under a newer.
func TestMigratorConflicts(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	set := func(names ...string) fstest.MapFS {
		fsys := fstest.MapFS{}
		for i, name := range names {
			base := fmt.Sprintf("%04d_%s", i+1, name)
			fsys[base+".up.sql"] = &fstest.MapFile{Data: []byte("CREATE TABLE " + name + " (id int);")}
			fsys[base+".down.sql"] = &fstest.MapFile{Data: []byte("DROP TABLE " + name + ";")}
		}
		return fsys
	}
	migrator := func(fsys fstest.MapFS) *db.Migrator {
		m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_conflict", FS: fsys, Table: "shared_migrations", Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	first := migrator(set("orders", "lines"))
	if applied, err := first.Up(ctx); err != nil || len(applied) != 2 {
		t.Fatalf("the first set: applied %d, %v", len(applied), err)
	}
	second := migrator(set("users"))
	if _, err := second.Up(ctx); !errors.Is(err, db.ErrMigrationConflict) || !strings.Contains(err.Error(), "MigratorConfig.Table") {
		t.Fatalf("a second set on the same table, Up: %v, want ErrMigrationConflict", err)
	}
	if _, err := second.Status(ctx); !errors.Is(err, db.ErrMigrationConflict) {
		t.Fatalf("Status: %v, want ErrMigrationConflict", err)
	}
	if _, err := second.Down(ctx, 1); !errors.Is(err, db.ErrMigrationConflict) {
		t.Fatalf("Down: %v, want ErrMigrationConflict", err)
	}
	if tableExists(t, pool, "mk_conflict.users") || !tableExists(t, pool, "mk_conflict.orders") {
		t.Fatal("a refused call changed the schema")
	}
	older := migrator(set("orders"))
	if _, err := older.Down(ctx, 1); !errors.Is(err, db.ErrMigrationConflict) || !strings.Contains(err.Error(), "0002_lines") {
		t.Fatalf("Down by a program that knows only 0001: %v, want ErrMigrationConflict naming 0002_lines", err)
	}
	if !tableExists(t, pool, "mk_conflict.orders") || !tableExists(t, pool, "mk_conflict.lines") {
		t.Fatal("the refused Down reverted something")
	}
	// Up by the older program applies nothing, leaves the newer one's
	// migration alone and says so; Status lists it as Unknown.
	var logs strings.Builder
	older = func() *db.Migrator {
		m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_conflict", FS: set("orders"), Table: "shared_migrations",
			Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}()
	if applied, err := older.Up(ctx); err != nil || len(applied) != 0 {
		t.Fatalf("Up by the older program: applied %d, %v", len(applied), err)
	}
	if !strings.Contains(logs.String(), "newer than this program") || !strings.Contains(logs.String(), "newest_recorded=0002_lines") {
		t.Fatalf("Up by the older program logged:\n%s", logs.String())
	}
	st, err := older.Status(ctx)
	if err != nil || len(st) != 2 {
		t.Fatalf("Status by the older program: %+v, %v", st, err)
	}
	if st[0].Version != 1 || st[0].Unknown || !st[0].Applied ||
		st[1].Version != 2 || st[1].Name != "lines" || !st[1].Unknown || !st[1].Applied || st[1].AppliedAt.IsZero() {
		t.Fatalf("Status by the older program: %+v, want 0001_orders applied, then 0002_lines applied and unknown", st)
	}
	if st, err := first.Status(ctx); err != nil || len(st) != 2 || st[1].Unknown {
		t.Fatalf("Status by the program that applied both: %+v, %v", st, err)
	}
}

func TestMigratorRejectsBadInput(t *testing.T) {
	pool := pgtest.NewDB(t).Provider.Pool
	for _, schema := range []string{"a;drop table x", `we"ird`, "1abc", "has space", "x123456789012345678901234567890123456789012345678901234567890123"} {
		if _, err := db.NewMigrator(pool, db.MigratorConfig{Schema: schema}); !errors.Is(err, db.ErrInvalidSchema) {
			t.Errorf("schema %q: want ErrInvalidSchema, got %v", schema, err)
		}
	}
	bad := []fstest.MapFS{
		{"0001_x.up.sql": {Data: []byte("SELECT 1")}},                                                // no down
		{"0001_x.down.sql": {Data: []byte("SELECT 1")}},                                              // no up
		{"x.up.sql": {Data: []byte("SELECT 1")}},                                                     // no version
		{"0001_a.up.sql": {Data: []byte("SELECT 1")}, "0001_b.down.sql": {Data: []byte("SELECT 1")}}, // two names
		{"0001_a.up.sql": {Data: []byte("SELECT 1")}, "1_a.up.sql": {Data: []byte("SELECT 2")},
			"0001_a.down.sql": {Data: []byte("SELECT 1")}}, // two files for one version's up
		{}, // nothing at the root
		{"migrations/0001_a.up.sql": {Data: []byte("SELECT 1")}, "migrations/0001_a.down.sql": {Data: []byte("SELECT 1")}}, // in a directory
	}
	for i, fsys := range bad {
		if _, err := db.NewMigrator(pool, db.MigratorConfig{FS: fsys}); err == nil {
			t.Errorf("bad FS %d accepted", i)
		}
	}
	// A version past int64 (20 digits) is told so, not "must be positive".
	if _, err := db.NewMigrator(pool, db.MigratorConfig{FS: fstest.MapFS{
		"20260102150405000000_a.up.sql": {Data: []byte("SELECT 1")}, "20260102150405000000_a.down.sql": {Data: []byte("SELECT 1")},
	}}); err == nil || !strings.Contains(err.Error(), "at most 19 digits") {
		t.Errorf("a 20-digit version: %v, want an error saying at most 19 digits", err)
	}
	if _, err := db.NewMigrator(nil, db.MigratorConfig{}); err == nil {
		t.Error("nil pool accepted")
	}
}

// A role that owns its schema but may not create schemas in the database
// (as no role but the owner may by default) migrates it: the migrator
// creates the schema only when it is missing.
func TestMigratorWithoutDatabaseCreate(t *testing.T) {
	ctx := context.Background()
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	role := "mk_migrator_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	for _, stmt := range []string{
		"CREATE ROLE " + role + " LOGIN PASSWORD 'pw'",
		"CREATE SCHEMA mk_owned AUTHORIZATION " + role,
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, stmt := range []string{"DROP SCHEMA mk_owned CASCADE", "DROP ROLE " + role} {
			if _, err := pool.Exec(context.Background(), stmt); err != nil {
				t.Errorf("%s: %v", stmt, err)
			}
		}
	})
	var mayCreate bool
	if err := pool.QueryRow(ctx, "SELECT has_database_privilege($1, current_database(), 'CREATE')", role).Scan(&mayCreate); err != nil || mayCreate {
		t.Fatalf("the role may create schemas in the database (%v, %v): the test needs one that may not", mayCreate, err)
	}
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User, cfg.ConnConfig.Password = role, "pw"
	rolePool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer rolePool.Close()
	m, err := db.NewMigrator(rolePool, db.MigratorConfig{Schema: "mk_owned", Logger: quiet, FS: fstest.MapFS{
		"0001_things.up.sql":   {Data: []byte("CREATE TABLE things (id int);")},
		"0001_things.down.sql": {Data: []byte("DROP TABLE things;")},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if applied, err := m.Up(ctx); err != nil || len(applied) != 1 {
		t.Fatalf("Up as the schema's owner: applied %d, %v", len(applied), err)
	}
	if !tableExists(t, pool, "mk_owned.things") {
		t.Fatal("Up did not create mk_owned.things")
	}
	if st, err := m.Status(ctx); err != nil || len(st) != 1 || !st[0].Applied {
		t.Fatalf("Status: %+v, %v", st, err)
	}
}

// The outbox is not migrated into a schema where PUBLIC (PostgreSQL 14's
// default for public) or one of its runtime roles may create objects: a
// function created there could run as the outbox functions' owner. Once
// that is revoked, it migrates.
func TestMigrateRefusesASchemaOthersMayCreateIn(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	for _, grantee := range []string{"PUBLIC", "modkit_outbox_producer"} {
		schema := "mk_open_" + strings.ToLower(strings.TrimPrefix(grantee, "modkit_outbox_"))
		if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema+"; GRANT CREATE ON SCHEMA "+schema+" TO "+grantee); err != nil {
			t.Fatal(err)
		}
		m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: schema, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		_, err = m.Up(ctx)
		if err == nil || !strings.Contains(err.Error(), "REVOKE CREATE ON SCHEMA "+schema+" FROM "+grantee) &&
			!strings.Contains(err.Error(), "create objects in it") {
			t.Fatalf("%s may create in %s: Up = %v, want it refused", grantee, schema, err)
		}
		if _, err := pool.Exec(ctx, "REVOKE CREATE ON SCHEMA "+schema+" FROM "+grantee); err != nil {
			t.Fatal(err)
		}
		if _, err := m.Up(ctx); err != nil {
			t.Fatalf("Up once %s may no longer create in %s: %v", grantee, schema, err)
		}
	}
}

// Every migration goes down in a schema whose name has upper-case letters
// (0004's down read the name as an identifier, folded to lower case).
func TestMigratorDownInAMixedCaseSchema(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "Shop", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	all := m.Migrations()
	if applied, err := m.Up(ctx); err != nil || len(applied) != len(all) {
		t.Fatalf("Up: %d of %d, %v", len(applied), len(all), err)
	}
	if reverted, err := m.Down(ctx, len(all)); err != nil || len(reverted) != len(all) {
		t.Fatalf("Down: %d of %d, %v", len(reverted), len(all), err)
	}
	if tableExists(t, pool, `"Shop".modkit_outbox_events`) {
		t.Fatal(`Down left "Shop".modkit_outbox_events behind`)
	}
}

// A Down in a schema that was never migrated (a typo in --schema, say)
// reverts nothing and creates nothing: it created the schema and its
// migrations table, then said there was nothing to revert.
func TestMigratorDownCreatesNothing(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_never", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	reverted, err := m.Down(ctx, 1)
	if err != nil || len(reverted) != 0 {
		t.Fatalf("Down in a schema never migrated: %+v, %v; want nothing reverted", reverted, err)
	}
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regnamespace('mk_never') IS NOT NULL").Scan(&exists); err != nil || exists {
		t.Fatalf("the schema exists after Down (%v)", err)
	}
}

// queryLog is a pgx tracer that keeps the text of every statement.
type queryLog struct {
	mu   sync.Mutex
	sqls []string
}

func (l *queryLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sqls = append(l.sqls, d.SQL)
	return ctx
}

func (l *queryLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// The migrator's advisory lock is a transaction's, taken by each
// transaction that changes the schema: behind a pooler in transaction mode
// (PgBouncer's), a session's lock was released on another server
// connection than the one holding it, and stayed held, and every later
// migration of the schema hung. A migrator that waited for the lock while
// another applied a migration reads the migrations table again under it,
// and goes on with the next one rather than applying that one twice.
func TestMigratorLocksEachTransaction(t *testing.T) {
	ctx := context.Background()
	tdb := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	log := &queryLog{}
	cfg.ConnConfig.Tracer = log
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	fsys := fstest.MapFS{
		"0001_a.up.sql":   {Data: []byte("CREATE TABLE a (x int);")},
		"0001_a.down.sql": {Data: []byte("DROP TABLE a;")},
		"0002_b.up.sql":   {Data: []byte("CREATE TABLE b (x int);")},
		"0002_b.down.sql": {Data: []byte("DROP TABLE b;")},
	}
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_waits", Logger: quiet, FS: fsys})
	if err != nil {
		t.Fatal(err)
	}
	// The schema and its migrations table exist; another migrator of the
	// schema is in the middle of applying 0001.
	if _, err := tdb.Provider.Pool.Exec(ctx, `CREATE SCHEMA mk_waits; CREATE TABLE mk_waits.modkit_schema_migrations
		(version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		t.Fatal(err)
	}
	other, err := tdb.Provider.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(ctx) }()
	for _, q := range []string{
		fmt.Sprintf("SELECT pg_advisory_xact_lock(%d)", db.LockKey(m)),
		"CREATE TABLE mk_waits.a (x int)",
		"INSERT INTO mk_waits.modkit_schema_migrations (version, name) VALUES (1, 'a')",
	} {
		if _, err := other.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	type result struct {
		applied []db.Migration
		err     error
	}
	done := make(chan result, 1)
	go func() {
		applied, err := m.Up(ctx)
		done <- result{applied, err}
	}()
	for {
		var waiting bool
		if err := tdb.Provider.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%pg_advisory_xact_lock%')`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		select {
		case r := <-done:
			t.Fatalf("the migrator did not wait for the other's lock: %v, %v", r.applied, r.err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || len(r.applied) != 1 || r.applied[0].Version != 2 {
		t.Fatalf("Up after another migrator applied 0001: %v, %v; want 0002 alone", r.applied, r.err)
	}
	if _, err := m.Down(ctx, 2); err != nil {
		t.Fatal(err)
	}

	log.mu.Lock()
	defer log.mu.Unlock()
	var xact int
	for _, q := range log.sqls {
		if strings.Contains(q, "pg_advisory_lock") || strings.Contains(q, "pg_advisory_unlock") {
			t.Errorf("the migrator took or released a session's advisory lock: %s", q)
		}
		if strings.Contains(q, "pg_advisory_xact_lock") {
			xact++
		}
	}
	if xact < 4 { // two migrations up, two down
		t.Errorf("the migrator took the transaction's advisory lock %d times, want one for each transaction that changes the schema", xact)
	}
}

// Each step is decided under the lock, from the migrations table read
// there: an Up and a Down that both waited for the lock plan nothing from
// their earlier reads. Planned from those, with 1 and 2 applied, an Up
// applied 3 and then a Down reverted 2, leaving 1 and 3; and an older
// program's Down, which must refuse a schema a newer one migrated further,
// reverted 2 after a newer program's Up applied 3.
func TestMigratorStepsAreDecidedUnderTheLock(t *testing.T) {
	ctx := context.Background()
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	files := func(n int) fstest.MapFS {
		fsys := fstest.MapFS{}
		for v := 1; v <= n; v++ {
			fsys[fmt.Sprintf("%04d_m%d.up.sql", v, v)] = &fstest.MapFile{Data: []byte(fmt.Sprintf("CREATE TABLE m%d (x int);", v))}
			fsys[fmt.Sprintf("%04d_m%d.down.sql", v, v)] = &fstest.MapFile{Data: []byte(fmt.Sprintf("DROP TABLE m%d;", v))}
		}
		return fsys
	}
	newer, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_steps", Logger: quiet, FS: files(3)})
	if err != nil {
		t.Fatal(err)
	}
	older, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_steps", Logger: quiet, FS: files(2)})
	if err != nil {
		t.Fatal(err)
	}
	applied := func() []int64 {
		t.Helper()
		st, err := newer.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var vs []int64
		for _, s := range st {
			if s.Applied {
				vs = append(vs, s.Version)
			}
		}
		return vs
	}
	type result struct {
		migs []db.Migration
		err  error
	}
	// race holds the lock while up and then down queue for it, lets them
	// go, and returns their results.
	race := func(up, down func() ([]db.Migration, error)) (result, result) {
		t.Helper()
		hold, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := hold.Exec(ctx, fmt.Sprintf("SELECT pg_advisory_xact_lock(%d)", db.LockKey(newer))); err != nil {
			t.Fatal(err)
		}
		ups, downs := make(chan result, 1), make(chan result, 1)
		for i, f := range []func() ([]db.Migration, error){up, down} {
			out := []chan result{ups, downs}[i]
			go func() { migs, err := f(); out <- result{migs, err} }()
			for waiting := 0; waiting < i+1; {
				if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
					AND wait_event_type = 'Lock' AND query LIKE '%pg_advisory_xact_lock%'`).Scan(&waiting); err != nil {
					t.Fatal(err)
				}
				time.Sleep(5 * time.Millisecond) // polling the server's view: nothing to wait on
			}
		}
		if err := hold.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return <-ups, <-downs
	}

	if _, err := older.Up(ctx); err != nil {
		t.Fatal(err)
	}
	u, d := race(func() ([]db.Migration, error) { return newer.Up(ctx) }, func() ([]db.Migration, error) { return newer.Down(ctx, 1) })
	if u.err != nil || d.err != nil || len(u.migs) != 1 || u.migs[0].Version != 3 || len(d.migs) != 1 || d.migs[0].Version != 3 {
		t.Fatalf("Up then Down(1) from 1 and 2 applied: up %v %v, down %v %v; want 3 applied, then 3 reverted", u.migs, u.err, d.migs, d.err)
	}
	if got := applied(); !slices.Equal(got, []int64{1, 2}) {
		t.Fatalf("applied after Up and Down(1): %v, want [1 2]", got)
	}

	u, d = race(func() ([]db.Migration, error) { return newer.Up(ctx) }, func() ([]db.Migration, error) { return older.Down(ctx, 1) })
	if u.err != nil || !errors.Is(d.err, db.ErrMigrationConflict) || len(d.migs) != 0 {
		t.Fatalf("a newer Up then an older Down(1): up %v %v, down %v %v; want the Down refused", u.migs, u.err, d.migs, d.err)
	}
	if got := applied(); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("applied after a newer Up and an older Down: %v, want [1 2 3]", got)
	}
}

// Migrators running Up and Down at once on one schema keep its
// migrations a prefix of the set, each step in order: every file checks,
// when it runs, that the one before it is applied and the one after it is
// not, and none fails.
func TestConcurrentUpsAndDownsKeepTheOrder(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	const n = 6
	fsys := fstest.MapFS{}
	for v := 1; v <= n; v++ {
		check := fmt.Sprintf(`DO $$ BEGIN
			IF %d > 1 AND to_regclass('m%d') IS NULL THEN RAISE EXCEPTION 'up %d before %d'; END IF;
			IF to_regclass('m%d') IS NOT NULL THEN RAISE EXCEPTION 'up %d after %d'; END IF;
		END $$;`, v, v-1, v, v-1, v+1, v, v+1)
		fsys[fmt.Sprintf("%04d_m%d.up.sql", v, v)] = &fstest.MapFile{Data: []byte(check + fmt.Sprintf("CREATE TABLE m%d (x int);", v))}
		fsys[fmt.Sprintf("%04d_m%d.down.sql", v, v)] = &fstest.MapFile{Data: []byte(fmt.Sprintf(`DO $$ BEGIN
			IF to_regclass('m%d') IS NOT NULL THEN RAISE EXCEPTION 'down %d before %d'; END IF;
		END $$; DROP TABLE m%d;`, v+1, v, v+1, v))}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 6*10)
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_churn", Logger: quiet, FS: fsys})
			if err != nil {
				errs <- err
				return
			}
			for i := range 10 {
				if (g+i)%2 == 0 {
					_, err = m.Up(ctx)
				} else {
					_, err = m.Down(ctx, 1+(g*7+i)%3)
				}
				if err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// UpTo applies the migrations up to a version and leaves the later ones;
// a version the set does not have is refused, and nothing is applied.
func TestMigratorUpTo(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewDB(t).Provider.Pool
	fsys := fstest.MapFS{}
	for v := 1; v <= 3; v++ {
		fsys[fmt.Sprintf("%04d_m%d.up.sql", v, v)] = &fstest.MapFile{Data: []byte(fmt.Sprintf("CREATE TABLE m%d (x int);", v))}
		fsys[fmt.Sprintf("%04d_m%d.down.sql", v, v)] = &fstest.MapFile{Data: []byte(fmt.Sprintf("DROP TABLE m%d;", v))}
	}
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "mk_upto", Logger: quiet, FS: fsys})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := m.UpTo(ctx, 4); !errors.Is(err, db.ErrUnknownVersion) || len(got) != 0 || !strings.Contains(err.Error(), "0001_m1 to 0003_m3") {
		t.Fatalf("UpTo(4) of a set of 3: %v, %v; want ErrUnknownVersion naming the set's range", got, err)
	}
	if tableExists(t, pool, "mk_upto.modkit_schema_migrations") {
		t.Fatal("a refused UpTo created the migrations table")
	}
	versions := func(ms []db.Migration) []int64 {
		var vs []int64
		for _, m := range ms {
			vs = append(vs, m.Version)
		}
		return vs
	}
	for _, c := range []struct {
		to   int64
		want []int64
	}{{2, []int64{1, 2}}, {2, nil}, {1, nil}, {3, []int64{3}}} {
		got, err := m.UpTo(ctx, c.to)
		if err != nil || !slices.Equal(versions(got), c.want) {
			t.Fatalf("UpTo(%d): %v, %v; want %v", c.to, versions(got), err, c.want)
		}
		if c.to == 2 && tableExists(t, pool, "mk_upto.m3") {
			t.Fatal("UpTo(2) applied 0003")
		}
	}
}
