package outbox_test

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// passCounter counts a dispatcher's maintenance passes, and those that
// finished before their deadline (a pass cut short on a slow machine may
// have left its sweep or purge undone), and lets the test wait for the next
// ones.
type passCounter struct {
	mu       sync.Mutex
	passes   int
	finished int
	held     map[string]int // role -> passes that held it
	moved    chan struct{}
}

func newPassCounter() *passCounter {
	return &passCounter{held: map[string]int{}, moved: make(chan struct{}, 1)}
}

func (p *passCounter) hook(held []string, finished bool) {
	p.mu.Lock()
	p.passes++
	if finished {
		p.finished++
	}
	for _, r := range held {
		p.held[r]++
	}
	p.mu.Unlock()
	select {
	case p.moved <- struct{}{}:
	default:
	}
}

func (p *passCounter) count() (passes, finished int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.passes, p.finished
}

func (p *passCounter) heldCount(role string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held[role]
}

// waitPasses waits until n more passes than now have run: the last of them
// started after the call.
func (p *passCounter) waitPasses(t *testing.T, n int) {
	t.Helper()
	p.wait(t, n, "", func() int { passes, _ := p.count(); return passes })
}

// waitFinishedPasses is waitPasses counting only the passes that finished
// before their deadline, for a test that checks what a sweep or purge did.
func (p *passCounter) waitFinishedPasses(t *testing.T, n int) {
	t.Helper()
	p.wait(t, n, "finished ", func() int { _, finished := p.count(); return finished })
}

func (p *passCounter) wait(t *testing.T, n int, what string, count func() int) {
	t.Helper()
	target := count() + n
	timeout := time.After(guard)
	for count() < target {
		select {
		case <-p.moved:
		case <-timeout:
			t.Fatalf("timed out waiting for %d %smaintenance passes", n, what)
		}
	}
}

func startMaintained(t *testing.T, c *outbox.Client, cfg outbox.DispatcherConfig, pubs ...outbox.Publisher) (*outbox.Dispatcher, *passCounter) {
	t.Helper()
	d, err := c.NewDispatcher(cfg, pubs...)
	if err != nil {
		t.Fatal(err)
	}
	pc := newPassCounter()
	outbox.OnMaintenancePass(d, pc.hook)
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return d, pc
}

// Two dispatchers serve different topics with different retentions: each
// topic's delivered events live exactly as long as its owner configured,
// and neither dispatcher touches the other's topic.
func TestRetentionPerDispatcherTopic(t *testing.T) {
	clock := newTestClock()
	c, tdb := newClient(t, outbox.Config{Now: clock.Now})
	pool := tdb.Provider.Pool
	short := outbox.Topic{Namespace: "ret", Topic: "short"}
	long := outbox.Topic{Namespace: "ret", Topic: "long"}
	enqueueTopic(t, c, pool, short, 30)
	enqueueTopic(t, c, pool, long, 30)

	log := newOutcomeLog()
	cfg := testConfig(log)
	// A pass must finish within 2/3 of three intervals (400ms here), or its
	// purge is cut short; the steps wait for passes that finished, so the
	// interval only sets how often a slow machine gets another try. (At
	// 10ms, when any pass counted, one run in ten under -race on a loaded
	// machine saw no purge.)
	cfg.SweepInterval = 200 * time.Millisecond
	cfgShort, cfgLong := cfg, cfg
	cfgShort.Retention = time.Hour
	cfgLong.Retention = 3 * time.Hour
	noop := outbox.Publisher{Publish: func(context.Context, outbox.Delivery) error { return nil }}
	pubShort, pubLong := noop, noop
	pubShort.Topic, pubLong.Topic = short, long
	_, passShort := startMaintained(t, c, cfgShort, pubShort)
	_, passLong := startMaintained(t, c, cfgLong, pubLong)
	log.waitFor(t, "all delivered", finalCount(outbox.StatusDelivered, 60))

	delivered := func(topic outbox.Topic) int {
		return countRows(t, pool, "namespace = $1 AND topic = $2 AND status = 'delivered'", topic.Namespace, topic.Topic)
	}
	step := func(d time.Duration, wantShort, wantLong int) {
		t.Helper()
		clock.Advance(d)
		passShort.waitFinishedPasses(t, 2)
		passLong.waitFinishedPasses(t, 2)
		if got := delivered(short); got != wantShort {
			t.Fatalf("at +%v: %d delivered events of %s, want %d", d, got, short, wantShort)
		}
		if got := delivered(long); got != wantLong {
			t.Fatalf("at +%v: %d delivered events of %s, want %d", d, got, long, wantLong)
		}
	}
	step(59*time.Minute, 30, 30) // inside both retentions
	step(2*time.Minute, 0, 30)   // 1h01: the short topic's have gone, the long one's stay
	step(118*time.Minute, 0, 30) // 2h59
	step(2*time.Minute, 0, 0)    // 3h01
	if passShort.heldCount("maintenance:ret:long") != 0 || passLong.heldCount("maintenance:ret:short") != 0 {
		t.Fatal("a dispatcher maintained a topic it does not serve")
	}
}

