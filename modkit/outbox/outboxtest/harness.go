package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// TB is the part of testing.TB the helpers use; *testing.T and *testing.B
// satisfy it.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Logf(format string, args ...any)
	Cleanup(func())
}

// Main sets up the PostgreSQL server for the test binary, runs the tests,
// drops what it created and, when every test passed, fails the binary if
// goroutines leaked (go.uber.org/goleak). A binary that panics or times
// out leaves its databases on a server of TEST_DATABASE_URL or
// DATABASE_URL; the first test binary that starts on that server a day
// later drops them (those nobody is connected to). Call it from TestMain;
// it calls os.Exit:
//
//	func TestMain(m *testing.M) { outboxtest.Main(m) }
func Main(m *testing.M) { pgtest.Main(m) }

// DB is one test's database, with the outbox's migrations applied in the
// public schema.
type DB struct {
	// Name of the database.
	Name string
	// DSN connects to it (for db.Config, or a second pool).
	DSN string
	// Provider is open on it (pgx pool, database/sql and bun) and closed
	// when the test ends.
	Provider *db.Provider
}

// NewDB creates a database for t, dropped when t ends. It needs Main in
// TestMain.
func NewDB(t TB) *DB {
	t.Helper()
	d, err := pgtest.Open()
	if errors.Is(err, pgtest.ErrNoMain) {
		t.Fatalf("outboxtest: NewDB needs outboxtest.Main: add func TestMain(m *testing.M) { outboxtest.Main(m) } to the package's tests")
	}
	if err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Logf("outboxtest: %v", err)
		}
	})
	return &DB{Name: d.Name, DSN: d.DSN, Provider: d.Provider}
}

// NewClient creates a database for t (see NewDB) and a Client on it with
// cfg, its schema migrated (cfg.Schema, public by default).
func NewClient(t TB, cfg outbox.Config) (*outbox.Client, *DB) {
	t.Helper()
	d := NewDB(t)
	c, err := outbox.New(outboxpg.New(d.Provider.Pool), cfg)
	if err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	if err := c.Migrate(context.Background()); err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	return c, d
}

func fatal(t TB, format string, args ...any) {
	t.Helper()
	t.Fatalf("outboxtest: "+format, args...)
}

func describe(ms []Matcher) string {
	if len(ms) == 0 {
		return ""
	}
	s := " matching"
	for i, m := range ms {
		if i > 0 {
			s += " and"
		}
		s += " " + m.desc
	}
	return s
}

// summary shows a few events for a failure message.
func summary(events []outbox.Event) string {
	const most = 10
	s := ""
	for i, e := range events {
		if i == most {
			s += fmt.Sprintf("\n\t… and %d more", len(events)-most)
			break
		}
		s += fmt.Sprintf("\n\t%s %s", e.ID, e.Payload)
		if e.DedupeKey != nil {
			s += fmt.Sprintf(" dedupe_key=%q", *e.DedupeKey)
		}
		if e.TenantID != nil {
			s += " tenant=" + e.TenantID.String()
		}
	}
	return s
}
