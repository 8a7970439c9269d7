package outboxtest_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// Drain delivers every event of its publishers' topics, retries included,
// returns the successful publishes and leaves other topics alone.
func TestDrain(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	for _, id := range []string{"o-1", "o-2", "o-3"} {
		enqueue(t, c, pool, placed, `{"id":"`+id+`"}`)
	}
	enqueue(t, c, pool, shipped, `{"id":"o-1"}`)
	rec := outboxtest.NewRecorder()
	var flaky uuid.UUID
	rec.Fail = func(d outbox.Delivery) error {
		if string(d.Payload) == `{"id": "o-2"}` && d.Attempt == 1 {
			flaky = d.ID
			return errors.New("broker busy")
		}
		return nil
	}
	published := outboxtest.Drain(t, c, rec.Publisher(placed))
	if len(published) != 3 {
		t.Fatalf("published %d events, want 3: %+v", len(published), published)
	}
	calls := rec.Deliveries()
	if len(calls) != 4 {
		t.Fatalf("recorded %d publish calls, want 4 (one retry)", len(calls))
	}
	if i := slices.IndexFunc(published, func(d outbox.Delivery) bool { return d.ID == flaky }); i < 0 || published[i].Attempt != 2 {
		t.Fatalf("the retried event: %+v", published)
	}
	for _, e := range outboxtest.RequireEnqueued(t, c, placed) {
		if e.Status != outbox.StatusDelivered {
			t.Errorf("event %s is %s after Drain", e.ID, e.Status)
		}
	}
	if e := outboxtest.RequireEnqueued(t, c, shipped); e[0].Status != outbox.StatusPending {
		t.Fatalf("another topic's event was touched: %+v", e[0])
	}
	// Nothing left: Drain returns at once with nothing.
	if again := outboxtest.Drain(t, c, rec.Publisher(placed)); len(again) != 0 {
		t.Fatalf("second drain published %+v", again)
	}
}

