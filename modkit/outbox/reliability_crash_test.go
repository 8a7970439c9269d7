package outbox_test

// Process crashes (issue 7, items 2 and 3): a dispatcher runs in a child
// process, the test binary re-executed with -test.run selecting
// TestHelperDispatcherProcess, and is killed with SIGKILL.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// The child process is configured through the environment.
const (
	childModeEnv = "OUTBOX_RELIABILITY_CHILD" // "crash" or "last-attempt"; unset: not a child
	childDSNEnv  = "OUTBOX_RELIABILITY_DSN"   // the test database
	// childAppName is the application_name of the child's sessions
	// (PGAPPNAME), so that a test can wait for them to end.
	childAppName = "outbox-reliability-child"
)

// Child modes.
const (
	// childCrash publishes every event: it says "start", works a little,
	// records the delivery in published_log, says "end" and returns nil.
	childCrash = "crash"
	// childLastAttempt fails every first attempt and, on the last one,
	// says "start" and freezes (SIGSTOP to itself) until it is killed: a
	// publish that merely hung would be abandoned at its deadline and its
	// event given back, so the process must die inside the publish.
	childLastAttempt = "last-attempt"
	// childOrdered publishes with orderedPublisher (see ordering_test.go),
	// saying "start" before each publish.
	childOrdered = "ordered"
)

// childLease is the lease of the child's dispatcher: the survivor can take
// over its events this long after the kill.
const childLease = time.Second

// orderedChildLease is the lease of the ordered mode's child dispatcher.
const orderedChildLease = 5 * time.Second

// childSweepInterval is the child's maintenance interval: a dead child's
// maintenance lease (three intervals) passes to the survivor this long
// after the kill.
const childSweepInterval = 100 * time.Millisecond

const publishedLogDDL = `CREATE TABLE published_log (
	event_id    uuid        NOT NULL,
	lease_token uuid,       -- NULL: published without the lease of its attempt
	attempt     int         NOT NULL,
	pid         int         NOT NULL,
	dedupe_key  text,
	payload     jsonb       NOT NULL,
	at          timestamptz NOT NULL DEFAULT clock_timestamp()
)`

// recordDelivery is a publisher whose downstream is published_log: the
// delivery is durable once the insert commits. Publishers do not see their
// lease, so the insert reads it from the event's row, which is processing
// under the publish's claim while the publisher runs; a publish that finds
// its row not leased for its attempt is recorded without a token and
// fails.
func recordDelivery(pool *pgxpool.Pool) func(context.Context, outbox.Delivery) error {
	return func(ctx context.Context, d outbox.Delivery) error {
		var token *uuid.UUID
		err := pool.QueryRow(ctx, `INSERT INTO published_log (event_id, lease_token, attempt, pid, dedupe_key, payload)
			SELECT $1, (SELECT lease_token FROM modkit_outbox_events
				WHERE id = $1 AND status = 'processing' AND attempts = $2 AND locked_until > clock_timestamp()), $2, $3, $4, $5
			RETURNING lease_token`, d.ID, d.Attempt, os.Getpid(), d.DedupeKey, string(d.Payload)).Scan(&token)
		if err != nil {
			return fmt.Errorf("record delivery: %w", err)
		}
		if token == nil {
			return fmt.Errorf("test: event %s published without the lease of attempt %d", d.ID, d.Attempt)
		}
		return nil
	}
}

