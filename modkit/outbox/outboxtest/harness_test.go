package outboxtest_test

import (
	"context"
	"log"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// records is a slog.Handler, enabled at every level, that keeps the
// messages logged at each level.
type records struct {
	mu     sync.Mutex
	byLvl  map[slog.Level][]string
	parent *records // a WithAttrs or WithGroup handler records into its parent
}

func newRecords() *records { return &records{byLvl: map[slog.Level][]string{}} }

func (r *records) root() *records {
	if r.parent != nil {
		return r.parent.root()
	}
	return r
}
func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) WithAttrs([]slog.Attr) slog.Handler       { return &records{parent: r.root()} }
func (r *records) WithGroup(string) slog.Handler            { return &records{parent: r.root()} }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	root := r.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	root.byLvl[rec.Level] = append(root.byLvl[rec.Level], rec.Message)
	return nil
}

// migrations counts the per-migration records ("migration applied") at
// level.
func (r *records) migrations(level slog.Level) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, msg := range r.byLvl[level] {
		if strings.HasPrefix(msg, "migration ") {
			n++
		}
	}
	return n
}

// NewDB and NewClient log no line per migration at Info, with the default
// logger as with one of the test's: a schema of its own gets some forty
// migrations, and go test -v showed a line for each. They are logged at
// Debug instead.
func TestNewClientMigratesQuietly(t *testing.T) {
	// Default options: the migration logs to slog.Default().
	def := newRecords()
	prev, prevOut, prevFlags := slog.Default(), log.Writer(), log.Flags()
	slog.SetDefault(slog.New(def))
	outboxtest.NewDB(t)
	outboxtest.NewClient(t, outbox.Config{Schema: "shop"})
	// slog.SetDefault sends the log package's output to the handler, and
	// setting the old default back does not undo that.
	slog.SetDefault(prev)
	log.SetOutput(prevOut)
	log.SetFlags(prevFlags)
	if n := def.migrations(slog.LevelInfo); n != 0 {
		t.Errorf("NewDB and NewClient with the default logger logged %d migration(s) at Info", n)
	}
	if n := def.migrations(slog.LevelDebug); n == 0 {
		t.Error("NewClient's migration of a schema of its own logged nothing at Debug: the migrations are not logged at all")
	}

	// The test's logger.
	own := newRecords()
	c, _ := outboxtest.NewClient(t, outbox.Config{Schema: "shop", Logger: slog.New(own)})
	if n := own.migrations(slog.LevelInfo); n != 0 || own.migrations(slog.LevelDebug) == 0 {
		t.Errorf("NewClient with the test's logger logged %d migration(s) at Info and %d at Debug; want none at Info",
			n, own.migrations(slog.LevelDebug))
	}
	if got := c.Config().Logger.Handler(); got != slog.Handler(own) {
		t.Errorf("the Client's logger has handler %T, want the one of its Config", got)
	}
}

// A per-test leak check as the README shows it, registered before
// NewClient so that it runs after the database's cleanup, passes whether
// the server is a throwaway one or TEST_DATABASE_URL's, with a dispatcher
// run and stopped in the test.
func TestPerTestLeakCheckAsTheREADMEShows(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	enqueue(t, c, tdb.Provider.Pool, placed, `{"id":"o-1"}`)
	if got := outboxtest.Drain(t, c, outboxtest.NewRecorder().Publisher(placed)); len(got) != 1 {
		t.Fatalf("drained %d, want 1", len(got))
	}
}
