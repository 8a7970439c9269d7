package pgtest

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { Main(m) }

// replaceDatabase points every form of DSN at the tests' database, even one
// whose query names a database (which would win over the URL's path: the
// tests then ran in, and migrated, the server's own database).
func TestReplaceDatabase(t *testing.T) {
	for _, dsn := range []string{
		"postgres://u@localhost:5432/app",
		"postgres://u@/?host=/var/run/postgresql&dbname=app",
		"postgresql://u@localhost/app?database=app&sslmode=disable",
		"host=localhost user=u dbname=app",
	} {
		got, err := replaceDatabase(dsn, "modkit_test_1")
		if err != nil {
			t.Errorf("%s: %v", dsn, err)
			continue
		}
		if cfg, err := pgx.ParseConfig(got); err != nil || cfg.Database != "modkit_test_1" {
			t.Errorf("%s became %s, which names database %q (%v)", dsn, got, cfg.Database, err)
		}
	}
}

// Test databases left by a binary that did not finish (a panic, a timeout)
// are dropped by a later binary once staleAfter old, by the time in their
// names. Younger ones (another binary's, running now), ones that are not
// test databases and ones somebody is connected to are left alone.
func TestDropStale(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	old, young := now.Add(-staleAfter-time.Minute).Unix(), now.Add(-time.Hour).Unix()
	names := map[string]bool{ // name: dropped
		fmt.Sprintf("modkit_test_%d_41_beef_tmpl", old):      true,
		fmt.Sprintf("modkit_test_%d_41_beef_7", old):         true,
		fmt.Sprintf("modkit_test_%d_42_beef_connected", old): false, // not a test database's name
		fmt.Sprintf("modkit_test_%d_43_beef_1", old):         false, // connected to (below)
		fmt.Sprintf("modkit_test_%d_44_beef_1", young):       false,
		"modkit_test_notes":                                  false,
	}
	for name := range names {
		if err := adminExec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = dropDatabase(ctx, name) })
	}
	dsn, err := replaceDatabase(adminDSN, fmt.Sprintf("modkit_test_%d_43_beef_1", old))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	dropped, err := dropStale(ctx, now)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range names {
		var exists bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
			t.Fatal(err)
		}
		// Another test binary starting on a shared server may have dropped
		// the stale ones first: what counts is that they are gone, and
		// that the others are left by everyone.
		switch {
		case want && exists:
			t.Errorf("%s: still there after dropStale", name)
		case !want && (!exists || slices.Contains(dropped, name)):
			t.Errorf("%s: dropped (exists %v, by this call %v), want it left", name, exists, slices.Contains(dropped, name))
		}
	}
	// This binary's own databases are young.
	if slices.ContainsFunc(dropped, func(n string) bool { return len(n) > len(prefix) && n[:len(prefix)] == prefix }) {
		t.Errorf("dropStale dropped this binary's databases: %v", dropped)
	}
}
