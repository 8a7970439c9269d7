package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/golang-migrate/migrate/v4"
	migratepgx "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"

	"github.com/modkit-go/modkit/migrations"
	"github.com/modkit-go/modkit/modkit/db"
)

// knownMigrations lists the embedded outbox migrations, so that the counts
// below follow the migrations folder.
func knownMigrations(t *testing.T) []db.Migration {
	t.Helper()
	m, err := db.ReadMigrations(migrations.FS)
	if err != nil || len(m) == 0 {
		t.Fatalf("read the embedded migrations: %d, %v", len(m), err)
	}
	return m
}

// schemaOf describes the outbox tables of a schema: columns, constraints,
// indexes, extended statistics and storage options, with the schema's name
// taken out (pg_catalog qualifies names outside the search_path only), so
// that two schemas can be compared.
func schemaOf(t *testing.T, pool *pgxpool.Pool, schema string) string {
	t.Helper()
	queries := []string{
		`SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '')
		 FROM information_schema.columns WHERE table_schema = $1 AND table_name LIKE 'modkit_outbox%' ORDER BY 1`,
		// A foreign key names its table with the schema when the schema is
		// not on the search_path.
		`SELECT c.relname || ' ' || con.conname || ' ' || replace(pg_get_constraintdef(con.oid), $1::text || '.', '')
		 FROM pg_constraint con JOIN pg_class c ON c.oid = con.conrelid
		 JOIN pg_namespace n ON n.oid = con.connamespace
		 WHERE n.nspname = $1::text AND c.relname LIKE 'modkit_outbox%' ORDER BY 1`,
		`SELECT replace(indexdef, $1 || '.', '') FROM pg_indexes WHERE schemaname = $1 AND tablename LIKE 'modkit_outbox%' ORDER BY 1`,
		`SELECT stxname || ' ' || replace(pg_get_statisticsobjdef(oid), $1 || '.', '') FROM pg_statistic_ext WHERE stxnamespace = $1::regnamespace ORDER BY 1`,
		`SELECT relname || ' ' || coalesce(array_to_string(reloptions, ','), '') FROM pg_class
		 WHERE relnamespace = $1::regnamespace AND relkind = 'r' AND relname LIKE 'modkit_outbox%' ORDER BY 1`,
	}
	var b strings.Builder
	for _, q := range queries {
		rows, err := pool.Query(bg, q, schema)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		b.WriteString(strings.Join(lines, "\n") + "\n--\n")
	}
	return b.String()
}

// inSchema returns a connection config whose search_path is schema, which
// it creates.
func inSchema(t *testing.T, f *fixture, schema string) *pgx.ConnConfig {
	t.Helper()
	if _, err := f.pool.Exec(bg, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(f.dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["search_path"] = schema
	return cfg
}

func sqlDB(t *testing.T, cfg *pgx.ConnConfig) *sql.DB {
	t.Helper()
	d := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = d.Close() })
	return d
}

func sameSchema(t *testing.T, f *fixture, schema string) {
	t.Helper()
	want, got := schemaOf(t, f.pool, "public"), schemaOf(t, f.pool, schema)
	if strings.Count(want, "\n") < 20 {
		t.Fatalf("the reference schema looks empty:\n%s", want)
	}
	if got != want {
		t.Fatalf("schema %s differs from the migrator's:\n%s\nwant:\n%s", schema, got, want)
	}
}

func noOutboxTables(t *testing.T, f *fixture, schema string) {
	t.Helper()
	var n int
	if err := f.pool.QueryRow(bg, `SELECT count(*) FROM pg_class WHERE relnamespace = $1::regnamespace AND relname LIKE 'modkit_outbox%'`, schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d outbox relations left in %s after migrating down", n, schema)
	}
}