// TestHelperDispatcherProcess is not a test: it is the dispatcher process
// that the crash tests start and kill. It runs until it is killed, or until
// its stdin closes (the parent died).
func TestHelperDispatcherProcess(t *testing.T) {
	mode := os.Getenv(childModeEnv)
	if mode == "" {
		t.Skip("the crash tests' dispatcher process; runs only when they start it")
	}
	pool, err := pgxpool.New(ctx, os.Getenv(childDSNEnv))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var outMu sync.Mutex
	say := func(what string, d outbox.Delivery) {
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Fprintf(os.Stdout, "%s %s %d\n", what, d.ID, d.Attempt)
	}
	record := recordDelivery(pool)
	cfg := outbox.DispatcherConfig{
		LeaseDuration: childLease,
		PollInterval:  100 * time.Millisecond,
		BatchSize:     20,
		Concurrency:   8,
		MaxAttempts:   10,
		Retry:         outbox.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: 4 * time.Millisecond},
		SweepInterval: childSweepInterval,
		StopTimeout:   5 * time.Second,
		Logger:        quietLog,
	}
	var publish func(context.Context, outbox.Delivery) error
	switch mode {
	case childCrash:
		publish = func(ctx context.Context, d outbox.Delivery) error {
			say("start", d)
			time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond) // the work of a publish
			if err := record(ctx, d); err != nil {
				return err
			}
			say("end", d)
			return nil
		}
	case childLastAttempt:
		cfg.MaxAttempts = 2
		publish = func(ctx context.Context, d outbox.Delivery) error {
			if d.Attempt < d.MaxAttempts {
				return errors.New("downstream unavailable")
			}
			say("start", d)
			// Crash here: the whole process stops at once, its timers
			// with it, until the parent kills it.
			if err := syscall.Kill(os.Getpid(), syscall.SIGSTOP); err != nil {
				return err
			}
			// The signal may take effect a moment after the call
			// returns: never return from here.
			select {}
		}
	case childOrdered:
		// orderedPublisher records its publishes whatever its context
		// says, so a publish that passed its context check and then
		// stalled past its lease (the process starved of CPU under -race)
		// would show as an overlap with the survivor that took the event
		// over. With 1s leases such stalls happened; 5s leaves them room.
		cfg.LeaseDuration = orderedChildLease
		logPool, err := orderedLogPool(os.Getenv(childDSNEnv))
		if err != nil {
			t.Fatal(err)
		}
		defer logPool.Close()
		pub := orderedPublisher(logPool, fmt.Sprintf("child-%d", os.Getpid()))
		publish = func(ctx context.Context, d outbox.Delivery) error {
			say("start", d)
			return pub(ctx, d)
		}
	default:
		t.Fatalf("unknown child mode %q", mode)
	}
	client, err := outbox.New(outboxpg.New(pool), outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := client.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: publish})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = d.Stop(ctx)
}

// childProc is a running dispatcher process.
type childProc struct {
	cmd    *exec.Cmd
	lines  chan string // its stdout, line by line; closed at EOF
	stderr *bytes.Buffer
}

// startChild starts a dispatcher process in mode on the database dsn. It is
// killed, and waited for, when the test ends if the test did not kill it.
func startChild(t *testing.T, dsn, mode string) *childProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperDispatcherProcess$", "-test.count=1", "-test.timeout=5m")
	// TEST_DATABASE_URL makes the child's pgtest.Main use our server
	// instead of starting a cluster of its own.
	cmd.Env = append(os.Environ(), childModeEnv+"="+mode, childDSNEnv+"="+dsn, "TEST_DATABASE_URL="+dsn, "PGAPPNAME="+childAppName)
	// A child frozen by SIGSTOP never sees its stdin close: it dies with
	// this process instead.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	c := &childProc{cmd: cmd, lines: make(chan string, 4096), stderr: new(bytes.Buffer)}
	cmd.Stderr = c.stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := cmd.StdinPipe() // never written; the child exits when it closes
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		defer close(c.lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		for range c.lines {
		}
		<-readerDone
		_ = cmd.Wait()
		_ = stdin.Close()
	})
	return c
}

// childLine is one "start"/"end" report of the child.
type childLine struct {
	what    string
	id      uuid.UUID
	attempt int
}