// Drain serves transactional handlers too, and a Recorder can be waited on
// while a dispatcher of one's own runs.
func TestDrainHandleTxAndRecorderWait(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE shipments (order_id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	enqueue(t, c, pool, shipped, `{"id":"o-1"}`)
	published := outboxtest.Drain(t, c, outbox.Publisher{Topic: shipped,
		HandleTx: func(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
			_, err := tx.Exec(ctx, `INSERT INTO shipments (order_id) VALUES ($1::jsonb->>'id')`, string(d.Payload))
			return err
		}})
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM shipments WHERE order_id = 'o-1'`).Scan(&n); err != nil || n != 1 || len(published) != 1 {
		t.Fatalf("handled %d shipments (%v), published %d", n, err, len(published))
	}

	rec := outboxtest.NewRecorder()
	d, err := c.NewDispatcher(outbox.DispatcherConfig{}, rec.Publisher(placed))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Stop(ctx) })
	enqueue(t, c, pool, placed, `{"id":"o-2"}`)
	if got := rec.Wait(t, 1); string(got[0].Payload) != `{"id": "o-2"}` {
		t.Fatalf("recorded %+v", got)
	}
}

// Drain sees events settled by another dispatcher (the module's own, in an
// fx test), not only by its own: it looks again every so often, not only
// after its own outcomes. The other dispatcher is let go only once Drain
// has looked and found the event undelivered (its first Backlog read has
// returned), so Drain's own dispatcher records no outcome after that: it
// only waited for those, and timed out.
func TestDrainSeesOthersDeliver(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	enqueue(t, c, tdb.Provider.Pool, placed, `{"id":"o-1"}`)
	entered, release := make(chan struct{}), make(chan struct{})
	other, err := c.NewDispatcher(outbox.DispatcherConfig{}, outbox.Publisher{Topic: placed,
		Publish: func(ctx context.Context, d outbox.Delivery) error {
			close(entered)
			<-release
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Stop(ctx) })
	<-entered // leased to the other dispatcher: Drain's cannot claim it

	// Drain's client, whose Backlog reads (Drain's looks) are reported.
	looked := make(chan struct{}, 1)
	watched, err := outbox.New(backlogWatcher{Driver: outboxpg.New(tdb.Provider.Pool), looked: looked}, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var got []outbox.Delivery
	f, done := &failT{T: t}, make(chan struct{})
	go func() {
		defer close(done)
		got = outboxtest.Drain(f, watched, outboxtest.NewRecorder().Publisher(placed))
	}()
	select {
	case <-looked:
	case <-done:
		t.Fatalf("Drain ended (%q) before looking at the backlog", f.failure)
	}
	close(release)
	<-done
	if f.failure != "" || len(got) != 0 {
		t.Fatalf("Drain: %q, %+v; want nothing published by its own dispatcher (the other one had the event)", f.failure, got)
	}
	if e := outboxtest.RequireEnqueued(t, c, placed); e[0].Status != outbox.StatusDelivered {
		t.Fatalf("after Drain: %+v", e[0])
	}
}

// backlogWatcher is the PostgreSQL driver whose store reports each Backlog
// read on looked, once it has returned (dropped when looked is full).
type backlogWatcher struct {
	driver.Driver
	looked chan struct{}
}

func (w backlogWatcher) Open(opts driver.Options) (driver.Store, error) {
	st, err := w.Driver.Open(opts)
	if err != nil {
		return nil, err
	}
	return watchedStore{Store: st, looked: w.looked}, nil
}

type watchedStore struct {
	driver.Store
	looked chan struct{}
}

func (s watchedStore) Backlog(ctx context.Context) ([]driver.StatsRow, error) {
	rows, err := s.Store.Backlog(ctx)
	select {
	case s.looked <- struct{}{}:
	default:
	}
	return rows, err
}

// A Drain whose dispatcher cannot become ready (its claims wait on a lock
// here; a database that refuses them is alike) fails the test within
// WaitTimeout, saying so: it waited for the first claim without a bound,
// and hung the test binary until go test's timeout. (A serial test: it
// changes WaitTimeout, which parallel tests read only after it ends.)
func TestDrainBoundsItsStart(t *testing.T) {
	saved := outboxtest.WaitTimeout
	outboxtest.WaitTimeout = time.Second
	defer func() { outboxtest.WaitTimeout = saved }()
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	enqueue(t, c, tdb.Provider.Pool, placed, `{"id":"o-1"}`)
	lock, err := tdb.Provider.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx)
	if _, err := lock.Exec(ctx, "LOCK TABLE modkit_outbox_events IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	failed := make(chan string, 1)
	go func() {
		failed <- failure(t, func(tb outboxtest.TB) { outboxtest.Drain(tb, c, outboxtest.NewRecorder().Publisher(placed)) })
	}()
	select {
	case msg := <-failed:
		if !strings.Contains(msg, "start the dispatcher") {
			t.Fatalf("Drain failed with %q; want it to say its dispatcher did not start", msg)
		}
	case <-time.After(2 * time.Minute): // a hang, not a timing
		t.Fatal("Drain still waiting for its dispatcher two minutes into a WaitTimeout of one second")
	}
}

// A Drain that times out because a dead event holds back its ordering key
// says so, naming the key and the dead event: it listed the waiting events
// as pending with no error, which did not say why they waited. (A serial
// test: it changes WaitTimeout.)
func TestDrainNamesABlockedKey(t *testing.T) {
	saved := outboxtest.WaitTimeout
	outboxtest.WaitTimeout = time.Second
	defer func() { outboxtest.WaitTimeout = saved }()
	c, rec := keyWithADeadHead(t, 2)
	msg := failure(t, func(tb outboxtest.TB) { outboxtest.Drain(tb, c, rec.Publisher(placed)) })
	for _, want := range []string{`(event 2 of ordering key "acct-1"), pending`, `ordering key "acct-1" of ` + placed.String() +
		`: its 1 later event(s) wait behind the dead event`, "the ledger refused it"} {
		if !strings.Contains(msg, want) {
			t.Errorf("Drain's failure does not say %q:\n%s", want, msg)
		}
	}
}

// Drain gives an event three attempts; DrainWith the app's number, and
// the app's retry policy.
func TestDrainWithTheAppsRetries(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueue(t, c, pool, placed, `{"id":"o-1"}`)
	enqueue(t, c, pool, shipped, `{"id":"o-1"}`)
	rec := outboxtest.NewRecorder()
	rec.Fail = func(outbox.Delivery) error { return errors.New("the endpoint is down") }
	attempts := func(topic outbox.Topic) int {
		t.Helper()
		n := 0
		for _, d := range rec.Deliveries() {
			if d.Topic == topic.Topic {
				n++
			}
		}
		return n
	}

	if got := outboxtest.Drain(t, c, rec.Publisher(shipped)); len(got) != 0 || attempts(shipped) != 3 {
		t.Fatalf("Drain: published %+v after %d attempts; want nothing after 3", got, attempts(shipped))
	}
	if got := outboxtest.DrainWith(t, c, outboxtest.DrainOptions{MaxAttempts: 5}, rec.Publisher(placed)); len(got) != 0 || attempts(placed) != 5 {
		t.Fatalf("DrainWith MaxAttempts 5: published %+v after %d attempts; want nothing after 5", got, attempts(placed))
	}
	for topic, n := range map[outbox.Topic]int{shipped: 3, placed: 5} {
		if e := outboxtest.RequireEnqueued(t, c, topic); e[0].Status != outbox.StatusDead || e[0].Attempts != n {
			t.Errorf("%s after the drain: %s after %d attempts, want dead after %d", topic, e[0].Status, e[0].Attempts, n)
		}
	}

	if msg := failure(t, func(tb outboxtest.TB) {
		outboxtest.DrainWith(tb, c, outboxtest.DrainOptions{MaxAttempts: -1}, rec.Publisher(placed))
	}); !strings.Contains(msg, "DrainOptions.MaxAttempts is -1") {
		t.Fatalf("DrainWith MaxAttempts -1 failed with %q", msg)
	}
}

// DrainWith's retry policy is the dispatcher's: after a failure, the event
// waits the policy's backoff (here an hour, from which the drain cannot
// come back: it fails at WaitTimeout, the event pending). (A serial test:
// it changes WaitTimeout.)
func TestDrainWithTheAppsRetryPolicy(t *testing.T) {
	saved := outboxtest.WaitTimeout
	outboxtest.WaitTimeout = time.Second
	defer func() { outboxtest.WaitTimeout = saved }()
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	enqueue(t, c, tdb.Provider.Pool, placed, `{"id":"o-1"}`)
	rec := outboxtest.NewRecorder()
	rec.Fail = func(outbox.Delivery) error { return errors.New("the endpoint is down") }
	msg := failure(t, func(tb outboxtest.TB) {
		outboxtest.DrainWith(tb, c, outboxtest.DrainOptions{MaxAttempts: 2, Retry: outbox.RetryPolicy{BaseDelay: time.Hour, MaxDelay: time.Hour}},
			rec.Publisher(placed))
	})
	if !strings.Contains(msg, "still pending or processing") {
		t.Fatalf("DrainWith an hour's backoff failed with %q; want it to say the event is still pending", msg)
	}
	e := outboxtest.RequireEnqueued(t, c, placed)[0]
	if wait := e.NextAttemptAt.Sub(e.UpdatedAt); e.Status != outbox.StatusPending || e.Attempts != 1 || wait < 30*time.Minute {
		t.Fatalf("after one failure: %s, %d attempt(s), next attempt %v after it; want pending, 1, at least half an hour (an hour, jittered)",
			e.Status, e.Attempts, wait)
	}
}

// logT stands in for a *testing.T and keeps what is logged through it.
type logT struct {
	*testing.T
	mu   sync.Mutex
	logs []string
}

func (l *logT) Logf(format string, args ...any) {
	l.mu.Lock()
	l.logs = append(l.logs, fmt.Sprintf(format, args...))
	l.mu.Unlock()
	l.T.Logf(format, args...)
}

// Drain puts each event it dead-letters, with its error, and its
// dispatcher's errors (a publisher's panic, with the stack) in the test's
// log. Its dispatcher logged into a buffer shown only when it could not
// start: a test whose publisher panicked passed with nothing in its -v
// output, and the stored error has no file or line.
func TestDrainLogsDeadEventsAndPanics(t *testing.T) {
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	enqueue(t, c, tdb.Provider.Pool, placed, `{"id":"o-1"}`)
	lt := &logT{T: t}
	published := outboxtest.Drain(lt, c, outbox.Publisher{Topic: placed, Publish: func(context.Context, outbox.Delivery) error {
		panic("the publisher broke")
	}})
	if len(published) != 0 {
		t.Fatalf("published %d, want none", len(published))
	}
	logs := strings.Join(lt.logs, "\n")
	for _, want := range []string{"dead-lettered after attempt 3", "shop/order_placed", "the publisher broke",
		"publisher panicked", "drain_test.go"} {
		if !strings.Contains(logs, want) {
			t.Errorf("Drain's log lacks %q:\n%s", want, logs)
		}
	}
}

// A Drain whose events left all wait behind dead events of their ordering
// keys fails as soon as it sees so, rather than after WaitTimeout (a
// minute by default), which could not change it; under SkipDeadHeads
// such a key goes on, and the Drain ends with its later events delivered.
// (A serial test: it changes WaitTimeout.)
func TestDrainFailsAtOnceBehindADeadHead(t *testing.T) {
	saved := outboxtest.WaitTimeout
	outboxtest.WaitTimeout = 2 * time.Minute // the guard: the failure must come long before
	defer func() { outboxtest.WaitTimeout = saved }()
	for _, skip := range []bool{false, true} {
		c, rec := keyWithADeadHead(t, 3)
		pub := rec.Publisher(placed)
		pub.SkipDeadHeads = skip
		var published []outbox.Delivery
		msg := failure(t, func(tb outboxtest.TB) { published = outboxtest.Drain(tb, c, pub) })
		if skip {
			if msg != "" || len(published) != 2 {
				t.Errorf("SkipDeadHeads: Drain failed with %q, published %d; want the two later events published", msg, len(published))
			}
			continue
		}
		for _, want := range []string{"the 2 event(s) left of 1 topic(s) all wait behind dead events", `ordering key "acct-1"`} {
			if !strings.Contains(msg, want) {
				t.Errorf("Drain behind a dead head failed with %q; want it to say %q", msg, want)
			}
		}
	}
}

// keyWithADeadHead enqueues n events of ordering key "acct-1" and returns
// a recorder whose publisher refuses the first for good ("the ledger
// refused it"): a drain leaves the key's later events behind a dead head.
func keyWithADeadHead(t *testing.T, n int) (*outbox.Client, *outboxtest.Recorder) {
	t.Helper()
	c, tdb := outboxtest.NewClient(t, outbox.Config{})
	for i := range n {
		enqueue(t, c, tdb.Provider.Pool, placed, fmt.Sprintf(`{"n":%d}`, i), func(m *outbox.Message) { m.OrderingKey = "acct-1" })
	}
	rec := outboxtest.NewRecorder()
	rec.Fail = func(d outbox.Delivery) error {
		if d.Sequence == 1 {
			return outbox.Permanent(errors.New("the ledger refused it"))
		}
		return nil
	}
	return c, rec
}
