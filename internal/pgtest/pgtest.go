// Package pgtest gives every test its own freshly migrated PostgreSQL
// database on a real server.
//
// The server is the one in TEST_DATABASE_URL or DATABASE_URL when either is
// set (the role needs CREATEDB, and CREATEROLE for the tests that create
// login roles); otherwise a throwaway cluster is started from
// the local server binaries for the test binary's lifetime (see
// internal/pgserver). Each test database is a copy of a template database
// migrated once per test binary, so a new database costs one CREATE DATABASE.
// Test databases are dropped when their test ends and the template when the
// binary exits, so an external server is left as it was found. A binary
// that does not get that far (a panic, go test's timeout, a kill) leaves
// its databases behind; their names carry their creation time, and the
// first test binary to use the server after staleAfter drops them.
//
// Use it from TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// and in a test:
//
//	tdb := pgtest.NewDB(t)
//	tdb.Provider.Pool.Exec(ctx, "...")
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/modkit-go/modkit/internal/pgserver"
	"github.com/modkit-go/modkit/modkit/db"
)

var (
	adminDSN string            // a DSN for the server's maintenance database
	cluster  *pgserver.Cluster // nil when an external server is used
	prefix   string            // names of this binary's databases start with it

	templateOnce sync.Once
	templateName string
	templateErr  error
	dbCounter    atomic.Int64
)

// Main sets the server up, runs the tests, removes what it created and checks
// for leaked goroutines. It calls os.Exit.
func Main(m *testing.M) {
	os.Exit(run(m))
}

// MainIgnoring is Main whose leak check also ignores the goroutines that
// ignore matches (goleak.IgnoreTopFunction, say).
func MainIgnoring(m *testing.M, ignore ...goleak.Option) {
	os.Exit(run(m, ignore...))
}

func run(m *testing.M, ignore ...goleak.Option) int {
	// Goroutines that run before the tests (started by a dependency's init,
	// say) are not the tests' leaks.
	before := append([]goleak.Option{goleak.IgnoreCurrent()}, ignore...)
	if err := setup(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	code := m.Run()
	teardown()
	if code == 0 {
		if err := goleak.Find(before...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: leaked goroutines after all tests passed:\n%v\n", err)
			return 1
		}
	}
	return code
}

// ServerURL returns the DSN a test binary uses, from TEST_DATABASE_URL or
// DATABASE_URL, or "" when a throwaway cluster is to be started.
func ServerURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return os.Getenv("DATABASE_URL")
}

func setup() error {
	prefix = fmt.Sprintf("modkit_test_%d_%d_%04x", time.Now().Unix(), os.Getpid(), rand.IntN(1<<16))
	if u := ServerURL(); u != "" {
		adminDSN = u
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = dropStale(ctx, time.Now())
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgserver.Start(ctx, pgserver.Options{})
	if err != nil {
		return fmt.Errorf("pgtest: no TEST_DATABASE_URL/DATABASE_URL set, and starting a throwaway PostgreSQL failed: %w", err)
	}
	cluster, adminDSN = c, c.DSN("postgres")
	return nil
}

func teardown() {
	if cluster != nil {
		_ = cluster.Stop()
		return
	}
	if templateName != "" {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = dropDatabase(ctx, templateName)
	}
}

// Cluster returns the throwaway cluster, or nil when the tests run against an
// external server. Tests that restart the server skip themselves when nil.
func Cluster() *pgserver.Cluster { return cluster }

// DB is one test's database.
type DB struct {
	// Name of the database.
	Name string
	// DSN connects to it.
	DSN string
	// Provider is open on it (pgx pool, database/sql and bun) and closed when
	// the test ends.
	Provider *db.Provider
}

// NewDB creates a migrated database for t and drops it when t ends.
func NewDB(t testing.TB) *DB {
	t.Helper()
	d, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	return d
}

// ErrNoMain is Open's error when Main did not run: the test binary's
// TestMain must call it.
var ErrNoMain = errors.New("pgtest: call pgtest.Main(m) from TestMain")

// Open creates a migrated database outside a test (for Example functions);
// Close drops it. Tests use NewDB.
func Open() (*DB, error) {
	if adminDSN == "" {
		return nil, ErrNoMain
	}
	ctx := context.Background()
	templateOnce.Do(func() { templateErr = createTemplate(ctx) })
	if templateErr != nil {
		return nil, fmt.Errorf("pgtest: template database: %w", templateErr)
	}
	name := fmt.Sprintf("%s_%d", prefix, dbCounter.Add(1))
	dsn, err := replaceDatabase(adminDSN, name)
	if err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	if err := adminExec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE "+pgx.Identifier{templateName}.Sanitize()); err != nil {
		return nil, fmt.Errorf("pgtest: create database: %w", err)
	}
	d := &DB{Name: name, DSN: dsn}
	if d.Provider, err = db.Open(ctx, db.Config{DSN: d.DSN}); err != nil {
		_ = dropDatabase(ctx, name)
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	return d, nil
}

// Close closes the database's provider and drops the database.
func (d *DB) Close() error {
	d.Provider.Close()
	if err := dropDatabase(context.Background(), d.Name); err != nil {
		return fmt.Errorf("pgtest: drop database %s: %w", d.Name, err)
	}
	return nil
}

// LoginAs creates a login role that is a member of group (an outbox role;
// "" for none), and returns a pool connected as it to the test's database.
// The role is dropped when the test ends.
func (d *DB) LoginAs(t testing.TB, group string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	name := "login_" + strings.TrimPrefix(group, "modkit_outbox_") + "_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	password := uuid.NewString()
	create := fmt.Sprintf("CREATE ROLE %s LOGIN PASSWORD '%s'", pgx.Identifier{name}.Sanitize(), password)
	if group != "" {
		create += " IN ROLE " + pgx.Identifier{group}.Sanitize()
	}
	if _, err := d.Provider.Pool.Exec(ctx, create); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(d.DSN)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg.ConnConfig.User, cfg.ConnConfig.Password = name, password
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		if _, err := d.Provider.Pool.Exec(ctx, "DROP ROLE "+pgx.Identifier{name}.Sanitize()); err != nil {
			t.Errorf("pgtest: drop role %s: %v", name, err)
		}
	})
	return pool
}