// Two dispatchers serve one topic: only one of them maintains it (sweeps,
// purges, reads its gauges) while it lives; when it stops, the other takes
// over.
func TestMaintenanceRunsOnOneReplica(t *testing.T) {
	clock := newTestClock() // frozen: a lease never expires by itself here
	c, tdb := newClient(t, outbox.Config{Now: clock.Now})
	pool := tdb.Provider.Pool
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.SweepInterval = 5 * time.Millisecond
	pub := outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	d1, pass1 := startMaintained(t, c, cfg, pub)
	c2 := clientOn(t, tdb.NewPool(t), outbox.Config{Now: clock.Now})
	d2, pass2 := startMaintained(t, c2, cfg, pub)
	enqueueN(t, c, pool, 20)
	log.waitFor(t, "all delivered", finalCount(outbox.StatusDelivered, 20))
	pass1.waitPasses(t, 10)
	pass2.waitPasses(t, 10)

	role := "maintenance:" + testTopic.Namespace + ":" + testTopic.Topic
	h1, h2 := pass1.heldCount(role), pass2.heldCount(role)
	if (h1 == 0) == (h2 == 0) {
		t.Fatalf("maintenance passes holding %s: first dispatcher %d, second %d; want exactly one of them", role, h1, h2)
	}
	leader, follower := d1, pass2
	if h2 > 0 {
		leader, follower = d2, pass1
	}
	if err := leader.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	before := follower.heldCount(role)
	follower.waitPasses(t, 2)
	if follower.heldCount(role) <= before {
		t.Fatal("the remaining dispatcher did not take maintenance over after the leader stopped")
	}
}

// A dispatcher stopped while its maintenance election is in flight still
// resigns: the election finishes (it is not cut short by the stop, so it
// cannot commit behind the resign's back) and the resign then removes the
// lease, so another dispatcher can take over at once.
func TestStopDuringElectionResigns(t *testing.T) {
	clock := newTestClock() // frozen: the lease never expires by itself
	c, tdb := newClient(t, outbox.Config{Now: clock.Now})
	pool := tdb.Provider.Pool
	cfg := testConfig(newOutcomeLog())
	cfg.SweepInterval = 20 * time.Millisecond
	d, passes := startMaintained(t, c, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	passes.waitPasses(t, 1)
	// Hold up the next election behind a table lock.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "LOCK TABLE modkit_outbox_leaders IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "an election blocked on the lock", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE '%modkit_outbox_elect(%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	stopped := make(chan error, 1)
	go func() { stopped <- d.Stop(ctx) }()
	// The stop has begun (the dispatcher no longer reports running) while
	// the election still waits on the lock.
	eventually(t, "the stop under way", func() bool { return !d.Health().Running })
	if err := tx.Rollback(ctx); err != nil { // the election goes through now
		t.Fatal(err)
	}
	if err := recv(t, "the stop", stopped); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_leaders WHERE holder = $1", d.Config().WorkerID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("the stopped dispatcher still holds %d maintenance lease(s): no other dispatcher can take over until they expire", n)
	}
}

// A SweepInterval as long as a time.Duration holds still gets its passes
// done: the maintenance lease (three intervals) and the two thirds of it a
// pass may run are capped instead of overflowing into a lease already over,
// which cut every pass short without a word.
func TestLongestSweepIntervalStillMaintains(t *testing.T) {
	clock := newTestClock()
	c, tdb := newClient(t, outbox.Config{Now: clock.Now})
	pool := tdb.Provider.Pool
	enqueueN(t, c, pool, 5)
	log := newOutcomeLog()
	noop := outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	d := startDispatcher(t, c, testConfig(log), noop)
	log.waitFor(t, "all delivered", finalCount(outbox.StatusDelivered, 5))
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	clock.Advance(2 * time.Hour)
	cfg := testConfig(newOutcomeLog())
	cfg.SweepInterval, cfg.Retention = time.Duration(math.MaxInt64), time.Hour
	startDispatcher(t, c, cfg, noop) // its first pass runs at start
	eventually(t, "the first maintenance pass to purge the delivered events", func() bool {
		return countRows(t, pool, "status = 'delivered'") == 0
	})
}

// failingSweepStore's sweep does its work and then fails, as the driver's
// loop of batches does when a later batch fails: it returns what the
// committed batches swept with the error.
type failingSweepStore struct{ driver.Store }

