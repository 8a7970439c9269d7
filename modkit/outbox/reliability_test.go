package outbox_test

// The reliability suite (issue 7): faults injected into a real PostgreSQL and
// real dispatchers. Every test checks the same three things:
//
//   - every enqueued event is delivered at least once (its publisher returned
//     nil and the row ended delivered);
//   - no event is settled by a worker without a valid lease: an audit trigger
//     records every transition out of processing with the lease it ended, and
//     checkLeaseFencing checks each one; a delivered mark must carry the
//     lease of a publish that succeeded (publishers do not see their lease:
//     publishLog reads it from the event's row as each publish starts);
//   - the final table state is consistent: no row left processing, every row
//     in the status the test expects.
//
// The process-crash tests are in reliability_crash_test.go, the server
// restart in reliability_restart_test.go, the fuzz targets in fuzz_test.go.
// Items of the issue already covered elsewhere: the dedupe race by
// TestEnqueueDedupeRace, validation writing nothing by TestEnqueueValidation.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// ---- Helpers shared by the reliability tests ----

// logCapture is a slog handler that keeps the records at or above a level,
// so tests can count warnings and check what was logged. Each record also
// signals changed, so a test can wait for a message instead of sleeping.
type logCapture struct {
	level   slog.Level
	mu      sync.Mutex
	recs    []logRecord
	changed chan struct{}
}

// logRecord is one captured record, its attributes flattened to strings
// (groups joined with dots).
type logRecord struct {
	Level slog.Level
	Msg   string
	Attrs map[string]string
}

func newLogCapture(level slog.Level) *logCapture {
	return &logCapture{level: level, changed: make(chan struct{}, 1)}
}

func (c *logCapture) logger() *slog.Logger { return slog.New(&captureHandler{c: c}) }

// records returns a copy of what was captured so far.
func (c *logCapture) records() []logRecord {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.recs)
}

// count counts the records of level with exactly the message msg.
func (c *logCapture) count(level slog.Level, msg string) int {
	n := 0
	for _, r := range c.records() {
		if r.Level == level && r.Msg == msg {
			n++
		}
	}
	return n
}

// waitFor blocks until cond holds on the captured records.
func (c *logCapture) waitFor(t *testing.T, what string, cond func([]logRecord) bool) {
	t.Helper()
	timeout := time.After(guard)
	for {
		if cond(c.records()) {
			return
		}
		select {
		case <-c.changed:
		case <-timeout:
			t.Fatalf("timed out waiting for %s (log: %v)", what, c.records())
		}
	}
}

// waitForMsg waits until n records carry message msg.
func (c *logCapture) waitForMsg(t *testing.T, msg string, n int) {
	t.Helper()
	c.waitFor(t, fmt.Sprintf("%d log records %q", n, msg), func(recs []logRecord) bool {
		k := 0
		for _, r := range recs {
			if r.Msg == msg {
				k++
			}
		}
		return k >= n
	})
}

type captureHandler struct {
	c      *logCapture
	attrs  []slog.Attr
	prefix string // group prefix, "" or "g."
}

func (h *captureHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= h.c.level }

func (h *captureHandler) Handle(_ context.Context, r slog.Record) error {
	rec := logRecord{Level: r.Level, Msg: r.Message, Attrs: map[string]string{}}
	for _, a := range h.attrs {
		flatten(rec.Attrs, "", a)
	}
	r.Attrs(func(a slog.Attr) bool {
		flatten(rec.Attrs, h.prefix, a)
		return true
	})
	h.c.mu.Lock()
	h.c.recs = append(h.c.recs, rec)
	h.c.mu.Unlock()
	select {
	case h.c.changed <- struct{}{}:
	default:
	}
	return nil
}

func (h *captureHandler) WithAttrs(as []slog.Attr) slog.Handler {
	out := *h
	out.attrs = slices.Clone(h.attrs)
	for _, a := range as {
		a.Key = h.prefix + a.Key
		out.attrs = append(out.attrs, a)
	}
	return &out
}

func (h *captureHandler) WithGroup(name string) slog.Handler {
	out := *h
	out.prefix = h.prefix + name + "."
	return &out
}

func flatten(into map[string]string, prefix string, a slog.Attr) {
	v := a.Value.Resolve()
	if v.Kind() == slog.KindGroup {
		for _, g := range v.Group() {
			flatten(into, prefix+a.Key+".", g)
		}
		return
	}
	into[prefix+a.Key] = v.String()
}

// publishCall is one call of a publisher: which worker, under which lease,
// when, and how it ended.
type publishCall struct {
	Worker   string
	Token    uuid.UUID // the lease token of the claim the publish ran under
	Attempt  int
	LeaseEnd time.Time // locked_until of that claim, by the outbox's clock
	Start    time.Time // by the outbox's clock
	End      time.Time // zero while in flight
	Err      error
}

// publishLog records every publish call of a test, and checks as calls
// begin that no two holders of a valid lease publish one event at once: a
// second publish of an event may only start once every other publish of it
// in flight runs under an expired lease (a stalled worker).
//
// Publishers do not see their lease, so a call starts by reading it from
// the event's row, which is processing under the call's claim while the
// publisher runs. A call that finds its row not leased for its attempt
// (another status or attempt, or an expired lease) started without its
// lease: it is recorded as such, refused (it returns an error without
// calling the publisher) and reported by checkNoOverlap. A call whose read
// fails returns that error without calling the publisher: a failed attempt
// that published nothing.
type publishLog struct {
	pool *pgxpool.Pool    // reads the leases
	now  func() time.Time // the outbox's clock (Config.Now), time.Now by default

	mu       sync.Mutex
	calls    map[uuid.UUID][]*publishCall
	inFlight map[uuid.UUID][]*publishCall
	overlaps []string
	unleased []string
	total    atomic.Int64
}

// newPublishLog returns a publishLog that reads leases through pool.
func newPublishLog(pool *pgxpool.Pool) *publishLog {
	return &publishLog{pool: pool, now: time.Now, calls: map[uuid.UUID][]*publishCall{}, inFlight: map[uuid.UUID][]*publishCall{}}
}

// wrap returns a Publish function that records each call of fn as done by
// worker.
func (l *publishLog) wrap(worker string, fn func(context.Context, outbox.Delivery) error) func(context.Context, outbox.Delivery) error {
	return func(ctx context.Context, d outbox.Delivery) error {
		end, err := l.begin(ctx, worker, d)
		if err != nil {
			return err
		}
		err = fn(ctx, d)
		end(err)
		return err
	}
}

