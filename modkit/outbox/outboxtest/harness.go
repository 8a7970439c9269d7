package outboxtest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"testing"

	"go.uber.org/goleak"

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
// goroutines leaked (go.uber.org/goleak). A binary that panics, times
// out or is killed (SIGKILL, or Ctrl-C, which go test passes on as
// SIGINT) leaves its databases on a server of TEST_DATABASE_URL or
// DATABASE_URL, where the first test binary that starts on that server a
// day later drops them (those nobody is connected to), and leaves a
// throwaway server's directory under the temporary directory, which the
// next binary to start one removes (the server itself exits with it). Call it from TestMain;
// it calls os.Exit:
//
//	func TestMain(m *testing.M) { outboxtest.Main(m) }
func Main(m *testing.M) { pgtest.Main(m) }

// MainOptions adjust MainWith.
type MainOptions struct {
	// IgnoreGoroutines are goleak options for goroutines the test binary
	// leaves running on purpose, which Main's leak check would report: a
	// dependency's background worker, say
	// (goleak.IgnoreTopFunction("example.com/dep.(*Client).loop")).
	IgnoreGoroutines []goleak.Option
}

// MainWith is Main with opts. Call it from TestMain; it calls os.Exit.
func MainWith(m *testing.M, opts MainOptions) { pgtest.MainIgnoring(m, opts.IgnoreGoroutines...) }

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
// cfg, its schema migrated (cfg.Schema, public by default). The migration
// logs to cfg.Logger (slog.Default() when nil) at Debug what it would log
// at Info: a line per migration applied, some forty for a schema other
// than public (NewDB's database holds the outbox migrated in public). Its
// warnings and errors keep their level. The Client logs as cfg says.
func NewClient(t TB, cfg outbox.Config) (*outbox.Client, *DB) {
	t.Helper()
	d := NewDB(t)
	c, err := outbox.New(outboxpg.New(d.Provider.Pool), cfg)
	if err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	// A client of its own for the migration, with the quieter log.
	mcfg := cfg
	mcfg.Logger = slog.New(infoAsDebug{cmp.Or(cfg.Logger, slog.Default()).Handler()})
	m, err := outbox.New(outboxpg.New(d.Provider.Pool), mcfg)
	if err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	if err := m.Migrate(context.Background()); err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	return c, d
}

// infoAsDebug hands its handler the records at Info level (up to, not
// including, Warn) as Debug records, and the others as they are: a test's
// setup says what it did at Debug, what went wrong at Warn and above.
type infoAsDebug struct{ slog.Handler }

func lowered(l slog.Level) slog.Level {
	if l >= slog.LevelInfo && l < slog.LevelWarn {
		return slog.LevelDebug
	}
	return l
}

// Enabled implements slog.Handler.
func (h infoAsDebug) Enabled(ctx context.Context, l slog.Level) bool {
	return h.Handler.Enabled(ctx, lowered(l))
}

// Handle implements slog.Handler.
func (h infoAsDebug) Handle(ctx context.Context, r slog.Record) error {
	r.Level = lowered(r.Level)
	return h.Handler.Handle(ctx, r)
}

// WithAttrs implements slog.Handler.
func (h infoAsDebug) WithAttrs(attrs []slog.Attr) slog.Handler {
	return infoAsDebug{h.Handler.WithAttrs(attrs)}
}

// WithGroup implements slog.Handler.
func (h infoAsDebug) WithGroup(name string) slog.Handler {
	return infoAsDebug{h.Handler.WithGroup(name)}
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
		if e.OrderingKey != "" {
			s += fmt.Sprintf(" ordering_key=%q seq=%d", e.OrderingKey, e.Sequence)
		}
		if len(e.Headers) > 0 {
			names := slices.Sorted(maps.Keys(e.Headers))
			s += " headers={"
			for i, n := range names {
				if i > 0 {
					s += ", "
				}
				s += fmt.Sprintf("%s: %q", n, e.Headers[n])
			}
			s += "}"
		}
	}
	return s
}