// TestMigrateCommands: up, status and down through the command, in a
// schema of its own.
func TestMigrateCommands(t *testing.T) {
	f := newFixture(t)
	status := func() string {
		return cli(t, f.dsn, "migrate", "status", "--schema", "ops").must(t, exitOK).stdout
	}
	known := knownMigrations(t)
	last := known[len(known)-1]
	if s := status(); strings.Count(s, " no\n") != len(known) {
		t.Fatalf("status before up:\n%s", s)
	}
	// Up to a version: the later ones wait, and say so. A version this
	// modkit-outbox does not have, or --to with another subcommand, is a
	// bad command line.
	cli(t, f.dsn, "migrate", "up", "--schema", "ops", "--to", "9998").must(t, exitUsage)
	cli(t, f.dsn, "migrate", "down", "--schema", "ops", "--to", "1").must(t, exitUsage)
	stop := known[len(known)-3]
	out := cli(t, f.dsn, "migrate", "up", "--schema", "ops", "--to", fmt.Sprint(stop.Version)).must(t, exitOK).stdout
	if !strings.Contains(out, "applied 0001_outbox_events") || !strings.Contains(out, fmt.Sprintf("applied %04d_%s", stop.Version, stop.Name)) ||
		strings.Contains(out, fmt.Sprintf("applied %04d_", known[len(known)-2].Version)) || !strings.Contains(out, "2 later migration(s) wait") {
		t.Fatalf("up --to %d:\n%s", stop.Version, out)
	}
	if s := status(); strings.Count(s, " no\n") != 2 {
		t.Fatalf("status after up --to %d:\n%s", stop.Version, s)
	}
	// Public holds the fixture's outbox; ops, named on purpose, is
	// migrated without a question (TestSchemaWithoutAnOutbox).
	if out := cli(t, f.dsn, "migrate", "up", "--schema", "ops").must(t, exitOK).stdout; !strings.Contains(out, fmt.Sprintf("applied %04d_%s", last.Version, last.Name)) {
		t.Fatalf("up:\n%s", out)
	}
	if out := cli(t, f.dsn, "migrate", "up", "--schema", "ops").must(t, exitOK).stdout; !strings.Contains(out, "up to date") {
		t.Fatalf("up again:\n%s", out)
	}
	if s := status(); strings.Contains(s, " no\n") {
		t.Fatalf("status after up:\n%s", s)
	}
	// A schema a newer version migrated further: up says so (it said "up
	// to date"), status marks the migration, and down refuses without
	// asking first.
	if _, err := f.pool.Exec(bg, "INSERT INTO ops.modkit_schema_migrations (version, name) VALUES (9999, 'from_the_future')"); err != nil {
		t.Fatal(err)
	}
	if out := cli(t, f.dsn, "migrate", "up", "--schema", "ops").must(t, exitOK).stdout; !strings.Contains(out,
		"1 newer migration(s) it does not know, up to 9999_from_the_future") || strings.Contains(out, "up to date") {
		t.Fatalf("up on a schema a newer version migrated:\n%s", out)
	}
	if s := status(); !strings.Contains(s, "from_the_future (newer than this modkit-outbox)") {
		t.Fatalf("status of a schema a newer version migrated:\n%s", s)
	}
	if r := cli(t, f.dsn, "migrate", "down", "--schema", "ops").must(t, exitFailure); !strings.Contains(r.stderr, "9999_from_the_future") ||
		strings.Contains(r.stdout+r.stderr, "Revert") {
		t.Fatalf("down on a schema a newer version migrated:\n%s%s", r.stdout, r.stderr)
	}
	if _, err := f.pool.Exec(bg, "DELETE FROM ops.modkit_schema_migrations WHERE version = 9999"); err != nil {
		t.Fatal(err)
	}
	sameSchema(t, f, "ops")
	// The prompt names what it would revert (its answer, empty here, is no).
	if r := cli(t, f.dsn, "migrate", "down", "--schema", "ops").must(t, exitAborted); !strings.Contains(r.stderr+r.stdout,
		fmt.Sprintf("Revert %04d_%s in schema ops? Their down scripts drop no table.", last.Version, last.Name)) {
		t.Fatalf("the prompt of migrate down:\n%s%s", r.stdout, r.stderr)
	}
	// It names the migrations whose down scripts drop tables, only those.
	r := cli(t, f.dsn, "migrate", "down", "--schema", "ops", "--steps", fmt.Sprint(len(known))).must(t, exitAborted)
	if _, what, _ := strings.Cut(r.stderr+r.stdout, "The down script of "); !strings.Contains(what, "0001_outbox_events") ||
		!strings.Contains(what, "drops tables") || strings.Contains(what, fmt.Sprintf("%04d_%s", last.Version, last.Name)) {
		t.Fatalf("the prompt of migrate down of every migration:\n%s%s", r.stdout, r.stderr)
	}
	out = cli(t, f.dsn, "migrate", "down", "--schema", "ops", "--steps", "1", "--yes").must(t, exitOK).stdout
	if out != fmt.Sprintf("reverted %04d_%s\n", last.Version, last.Name) {
		t.Fatalf("down 1:\n%s", out)
	}
	cli(t, f.dsn, "migrate", "down", "--schema", "ops", "--steps", fmt.Sprint(len(known)-1), "--yes").must(t, exitOK)
	noOutboxTables(t, f, "ops")
	if s := status(); strings.Count(s, " no\n") != len(known) {
		t.Fatalf("status after down:\n%s", s)
	}
	cli(t, f.dsn, "migrate", "down", "--steps", "0", "--yes").must(t, exitUsage)

	// Three processes migrating one schema at once: each migration is
	// applied once, and only the process that applied it says so. Each
	// said it applied every migration (it compared the schema's status
	// before and after its run).
	var wg sync.WaitGroup
	outs := make([]result, 3)
	for i := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i] = cli(t, f.dsn, "migrate", "up", "--schema", "ops_concurrent", "--yes")
		}()
	}
	wg.Wait()
	said := 0
	for _, r := range outs {
		if r.code != exitOK {
			t.Fatalf("concurrent migrate up: exit %d\n%s", r.code, r.stderr)
		}
		said += strings.Count(r.stdout, "applied ")
	}
	if said != len(known) {
		t.Fatalf("concurrent migrate up said it applied %d migrations in all, want %d:\n%s\n%s\n%s",
			said, len(known), outs[0].stdout, outs[1].stdout, outs[2].stdout)
	}

	// A schema others may create objects in is refused before anything is
	// migrated, and the advice is about the schema, not about the reader
	// and operator roles (printed for every refusal of a privilege).
	if _, err := f.pool.Exec(bg, "CREATE SCHEMA open_ops; GRANT CREATE ON SCHEMA open_ops TO PUBLIC"); err != nil {
		t.Fatal(err)
	}
	r = cli(t, f.dsn, "migrate", "up", "--schema", "open_ops").must(t, exitFailure)
	if !strings.Contains(r.stderr, "REVOKE CREATE ON SCHEMA open_ops FROM PUBLIC") || !strings.Contains(r.stderr, "nothing was migrated") ||
		strings.Contains(r.stderr, "modkit_outbox_reader") {
		t.Fatalf("migrate up of a schema PUBLIC may create in:\n%s", r.stderr)
	}
	noOutboxTables(t, f, "open_ops")
}