// begin reads the lease of d's attempt and records the start of a publish
// under it; call the function it returns with the publish's result. When
// it returns an error, nothing may be published.
func (l *publishLog) begin(ctx context.Context, worker string, d outbox.Delivery) (func(error), error) {
	start := l.now()
	var status string
	var attempts int
	var token *uuid.UUID
	var leaseEnd *time.Time
	if err := l.pool.QueryRow(ctx, `SELECT status, attempts, lease_token, locked_until FROM modkit_outbox_events WHERE id = $1`, d.ID).
		Scan(&status, &attempts, &token, &leaseEnd); err != nil {
		return nil, fmt.Errorf("test: read the lease of event %s: %w", d.ID, err)
	}
	if status != string(outbox.StatusProcessing) || attempts != d.Attempt || token == nil || !leaseEnd.After(start) {
		l.mu.Lock()
		l.unleased = append(l.unleased, fmt.Sprintf("event %s: %s started attempt %d at %s without its lease: the row is %s, attempts %d, lease until %v",
			d.ID, worker, d.Attempt, start.Format(time.RFC3339Nano), status, attempts, leaseEnd))
		l.mu.Unlock()
		return nil, fmt.Errorf("test: event %s is not leased for attempt %d", d.ID, d.Attempt)
	}
	c := &publishCall{Worker: worker, Token: *token, Attempt: d.Attempt, LeaseEnd: *leaseEnd, Start: start}
	l.mu.Lock()
	for _, other := range l.inFlight[d.ID] {
		if other.Token != c.Token && other.LeaseEnd.After(c.Start) {
			l.overlaps = append(l.overlaps, fmt.Sprintf("event %s: %s (attempt %d) started while %s (attempt %d) held a valid lease until %s",
				d.ID, worker, d.Attempt, other.Worker, other.Attempt, other.LeaseEnd.Format(time.RFC3339Nano)))
		}
	}
	l.inFlight[d.ID] = append(l.inFlight[d.ID], c)
	l.calls[d.ID] = append(l.calls[d.ID], c)
	l.mu.Unlock()
	l.total.Add(1)
	return func(err error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		c.End, c.Err = l.now(), err
		l.inFlight[d.ID] = slices.DeleteFunc(l.inFlight[d.ID], func(x *publishCall) bool { return x == c })
		if len(l.inFlight[d.ID]) == 0 {
			delete(l.inFlight, d.ID)
		}
	}, nil
}

// givenBack records that the lease token of event id was given back (the
// dispatcher released the event) by now: publishes of id under it that are
// still running no longer hold a valid lease.
func (l *publishLog) givenBack(id, token uuid.UUID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	for _, c := range l.calls[id] {
		if c.Token == token && c.LeaseEnd.After(now) {
			c.LeaseEnd = now
		}
	}
}

// callsOf returns copies of the calls made for id.
func (l *publishLog) callsOf(id uuid.UUID) []publishCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]publishCall, 0, len(l.calls[id]))
	for _, c := range l.calls[id] {
		out = append(out, *c)
	}
	return out
}

// okTokens returns, per event, the lease tokens under which a publish
// returned nil: the only leases allowed to mark it delivered.
func (l *publishLog) okTokens() map[uuid.UUID]map[uuid.UUID]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[uuid.UUID]map[uuid.UUID]bool, len(l.calls))
	for id, calls := range l.calls {
		for _, c := range calls {
			if !c.End.IsZero() && c.Err == nil {
				if out[id] == nil {
					out[id] = map[uuid.UUID]bool{}
				}
				out[id][c.Token] = true
			}
		}
	}
	return out
}

// checkNoOverlap fails the test if two valid lease holders ever published
// the same event at once, or if a publish started without the lease of its
// attempt.
func (l *publishLog) checkNoOverlap(t *testing.T) {
	t.Helper()
	l.checkLeased(t)
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, o := range l.overlaps {
		t.Error("double publish under valid leases: " + o)
	}
}

// checkLeased fails the test if a publish started without the lease of its
// attempt.
func (l *publishLog) checkLeased(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, u := range l.unleased {
		t.Error("publish without a lease: " + u)
	}
}

// checkDelivered fails the test unless every id had a publish that
// returned nil.
func (l *publishLog) checkDelivered(t *testing.T, ids []uuid.UUID) {
	t.Helper()
	ok := l.okTokens()
	for _, id := range ids {
		if len(ok[id]) == 0 {
			t.Errorf("event %s was never successfully published", id)
		}
	}
}

// auditDDL installs the audit trail of lease transitions: every update of a
// row that was processing records the lease it had (token, end), the new
// status and token, and the time of the transition by the outbox's clock:
// the updated_at the statement wrote, which is the very time its lease
// check compared against (the database clock, or Config.Now). The
// transaction's and the statement's start by the database clock are kept
// too, to check that updated_at is that time when no test clock is used.
const auditDDL = `
CREATE TABLE reliability_audit (
	seq              bigserial PRIMARY KEY,
	event_id         uuid NOT NULL,
	old_status       text NOT NULL,
	new_status       text NOT NULL,
	old_token        uuid,
	new_token        uuid,
	old_locked_until timestamptz,
	new_last_error   text,
	at               timestamptz NOT NULL,
	xact_at          timestamptz NOT NULL,
	stmt_at          timestamptz NOT NULL
);
CREATE FUNCTION reliability_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO reliability_audit (event_id, old_status, new_status, old_token, new_token, old_locked_until, new_last_error, at, xact_at, stmt_at)
	VALUES (OLD.id, OLD.status, NEW.status, OLD.lease_token, NEW.lease_token, OLD.locked_until, NEW.last_error, NEW.updated_at,
		now(), statement_timestamp());
	RETURN NULL;
END $$;
CREATE TRIGGER reliability_audit AFTER UPDATE ON modkit_outbox_events
	FOR EACH ROW WHEN (OLD.status = 'processing') EXECUTE FUNCTION reliability_audit();`

func installAudit(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(ctx, auditDDL); err != nil {
		t.Fatalf("install audit trigger: %v", err)
	}
}

// checkLeaseFencing reads the audit trail and fails the test on any
// transition out of processing that the lease did not allow:
//
//   - delivered, pending (retry or release) and dead by a publish outcome
//     need a lease unexpired at the statement's time;
//   - delivered must also present the token of a publish that returned nil
//     (okTokens; nil skips this check);
//   - a reclaim (processing with a new token) needs the old lease expired;
//   - dead with an expired lease is only allowed to the sweep of exhausted
//     events, which says so in last_error;
//   - pending with an expired lease is only allowed to the sweeper's lease
//     repair, which records a lease_expired entry for that lease.
//
// The outbox runs on the database clock: each transition's time must be
// its statement's. It returns the number of audited transitions.
func checkLeaseFencing(t *testing.T, pool *pgxpool.Pool, okTokens map[uuid.UUID]map[uuid.UUID]bool) int {
	t.Helper()
	return auditLeases(t, pool, okTokens, false)
}

// checkLeaseFencingOnTestClock is checkLeaseFencing for an outbox on a test
// clock (Config.Now), whose times are not the database's.
func checkLeaseFencingOnTestClock(t *testing.T, pool *pgxpool.Pool, okTokens map[uuid.UUID]map[uuid.UUID]bool) int {
	t.Helper()
	return auditLeases(t, pool, okTokens, true)
}