// next returns the child's next report. It fails the test if the child
// exits first.
func (c *childProc) next(t *testing.T) childLine {
	t.Helper()
	timeout := time.After(guard)
	for {
		select {
		case line, ok := <-c.lines:
			if !ok {
				_ = c.cmd.Wait()
				t.Fatalf("the dispatcher process exited early:\n%s", c.stderr)
			}
			var l childLine
			var id string
			if _, err := fmt.Sscanf(line, "%s %s %d", &l.what, &id, &l.attempt); err != nil ||
				(l.what != "start" && l.what != "end") {
				continue // the test framework's own output
			}
			l.id = uuid.MustParse(id)
			return l
		case <-timeout:
			t.Fatal("timed out waiting for the dispatcher process")
		}
	}
}

// kill SIGKILLs the child and waits for it to be gone.
func (c *childProc) kill(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	for range c.lines {
	}
	if err := c.cmd.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("the dispatcher process ended with %v, want killed", err)
	}
}

// ---- 2. Process crash ----

// A dispatcher process is SIGKILLed mid-publish, at a point drawn from the
// seed; a second dispatcher takes over once the dead one's leases expire.
// Nothing is lost, every redelivery carries the same event (id, dedupe key,
// payload), and every delivered mark was made under a valid lease whose
// publish succeeded.
func TestReliabilityProcessCrash(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { crashAndRecover(t, seed) })
	}
}

func crashAndRecover(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0x0b0c))
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	installAudit(t, pool)
	if _, err := pool.Exec(ctx, publishedLogDDL); err != nil {
		t.Fatal(err)
	}
	const n = 200
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = keyed(i, fmt.Sprintf("crash/%d/%d", seed, i))
	}
	res, err := client.EnqueueBatch(ctx, pool, msgs)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]uuid.UUID, n)
	for i, r := range res {
		ids[i] = r.ID
	}

	// Kill when the killAt-th publish has started.
	killAt := 1 + rng.IntN(n-1)
	child := startChild(t, tdb.DSN, childCrash)
	inFlight := map[uuid.UUID]bool{}
	for started := 0; started < killAt; {
		l := child.next(t)
		if l.what == "start" {
			started++
			inFlight[l.id] = true
		} else {
			delete(inFlight, l.id)
		}
	}
	child.kill(t)
	// A statement the child sent before it died (an outcome write) may
	// still commit: its sessions must end before the leases are read.
	eventually(t, "the killed process's sessions to end", func() bool {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", childAppName).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	byChild := countWhere(t, pool, "published_log", "true")
	leased := countRows(t, pool, "status = 'processing'")
	orphans := leasesHeld(t, pool)

	// The survivor.
	startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), testConfig(newOutcomeLog()),
		outbox.Publisher{Topic: testTopic, Publish: recordDelivery(pool)})
	eventually(t, "every event delivered", func() bool { return countRows(t, pool, "status = 'delivered'") == n })

	// Nothing lost: every event reached the downstream.
	var missing int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM modkit_outbox_events e
		WHERE NOT EXISTS (SELECT 1 FROM published_log p WHERE p.event_id = e.id)`).Scan(&missing); err != nil {
		t.Fatal(err)
	}
	if missing != 0 {
		t.Fatalf("%d events never published", missing)
	}
	// The ledger records each lease the dead process held as
	// lease_expired, and is whole: one delivered entry per event, entries
	// numbered without gaps.
	checkLeaseExpired(t, pool, orphans)
	checkLedger(t, pool)
	// Redeliveries are the same event: same id, dedupe key and payload;
	// one id per dedupe key.
	var mismatched, keysWithTwoIDs, redelivered int
	if err := pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM published_log p JOIN modkit_outbox_events e ON e.id = p.event_id
			WHERE p.dedupe_key IS DISTINCT FROM e.dedupe_key OR p.payload <> e.payload),
		(SELECT count(*) FROM (SELECT dedupe_key FROM published_log GROUP BY dedupe_key HAVING count(DISTINCT event_id) > 1) k),
		(SELECT count(*) FROM (SELECT event_id FROM published_log GROUP BY event_id HAVING count(*) > 1) r)`).
		Scan(&mismatched, &keysWithTwoIDs, &redelivered); err != nil {
		t.Fatal(err)
	}
	if mismatched != 0 || keysWithTwoIDs != 0 {
		t.Fatalf("redeliveries differ from the event: %d mismatched deliveries, %d dedupe keys with several ids", mismatched, keysWithTwoIDs)
	}
	// Every publish, the dead process's and the survivor's, ran under the
	// lease of its attempt.
	if unleased := countWhere(t, pool, "published_log", "lease_token IS NULL"); unleased != 0 {
		t.Fatalf("%d publishes ran without the lease of their attempt", unleased)
	}
	// Every delivered mark was made under a valid lease whose publish
	// reached the downstream.
	ok := map[uuid.UUID]map[uuid.UUID]bool{}
	rows, err := pool.Query(ctx, "SELECT event_id, lease_token FROM published_log WHERE lease_token IS NOT NULL")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, token uuid.UUID
		if err := rows.Scan(&id, &token); err != nil {
			t.Fatal(err)
		}
		if ok[id] == nil {
			ok[id] = map[uuid.UUID]bool{}
		}
		ok[id][token] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	checkLeaseFencing(t, pool, ok)
	checkFinalState(t, pool, allStatus(ids, outbox.StatusDelivered))
	t.Logf("seed %d: killed at publish start %d with %d publishes in flight; %d deliveries recorded by the dead process, "+
		"%d events left leased to it; %d events delivered twice", seed, killAt, len(inFlight), byChild, leased, redelivered)
}