// NewPool opens another pool on the test's database (a second "replica"),
// closed when the test ends.
func (d *DB) NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), d.DSN)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func createTemplate(ctx context.Context) error {
	name := prefix + "_tmpl"
	if err := adminExec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return err
	}
	templateName = name
	dsn, err := replaceDatabase(adminDSN, name)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	// As PostgreSQL 15 does: on 14 and earlier every role may create
	// objects in public, and the outbox refuses such a schema (migration
	// 0028). The template is this binary's own.
	if _, err := pool.Exec(ctx, "REVOKE CREATE ON SCHEMA public FROM PUBLIC"); err != nil {
		return err
	}
	m, err := db.NewMigrator(pool, db.MigratorConfig{Logger: discardLogger()})
	if err != nil {
		return err
	}
	_, err = m.Up(ctx)
	return err
}

func adminExec(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", redact(adminDSN), err)
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// staleAfter is how old a test database is when the next test binary
// takes it for one that an earlier binary left behind: far longer than
// any test binary runs.
const staleAfter = 24 * time.Hour

// staleName matches the names of the test databases (the prefix, then _tmpl
// or a counter) and captures their creation time, in Unix seconds.
var staleName = regexp.MustCompile(`^modkit_test_([0-9]{10})_[0-9]+_[0-9a-f]{4}_(tmpl|[0-9]+)$`)

// dropStale drops the test databases created more than staleAfter before
// now, and returns their names. Databases it may not drop (another role's,
// one somebody is connected to) are left alone.
func dropStale(ctx context.Context, now time.Time) ([]string, error) {
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT datname FROM pg_catalog.pg_database WHERE datname LIKE 'modkit\_test\_%'`)
	if err != nil {
		return nil, err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	var dropped []string
	for _, name := range names {
		m := staleName.FindStringSubmatch(name)
		if m == nil {
			continue
		}
		created, err := strconv.ParseInt(m[1], 10, 64)
		if err != nil || now.Sub(time.Unix(created, 0)) < staleAfter {
			continue
		}
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()); err == nil {
			dropped = append(dropped, name)
		}
	}
	return dropped, nil
}

func dropDatabase(ctx context.Context, name string) error {
	return adminExec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

// replaceDatabase points a DSN (URL or key=value form) at another database
// on the same server.
func replaceDatabase(dsn, name string) (string, error) {
	if _, err := pgx.ParseConfig(dsn); err != nil {
		return "", fmt.Errorf("parse %s: %w", redact(dsn), err)
	}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("parse %s: %w", redact(dsn), err)
		}
		u.Path = "/" + name
		// A dbname (or database) parameter would win over the path, and
		// the tests would run in, and migrate, the server's own database.
		q := u.Query()
		q.Del("dbname")
		q.Del("database")
		u.RawQuery = q.Encode()
		dsn = u.String()
	} else {
		// key=value form: a later dbname overrides an earlier one.
		dsn += " dbname=" + name
	}
	if cfg, err := pgx.ParseConfig(dsn); err != nil || cfg.Database != name {
		return "", fmt.Errorf("cannot point %s at a database of the tests' own (%s); give TEST_DATABASE_URL as a URL or key=value string without parameters that name a database", redact(dsn), name)
	}
	return dsn, nil
}

func redact(dsn string) string {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return "(unparsable DSN)"
	}
	return fmt.Sprintf("postgres://%s@%s:%d/%s", cfg.User, cfg.Host, cfg.Port, cfg.Database)
}