func auditLeases(t *testing.T, pool *pgxpool.Pool, okTokens map[uuid.UUID]map[uuid.UUID]bool, testClock bool) int {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT event_id, new_status, old_token, new_token, old_locked_until > at,
		coalesce(new_last_error, ''), at BETWEEN xact_at AND stmt_at,
		EXISTS (SELECT 1 FROM modkit_outbox_attempts l WHERE l.event_id = a.event_id AND l.lease_token = a.old_token
			AND l.outcome = 'lease_expired' AND l.detail LIKE '%repaired by the sweeper%')
		FROM reliability_audit a ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for rows.Next() {
		var id, oldToken uuid.UUID
		var newToken *uuid.UUID
		var status, lastErr string
		var valid, dbTime, repaired bool
		if err := rows.Scan(&id, &status, &oldToken, &newToken, &valid, &lastErr, &dbTime, &repaired); err != nil {
			t.Fatal(err)
		}
		n++
		moved := status == string(outbox.StatusProcessing) && newToken != nil && *newToken == oldToken
		if !moved && !testClock && !dbTime {
			t.Errorf("event %s moved to %s at a time other than its statement's by the database clock", id, status)
		}
		switch {
		case moved:
			// A test moved the lease; not a settlement.
		case status == string(outbox.StatusProcessing):
			if valid {
				t.Errorf("event %s reclaimed while its lease %s was still valid", id, oldToken)
			}
		case status == string(outbox.StatusDead) && !valid:
			if !strings.Contains(lastErr, "expired on the final attempt") {
				t.Errorf("event %s dead-lettered under an expired lease by someone other than the sweep: %q", id, lastErr)
			}
		case status == string(outbox.StatusPending) && !valid && repaired:
			// The sweeper's lease repair, recorded as lease_expired.
		case !valid:
			t.Errorf("event %s moved to %s under an expired lease (token %s)", id, status, oldToken)
		case status == string(outbox.StatusDelivered) && okTokens != nil && !okTokens[id][oldToken]:
			t.Errorf("event %s marked delivered under lease %s, whose publish never succeeded", id, oldToken)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// checkFinalState fails the test unless each event of want has its status,
// no lease is left on a settled row, and nothing at all is left processing.
func checkFinalState(t *testing.T, pool *pgxpool.Pool, want map[uuid.UUID]outbox.Status) {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT id, status, locked_by IS NOT NULL FROM modkit_outbox_events`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[uuid.UUID]outbox.Status{}
	for rows.Next() {
		var id uuid.UUID
		var st outbox.Status
		var locked bool
		if err := rows.Scan(&id, &st, &locked); err != nil {
			t.Fatal(err)
		}
		got[id] = st
		if st == outbox.StatusProcessing {
			t.Errorf("event %s left processing", id)
		}
		if locked && st != outbox.StatusProcessing {
			t.Errorf("event %s is %s but still leased", id, st)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for id, st := range want {
		if got[id] != st {
			t.Errorf("event %s is %q, want %q", id, got[id], st)
		}
	}
}

// allStatus maps each id to st, for checkFinalState.
func allStatus(ids []uuid.UUID, st outbox.Status) map[uuid.UUID]outbox.Status {
	out := make(map[uuid.UUID]outbox.Status, len(ids))
	for _, id := range ids {
		out[id] = st
	}
	return out
}

// eventually polls cond (a database condition, typically) until it holds.
// It waits on a condition with a hang guard; it asserts nothing about time.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	eventuallyWithin(t, guard, what, cond)
}

// eventuallyWithin is eventually with a hang guard of its own, for the few
// tests whose work (tens of thousands of events under -race) may take longer
// than guard on a loaded machine.
func eventuallyWithin(t *testing.T, hang time.Duration, what string, cond func() bool) {
	t.Helper()
	timeout := time.After(hang)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// recv waits for a value on ch.
func recv[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(guard):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

// namedPool opens a pool on dsn whose sessions carry application_name app,
// so a test can find (and terminate) exactly the dispatcher's backends.
func namedPool(t *testing.T, dsn, app string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// sizedPool opens a pool of at most maxConns connections on dsn.
func sizedPool(t *testing.T, dsn string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// backends counts the other sessions on the test's database matching where
// (a condition on pg_stat_activity).
func backends(t *testing.T, pool *pgxpool.Pool, where string, args ...any) int {
	t.Helper()
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND `+where, args...).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// terminate kills the backends matching where with pg_terminate_backend and
// returns how many it killed.
func terminate(t *testing.T, pool *pgxpool.Pool, where string, args ...any) int {
	t.Helper()
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND `+where, args...).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// deliveredCounter counts delivered settlements without keeping them, for
// tests with tens of thousands of events.
type deliveredCounter struct {
	n, want atomic.Int64
	done    chan struct{}
	once    sync.Once
}

func newDeliveredCounter(want int) *deliveredCounter {
	c := &deliveredCounter{done: make(chan struct{})}
	c.want.Store(int64(want))
	return c
}

// wait waits for the wanted count; it fails only when no delivery was
// counted for a whole guard (a hang), however long the deliveries take on
// a slow machine.
func (c *deliveredCounter) wait(t *testing.T) {
	t.Helper()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	last, lastMoved := c.n.Load(), time.Now()
	for {
		select {
		case <-c.done:
			return
		case <-tick.C:
		}
		if n := c.n.Load(); n != last {
			last, lastMoved = n, time.Now()
		} else if time.Since(lastMoved) > guard {
			t.Fatalf("%d of %d deliveries, and none for %v", n, c.want.Load(), guard)
		}
	}
}

func (c *deliveredCounter) hook(_ outbox.Delivery, o outbox.Outcome) {
	if !o.LeaseLost && !o.Released && o.Status == outbox.StatusDelivered && c.n.Add(1) >= c.want.Load() {
		c.once.Do(func() { close(c.done) })
	}
}

// ---- 1. Stale worker ----

// A dispatcher whose publisher stalls past its lease (a GC pause, a network
// partition) is overtaken: a second dispatcher reclaims the event and
// delivers it; the stale lease's outcomes (delivered, retry, dead, release)
// are refused and change nothing, and its dispatcher records nothing when
// the stalled publish finally returns, whether with success or with an
// error.
//
// A publisher that ignores its context is abandoned at its deadline, before
// its lease ends (TestReliabilityAbandonedPublish), so the lease is made to
// expire while the publish runs the way a paused process sees it: the
// outbox's clock (Config.Now) jumps past the lease while the dispatcher's
// own timers, on the real clock, are far from their deadline.
func TestReliabilityStaleWorker(t *testing.T) {
	for _, tc := range []struct {
		name   string
		result error // what the stalled publish finally returns
	}{
		{"ack", nil},
		{"nack", errors.New("stalled worker's late failure")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, tdb := newClient(t, outbox.Config{})
			pool := tdb.Provider.Pool
			installAudit(t, pool)
			ids := enqueueN(t, client, pool, 2)
			x, y := ids[0], ids[1]
			// Started after the enqueue, so the events are due by it.
			clock := newTestClock()
			clocked := func() *outbox.Client { return clientOn(t, tdb.NewPool(t), outbox.Config{Now: clock.Now}) }
			pubs := newPublishLog(pool)
			pubs.now = clock.Now

			// A: one worker, a queue of one. Its worker stalls on x; the claim
			// loop then claims y into the queue and, the lane being full,
			// claims nothing more, so only B can rescue x. Its real-time
			// deadlines are far beyond the test's guard.
			entered := make(chan outbox.Delivery, 1)
			unstall := make(chan struct{})
			outcomesA, logA := newOutcomeLog(), newLogCapture(slog.LevelWarn)
			cfgA := testConfig(outcomesA)
			cfgA.LeaseDuration = 10 * time.Minute
			cfgA.Concurrency, cfgA.BatchSize = 1, 1
			cfgA.WorkerID = uuid.New()
			cfgA.Logger = logA.logger()
			a := startDispatcher(t, clocked(), cfgA, outbox.Publisher{Topic: testTopic,
				Publish: pubs.wrap("A", func(ctx context.Context, d outbox.Delivery) error {
					select {
					case entered <- d:
					default:
					}
					<-unstall // deliberately deaf to ctx: a stalled worker
					return tc.result
				})})
			if dA := recv(t, "A's publish of x", entered); dA.ID != x {
				t.Fatalf("A published %s first, want %s", dA.ID, x)
			}
			eventually(t, "y queued by A", func() bool {
				return countRows(t, pool, "id = $1 AND locked_by = $2", y, cfgA.WorkerID) == 1
			})
			callsA := pubs.callsOf(x)
			if len(callsA) != 1 {
				t.Fatalf("%d publishes of x, want A's", len(callsA))
			}
			tokenA := callsA[0].Token

			// A's leases end while its publish of x is stalled.
			clock.Advance(cfgA.LeaseDuration + time.Second)

			// B takes x and y over. Its publish of x waits, so that A's
			// stale outcomes meet x leased to B.
			outcomesB := newOutcomeLog()
			cfgB := testConfig(outcomesB)
			cfgB.LeaseDuration = 10 * time.Minute
			enteredB, releaseB := make(chan struct{}), make(chan struct{})
			b := startDispatcher(t, clocked(), cfgB, outbox.Publisher{Topic: testTopic,
				Publish: pubs.wrap("B", func(_ context.Context, d outbox.Delivery) error {
					if d.ID == x {
						close(enteredB)
						<-releaseB
					}
					return nil
				})})
			recv(t, "B's publish of x", enteredB)

			// A's lease fences nothing any more: every outcome it could
			// record is refused and leaves x as B holds it.
			st, err := outboxpg.New(pool).Open(driver.Options{Schema: "public", Now: clock.Now})
			if err != nil {
				t.Fatal(err)
			}
			held := get(t, client, x)
			for _, o := range []driver.Outcome{
				{Kind: driver.Delivered},
				{Kind: driver.Retry, Error: "stale nack", Delay: time.Millisecond},
				{Kind: driver.Dead, Error: "stale dead-letter"},
				{Kind: driver.Release},
			} {
				o.ID, o.LeaseToken = x, tokenA
				settled, err := st.Complete(ctx, nil, cfgA.WorkerID, []driver.Outcome{o})
				if err != nil || len(settled) != 1 || settled[0] {
					t.Fatalf("stale outcome %+v: settled %v, %v; want refused", o, settled, err)
				}
			}
			if now := get(t, client, x); now.Status != outbox.StatusProcessing || now.LockedBy == nil || *now.LockedBy == cfgA.WorkerID ||
				!now.UpdatedAt.Equal(held.UpdatedAt) || now.Attempts != held.Attempts || now.LastError != nil {
				t.Fatalf("the stale outcomes changed x:\nbefore %+v\nafter  %+v", held, now)
			}
			close(releaseB)
			outcomesB.waitFor(t, "B delivering x and y", finalCount(outbox.StatusDelivered, 2))
			before := get(t, client, x)

			// A stops: its queued y goes back, refused. Then the stalled
			// publish returns; A must record nothing.
			stopped := make(chan error, 1)
			go func() { stopped <- a.Stop(ctx) }()
			outcomesA.waitFor(t, "A giving y back", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m[y]) > 0 })
			close(unstall)
			if err := recv(t, "A's stop", stopped); err != nil {
				t.Fatal(err)
			}
			after := get(t, client, x)
			if after.Status != outbox.StatusDelivered || !after.UpdatedAt.Equal(before.UpdatedAt) ||
				after.Attempts != before.Attempts || after.LastError != nil {
				t.Fatalf("the stale worker changed x:\nbefore %+v\nafter  %+v", before, after)
			}
			outcomesA.mu.Lock()
			for id, outs := range outcomesA.byID {
				for _, o := range outs {
					if !o.LeaseLost {
						t.Errorf("A recorded %+v for %s after losing the lease", o, id)
					}
				}
			}
			// y's release was refused; x's late result at most once (that
			// Stop reports it at all is TestStopRecordsInFlightOutcome's).
			if len(outcomesA.byID[x]) > 1 || len(outcomesA.byID[y]) != 1 {
				t.Errorf("A's outcomes: %v, want one refused outcome for y and at most one for x", outcomesA.byID)
			}
			outcomesA.mu.Unlock()

			// Fencing: x was delivered under B's lease, the one whose publish
			// succeeded after the reclaim.
			var bToken uuid.UUID
			for _, c := range pubs.callsOf(x) {
				if c.Worker == "B" {
					bToken = c.Token
				}
			}
			var deliveredBy uuid.UUID
			if err := pool.QueryRow(ctx, `SELECT old_token FROM reliability_audit WHERE event_id = $1 AND new_status = 'delivered'`, x).
				Scan(&deliveredBy); err != nil {
				t.Fatal(err)
			}
			if deliveredBy != bToken || bToken == tokenA {
				t.Fatalf("x delivered under lease %s; B's is %s, A's %s", deliveredBy, bToken, tokenA)
			}
			okB := pubs.okTokens()
			for id := range okB {
				delete(okB[id], tokenA) // A's late success must not count
			}
			checkLeaseFencingOnTestClock(t, pool, okB)
			pubs.checkNoOverlap(t)
			pubs.checkDelivered(t, ids)
			if err := b.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			checkFinalState(t, pool, allStatus(ids, outbox.StatusDelivered))
			t.Logf("A's warnings: %v", logA.records())
		})
	}
}

// A publisher that ignores its context is abandoned a little after its
// deadline, while its lease still holds: its event goes back at once,
// without using up an attempt, and is delivered by another dispatcher; the
// topic pauses (its one slot is held by the abandoned call) and Health says
// so; when the abandoned call finally returns, whatever it returns, nothing
// is recorded for it.
func TestReliabilityAbandonedPublish(t *testing.T) {
	for _, tc := range []struct {
		name   string
		result error // what the abandoned publish finally returns
	}{
		{"ack", nil},
		{"nack", errors.New("abandoned worker's late failure")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, tdb := newClient(t, outbox.Config{})
			pool := tdb.Provider.Pool
			installAudit(t, pool)
			ids := enqueueN(t, client, pool, 2)
			x, y := ids[0], ids[1]
			pubs := newPublishLog(pool)

			entered := make(chan outbox.Delivery, 1)
			unstall := make(chan struct{})
			outcomesA, logA := newOutcomeLog(), newLogCapture(slog.LevelWarn)
			cfgA := testConfig(outcomesA)
			// The most headroom a 1s lease allows. It bounds A's claims: a
			// claim that commits but answers after it leaves its event leased
			// to nobody, and A would publish y first. And it is the margin
			// between A's abandoning x, a quarter of it after the publish
			// deadline, and the lease's end, before which the abandonment
			// must give x back.
			cfgA.LeaseDuration, cfgA.LeaseHeadroom, cfgA.PollInterval = time.Second, 500*time.Millisecond, 100*time.Millisecond
			cfgA.Concurrency, cfgA.BatchSize = 1, 1
			cfgA.Logger = logA.logger()
			a := startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfgA, outbox.Publisher{Topic: testTopic,
				Publish: pubs.wrap("A", func(ctx context.Context, d outbox.Delivery) error {
					select {
					case entered <- d:
					default:
					}
					<-unstall // deliberately deaf to ctx
					return tc.result
				})})
			if dA := recv(t, "A's publish of x", entered); dA.ID != x {
				t.Fatalf("A published %s first, want %s (A's warnings: %v)", dA.ID, x, logA.records())
			}
			outcomesA.waitFor(t, "A abandoning x", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m[x]) > 0 })
			outcomesA.mu.Lock()
			ox := outcomesA.byID[x][0]
			outcomesA.mu.Unlock()
			if !ox.Abandoned || ox.Released || ox.LeaseLost || ox.Status != outbox.StatusPending || !strings.Contains(ox.Error, "abandoned") {
				t.Fatalf("x's outcome at A: %+v, want abandoned, its attempt failed under its lease", ox)
			}
			// The release ended A's lease; its call runs on without one.
			callsA := pubs.callsOf(x)
			if len(callsA) != 1 {
				t.Fatalf("%d publishes of x, want A's", len(callsA))
			}
			pubs.givenBack(x, callsA[0].Token)
			if h := a.Health(); !h.Running || !h.Degraded || h.Abandoned != 1 || len(h.Problems) == 0 {
				t.Fatalf("A's health with an abandoned publish: %+v", h)
			}
			// Its one slot held by the abandoned call, the topic pauses.
			logA.waitForMsg(t, "topic paused: its publisher ignores its context and every slot of the topic is held by an abandoned publish; "+
				"other topics go on, this one resumes when they return", 1)

			outcomesB := newOutcomeLog()
			b := startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), testConfig(outcomesB),
				outbox.Publisher{Topic: testTopic, Publish: pubs.wrap("B", noopPublish)})
			outcomesB.waitFor(t, "B delivering x and y", finalCount(outbox.StatusDelivered, 2))
			before := get(t, client, x)
			if before.Attempts != 2 {
				t.Fatalf("x after B's delivery: %+v, want attempt 2: the abandoned attempt counts", before)
			}

			close(unstall)
			returnedMsg := "an abandoned publish returned; its result is ignored (its attempt was recorded as failed, " +
				"or the event given back at a stop, and the event is published again)"
			logA.waitForMsg(t, returnedMsg, 1)
			// Its error, when it returned one, and no empty one otherwise.
			for _, r := range logA.records() {
				if _, has := r.Attrs["publish_error"]; r.Msg == returnedMsg && has != (tc.result != nil) {
					t.Errorf("the warning of the abandoned publish that returned %v: %v", tc.result, r.Attrs)
				}
			}
			if err := a.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			if after := get(t, client, x); after.Status != outbox.StatusDelivered || !after.UpdatedAt.Equal(before.UpdatedAt) ||
				after.Attempts != before.Attempts || !reflect.DeepEqual(after.LastError, before.LastError) {
				t.Fatalf("the abandoned publish changed x:\nbefore %+v\nafter  %+v", before, after)
			}
			outcomesA.mu.Lock()
			if outs := outcomesA.byID[x]; len(outs) != 1 {
				t.Errorf("A recorded %+v for x, want only its abandonment", outs)
			}
			for _, o := range outcomesA.byID[y] {
				if !o.Released || o.Abandoned || o.Status != outbox.StatusPending {
					t.Errorf("A recorded %+v for y, which it never started", o)
				}
			}
			outcomesA.mu.Unlock()

			// x was delivered under B's lease, the only one whose publish
			// counts: the abandoned one's late result is not an outcome.
			okB := pubs.okTokens()
			for _, c := range pubs.callsOf(x) {
				if c.Worker == "A" {
					delete(okB[x], c.Token)
				}
			}
			checkLeaseFencing(t, pool, okB)
			pubs.checkNoOverlap(t)
			pubs.checkDelivered(t, ids)
			if err := b.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			checkFinalState(t, pool, allStatus(ids, outbox.StatusDelivered))
		})
	}
}

// ---- 4. Backend killed ----

// The dispatcher's database sessions are killed with pg_terminate_backend
// at the worst moments; it recovers by itself and nothing is lost.
func TestReliabilityBackendKilled(t *testing.T) {
	const app = "reliability-dispatcher"
	type fixture struct {
		client  *outbox.Client // on pool
		dclient *outbox.Client // the dispatcher's, on dpool
		pool    *pgxpool.Pool
		dpool   *pgxpool.Pool
		ids     []uuid.UUID
		settled *outcomeLog
		logs    *logCapture
		pubs    *publishLog
		cfg     outbox.DispatcherConfig
		dsn     string
	}
	setup := func(t *testing.T, n int) *fixture {
		client, tdb := newClient(t, outbox.Config{})
		f := &fixture{client: client, pool: tdb.Provider.Pool, dsn: tdb.DSN, settled: newOutcomeLog(), logs: newLogCapture(slog.LevelWarn)}
		f.pubs = newPublishLog(f.pool)
		installAudit(t, f.pool)
		f.dpool = namedPool(t, tdb.DSN, app)
		f.dclient = clientOn(t, f.dpool, outbox.Config{})
		if n > 0 {
			f.ids = enqueueN(t, client, f.pool, n)
		}
		f.cfg = testConfig(f.settled)
		f.cfg.Logger, f.cfg.SweepInterval = f.logs.logger(), time.Hour
		return f
	}
	check := func(t *testing.T, f *fixture) {
		t.Helper()
		f.settled.waitFor(t, "all deliveries", finalCount(outbox.StatusDelivered, len(f.ids)))
		f.pubs.checkDelivered(t, f.ids)
		f.pubs.checkNoOverlap(t)
		checkLeaseFencing(t, f.pool, f.pubs.okTokens())
		checkFinalState(t, f.pool, allStatus(f.ids, outbox.StatusDelivered))
	}

	t.Run("during claim", func(t *testing.T) {
		f := setup(t, 0)
		startDispatcher(t, f.dclient, f.cfg, outbox.Publisher{Topic: testTopic, Publish: f.pubs.wrap("d", noopPublish)})
		// The claim blocks behind a table lock held by the transaction
		// that enqueues the events; its session is killed while it waits.
		tx, err := f.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "LOCK TABLE modkit_outbox_events IN ACCESS EXCLUSIVE MODE"); err != nil {
			t.Fatal(err)
		}
		f.ids = enqueueIn(t, f.client, tx, 50)
		claimWaiting := "application_name = $1 AND wait_event_type = 'Lock' AND query LIKE '%modkit_outbox_claim_chained(%'"
		eventually(t, "a claim blocked on the lock", func() bool { return backends(t, f.pool, claimWaiting, app) > 0 })
		if n := terminate(t, f.pool, claimWaiting, app); n == 0 {
			t.Fatal("no claim backend terminated")
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		check(t, f)
		if n := f.logs.count(slog.LevelWarn, "claim failed; retrying"); n < 1 {
			t.Fatalf("%d claim failures logged, want at least the killed one", n)
		}
	})

	t.Run("during publish", func(t *testing.T) {
		f := setup(t, 20)
		target := f.ids[5]
		entered, resume := make(chan struct{}), make(chan struct{})
		startDispatcher(t, f.dclient, f.cfg, outbox.Publisher{Topic: testTopic, Publish: f.pubs.wrap("d",
			func(ctx context.Context, d outbox.Delivery) error {
				if d.ID == target && d.Attempt == 1 {
					close(entered)
					<-resume
				}
				return nil
			})})
		recv(t, "the target's publish", entered)
		// Every session of the dispatcher: pooled connections and the
		// listener. The outcome then has to be recorded on a new one.
		if n := terminate(t, f.pool, "application_name = $1", app); n == 0 {
			t.Fatal("no dispatcher backend terminated")
		}
		close(resume)
		check(t, f)
		if calls := f.pubs.callsOf(target); len(calls) != 1 {
			t.Fatalf("target published %d times, want once: its outcome is recorded on a new connection within the lease", len(calls))
		}
		t.Logf("warnings: %d outcome retries, %d listener reconnects",
			f.logs.count(slog.LevelWarn, "recording outcomes failed; retrying"),
			f.logs.count(slog.LevelWarn, "notification listener lost; polling continues, reconnecting"))
	})

	t.Run("during transactional handler", func(t *testing.T) {
		f := setup(t, 10)
		if _, err := f.pool.Exec(ctx, "CREATE TABLE consumed (event_id uuid NOT NULL, attempt int NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		target := f.ids[3]
		pids, resume := make(chan int, 1), make(chan struct{})
		startDispatcher(t, f.dclient, f.cfg, outbox.Publisher{Topic: testTopic,
			HandleTx: func(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
				end, err := f.pubs.begin(ctx, "d", d)
				if err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, "INSERT INTO consumed VALUES ($1, $2)", d.ID, d.Attempt); err != nil {
					end(err)
					return err
				}
				if d.ID == target && d.Attempt == 1 {
					var pid int
					if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
						end(err)
						return err
					}
					pids <- pid
					<-resume
				}
				end(nil) // the ack commits with the handler's writes, or neither does
				return nil
			}})
		pid := recv(t, "the handler's backend", pids)
		if n := terminate(t, f.pool, "pid = $1", pid); n != 1 {
			t.Fatal("handler backend not terminated")
		}
		close(resume)
		f.settled.waitFor(t, "all deliveries", finalCount(outbox.StatusDelivered, len(f.ids)))
		checkFinalState(t, f.pool, allStatus(f.ids, outbox.StatusDelivered))
		checkLeaseFencing(t, f.pool, nil) // the handler's "success" on attempt 1 never committed
		for _, id := range f.ids {
			if n := countConsumed(t, f.pool, id); n != 1 {
				t.Fatalf("event %s consumed %d times, want exactly once", id, n)
			}
		}
		f.pubs.checkNoOverlap(t)
		if e := get(t, f.client, target); e.Attempts != 2 || e.LastError == nil {
			t.Fatalf("target: %+v, want delivered on attempt 2 after a recorded failure", e)
		}
	})

	t.Run("between publish and ack", func(t *testing.T) {
		f := setup(t, 20)
		target := f.ids[7]
		entered, resume := make(chan struct{}), make(chan struct{})
		startDispatcher(t, f.dclient, f.cfg, outbox.Publisher{Topic: testTopic, Publish: f.pubs.wrap("d",
			func(ctx context.Context, d outbox.Delivery) error {
				if d.ID == target && d.Attempt == 1 {
					close(entered)
					<-resume
				}
				return nil
			})})
		recv(t, "the target's publish", entered)
		// Hold the row so the ack blocks, then kill the session running it.
		tx, err := f.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SELECT 1 FROM modkit_outbox_events WHERE id = $1 FOR UPDATE", target); err != nil {
			t.Fatal(err)
		}
		close(resume)
		ackWaiting := "application_name = $1 AND wait_event_type = 'Lock' AND query LIKE '%modkit_outbox_complete(%'"
		eventually(t, "the ack blocked on the row", func() bool { return backends(t, f.pool, ackWaiting, app) > 0 })
		if n := terminate(t, f.pool, ackWaiting, app); n == 0 {
			t.Fatal("no ack backend terminated")
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		check(t, f)
		if n := f.logs.count(slog.LevelWarn, "recording outcomes failed; retrying"); n < 1 {
			t.Fatalf("%d outcome retries logged, want at least one", n)
		}
		if calls := f.pubs.callsOf(target); len(calls) != 1 {
			t.Fatalf("target published %d times, want once: the ack is retried within the lease", len(calls))
		}
	})
}

func noopPublish(context.Context, outbox.Delivery) error { return nil }

// enqueueIn enqueues n events through r.
func enqueueIn(t *testing.T, c *outbox.Client, r pgx.Tx, n int) []uuid.UUID {
	t.Helper()
	return enqueueTopic(t, c, r, testTopic, n)
}

func countConsumed(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM consumed WHERE event_id = $1", id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// ---- 6. Listener lost ----

// The LISTEN session is killed and reconnecting is made impossible (the
// dispatcher's pool refuses to dial, as in a network partition) while
// events are enqueued, so their NOTIFYs are certainly lost. With a short
// poll interval they still arrive while the listener is down; with a poll
// interval far beyond the test's guard they arrive when the listener
// reconnects, which alone proves the reconnect catches up on what it missed.
func TestReliabilityListenerLost(t *testing.T) {
	for _, tc := range []struct {
		name string
		poll time.Duration
	}{
		{"poll covers the gap", 100 * time.Millisecond},
		{"reconnect covers the gap", 10 * time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, tdb := newClient(t, outbox.Config{})
			pool := tdb.Provider.Pool
			installAudit(t, pool)
			var partitioned atomic.Bool
			dpool := gatedPool(t, tdb.DSN, &partitioned)
			// Open the connections the dispatcher will need while new ones
			// are refused.
			warm(t, dpool, 4)

			settled, logs, pubs := newOutcomeLog(), newLogCapture(slog.LevelWarn), newPublishLog(pool)
			cfg := testConfig(settled)
			cfg.Logger, cfg.SweepInterval = logs.logger(), time.Hour
			if tc.poll > time.Minute {
				cfg.LeaseDuration = time.Hour
			}
			cfg.PollInterval = tc.poll
			startDispatcher(t, clientOn(t, dpool, outbox.Config{}), cfg, outbox.Publisher{Topic: testTopic, Publish: pubs.wrap("d", noopPublish)})
			listening := "query LIKE 'LISTEN %'"
			eventually(t, "the dispatcher listening", func() bool { return backends(t, pool, listening) == 1 })

			partitioned.Store(true)
			if terminate(t, pool, listening) != 1 {
				t.Fatal("LISTEN backend not terminated")
			}
			// Two losses: the kill, and a reconnect refused. We are in the gap.
			const lost = "notification listener lost; polling continues, reconnecting"
			logs.waitForMsg(t, lost, 2)

			gap := enqueueN(t, client, pool, 5) // their NOTIFYs reach nobody
			if tc.poll < time.Minute {
				settled.waitFor(t, "the gap's events, by polling", finalCount(outbox.StatusDelivered, len(gap)))
				if n := backends(t, pool, listening); n != 0 {
					t.Fatalf("%d listeners: the gap ended before the events arrived, so polling was not shown to cover it", n)
				}
				partitioned.Store(false)
			} else {
				partitioned.Store(false)
				settled.waitFor(t, "the gap's events, after the reconnect", finalCount(outbox.StatusDelivered, len(gap)))
			}
			// And the listener is back: a new event wakes the dispatcher.
			eventually(t, "the listener back", func() bool { return backends(t, pool, listening) == 1 })
			last := enqueueN(t, client, pool, 1)
			all := append(gap, last...)
			settled.waitFor(t, "an event after the gap", finalCount(outbox.StatusDelivered, len(all)))
			pubs.checkDelivered(t, all)
			pubs.checkNoOverlap(t)
			checkLeaseFencing(t, pool, pubs.okTokens())
			checkFinalState(t, pool, allStatus(all, outbox.StatusDelivered))
			t.Logf("listener losses logged: %d", logs.count(slog.LevelWarn, lost))
		})
	}
}

// gatedPool opens a pool on dsn that cannot open new connections while
// partitioned is set (its dialer fails, as in a network partition).
// Connections already open keep working. The LISTEN connection, which the
// dispatcher dials from the pool's configuration, is gated too.
func gatedPool(t *testing.T, dsn string, partitioned *atomic.Bool) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var dialer net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if partitioned.Load() {
			return nil, errors.New("test: network partition")
		}
		return dialer.DialContext(ctx, network, addr)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// warm opens n connections in pool and returns them to it idle.
func warm(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	conns := make([]*pgxpool.Conn, 0, n)
	for range n {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
}

// ---- 7. Out-of-order commits ----

// Transactions that enqueue first but commit last are still delivered: the
// claim has no id or time watermark that a later commit could fall behind.
// Transactions are opened in order (so created_at ascends) and committed in
// reverse, each only after everything committed before it was delivered.
func TestReliabilityOutOfOrderCommits(t *testing.T) {
	for _, pollOnly := range []bool{false, true} {
		t.Run(fmt.Sprintf("poll-only=%v", pollOnly), func(t *testing.T) {
			_, tdb := newClient(t, outbox.Config{})
			pool := tdb.Provider.Pool
			installAudit(t, pool)
			producer := clientOn(t, pool, outbox.Config{DisableNotify: pollOnly})
			const n = 6
			txs := make([]pgx.Tx, n)
			ids := make([]uuid.UUID, n)
			for i := range n {
				conn, err := pgx.Connect(ctx, tdb.DSN)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { conn.Close(ctx) })
				if txs[i], err = conn.Begin(ctx); err != nil {
					t.Fatal(err)
				}
				res, err := producer.Enqueue(ctx, txs[i], msg(i))
				if err != nil {
					t.Fatal(err)
				}
				ids[i] = res.ID
			}
			settled, pubs := newOutcomeLog(), newPublishLog(pool)
			cfg := testConfig(settled)
			cfg.PollOnly = pollOnly
			startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfg, outbox.Publisher{Topic: testTopic, Publish: pubs.wrap("d", noopPublish)})
			for i := n - 1; i >= 0; i-- {
				if err := txs[i].Commit(ctx); err != nil {
					t.Fatal(err)
				}
				id := ids[i]
				settled.waitFor(t, fmt.Sprintf("event %d, committed %d-th", i, n-i), func(m map[uuid.UUID][]outbox.Outcome) bool {
					outs := m[id]
					return len(outs) > 0 && !outs[len(outs)-1].LeaseLost && outs[len(outs)-1].Status == outbox.StatusDelivered
				})
			}
			var ordered bool
			if err := pool.QueryRow(ctx, `SELECT (SELECT created_at FROM modkit_outbox_events WHERE id = $1) <
				(SELECT created_at FROM modkit_outbox_events WHERE id = $2)`, ids[0], ids[n-1]).Scan(&ordered); err != nil {
				t.Fatal(err)
			}
			if !ordered {
				t.Fatal("the first-enqueued event does not have the earliest created_at; the test shows nothing")
			}
			pubs.checkDelivered(t, ids)
			pubs.checkNoOverlap(t)
			checkLeaseFencing(t, pool, pubs.okTokens())
			checkFinalState(t, pool, allStatus(ids, outbox.StatusDelivered))
		})
	}
}

// ---- 8. Locked rows ----

// Other sessions hold row locks (FOR UPDATE, FOR SHARE, an uncommitted
// UPDATE) and sit idle in transaction, one with an uncommitted enqueue of
// its own: the claim skips the locked rows and delivers everything else;
// once the locks go, the skipped rows are delivered too.
func TestReliabilityLockedRows(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	installAudit(t, pool)
	ids := enqueueN(t, client, pool, 100)
	locked := []uuid.UUID{ids[0], ids[50], ids[99]}
	holders := []struct {
		sql string
		id  uuid.UUID
	}{
		{"SELECT 1 FROM modkit_outbox_events WHERE id = $1 FOR UPDATE", ids[0]},
		{"SELECT 1 FROM modkit_outbox_events WHERE id = $1 FOR SHARE", ids[50]},
		{"UPDATE modkit_outbox_events SET payload = payload WHERE id = $1", ids[99]},
	}
	txs := make([]pgx.Tx, 0, len(holders)+1)
	begin := func() pgx.Tx {
		conn, err := pgx.Connect(ctx, tdb.DSN)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close(ctx) })
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		txs = append(txs, tx)
		return tx
	}
	for _, h := range holders {
		if _, err := begin().Exec(ctx, h.sql, h.id); err != nil {
			t.Fatal(err)
		}
	}
	pendingTx := begin()
	late, err := client.Enqueue(ctx, pendingTx, msg(1000))
	if err != nil {
		t.Fatal(err)
	}
	if n := backends(t, pool, "state = 'idle in transaction'"); n != 4 {
		t.Fatalf("%d sessions idle in transaction, want 4", n)
	}

	settled, pubs := newOutcomeLog(), newPublishLog(pool)
	startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), testConfig(settled), outbox.Publisher{Topic: testTopic, Publish: pubs.wrap("d", noopPublish)})
	settled.waitFor(t, "the unlocked events", finalCount(outbox.StatusDelivered, len(ids)-len(locked)))
	for _, id := range locked {
		if e := get(t, client, id); e.Status != outbox.StatusPending || e.Attempts != 0 || len(pubs.callsOf(id)) != 0 {
			t.Fatalf("locked event %s touched: %+v", id, e)
		}
	}
	// Let go: rollbacks and a commit (which also makes the late enqueue visible).
	for i, tx := range txs {
		finish := tx.Rollback
		if i%2 == 1 {
			finish = tx.Commit
		}
		if err := finish(ctx); err != nil {
			t.Fatal(err)
		}
	}
	all := append(slices.Clone(ids), late.ID)
	settled.waitFor(t, "every event", finalCount(outbox.StatusDelivered, len(all)))
	pubs.checkDelivered(t, all)
	pubs.checkNoOverlap(t)
	checkLeaseFencing(t, pool, pubs.okTokens())
	checkFinalState(t, pool, allStatus(all, outbox.StatusDelivered))
}

// ---- 9. Poison event ----

// An event whose publish always fails is dead after exactly MaxAttempts
// calls, and 1000 healthy events enqueued around it are not held up: its
// last attempt does not return until all of them were delivered, which
// could not happen if it blocked them. A permanently failing event is dead
// after one call.
func TestReliabilityPoisonEvent(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	installAudit(t, pool)
	healthy := enqueueN(t, client, pool, 500)
	poisonRes, err := client.Enqueue(ctx, pool, msg(-1))
	if err != nil {
		t.Fatal(err)
	}
	permanentRes, err := client.Enqueue(ctx, pool, msg(-2))
	if err != nil {
		t.Fatal(err)
	}
	healthy = append(healthy, enqueueN(t, client, pool, 500)...)
	poison, permanent := poisonRes.ID, permanentRes.ID

	const maxAttempts = 5
	healthyDone := make(chan struct{})
	settled, pubs := newOutcomeLog(), newPublishLog(pool)
	cfg := testConfig(settled)
	cfg.MaxAttempts = maxAttempts
	startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfg, outbox.Publisher{Topic: testTopic, Publish: pubs.wrap("d",
		func(ctx context.Context, d outbox.Delivery) error {
			switch d.ID {
			case permanent:
				return outbox.Permanent(errors.New("payload schema v0 is not supported"))
			case poison:
				if d.Attempt == d.MaxAttempts {
					select {
					case <-healthyDone:
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				return fmt.Errorf("downstream rejects event (attempt %d)", d.Attempt)
			}
			return nil
		})})
	settled.waitFor(t, "1000 healthy deliveries", finalCount(outbox.StatusDelivered, len(healthy)))
	close(healthyDone)
	settled.waitFor(t, "both poison events dead", finalCount(outbox.StatusDead, 2))

	e := get(t, client, poison)
	if e.Status != outbox.StatusDead || e.Attempts != maxAttempts || len(pubs.callsOf(poison)) != maxAttempts ||
		!strings.Contains(*e.LastError, fmt.Sprintf("attempt %d of %d failed, no attempts left", maxAttempts, maxAttempts)) {
		t.Fatalf("poison: %+v after %d calls, want dead after exactly %d", e, len(pubs.callsOf(poison)), maxAttempts)
	}
	if e := get(t, client, permanent); e.Status != outbox.StatusDead || e.Attempts != 1 || len(pubs.callsOf(permanent)) != 1 {
		t.Fatalf("permanent failure: %+v after %d calls, want dead after 1", e, len(pubs.callsOf(permanent)))
	}
	for _, id := range healthy {
		if n := len(pubs.callsOf(id)); n != 1 {
			t.Fatalf("healthy event %s published %d times", id, n)
		}
	}
	want := allStatus(healthy, outbox.StatusDelivered)
	want[poison], want[permanent] = outbox.StatusDead, outbox.StatusDead
	pubs.checkNoOverlap(t)
	checkLeaseFencing(t, pool, pubs.okTokens())
	checkFinalState(t, pool, want)
}

// ---- 10. Concurrency ----

// manyDispatchersEvents is how many events eight dispatchers drain. 50,000
// take some tens of seconds under -race on two cores (each publish also
// reads its lease).
const manyDispatchersEvents = 50_000

// Eight dispatchers on separate pools (eight "replicas") drain 50,000
// events: the delivered set is the enqueued set, each event is published
// exactly once (no faults here), and no two holders of a valid lease ever
// publish one event at once.
func TestReliabilityManyDispatchers(t *testing.T) {
	if testing.Short() {
		t.Skip("drains 50,000 events")
	}
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	installAudit(t, pool)
	const n, dispatchers = manyDispatchersEvents, 8
	ids := make([]uuid.UUID, 0, n)
	for len(ids) < n {
		ids = append(ids, enqueueN(t, client, pool, min(5000, n-len(ids)))...)
	}
	// The publishes read their leases through a pool of their own, wide
	// enough not to throttle 8 × 16 publishes.
	counter, pubs := newDeliveredCounter(n), newPublishLog(sizedPool(t, tdb.DSN, 32))
	start := time.Now()
	for i := range dispatchers {
		cfg := testConfig(newOutcomeLog())
		cfg.OnOutcome = counter.hook
		cfg.BatchSize, cfg.Concurrency = 200, 16
		startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfg, outbox.Publisher{Topic: testTopic, Publish: pubs.wrap(fmt.Sprint("d", i), noopPublish)})
	}
	counter.wait(t)
	elapsed := time.Since(start)

	pubs.checkNoOverlap(t)
	pubs.checkDelivered(t, ids)
	byWorker := map[string]int{}
	pubs.mu.Lock()
	if len(pubs.calls) != n {
		t.Errorf("%d distinct events published, want %d", len(pubs.calls), n)
	}
	for id, calls := range pubs.calls {
		if len(calls) != 1 {
			t.Errorf("event %s published %d times, want once", id, len(calls))
		}
		for _, c := range calls {
			byWorker[c.Worker]++
		}
	}
	pubs.mu.Unlock()
	audited := checkLeaseFencing(t, pool, pubs.okTokens())
	if audited != n {
		t.Errorf("%d audited settlements, want %d", audited, n)
	}
	checkFinalState(t, pool, allStatus(ids, outbox.StatusDelivered))
	t.Logf("%d events drained by %d dispatchers in %v; per dispatcher: %v", n, dispatchers, elapsed.Round(time.Millisecond), byWorker)
}

// ---- 13. Secrets ----

// A publish error that quotes credentials and is far longer than the limit
// is redacted and truncated in last_error and in every log record.
func TestReliabilitySecretsRedacted(t *testing.T) {
	const maxLen = 256
	secret := "sk_live_" + strings.ReplaceAll(uuid.NewString(), "-", "")
	password := fmt.Sprintf("hunter%d", rand.IntN(1e9))
	leaky := fmt.Sprintf("POST https://svc:%s@hooks.example.com/v1/events: 401 Unauthorized; request headers: Authorization: Bearer %s; body: %s",
		password, secret, strings.Repeat("é", 3000))

	t.Run("publish error", func(t *testing.T) {
		client, tdb := newClient(t, outbox.Config{ErrorMaxLen: maxLen})
		pool := tdb.Provider.Pool
		id := enqueueN(t, client, pool, 1)[0]
		settled, logs := newOutcomeLog(), newLogCapture(slog.LevelDebug)
		cfg := testConfig(settled)
		cfg.MaxAttempts, cfg.Logger = 2, logs.logger()
		startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{ErrorMaxLen: maxLen}), cfg, outbox.Publisher{Topic: testTopic,
			Publish: func(context.Context, outbox.Delivery) error { return errors.New(leaky) }})
		settled.waitFor(t, "the event dead", finalCount(outbox.StatusDead, 1))

		e := get(t, client, id)
		checkSanitized(t, "last_error", *e.LastError, maxLen, secret, password)
		if !strings.Contains(*e.LastError, "[REDACTED]") || !strings.Contains(*e.LastError, "[truncated ") {
			t.Errorf("last_error %q: want redaction and truncation marks", *e.LastError)
		}
		var errorAttrs int
		for _, r := range logs.records() {
			for k, v := range r.Attrs {
				checkSanitized(t, fmt.Sprintf("log %q attribute %s", r.Msg, k), v, -1, secret, password)
				if k == "error" {
					errorAttrs++
					checkSanitized(t, fmt.Sprintf("log %q attribute %s", r.Msg, k), v, maxLen, secret, password)
				}
			}
		}
		if errorAttrs < 2 { // the retry warning and the dead-letter error
			t.Errorf("%d log records carried the publish error, want at least 2: %v", errorAttrs, logs.records())
		}
	})

	t.Run("publisher panic", func(t *testing.T) {
		client, tdb := newClient(t, outbox.Config{ErrorMaxLen: maxLen})
		pool := tdb.Provider.Pool
		id := enqueueN(t, client, pool, 1)[0]
		settled, logs := newOutcomeLog(), newLogCapture(slog.LevelInfo)
		cfg := testConfig(settled)
		cfg.MaxAttempts, cfg.Logger = 1, logs.logger()
		startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{ErrorMaxLen: maxLen}), cfg, outbox.Publisher{Topic: testTopic,
			Publish: func(context.Context, outbox.Delivery) error { panic(leaky) }})
		settled.waitFor(t, "the event dead", finalCount(outbox.StatusDead, 1))
		e := get(t, client, id)
		checkSanitized(t, "last_error", *e.LastError, maxLen, secret, password)
		var leaks []string
		for _, r := range logs.records() {
			for k, v := range r.Attrs {
				if strings.Contains(v, secret) || strings.Contains(v, password) || (k != "stack" && len(v) > maxLen) {
					leaks = append(leaks, fmt.Sprintf("%q attribute %s (%d bytes)", r.Msg, k, len(v)))
				}
			}
		}
		if len(leaks) > 0 {
			t.Fatalf("secrets or oversized values in logs: %v", leaks)
		}
	})
}

// checkSanitized fails if s shows a secret, is not valid UTF-8, or is longer
// than maxLen bytes (maxLen < 0: no limit).
func checkSanitized(t *testing.T, what, s string, maxLen int, secrets ...string) {
	t.Helper()
	for _, sec := range secrets {
		if strings.Contains(s, sec) {
			t.Errorf("%s shows a secret: %q", what, s)
		}
	}
	if !utf8.ValidString(s) {
		t.Errorf("%s is not valid UTF-8", what)
	}
	if maxLen >= 0 && len(s) > maxLen {
		t.Errorf("%s is %d bytes, over the %d limit", what, len(s), maxLen)
	}
}