func (s failingSweepStore) Sweep(ctx context.Context, p driver.SweepParams) ([]driver.Swept, error) {
	got, err := s.Store.Sweep(ctx, p)
	if err != nil {
		return got, err
	}
	return got, errors.New("the connection was lost before the next batch")
}

// Events a sweep buried before it failed are dead all the same: they are
// counted in outbox.events.dead (which the docs suggest alerting on) and
// the failure is logged. They were neither counted nor logged.
func TestSweepCountsWhatAFailedSweepBuried(t *testing.T) {
	reader := mtInstall(t)
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	c := clientWrappingStore(t, pool, func(s driver.Store) driver.Store { return failingSweepStore{s} })
	enqueueN(t, c, pool, 3)
	// Out of attempts and never leased again: only the sweep buries them.
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET attempts = 3`); err != nil {
		t.Fatal(err)
	}
	logs := newLogCapture(slog.LevelWarn)
	cfg := testConfig(newOutcomeLog())
	cfg.Logger = logs.logger()
	cfg.SweepInterval = 100 * time.Millisecond
	noop := outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	_, pass := startMaintained(t, c, cfg, noop)
	pass.waitPasses(t, 1)
	if dead := countRows(t, pool, "status = 'dead'"); dead != 3 {
		t.Fatalf("%d events dead after a pass; want 3", dead)
	}
	if v, _ := mtValue(mtCollect(t, reader), "outbox.events.dead", mtTopicAttrs(testTopic)); v != 3 {
		t.Fatalf("outbox.events.dead counted %v of the 3 events the failed sweep buried", v)
	}
	if logs.count(slog.LevelWarn, "sweep of exhausted events failed") == 0 {
		t.Fatalf("the sweep's failure was not logged: %v", logs.records())
	}
}

// stalledSweepStore's sweep waits for its context's end.
type stalledSweepStore struct{ driver.Store }

func (s stalledSweepStore) Sweep(ctx context.Context, _ driver.SweepParams) ([]driver.Swept, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// A maintenance pass that outlives its share of the maintenance lease says
// which step it cut short. It was silent: a pass that never finished left
// its topics unmaintained while its dispatcher kept the lease.
func TestMaintenancePassOutOfTimeIsLogged(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	c := clientWrappingStore(t, tdb.Provider.Pool, func(s driver.Store) driver.Store { return stalledSweepStore{s} })
	logs := newLogCapture(slog.LevelWarn)
	cfg := testConfig(newOutcomeLog())
	cfg.Logger = logs.logger()
	cfg.SweepInterval = 50 * time.Millisecond
	noop := outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	_, pass := startMaintained(t, c, cfg, noop)
	pass.waitPasses(t, 1)
	const msg = "maintenance pass ran out of time; what it left waits for the next pass, and a pass that never " +
		"finishes leaves these topics unmaintained (raise DispatcherConfig.SweepInterval, or find what slows the database)"
	logs.waitForMsg(t, msg, 1)
	for _, r := range logs.records() {
		if r.Msg == msg && r.Attrs["cut_short"] != "the sweep of exhausted events" {
			t.Fatalf("the pass names %q as cut short; want the sweep", r.Attrs["cut_short"])
		}
	}
	if passes, finished := pass.count(); finished != 0 {
		t.Fatalf("%d of %d passes counted as finished; their sweep never returned before the deadline", finished, passes)
	}
}

// A dispatcher started on a schema that lacks migrations of this build (a
// library upgraded, its migrations not run) says so once, naming them;
// on a schema with every migration, or one whose migrations another tool
// applied (no record of them), it says nothing.
func TestDispatcherWarnsOfMissingMigrations(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	var newest string
	if err := pool.QueryRow(ctx, "SELECT to_char(version, 'FM0000') || '_' || name FROM public.modkit_schema_migrations "+
		"ORDER BY version DESC LIMIT 1").Scan(&newest); err != nil {
		t.Fatal(err)
	}
	const warning = "the outbox schema lacks migrations of this build: run them (Client.Migrate, outbox.Module's " +
		"migrations, or modkit-outbox migrate up); until then the database runs the functions of the migrations it has"
	for _, tc := range []struct {
		name, forget string // forget: the rows of the migrations table deleted first
		want         string // the missing migrations logged; "" for no warning
	}{
		{"every migration applied", "", ""},
		{"the newest not applied", "version = (SELECT max(version) FROM public.modkit_schema_migrations)", "[" + newest + "]"},
		{"no record", "true", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.forget != "" {
				if _, err := pool.Exec(ctx, "DELETE FROM public.modkit_schema_migrations WHERE "+tc.forget); err != nil {
					t.Fatal(err)
				}
			}
			logs := newLogCapture(slog.LevelWarn)
			cfg := testConfig(newOutcomeLog())
			cfg.Logger = logs.logger()
			d, passes := startMaintained(t, client, cfg,
				outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
			passes.waitPasses(t, 1) // the check runs before the first pass
			if err := d.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, r := range logs.records() {
				if r.Msg == warning {
					got = append(got, r.Attrs["missing"])
				}
			}
			if tc.want == "" && len(got) > 0 || tc.want != "" && (len(got) != 1 || got[0] != tc.want) {
				t.Fatalf("warnings of missing migrations: %q; want %q", got, tc.want)
			}
		})
	}
}

// A dispatcher whose events table autovacuum does not run on says so once
// at start: without vacuum, the dead row versions that claims and outcomes
// leave pile up (a trial: 105,000 dead against 92,000 live rows in 6
// minutes), and nothing said so.
func TestDispatcherWarnsWhenAutovacuumIsOff(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	var serverOn bool
	if err := pool.QueryRow(ctx, "SELECT current_setting('autovacuum')::bool").Scan(&serverOn); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, alter string
		want        string // the reason logged; "" for no warning
	}{
		{"the table's parameter off", "SET (autovacuum_enabled = false)",
			map[bool]string{true: "the table's autovacuum_enabled storage parameter is false", false: "the server's autovacuum setting is off"}[serverOn]},
		{"the table's parameter reset", "RESET (autovacuum_enabled)",
			map[bool]string{true: "", false: "the server's autovacuum setting is off"}[serverOn]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := pool.Exec(ctx, "ALTER TABLE modkit_outbox_events "+tc.alter); err != nil {
				t.Fatal(err)
			}
			logs := newLogCapture(slog.LevelWarn)
			cfg := testConfig(newOutcomeLog())
			cfg.Logger = logs.logger()
			d, passes := startMaintained(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
			passes.waitPasses(t, 1) // the check runs before the first pass
			if err := d.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, r := range logs.records() {
				if strings.HasPrefix(r.Msg, "autovacuum does not run on the outbox's events") {
					got = append(got, r.Msg)
				}
			}
			if tc.want == "" && len(got) > 0 || tc.want != "" && (len(got) != 1 || !strings.Contains(got[0], "("+tc.want+")")) {
				t.Fatalf("autovacuum warnings: %q; want one saying %q", got, tc.want)
			}
		})
	}
}

// electResignStore runs elections through elect, reporting each one's end
// on elected, and fails every resign.
type electResignStore struct {
	driver.Store
	elect   func(ctx context.Context, st driver.Store, p driver.ElectParams) ([]string, error)
	elected chan struct{}
}

func (s *electResignStore) Elect(ctx context.Context, p driver.ElectParams) ([]string, error) {
	held, err := s.elect(ctx, s.Store, p)
	select {
	case s.elected <- struct{}{}:
	default:
	}
	return held, err
}

func (s *electResignStore) Resign(context.Context, uuid.UUID, []string) error {
	return errors.New("test: the database is down")
}

// A stop resigns the maintenance leadership only when the dispatcher may
// hold a lease (an election won one, or ran out of its time and may have
// committed), and then says when the resign failed. A dispatcher whose
// elections were all refused (its database down since its start) holds
// none: it warned that it could not resign.
func TestStopResignsOnlyALeaseItMayHold(t *testing.T) {
	const warning = "could not resign maintenance leadership; another dispatcher takes over when the lease expires"
	refused := func(context.Context, driver.Store, driver.ElectParams) ([]string, error) {
		return nil, errors.New("test: connection refused")
	}
	outOfTime := func(ctx context.Context, _ driver.Store, _ driver.ElectParams) ([]string, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	won := func(ctx context.Context, st driver.Store, p driver.ElectParams) ([]string, error) {
		return st.Elect(ctx, p)
	}
	for _, tc := range []struct {
		name  string
		elect func(context.Context, driver.Store, driver.ElectParams) ([]string, error)
		warns bool
	}{
		{"every election refused", refused, false},
		{"an election out of time", outOfTime, true},
		{"a lease won", won, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, tdb := newClient(t, outbox.Config{})
			st := &electResignStore{elect: tc.elect, elected: make(chan struct{}, 1)}
			c := clientWrappingStore(t, tdb.Provider.Pool, func(s driver.Store) driver.Store { st.Store = s; return st })
			logs := newLogCapture(slog.LevelWarn)
			cfg := testConfig(newOutcomeLog())
			cfg.Logger = logs.logger()
			cfg.LeaseHeadroom = 500 * time.Millisecond // how long the election out of time waits
			d := startDispatcher(t, c, cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
			recv(t, "an election", st.elected)
			if err := d.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			if got := logs.count(slog.LevelWarn, warning) > 0; got != tc.warns {
				t.Fatalf("warned that the resign failed: %v, want %v", got, tc.warns)
			}
		})
	}
}