// ---- 3. Crash on the last attempt ----

// A dispatcher process dies on an event's last allowed attempt, leaving it
// processing with attempts = max_attempts, which no claim picks up. A second
// dispatcher's maintenance, once the dead one's maintenance lease has
// expired, dead-letters it, saying why, and never publishes it; healthy
// events flow meanwhile.
func TestReliabilityCrashOnLastAttempt(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	installAudit(t, pool)
	victim := enqueueN(t, client, pool, 1)[0]
	child := startChild(t, tdb.DSN, childLastAttempt)
	for {
		l := child.next(t)
		if l.what == "start" && l.id == victim && l.attempt == 2 {
			break
		}
	}
	child.kill(t)
	if e := get(t, client, victim); e.Status != outbox.StatusProcessing || e.Attempts != 2 {
		t.Fatalf("after the crash: %+v, want processing on attempt 2 of 2", e)
	}

	healthy := enqueueN(t, client, pool, 20)
	settled, logs, pubs := newOutcomeLog(), newLogCapture(slog.LevelInfo), newPublishLog(pool)
	cfg := testConfig(settled)
	cfg.MaxAttempts, cfg.SweepInterval, cfg.Logger = 2, 100*time.Millisecond, logs.logger()
	startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfg, outbox.Publisher{Topic: testTopic, Publish: pubs.wrap("survivor", noopPublish)})
	logs.waitForMsg(t, "dead-lettered events whose attempts were used up (crashed or overran on the last attempt)", 1)
	settled.waitFor(t, "the healthy events", finalCount(outbox.StatusDelivered, len(healthy)))

	e := get(t, client, victim)
	if e.Status != outbox.StatusDead || e.Attempts != 2 || e.LockedBy != nil || e.LastError == nil ||
		!strings.Contains(*e.LastError, "expired on the final attempt (2 of 2)") ||
		!strings.Contains(*e.LastError, "last publish error: attempt 1 of 2 failed: downstream unavailable") {
		t.Fatalf("victim after the sweep: %+v", e)
	}
	if calls := pubs.callsOf(victim); len(calls) != 0 {
		t.Fatalf("the survivor published the exhausted event %d times", len(calls))
	}
	want := allStatus(healthy, outbox.StatusDelivered)
	want[victim] = outbox.StatusDead
	pubs.checkNoOverlap(t)
	checkLeaseFencing(t, pool, pubs.okTokens())
	checkFinalState(t, pool, want)
}

// countWhere counts the rows of table matching where.
func countWhere(t *testing.T, pool *pgxpool.Pool, table, where string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{table}.Sanitize()+" WHERE "+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