// TestMigrateSQLGoose applies the goose files with goose itself, then
// reverts them with goose.
func TestMigrateSQLGoose(t *testing.T) {
	f := newFixture(t)
	dir := t.TempDir()
	cli(t, f.dsn, "migrate", "sql", "--format", "goose", "--out", dir).must(t, exitOK)
	files, _ := filepath.Glob(filepath.Join(dir, "*.sql"))
	n := len(knownMigrations(t))
	if len(files) != n {
		t.Fatalf("goose files: %v", files)
	}
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB(t, inSchema(t, f, "viagoose")), os.DirFS(dir))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := p.Up(bg); err != nil || len(res) != n {
		t.Fatalf("goose up: %v %v", res, err)
	}
	sameSchema(t, f, "viagoose")
	if _, err := p.DownTo(bg, 0); err != nil {
		t.Fatalf("goose down: %v", err)
	}
	noOutboxTables(t, f, "viagoose")
}

// TestGooseStatementBlocks: a migration with a $$ body and semicolons
// inside it, as later migrations will have, goes through goose whole.
func TestGooseStatementBlocks(t *testing.T) {
	f := newFixture(t)
	ms, err := db.ReadMigrations(fstest.MapFS{
		"0001_fn.up.sql": {Data: []byte(`CREATE TABLE modkit_outbox_probe (n int);
CREATE FUNCTION modkit_outbox_probe_add(x int) RETURNS int LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO modkit_outbox_probe VALUES (x);
	RETURN x + 1;
END;
$$;
`)},
		"0001_fn.down.sql": {Data: []byte("DROP FUNCTION modkit_outbox_probe_add(int);\nDROP TABLE modkit_outbox_probe;\n")},
	})
	if err != nil {
		t.Fatal(err)
	}
	files, err := formatMigrations("goose", ms)
	if err != nil {
		t.Fatal(err)
	}
	probe := sqlDB(t, inSchema(t, f, "probe"))
	p, err := goose.NewProvider(goose.DialectPostgres, probe,
		fstest.MapFS{files[0].name: {Data: []byte(files[0].body)}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(bg); err != nil {
		t.Fatalf("goose up:\n%s\n%v", files[0].body, err)
	}
	var n int
	if err := probe.QueryRowContext(bg, "SELECT modkit_outbox_probe_add(41)").Scan(&n); err != nil || n != 42 {
		t.Fatalf("the function: %d %v", n, err)
	}
	if _, err := p.DownTo(bg, 0); err != nil {
		t.Fatal(err)
	}
}

// golang-migrate's file name rule (source/parse.go): VERSION_TITLE.up|down.EXT.
var golangMigrateName = regexp.MustCompile(`^([0-9]+)_(.*)\.(down|up)\.(.*)$`)

// TestMigrateSQLGolangMigrate checks the files against golang-migrate's
// naming and applies them the way it does: each file as one multi-statement
// exec, ups by ascending version, downs by descending. (golang-migrate
// itself is not served by the module proxy this project builds from.)
func TestMigrateSQLGolangMigrate(t *testing.T) {
	f := newFixture(t)
	dir := t.TempDir()
	cli(t, f.dsn, "migrate", "sql", "--format", "golang-migrate", "--out", dir).must(t, exitOK)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var ups, downs []string
	for _, e := range entries {
		m := golangMigrateName.FindStringSubmatch(e.Name())
		if m == nil || m[4] != "sql" {
			t.Fatalf("%s does not follow golang-migrate's naming", e.Name())
		}
		if m[3] == "up" {
			ups = append(ups, e.Name())
		} else {
			downs = append(downs, e.Name())
		}
	}
	if n := len(knownMigrations(t)); len(ups) != n || len(downs) != n {
		t.Fatalf("ups %v downs %v", ups, downs)
	}
	// golang-migrate itself, with its pgx v5 driver, applies the files
	// and reverts them.
	drv, err := migratepgx.WithInstance(sqlDB(t, inSchema(t, f, "viamigrate")), &migratepgx.Config{MigrationsTable: "schema_migrations"})
	if err != nil {
		t.Fatal(err)
	}
	src, err := iofs.New(os.DirFS(dir), ".")
	if err != nil {
		t.Fatal(err)
	}
	m, err := migrate.NewWithInstance("iofs", src, "pgx5", drv)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Up(); err != nil {
		t.Fatalf("golang-migrate up: %v", err)
	}
	if v, dirty, err := m.Version(); err != nil || dirty || int(v) != len(ups) {
		t.Fatalf("golang-migrate version %d (dirty %v, %v), want %d", v, dirty, err, len(ups))
	}
	sameSchema(t, f, "viamigrate")
	if err := m.Down(); err != nil {
		t.Fatalf("golang-migrate down: %v", err)
	}
	noOutboxTables(t, f, "viamigrate")
}

// TestMigrateSQLPlain runs the plain script as psql would, then checks
// that the migrator sees it as up to date.
func TestMigrateSQLPlain(t *testing.T) {
	f := newFixture(t)
	script := cli(t, f.dsn, "migrate", "sql").must(t, exitOK).stdout
	conn, err := pgx.ConnectConfig(bg, inSchema(t, f, "viaplain"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(bg, script); err != nil {
		t.Fatalf("plain script: %v\n%s", err, script)
	}
	sameSchema(t, f, "viaplain")
	out := cli(t, f.dsn, "migrate", "up", "--schema", "viaplain").must(t, exitOK).stdout
	if !strings.Contains(out, "up to date") {
		t.Fatalf("the migrator after the plain script:\n%s", out)
	}
	// Printing to stdout separates the files of the other formats.
	out = cli(t, f.dsn, "migrate", "sql", "--format", "goose").must(t, exitOK).stdout
	if strings.Count(out, "-- +goose Up\n") != len(knownMigrations(t)) || !strings.Contains(out, "-- ==== 0002_outbox_leaders.sql ====") {
		t.Fatalf("goose to stdout:\n%s", out)
	}
}

// A command on a schema without an outbox, while another schema holds
// one, names that schema instead of reading an empty outbox or advising
// migrate up, which made a second, empty outbox that every later command
// without --schema read (a user trial: its dead events looked gone).
// --schema may come before the command, and MODKIT_OUTBOX_SCHEMA gives
// its default.
func TestSchemaWithoutAnOutbox(t *testing.T) {
	f := newFixture(t) // its outbox is in public
	if _, err := f.pool.Exec(bg, "CREATE SCHEMA ops"); err != nil {
		t.Fatal(err)
	}
	f.enqueue(t, orders, 1)
	const refused = "schema ops holds no outbox; schema public holds one: pass --schema public (or set MODKIT_OUTBOX_SCHEMA=public)"
	for _, args := range [][]string{{"stats", "--schema", "ops"}, {"--schema", "ops", "stats"}, {"--schema=ops", "events", "list"}} {
		if r := cli(t, f.dsn, args...).must(t, exitFailure); !strings.Contains(r.stderr, refused) || strings.Contains(r.stderr, "migrate up") {
			t.Fatalf("%v:\n%s", args, r.stderr)
		}
	}
	env := map[string]string{"DATABASE_URL": f.dsn, "MODKIT_OUTBOX_SCHEMA": "ops"}
	if r := cliEnv(t, env, "stats").must(t, exitFailure); !strings.Contains(r.stderr, refused) {
		t.Fatalf("stats with MODKIT_OUTBOX_SCHEMA=ops:\n%s", r.stderr)
	}
	if r := cliEnv(t, env, "stats", "--schema", "public").must(t, exitOK); !strings.Contains(r.stdout, "order_paid") {
		t.Fatalf("stats --schema public over MODKIT_OUTBOX_SCHEMA=ops:\n%s", r.stdout)
	}
	if r := cli(t, f.dsn, "--bogus", "stats").must(t, exitUsage); !strings.Contains(r.stderr, "only --database-url, --schema and --connect-timeout") {
		t.Fatalf("an unknown flag before the command:\n%s", r.stderr)
	}
	if r := cli(t, f.dsn, "--schema", "ops", "stats", "--schema", "public").must(t, exitOK); !strings.Contains(r.stdout, "order_paid") {
		t.Fatalf("--schema before the command and again after it: the one after should win:\n%s%s", r.stdout, r.stderr)
	}
	if r := cli(t, f.dsn, "--schema", "ops", "help", "stats").must(t, exitOK); !strings.Contains(r.stdout, "modkit-outbox stats") {
		t.Fatalf("help after a leading flag:\n%s%s", r.stdout, r.stderr)
	}

	// migrate status says where the outbox is. migrate up on public by
	// default (with the outbox elsewhere) asks first; on a schema named on
	// purpose, by --schema or MODKIT_OUTBOX_SCHEMA, it does as asked.
	if r := cli(t, f.dsn, "migrate", "status", "--schema", "ops").must(t, exitOK); !strings.Contains(r.stderr, "schema public holds one: pass --schema public") {
		t.Fatalf("migrate status --schema ops:\n%s", r.stderr)
	}
	if _, err := f.pool.Exec(bg, "ALTER SCHEMA public RENAME TO shop; CREATE SCHEMA public"); err != nil {
		t.Fatal(err)
	}
	if r := cli(t, f.dsn, "migrate", "up").must(t, exitAborted); !strings.Contains(r.stderr,
		"Schema public (the default) holds no outbox, but schema shop holds one (pass --schema shop to migrate that one). Create a second outbox in schema public?") {
		t.Fatalf("migrate up on public by default, the outbox in shop:\n%s", r.stderr)
	}
	var made bool
	if err := f.pool.QueryRow(bg, "SELECT to_regclass('public.modkit_schema_migrations') IS NOT NULL").Scan(&made); err != nil || made {
		t.Fatalf("migrate up refused, yet the schema has a migrations table (%v, %v)", made, err)
	}
	if _, err := f.pool.Exec(bg, "DROP SCHEMA public; ALTER SCHEMA shop RENAME TO public"); err != nil {
		t.Fatal(err)
	}
	cliEnv(t, env, "migrate", "up").must(t, exitOK)
	if r := cliEnv(t, env, "stats").must(t, exitOK); strings.Contains(r.stdout, "order_paid") {
		t.Fatalf("stats of the new, empty outbox in ops shows public's events:\n%s", r.stdout)
	}

	// With no outbox in any schema, the command says to migrate.
	if _, err := f.pool.Exec(bg, `DROP SCHEMA ops CASCADE; CREATE SCHEMA ops;
		ALTER TABLE public.modkit_outbox_events RENAME TO modkit_outbox_events_elsewhere`); err != nil {
		t.Fatal(err)
	}
	if r := cli(t, f.dsn, "stats", "--schema", "ops").must(t, exitFailure); !strings.Contains(r.stderr, "modkit-outbox migrate up (with the same --schema)") {
		t.Fatalf("stats with no outbox in any schema:\n%s", r.stderr)
	}
}
