package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// A dispatcher is ready only once a claim succeeds: while its claims fail
// (here they wait on a table lock until their deadline), Start waits and
// Health reports it starting and degraded by the failing claims, its State
// "starting" (it said "degraded", which is for a dispatcher that started);
// when a claim succeeds, Start returns and Health reports it running and
// healthy.
func TestHealthReadyAfterFirstClaim(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	cfg := testConfig(newOutcomeLog())
	cfg.LeaseDuration = time.Second // a claim gives up after LeaseHeadroom, 200ms
	d, err := c.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if h := d.Health(); h.State() != "stopped" || h.Running || h.Starting || h.Degraded {
		t.Fatalf("health before Start: %+v (%s)", h, h.State())
	}

	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, "LOCK TABLE modkit_outbox_events IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	started := make(chan error, 1)
	go func() { started <- d.Start(ctx) }()
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	eventually(t, "a failed claim reported", func() bool { return d.Health().Degraded })
	h := d.Health()
	if !h.Starting || h.Running || h.State() != "starting" || !strings.Contains(strings.Join(h.Problems, "\n"), "claims failing") {
		t.Fatalf("health while claims fail before the first success: %+v (%s)", h, h.State())
	}
	// The error is in ClaimError, not quoted in Problems, which anyone
	// who sees the health may read.
	if h.ClaimError == nil || strings.Contains(strings.Join(h.Problems, "\n"), h.ClaimError.Error()) {
		t.Fatalf("health while claims fail: ClaimError %v, problems %q: want the error in ClaimError only", h.ClaimError, h.Problems)
	}
	select {
	case err := <-started:
		t.Fatalf("Start returned (%v) before any claim succeeded", err)
	default:
	}

	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := recv(t, "Start to return", started); err != nil {
		t.Fatalf("start: %v", err)
	}
	if h := d.Health(); !h.Running || h.Starting || h.Degraded || len(h.Problems) != 0 || h.ClaimError != nil || h.State() != "running" {
		t.Fatalf("health after the first claim: %+v (%s)", h, h.State())
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if h := d.Health(); h.State() != "stopped" {
		t.Fatalf("health after Stop: %+v (%s)", h, h.State())
	}
}

// State sums Health up: "starting" until the first claim succeeds, even
// while failing claims degrade it; "degraded" once started.
func TestHealthState(t *testing.T) {
	for _, tc := range []struct {
		h    outbox.Health
		want string
	}{
		{outbox.Health{}, "stopped"},
		{outbox.Health{Starting: true}, "starting"},
		{outbox.Health{Starting: true, Degraded: true, Problems: []string{"claims failing"}}, "starting"},
		{outbox.Health{Running: true}, "running"},
		{outbox.Health{Running: true, Degraded: true, Problems: []string{"claims failing"}}, "degraded"},
	} {
		if got := tc.h.State(); got != tc.want {
			t.Errorf("State of %+v: %q, want %q", tc.h, got, tc.want)
		}
	}
}

// failingCompleteStore fails every outcome write while failing is set.
type failingCompleteStore struct {
	driver.Store
	failing atomic.Bool
}

func (s *failingCompleteStore) Complete(ctx context.Context, tx any, worker uuid.UUID, o []driver.Outcome) ([]bool, error) {
	if s.failing.Load() {
		return nil, errors.New("test: outcome writes fail")
	}
	return s.Store.Complete(ctx, tx, worker, o)
}

// While outcome writes fail, events are published but never marked
// delivered (and are published again when their leases end): Health says
// so, and is healthy again once a write succeeds.
func TestHealthDegradedWhileOutcomeWritesFail(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	store := &failingCompleteStore{}
	store.failing.Store(true)
	fc := clientWrappingStore(t, tdb.Provider.Pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	id := enqueueN(t, c, tdb.Provider.Pool, 1)[0]
	outcomes := newOutcomeLog()
	d := startDispatcher(t, fc, testConfig(outcomes), outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	eventually(t, "failing outcome writes reported", func() bool { return d.Health().Degraded })
	if h := d.Health(); !h.Running || !strings.Contains(strings.Join(h.Problems, "\n"), "recording outcomes failing since") {
		t.Fatalf("health while outcome writes fail: %+v", h)
	}
	store.failing.Store(false)
	outcomes.waitFor(t, "the delivery recorded", func(m map[uuid.UUID][]outbox.Outcome) bool {
		return slices.ContainsFunc(m[id], func(o outbox.Outcome) bool { return o.Status == outbox.StatusDelivered })
	})
	if h := d.Health(); h.Degraded || len(h.Problems) > 0 {
		t.Fatalf("health after an outcome write succeeded: %+v", h)
	}
}

// A stop whose time runs out while outcome writes fail says so: Stop
// returns an error counting the outcomes not recorded (their events will be
// published again when their leases end), and the log names the stop, not
// the leases, which had most of their time left. Stop returned nil, as if
// every outcome had been recorded, and the log said the leases had ended.
func TestStopSaysWhichOutcomesItCouldNotRecord(t *testing.T) {
	reader := mtInstall(t)
	c, tdb := newClient(t, outbox.Config{})
	store := &failingCompleteStore{}
	store.failing.Store(true)
	fc := clientWrappingStore(t, tdb.Provider.Pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	enqueueN(t, c, tdb.Provider.Pool, 1)
	logs := newLogCapture(slog.LevelWarn)
	cfg := testConfig(newOutcomeLog())
	cfg.StopTimeout = time.Second
	cfg.Logger = logs.logger()
	d, err := fc.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the failing outcome write reported", func() bool { return d.Health().Degraded })
	err = d.Stop(ctx)
	if err == nil || !strings.Contains(err.Error(), "1 outcome(s) not recorded") {
		t.Fatalf("Stop while the outcome could not be recorded: %v; want an error counting it", err)
	}
	stopMsg := "could not record outcomes before the stop's time ran out; the events will be delivered again when their leases end"
	if logs.count(slog.LevelWarn, stopMsg) != 1 ||
		logs.count(slog.LevelWarn, "could not record outcomes before the leases ended; the events will be delivered again") != 0 {
		t.Fatalf("log of the stop: %v", logs.records())
	}
	// The metrics count it too (OnOutcome is not called for it).
	if v, _ := mtValue(mtCollect(t, reader), "outbox.events.unrecorded", mtTopicAttrs(testTopic)); v != 1 {
		t.Fatalf("outbox.events.unrecorded after the stop: %v, want 1", v)
	}
	// The next run starts afresh: its clean stop returns nil.
	store.failing.Store(false)
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("a clean stop after one that could not record: %v", err)
	}
}

// A dispatcher whose deliveries all go through HandleTx records each
// outcome in the handler's transaction, not through the completer's writes:
// once one of those is recorded, the failing spell of outcome writes that
// Health reports is over. It stayed degraded for ever (only the completer's
// writes ended it). The failing write here is the completer's, given up at
// once as its context is done, as when the leases end while writes fail.
func TestHealthRecoversWhenTransactionalDeliveriesRecordOutcomes(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	store := &failingCompleteStore{}
	fc := clientWrappingStore(t, pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	outcomes := newOutcomeLog()
	d := startDispatcher(t, fc, testConfig(outcomes), outbox.Publisher{Topic: testTopic,
		HandleTx: func(context.Context, pgx.Tx, outbox.Delivery) error { return nil }})

	store.failing.Store(true)
	done, cancel := context.WithCancel(ctx)
	cancel()
	outbox.SettleInOneBatch(done, d, outbox.SettleItem{Claim: driver.Claimed{ID: uuid.New(), Namespace: testTopic.Namespace,
		Topic: testTopic.Topic, Attempts: 1}, Deliver: true})
	store.failing.Store(false)
	if h := d.Health(); !h.Degraded || !strings.Contains(strings.Join(h.Problems, "\n"), "recording outcomes failing since") {
		t.Fatalf("health after an outcome write failed: %+v", h)
	}

	enqueueN(t, c, pool, 6)
	outcomes.waitFor(t, "the six deliveries through HandleTx", finalCount(outbox.StatusDelivered, 6))
	if h := d.Health(); h.Degraded || len(h.Problems) > 0 {
		t.Fatalf("health after HandleTx recorded outcomes: %+v", h)
	}
}

// nextListen returns what the next call of a test store's Listen reported
// on calls.
func nextListen(t *testing.T, calls <-chan bool) bool {
	t.Helper()
	select {
	case ok := <-calls:
		return ok
	case <-time.After(guard):
		t.Fatal("the listener was not tried again")
		return false
	}
}

// failingListenStore's Listen fails while failing is set; otherwise it
// listens (it calls onReady) until its context ends. Each call reports on
// calls once it has failed or is listening.
type failingListenStore struct {
	driver.Store
	failing atomic.Bool
	calls   chan bool // true: listening
}

func (s *failingListenStore) Listen(ctx context.Context, onReady func(), _ func(string)) error {
	if s.failing.Load() {
		s.calls <- false
		return errors.New("test: the listener cannot connect")
	}
	onReady()
	s.calls <- true
	<-ctx.Done()
	return ctx.Err()
}

// While the notification listener cannot listen, events wait for the poll:
// Health says so (it said nothing), and is healthy again once it listens.
func TestHealthDegradedWhileTheListenerIsDown(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	st := &failingListenStore{calls: make(chan bool, 100)}
	st.failing.Store(true)
	c := clientWrappingStore(t, tdb.Provider.Pool, func(s driver.Store) driver.Store { st.Store = s; return st })
	d := startDispatcher(t, c, testConfig(newOutcomeLog()), outbox.Publisher{Topic: testTopic,
		Publish: func(context.Context, outbox.Delivery) error { return nil }})
	next := func() bool { t.Helper(); return nextListen(t, st.calls) }
	// Two failed attempts: the second begins after the notifier has
	// taken in the first.
	next()
	next()
	h := d.Health()
	if !h.Degraded || !slices.ContainsFunc(h.Problems, func(p string) bool { return strings.Contains(p, "notification listener down") }) {
		t.Fatalf("health while the listener cannot listen: %+v", h)
	}
	st.failing.Store(false)
	for !next() { // attempts already under way may still fail
	}
	if h := d.Health(); h.Degraded {
		t.Fatalf("health once the listener listens: %+v", h)
	}
}

// deafListenStore's Listen listens, and while deaf is set ends as a
// listener that hears nothing does (driver.ErrListenDeaf); otherwise it
// reports a check that came back (wake with the empty topic). Each call
// reports on calls: true once it heard.
type deafListenStore struct {
	driver.Store
	deaf  atomic.Bool
	calls chan bool
}

func (s *deafListenStore) Listen(ctx context.Context, onReady func(), wake func(string)) error {
	onReady()
	if s.deaf.Load() {
		s.calls <- false
		return fmt.Errorf("test: %w", driver.ErrListenDeaf)
	}
	wake("")
	s.calls <- true
	<-ctx.Done()
	return ctx.Err()
}

// A listener that listens but hears nothing (behind PgBouncer in
// transaction mode, its LISTEN reaches no one) leaves events to the poll:
// Health says so, although each reconnect listens again, and is healthy
// once the listener hears.
func TestHealthDegradedWhileTheListenerIsDeaf(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	st := &deafListenStore{calls: make(chan bool, 100)}
	st.deaf.Store(true)
	c := clientWrappingStore(t, tdb.Provider.Pool, func(s driver.Store) driver.Store { st.Store = s; return st })
	d := startDispatcher(t, c, testConfig(newOutcomeLog()), outbox.Publisher{Topic: testTopic,
		Publish: func(context.Context, outbox.Delivery) error { return nil }})
	next := func() bool { t.Helper(); return nextListen(t, st.calls) }
	// Two deaf connections: the second begins after the notifier has
	// taken in the first.
	next()
	next()
	h := d.Health()
	if !h.Degraded || !slices.ContainsFunc(h.Problems, func(p string) bool {
		return strings.Contains(p, "notification listener deaf since") && strings.Contains(p, "ListenOn")
	}) {
		t.Fatalf("health while the listener hears nothing: %+v", h)
	}
	st.deaf.Store(false)
	for !next() { // connections already under way may still be deaf
	}
	if h := d.Health(); h.Degraded {
		t.Fatalf("health once the listener hears: %+v", h)
	}
}

// failingSweepHealthStore's sweep fails while failing is set.
type failingSweepHealthStore struct {
	driver.Store
	failing atomic.Bool
}

func (s *failingSweepHealthStore) Sweep(ctx context.Context, p driver.SweepParams) ([]driver.Swept, error) {
	if s.failing.Load() {
		return nil, errors.New("test: the sweep fails")
	}
	return s.Store.Sweep(ctx, p)
}

// While maintenance fails, exhausted events are not dead-lettered nor
// delivered ones purged: Health says so (it said nothing), and is healthy
// again after a pass that worked.
func TestHealthDegradedWhileMaintenanceFails(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	st := &failingSweepHealthStore{}
	st.failing.Store(true)
	c := clientWrappingStore(t, tdb.Provider.Pool, func(s driver.Store) driver.Store { st.Store = s; return st })
	cfg := testConfig(newOutcomeLog())
	// Passes get 400ms: a pass cut short by a slow machine would also
	// count as failing maintenance.
	cfg.SweepInterval = 200 * time.Millisecond
	d, pass := startMaintained(t, c, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	pass.waitPasses(t, 1)
	h := d.Health()
	if !h.Degraded || !slices.ContainsFunc(h.Problems, func(p string) bool { return strings.Contains(p, "maintenance failing") }) {
		t.Fatalf("health while the sweep fails: %+v", h)
	}
	st.failing.Store(false)
	pass.waitFinishedPasses(t, 2) // the second began after the sweep was fixed
	if h := d.Health(); h.Degraded {
		t.Fatalf("health after a pass that worked: %+v", h)
	}
}

// failingElectStore's elections fail while failing is set, and report each
// failure on failed.
type failingElectStore struct {
	driver.Store
	failing atomic.Bool
	failed  chan struct{}
}

func (s *failingElectStore) Elect(ctx context.Context, p driver.ElectParams) ([]string, error) {
	if s.failing.Load() {
		select {
		case s.failed <- struct{}{}:
		default:
		}
		return nil, errors.New("test: connection refused")
	}
	return s.Store.Elect(ctx, p)
}

// After a maintenance election failed (a database blip), the election is
// tried again within seconds, not at the next SweepInterval: once the
// database answers, a pass runs and Health is no longer degraded. It stayed
// degraded, reporting failing maintenance, until the next SweepInterval (an
// hour here, 30s by default) although claims worked again.
func TestHealthRecoversSoonAfterAFailedElection(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	st := &failingElectStore{failed: make(chan struct{}, 1)}
	st.failing.Store(true)
	c := clientWrappingStore(t, tdb.Provider.Pool, func(s driver.Store) driver.Store { st.Store = s; return st })
	cfg := testConfig(newOutcomeLog())
	cfg.SweepInterval = time.Hour
	d, pass := startMaintained(t, c, cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	eventually(t, "failing maintenance reported", func() bool {
		return slices.ContainsFunc(d.Health().Problems, func(p string) bool { return strings.Contains(p, "maintenance failing") })
	})
	recv(t, "a failed election", st.failed)
	recv(t, "the election tried again", st.failed)
	st.failing.Store(false)
	pass.waitFinishedPasses(t, 1)
	if h := d.Health(); h.Degraded {
		t.Fatalf("health after the election worked again and its pass finished: %+v", h)
	}
}

// failingDepthStore's reads of the depth gauges fail while failing is set.
type failingDepthStore struct {
	driver.Store
	failing atomic.Bool
}

func (s *failingDepthStore) Depth(ctx context.Context, topics []string) ([]driver.DepthRow, error) {
	if s.failing.Load() {
		return nil, errors.New("test: statement timeout")
	}
	return s.Store.Depth(ctx, topics)
}

// While the depth gauges cannot be read, they are not reported (they kept
// their last values, so that an alert on the oldest event's age stayed
// quiet while events piled up) and Health says maintenance is failing (it
// said nothing); both recover with a read that works.
func TestDepthReadFailureIsNotHidden(t *testing.T) {
	reader := mtInstall(t)
	_, tdb := newClient(t, outbox.Config{})
	st := &failingDepthStore{}
	c := clientWrappingStore(t, tdb.Provider.Pool, func(s driver.Store) driver.Store { st.Store = s; return st })
	cfg := testConfig(newOutcomeLog())
	cfg.SweepInterval = 200 * time.Millisecond
	d, pass := startMaintained(t, c, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	attrs := mtTopicAttrs(testTopic)
	pass.waitFinishedPasses(t, 1)
	if _, n := mtValue(mtCollect(t, reader), "outbox.pending.depth", attrs); n != 1 {
		t.Fatalf("pending depth reported %d times after a pass that read it, want once", n)
	}
	st.failing.Store(true)
	pass.waitPasses(t, 2) // the second began after the reads began to fail
	if _, n := mtValue(mtCollect(t, reader), "outbox.pending.depth", attrs); n != 0 {
		t.Errorf("pending depth still reported while it cannot be read")
	}
	if h := d.Health(); !h.Degraded || !slices.ContainsFunc(h.Problems, func(p string) bool { return strings.Contains(p, "maintenance failing") }) {
		t.Errorf("health while the depth cannot be read: %+v", h)
	}
	st.failing.Store(false)
	pass.waitFinishedPasses(t, 2)
	if _, n := mtValue(mtCollect(t, reader), "outbox.pending.depth", attrs); n != 1 {
		t.Errorf("pending depth reported %d times once it is read again, want once", n)
	}
	if h := d.Health(); h.Degraded {
		t.Errorf("health once the depth is read again: %+v", h)
	}
}

// The graph's *Dispatcher is nil in an fx app without publishers: its
// Health is the zero Health, where reading it panicked.
func TestHealthOfANilDispatcher(t *testing.T) {
	var d *outbox.Dispatcher
	if h := d.Health(); h.Running || h.Starting || h.Degraded || len(h.Problems) != 0 {
		t.Fatalf("health of a nil dispatcher: %+v, want the zero Health", h)
	}
}

// A topic whose last publishes all failed (its broker or endpoint is
// down, say) makes the dispatcher degraded once three in a row have
// failed, naming the topic and when, until a publish delivers. Health
// said nothing of it: the failures showed only in the log and the
// events' history. Permanent errors (the event's fault) do not count.
func TestHealthDegradedWhileATopicsPublishesFail(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	// mode: 0 the endpoint is down, 1 up, 2 every event is poison, 3 a
	// publish waits for up (set by the third failure, so that the check of
	// three failures in a row is not raced by the next retry's).
	var mode atomic.Int32
	var failures atomic.Int32
	up := make(chan struct{})
	outcomes := newOutcomeLog()
	cfg := testConfig(outcomes)
	cfg.MaxAttempts = 2
	d := startDispatcher(t, c, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error {
		switch mode.Load() {
		case 0:
			if failures.Add(1) == 3 {
				mode.Store(3)
			}
			return errors.New("the endpoint is down")
		case 2:
			return outbox.Permanent(errors.New("poison"))
		case 3:
			<-up
		}
		return nil
	}})
	var upOnce sync.Once
	letUp := func() { upOnce.Do(func() { close(up) }) }
	t.Cleanup(letUp) // before the dispatcher's stop, should the test end early
	problem := func() string {
		for _, p := range d.Health().Problems {
			if strings.Contains(p, "publishes failed") {
				return p
			}
		}
		return ""
	}

	enqueueN(t, c, pool, 1)
	outcomes.waitFor(t, "the first event dead after two failed attempts", finalCount(outbox.StatusDead, 1))
	if h := d.Health(); h.Degraded {
		t.Fatalf("health after two failed publishes: %+v, want not degraded", h)
	}
	second := enqueueN(t, c, pool, 1)[0]
	outcomes.waitFor(t, "the second event's first attempt failed", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m[second]) >= 1 })
	if p := problem(); !d.Health().Degraded || !strings.Contains(p, "topic "+testTopic.String()+": its last 3 publishes failed, from ") {
		t.Fatalf("health after three failed publishes in a row: %+v, want the topic named", d.Health())
	}

	mode.Store(1)
	letUp()
	outcomes.waitFor(t, "the second event delivered", func(m map[uuid.UUID][]outbox.Outcome) bool {
		os := m[second]
		return len(os) > 0 && os[len(os)-1].Status == outbox.StatusDelivered
	})
	if h := d.Health(); h.Degraded || problem() != "" {
		t.Fatalf("health once a publish delivered: %+v, want healthy", h)
	}

	// Failures that stopped coming (the topic's events all dead, none
	// enqueued since) are reported for ten minutes after the last.
	mode.Store(0)
	quiet := enqueueN(t, c, pool, 2)
	outcomes.waitFor(t, "two more events dead", allEnded(outbox.StatusDead, quiet))
	if p := problem(); !strings.Contains(p, "its last 4 publishes failed") {
		t.Fatalf("health after four failed publishes in a row: %+v, want the topic named", d.Health())
	}
	outbox.AgeTopicFailures(d, 9*time.Minute+50*time.Second)
	if p := problem(); !d.Health().Degraded || p == "" {
		t.Fatalf("health 9m50s after the last failure: %+v, want the topic still named", d.Health())
	}
	outbox.AgeTopicFailures(d, 20*time.Second)
	if h := d.Health(); h.Degraded || problem() != "" {
		t.Fatalf("health ten minutes after the last failure: %+v, want healthy", h)
	}

	mode.Store(2)
	poison := enqueueN(t, c, pool, 3)
	outcomes.waitFor(t, "three poison events dead", allEnded(outbox.StatusDead, poison))
	if h := d.Health(); h.Degraded {
		t.Fatalf("health after three Permanent failures: %+v, want not degraded (the events were at fault)", h)
	}
}

// lateClaimStore answers its first claim that leases events only when
// released: the claim commits at once, its answer waits (a server frozen
// after the commit, say). Cancelled meanwhile, it returns the context's
// error, as pgx does, the events leased all the same.
type lateClaimStore struct {
	driver.Store
	armed   atomic.Bool
	held    chan struct{} // closed when the claim committed and waits
	release chan struct{} // close to let its answer through
}

func (s *lateClaimStore) Claim(ctx context.Context, p driver.ClaimParams) ([]driver.Claimed, error) {
	got, err := s.Store.Claim(ctx, p)
	if err != nil || len(got) == 0 || !s.armed.CompareAndSwap(true, false) {
		return got, err
	}
	close(s.held)
	select {
	case <-s.release:
		return got, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// A claim that commits but answers after the claimer stopped waiting
// (LeaseHeadroom) has its events given back when it answers, without using
// an attempt. The claim was cancelled, its events stranded until their
// lease ended and each charged an attempt it never had: a trial's 45 s
// freeze dead-lettered events delivered once, with MaxAttempts 2.
func TestALateClaimsEventsAreGivenBack(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	store := &lateClaimStore{held: make(chan struct{}), release: make(chan struct{})}
	fc := clientWrappingStore(t, pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	outcomes := newOutcomeLog()
	cfg := testConfig(outcomes)
	cfg.LeaseHeadroom = 100 * time.Millisecond
	d := startDispatcher(t, fc, cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	store.armed.Store(true)
	id := enqueueN(t, c, pool, 1)[0]
	recv(t, "the claim committed, its answer held", store.held)
	eventually(t, "the claimer giving up on the claim", func() bool {
		err := d.Health().ClaimError
		return err != nil && strings.Contains(err.Error(), "had not answered after LeaseHeadroom")
	})
	close(store.release)
	outcomes.waitFor(t, "the event delivered", finalCount(outbox.StatusDelivered, 1))
	if e := get(t, c, id); e.Attempts != 1 {
		t.Fatalf("the event was delivered on attempt %d, want 1 (the late claim's attempt given back)", e.Attempts)
	}
	h, err := c.Admin().History(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 2 || h[0].Outcome != "released" || !strings.Contains(h[0].Detail, "answered after the claimer") {
		t.Fatalf("history: %+v, want the give-back, then the delivery", h)
	}
}

// A stop while a late claim still waits for its answer ends that claim
// as the stop bounds its statements, and returns: the run waits for the
// claim's goroutine, which would otherwise outlive Stop.
func TestStopWhileALateClaimWaits(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	store := &lateClaimStore{held: make(chan struct{}), release: make(chan struct{})}
	fc := clientWrappingStore(t, pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	cfg := testConfig(newOutcomeLog())
	cfg.LeaseHeadroom = 100 * time.Millisecond
	cfg.StopTimeout = 2 * time.Second
	d, err := fc.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	store.armed.Store(true)
	enqueueN(t, c, pool, 1)
	recv(t, "the claim committed, its answer held", store.held)
	eventually(t, "the claimer giving up on the claim", func() bool {
		err := d.Health().ClaimError
		return err != nil && strings.Contains(err.Error(), "had not answered after LeaseHeadroom")
	})
	stopped := make(chan error, 1)
	go func() { stopped <- d.Stop(ctx) }()
	if err := recv(t, "Stop to return while the late claim's answer is held", stopped); err != nil {
		t.Logf("stop: %v", err) // the claim's events were not given back; their lease ends
	}
	if h := d.Health(); h.Running {
		t.Fatalf("health after Stop: %+v", h)
	}
}
