package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

func TestDispatcherDelivers(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, client, pool, 300)
	log := newOutcomeLog()
	var published sync.Map
	var deadlineOK atomic.Bool
	deadlineOK.Store(true)
	var leaseErr atomic.Pointer[error]
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, d outbox.Delivery) error {
		// The publish context ends before the lease does: the event is
		// processing under this claim while the publisher runs, so its
		// row holds the lease's end.
		var leaseEnd time.Time
		if err := pool.QueryRow(ctx, "SELECT locked_until FROM modkit_outbox_events WHERE id = $1 AND status = 'processing' AND attempts = $2",
			d.ID, d.Attempt).Scan(&leaseEnd); err != nil {
			err = fmt.Errorf("read the lease of %s: %w", d.ID, err)
			leaseErr.CompareAndSwap(nil, &err)
			return err
		}
		if dl, ok := ctx.Deadline(); !ok || !dl.Before(leaseEnd) {
			deadlineOK.Store(false)
		}
		published.Store(d.ID, d.Attempt)
		return nil
	}})
	log.waitFor(t, "300 deliveries", finalCount(outbox.StatusDelivered, 300))
	if err := leaseErr.Load(); err != nil {
		t.Fatal(*err)
	}
	for _, id := range ids {
		if _, ok := published.Load(id); !ok {
			t.Fatalf("event %s not published", id)
		}
	}
	if c := countRows(t, pool, "status = 'delivered'"); c != 300 {
		t.Fatalf("%d delivered rows, want 300", c)
	}
	if !deadlineOK.Load() {
		t.Fatal("a publish context had no deadline, or one past the lease")
	}
}

func TestDispatcherRetriesThenDeadLetters(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	flaky := enqueueN(t, client, pool, 1)[0]
	poison, err := client.Enqueue(ctx, pool, outbox.Message{Namespace: "test", Topic: "poison", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	log := newOutcomeLog()
	var calls sync.Map
	count := func(id uuid.UUID) int {
		v, _ := calls.LoadOrStore(id, new(atomic.Int32))
		return int(v.(*atomic.Int32).Add(1))
	}
	startDispatcher(t, client, testConfig(log),
		outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, d outbox.Delivery) error {
			if count(d.ID) < 3 {
				return fmt.Errorf("transient %d", d.Attempt)
			}
			return nil
		}},
		outbox.Publisher{Topic: outbox.Topic{Namespace: "test", Topic: "poison"}, Publish: func(ctx context.Context, d outbox.Delivery) error {
			count(d.ID)
			return errors.New("always broken")
		}},
	)
	log.waitFor(t, "flaky delivered and poison dead", func(m map[uuid.UUID][]outbox.Outcome) bool {
		f, p := m[flaky], m[poison.ID]
		return len(f) > 0 && f[len(f)-1].Status == outbox.StatusDelivered && len(p) > 0 && p[len(p)-1].Status == outbox.StatusDead
	})
	log.mu.Lock()
	f, p := log.byID[flaky], log.byID[poison.ID]
	log.mu.Unlock()
	if len(f) != 3 || f[0].Status != outbox.StatusPending || f[1].Status != outbox.StatusPending || f[0].RetryIn <= 0 ||
		f[0].Released || f[1].Released {
		t.Fatalf("flaky outcomes: %+v", f)
	}
	if len(p) != 3 { // max attempts 3: two retries, then dead
		t.Fatalf("poison settled %d times, want 3: %+v", len(p), p)
	}
	e := get(t, client, poison.ID)
	if e.Status != outbox.StatusDead || e.Attempts != 3 || !strings.Contains(*e.LastError, "always broken") {
		t.Fatalf("poison row: %+v", e)
	}
}

func TestDispatcherIsolatesPanics(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, client, pool, 20)
	log := newOutcomeLog()
	var panicked atomic.Bool
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, d outbox.Delivery) error {
		if d.ID == ids[7] && panicked.CompareAndSwap(false, true) {
			panic("publisher bug")
		}
		return nil
	}})
	log.waitFor(t, "20 deliveries", finalCount(outbox.StatusDelivered, 20))
	e := get(t, client, ids[7])
	if e.Attempts != 2 || !strings.Contains(*e.LastError, "panicked: publisher bug") {
		t.Fatalf("panicking event: %+v", e)
	}
}

// A publisher that ends its goroutine with runtime.Goexit (t.Fatal or
// t.FailNow in a publisher under test) fails that attempt, with an error
// that says so, and its slot goes on to the next event. The call never
// returned: it was abandoned at its deadline, the event given back without
// using an attempt, and its slot held for good, so a topic of one slot was
// paused for ever. The same through HandleTx, whose transaction is rolled
// back.
func TestDispatcherSurvivesAPublisherThatCallsGoexit(t *testing.T) {
	for _, viaTx := range []bool{false, true} {
		t.Run(map[bool]string{false: "Publish", true: "HandleTx"}[viaTx], func(t *testing.T) {
			client, tdb := newClient(t, outbox.Config{})
			pool := tdb.Provider.Pool
			ids := enqueueN(t, client, pool, 5)
			log := newOutcomeLog()
			var exited atomic.Bool
			maybeExit := func(d outbox.Delivery) {
				if d.ID == ids[2] && exited.CompareAndSwap(false, true) {
					runtime.Goexit()
				}
			}
			pub := outbox.Publisher{Topic: testTopic, Concurrency: 1}
			if viaTx {
				pub.HandleTx = func(_ context.Context, _ pgx.Tx, d outbox.Delivery) error { maybeExit(d); return nil }
			} else {
				pub.Publish = func(_ context.Context, d outbox.Delivery) error { maybeExit(d); return nil }
			}
			cfg := testConfig(log)
			cfg.LeaseDuration = 2 * time.Second // an abandonment, the old behaviour, comes at once
			d := startDispatcher(t, client, cfg, pub)
			log.waitFor(t, "5 deliveries, or an abandoned publish", func(m map[uuid.UUID][]outbox.Outcome) bool {
				return finalCount(outbox.StatusDelivered, 5)(m) || d.Health().Abandoned > 0
			})
			if h := d.Health(); h.Abandoned > 0 {
				t.Fatalf("the publish that called Goexit was abandoned: %+v", h)
			}
			e := get(t, client, ids[2])
			if e.Status != outbox.StatusDelivered || e.Attempts != 2 || e.LastError == nil || !strings.Contains(*e.LastError, "runtime.Goexit") {
				t.Fatalf("the event whose publish called Goexit: %+v", e)
			}
		})
	}
}

// nilSendError is an error type whose Error method reads its receiver.
type nilSendError struct{ code int }

func (e *nilSendError) Error() string { return fmt.Sprintf("send failed: %d", e.code) }

// A publisher that returns a nil pointer as its error (var err *T; return
// err), whose Error method then panics, fails that attempt with an error
// that says so. The dispatcher read the error after the publisher's call,
// outside its panic guard, and the panic ended the process, again after
// each restart.
func TestDispatcherSurvivesANilPointerError(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, client, pool, 5)
	log := newOutcomeLog()
	var failed atomic.Bool
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, d outbox.Delivery) error {
		if d.ID == ids[2] && failed.CompareAndSwap(false, true) {
			var err *nilSendError
			return err
		}
		return nil
	}})
	log.waitFor(t, "5 deliveries", finalCount(outbox.StatusDelivered, 5))
	e := get(t, client, ids[2])
	if e.Attempts != 2 || e.LastError == nil || !strings.Contains(*e.LastError, "nilSendError whose methods panic") {
		t.Fatalf("the event whose publish returned a nil pointer: %+v", e)
	}
}

// An event written with one's own SQL whose headers hold values that are
// not strings (the table takes any JSON object) is delivered with their
// JSON text, and the events claimed with it are delivered too: the claim
// failed to decode it after leasing the batch, and the batch went
// unpublished until the sweep buried it.
func TestHeadersOfOwnSQLWithOtherValues(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	own := uuid.Must(uuid.NewV7())
	if _, err := pool.Exec(ctx, `INSERT INTO modkit_outbox_events (id, namespace, topic, payload, headers)
		VALUES ($1, $2, $3, '{}', '{"retries": 3, "ok": true, "s": "x", "n": null, "o": {"a": 1}}')`,
		own, testTopic.Namespace, testTopic.Topic); err != nil {
		t.Fatal(err)
	}
	enqueueN(t, client, pool, 5)
	log := newOutcomeLog()
	got := make(chan map[string]string, 1)
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(_ context.Context, d outbox.Delivery) error {
		if d.ID == own {
			got <- d.Headers
		}
		return nil
	}})
	log.waitFor(t, "6 deliveries", finalCount(outbox.StatusDelivered, 6))
	want := map[string]string{"retries": "3", "ok": "true", "s": "x", "n": "null", "o": `{"a": 1}`}
	if h := <-got; !maps.Equal(h, want) {
		t.Fatalf("headers delivered %v, want %v", h, want)
	}
	if e := get(t, client, own); !maps.Equal(e.Headers, want) {
		t.Fatalf("Admin.Get headers %v, want %v", e.Headers, want)
	}
}

// Two dispatchers on separate pools, like two replicas, share the work and
// never publish one event twice under valid leases at once.
func TestTwoDispatchersShareWork(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	ids := enqueueN(t, client, tdb.Provider.Pool, 2000)
	log := newOutcomeLog()
	var mu sync.Mutex
	inFlight := map[uuid.UUID]bool{}
	published := map[uuid.UUID]int{}
	var overlap atomic.Bool
	pub := func(ctx context.Context, d outbox.Delivery) error {
		mu.Lock()
		if inFlight[d.ID] {
			overlap.Store(true)
		}
		inFlight[d.ID] = true
		published[d.ID]++
		mu.Unlock()
		mu.Lock()
		delete(inFlight, d.ID)
		mu.Unlock()
		return nil
	}
	cfg := testConfig(log)
	cfg.BatchSize = 50
	for range 2 {
		startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfg, outbox.Publisher{Topic: testTopic, Publish: pub})
	}
	log.waitFor(t, "2000 deliveries", finalCount(outbox.StatusDelivered, 2000))
	if overlap.Load() {
		t.Fatal("an event was published by two holders at once")
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if published[id] != 1 {
			t.Fatalf("event %s published %d times, want once (no crashes here)", id, published[id])
		}
	}
}

func TestDispatcherWakesOnNotifyAndSurvivesListenerKill(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	log := newOutcomeLog()
	cfg := testConfig(log)
	// Polling alone would take ten minutes, far past the wait guard.
	cfg.LeaseDuration, cfg.PollInterval = time.Hour, 10*time.Minute
	delivered := make(chan uuid.UUID, 10)
	startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, d outbox.Delivery) error {
		delivered <- d.ID
		return nil
	}})
	expect := func(id uuid.UUID) {
		t.Helper()
		select {
		case got := <-delivered:
			if got != id {
				t.Fatalf("delivered %s, want %s", got, id)
			}
		case <-time.After(guard):
			t.Fatalf("event %s not delivered: the NOTIFY wake-up did not work", id)
		}
	}
	listenerPID := func() int {
		var pid int
		if err := pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND datname = current_database()`).Scan(&pid); err != nil {
			return 0
		}
		return pid
	}
	first := enqueueN(t, client, pool, 1)[0]
	expect(first)
	pid := listenerPID()
	if pid == 0 {
		t.Fatal("no LISTEN connection found")
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	second := enqueueN(t, client, pool, 1)[0]
	expect(second)
}

func TestDispatcherPollOnly(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{DisableNotify: true})
	pool := tdb.Provider.Pool
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.PollOnly = true
	startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	enqueueN(t, client, pool, 5)
	log.waitFor(t, "5 deliveries by polling", finalCount(outbox.StatusDelivered, 5))
	var listeners int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND datname = current_database()`).Scan(&listeners); err != nil {
		t.Fatal(err)
	}
	if listeners != 0 {
		t.Fatal("poll-only dispatcher opened a LISTEN connection")
	}
}

// Stop gives claimed-but-unstarted events back at once, lets the publish in
// flight finish, and records its outcome.
func TestStopReleasesUnstartedEvents(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, client, pool, 10)
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.Concurrency, cfg.BatchSize = 1, 10
	logs := newLogCapture(slog.LevelInfo)
	cfg.Logger = logs.logger()
	entered, release := make(chan uuid.UUID, 1), make(chan struct{})
	d, err := client.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, d outbox.Delivery) error {
		entered <- d.ID
		<-release
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	var inFlight uuid.UUID
	select {
	case inFlight = <-entered:
	case <-time.After(guard):
		t.Fatal("no publish started")
	}
	stopped := make(chan error, 1)
	go func() { stopped <- d.Stop(ctx) }()
	log.waitFor(t, "9 releases", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m) >= 9 })
	log.mu.Lock()
	for id, outs := range log.byID {
		if id == inFlight || len(outs) != 1 || !outs[0].Released || outs[0].Abandoned || outs[0].LeaseLost || outs[0].Status != outbox.StatusPending {
			t.Errorf("event %s: outcomes %+v while the publish is in flight, want one release", id, outs)
		}
	}
	log.mu.Unlock()
	for _, id := range ids {
		if id == inFlight {
			continue
		}
		if e := get(t, client, id); e.Status != outbox.StatusPending || e.Attempts != 0 || e.LockedBy != nil {
			t.Fatalf("unstarted event not released while the publish is in flight: %+v", e)
		}
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	if e := get(t, client, inFlight); e.Status != outbox.StatusDelivered {
		t.Fatalf("in-flight publish not recorded on stop: %+v", e)
	}
	// The stop sums up what it gave back, in one line.
	var summary []logRecord
	for _, r := range logs.records() {
		if strings.HasPrefix(r.Msg, "stopped: events given back unpublished") {
			summary = append(summary, r)
		}
	}
	if len(summary) != 1 || summary[0].Attrs["given_back"] != "9" || summary[0].Attrs["of_them_abandoned"] != "0" {
		t.Fatalf("the stop's summary: %+v; want one saying 9 given back, none abandoned", summary)
	}
}

// Stop records the outcome of a publish that was in flight when it began
// and returned long before the stop timeout. Repeated, because the outcome
// and the end of the stop race each other.
func TestStopRecordsInFlightOutcome(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	for round := range 40 {
		id := enqueueN(t, client, pool, 1)[0]
		log := newOutcomeLog()
		entered, release := make(chan struct{}), make(chan struct{})
		d, err := client.NewDispatcher(testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error {
			close(entered)
			<-release
			return nil
		}})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Start(ctx); err != nil {
			t.Fatal(err)
		}
		recv(t, "the publish", entered)
		if err := stopDuringPublish(t, d, release); err != nil {
			t.Fatal(err)
		}
		log.mu.Lock()
		outs := log.byID[id]
		log.mu.Unlock()
		if e := get(t, client, id); e.Status != outbox.StatusDelivered || len(outs) != 1 {
			t.Fatalf("round %d: after Stop the in-flight publish's event is %s with outcomes %+v; want delivered and reported", round, e.Status, outs)
		}
	}
}

// A Stop whose context ends before StopTimeout (fx's stop timeout, 15s,
// against the default 30s) fits its stages into the time the context
// leaves: the publish in flight is cancelled in time, its event goes back
// with its attempt not counted and the outcome is recorded, all before
// Stop returns, instead of Stop timing out with the event still leased.
func TestStopFitsItsContextDeadline(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	id := enqueueN(t, client, tdb.Provider.Pool, 1)[0]
	log := newOutcomeLog()
	entered := make(chan struct{})
	cfg := testConfig(log) // StopTimeout 30s
	d := startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, _ outbox.Delivery) error {
		close(entered)
		<-ctx.Done() // a slow consumer: only the stop ends it
		return ctx.Err()
	}})
	recv(t, "the publish", entered)
	stopCtx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	if err := d.Stop(stopCtx); err != nil {
		t.Fatalf("stop with a 4s context and a 30s StopTimeout: %v", err)
	}
	log.mu.Lock()
	outs := log.byID[id]
	log.mu.Unlock()
	e := get(t, client, id)
	if e.Status != outbox.StatusPending || e.Attempts != 0 || len(outs) != 1 || !outs[0].Released {
		t.Fatalf("after Stop the event is %s with %d attempts and outcomes %+v; want pending, its attempt not counted, one released outcome",
			e.Status, e.Attempts, outs)
	}
}

// A publish that ignores its context and is still running when the stop
// runs out of time is abandoned as the stop's last resort: its event goes
// back with its attempt not counted, and its history and the log say that
// the stop ran out of time, not that the publish outlived its deadline
// (its deadline, a 30s lease away, is far off).
func TestStopAbandonsAPublishThatIgnoresItsContext(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	id := enqueueN(t, client, tdb.Provider.Pool, 1)[0]
	log, logs := newOutcomeLog(), newLogCapture(slog.LevelWarn)
	entered, release := make(chan struct{}), make(chan struct{})
	returned := make(chan struct{})
	t.Cleanup(func() { close(release); <-returned })
	cfg := testConfig(log)
	cfg.StopTimeout = 2 * time.Second
	cfg.Logger = logs.logger()
	d := startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error {
		defer close(returned)
		close(entered)
		<-release // deaf to its context
		return nil
	}})
	recv(t, "the publish", entered)
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
	log.mu.Lock()
	outs := log.byID[id]
	log.mu.Unlock()
	e := get(t, client, id)
	if e.Status != outbox.StatusPending || e.Attempts != 0 || len(outs) != 1 || !outs[0].Abandoned || !outs[0].Released {
		t.Fatalf("after Stop the event is %s with %d attempts and outcomes %+v; want pending, its attempt not counted, one abandoned outcome",
			e.Status, e.Attempts, outs)
	}
	h, err := client.Admin().History(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 1 || h[0].Outcome != "released" || !strings.Contains(h[0].Detail, "stop ran out of time") {
		t.Fatalf("the event's history is %+v; want one release saying the stop ran out of time", h)
	}
	for _, r := range logs.records() {
		if strings.Contains(r.Msg, "outlived its deadline") || strings.Contains(r.Msg, "topic paused") {
			t.Errorf("logged %q for a publish abandoned by a stop", r.Msg)
		}
	}
	if logs.count(slog.LevelWarn, "publish still running when the stop ran out of time (the publisher ignores its context); "+
		"abandoned, the event goes back without using an attempt") != 1 {
		t.Errorf("no warning for the abandoned publish: %v", logs.records())
	}
}

// NewDispatcher warns when its publishers with HandleTx can hold more
// pool connections at once than the pool opens (plus the three its
// claims, outcome writes and listener want): their calls would wait for a
// connection and could run out of their deadline, failing attempts.
func TestNewDispatcherWarnsOfASmallPoolForHandleTx(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pcfg := tdb.Provider.Pool.Config().Copy()
	pcfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	client := clientOn(t, pool, outbox.Config{})
	inTx := outbox.Publisher{Topic: testTopic, HandleTx: func(context.Context, pgx.Tx, outbox.Delivery) error { return nil }}
	plain := outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	inTx32 := inTx
	inTx32.Concurrency = 32
	for _, tc := range []struct {
		name        string
		concurrency int
		pub         outbox.Publisher
		warns       bool
		lane        int // the topic's limit
	}{
		{"HandleTx, Concurrency 32 set on the publisher", 32, inTx32, true, 32},
		// By default a HandleTx topic runs no more calls than the pool
		// has connections for beside the dispatcher's three: one here.
		// It ran 32, and every start of such an app warned.
		{"HandleTx, dispatcher Concurrency 32, the publisher's default", 32, inTx, false, 1},
		{"HandleTx, Concurrency 1", 1, inTx, false, 1},
		{"Publish, Concurrency 32", 32, plain, false, 32},
	} {
		logs := newLogCapture(slog.LevelWarn)
		d, err := client.NewDispatcher(outbox.DispatcherConfig{Concurrency: tc.concurrency, Logger: logs.logger()}, tc.pub)
		if err != nil {
			t.Fatal(err)
		}
		if got := outbox.LaneLimit(d, testTopic); got != tc.lane {
			t.Errorf("%s: the topic runs %d publishes at once, want %d", tc.name, got, tc.lane)
		}
		warnings := len(logs.records())
		warned := slices.ContainsFunc(logs.records(), func(r logRecord) bool {
			return strings.Contains(r.Msg, "may run 32 transactions at once") && strings.Contains(r.Msg, "the pool opens at most 4") &&
				strings.Contains(r.Msg, "raise the pool's MaxConns to 35")
		})
		if warned != tc.warns || (!tc.warns && warnings > 0) {
			t.Errorf("%s: warned %v, want %v (log: %v)", tc.name, warned, tc.warns, logs.records())
		}
	}
}

// A WakeWindow not above the client's NotifyInterval draws a warning (the
// docs said it must exceed it, and nothing said so when it did not).
func TestNewDispatcherWarnsOfAWakeWindowBelowNotifyInterval(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	for _, tc := range []struct {
		name   string
		client outbox.Config
		cfg    outbox.DispatcherConfig
		warns  bool
	}{
		{"defaults", outbox.Config{}, outbox.DispatcherConfig{}, false},
		{"NotifyInterval 100ms, WakeWindow default", outbox.Config{NotifyInterval: 100 * time.Millisecond}, outbox.DispatcherConfig{}, true},
		{"NotifyInterval 100ms, WakeWindow 200ms", outbox.Config{NotifyInterval: 100 * time.Millisecond},
			outbox.DispatcherConfig{WakeWindow: 200 * time.Millisecond}, false},
		{"NotifyInterval 100ms, DisableNotify", outbox.Config{NotifyInterval: 100 * time.Millisecond, DisableNotify: true},
			outbox.DispatcherConfig{}, false},
		{"NotifyInterval 100ms, PollOnly", outbox.Config{NotifyInterval: 100 * time.Millisecond}, outbox.DispatcherConfig{PollOnly: true}, false},
	} {
		logs := newLogCapture(slog.LevelWarn)
		tc.cfg.Logger = logs.logger()
		if _, err := clientOn(t, tdb.Provider.Pool, tc.client).NewDispatcher(tc.cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish}); err != nil {
			t.Fatal(err)
		}
		warned := slices.ContainsFunc(logs.records(), func(r logRecord) bool {
			return strings.Contains(r.Msg, "is not above this client's Config.NotifyInterval")
		})
		if warned != tc.warns {
			t.Errorf("%s: warned %v, want %v (log: %v)", tc.name, warned, tc.warns, logs.records())
		}
	}
}

// A StopTimeout as long as a time.Duration holds ("wait as long as it
// takes") gives in-flight publishes all that time; the stages' arithmetic
// does not overflow into a stop that cancels them at once.
func TestStopTimeoutLongestDuration(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	id := enqueueN(t, client, tdb.Provider.Pool, 1)[0]
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.StopTimeout = time.Duration(math.MaxInt64)
	entered, release := make(chan struct{}), make(chan struct{})
	var cancelled atomic.Bool
	d := startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, _ outbox.Delivery) error {
		close(entered)
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			cancelled.Store(true)
			return ctx.Err()
		}
	}})
	recv(t, "the publish", entered)
	if err := stopDuringPublish(t, d, release); err != nil {
		t.Fatal(err)
	}
	if cancelled.Load() {
		t.Fatal("the in-flight publish was cancelled at once by a stop with the longest StopTimeout")
	}
	if e := get(t, client, id); e.Status != outbox.StatusDelivered {
		t.Fatalf("after Stop the event is %s; want delivered", e.Status)
	}
}

// heldClaimStore holds up the first claim that returns events, after it
// committed, until release is closed: a claim that finishes after a stop.
type heldClaimStore struct {
	driver.Store
	once          atomic.Bool
	held, release chan struct{}
}

func (s *heldClaimStore) Claim(ctx context.Context, p driver.ClaimParams) ([]driver.Claimed, error) {
	got, err := s.Store.Claim(ctx, p)
	if len(got) > 0 && s.once.CompareAndSwap(false, true) {
		close(s.held)
		<-s.release
	}
	return got, err
}

// Events of a claim that commits after Stop began go straight back,
// unpublished and uncharged, and each outcome is reported to OnOutcome as
// any other is.
func TestClaimFinishedAfterStopIsGivenBackAndReported(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{}) // migrated
	pool := tdb.Provider.Pool
	store := &heldClaimStore{held: make(chan struct{}), release: make(chan struct{})}
	c := clientWrappingStore(t, pool, func(st driver.Store) driver.Store { store.Store = st; return store })
	log := newOutcomeLog()
	var published atomic.Int64
	d := startDispatcher(t, c, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error {
		published.Add(1)
		return nil
	}})
	ids := enqueueN(t, c, pool, 3)
	recv(t, "a claim of the events", store.held)
	if err := stopDuringPublish(t, d, store.release); err != nil {
		t.Fatal(err)
	}
	if n := published.Load(); n != 0 {
		t.Fatalf("%d events published by a claim that finished after the stop", n)
	}
	if n := countRows(t, pool, "status = 'pending' AND attempts = 0"); n != len(ids) {
		t.Fatalf("%d of %d events back to pending with no attempt counted", n, len(ids))
	}
	log.mu.Lock()
	defer log.mu.Unlock()
	for _, id := range ids {
		if outs := log.byID[id]; len(outs) != 1 || !outs[0].Released {
			t.Fatalf("event %s: outcomes %+v, want one released outcome reported", id, outs)
		}
	}
}

// stopDuringPublish stops d while one of its publishes is held up, lets
// that publish return (closing release) once the stop has begun, and
// returns Stop's error.
func stopDuringPublish(t *testing.T, d *outbox.Dispatcher, release chan struct{}) error {
	t.Helper()
	stopped := make(chan error, 1)
	go func() { stopped <- d.Stop(ctx) }()
	eventually(t, "the dispatcher stopping", func() bool { return !d.Health().Running })
	close(release)
	return recv(t, "the stop", stopped)
}

func TestTransactionalHandler(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, "CREATE TABLE consumed (event_id uuid NOT NULL, attempt int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	ids := enqueueN(t, client, pool, 3)
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic,
		HandleTx: func(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
			if _, err := tx.Exec(ctx, "INSERT INTO consumed VALUES ($1, $2)", d.ID, d.Attempt); err != nil {
				return err
			}
			switch {
			case d.ID == ids[1] && d.Attempt == 1:
				return errors.New("handler failed") // its insert must roll back
			case d.ID == ids[2] && d.Attempt == 1:
				// The lease ends before the handler commits: the delivered
				// mark in the same transaction is refused and the insert
				// rolls back.
				if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET locked_until = now() - interval '1 second' WHERE id = $1", d.ID); err != nil {
					return err
				}
			}
			return nil
		}})
	// The expired attempt's lease-lost report and the reclaimed attempt's
	// delivery race each other, so wait for both in either order.
	log.waitFor(t, "3 deliveries and one lost lease", func(m map[uuid.UUID][]outbox.Outcome) bool {
		delivered := 0
		for _, outs := range m {
			if slices.ContainsFunc(outs, func(o outbox.Outcome) bool { return !o.LeaseLost && o.Status == outbox.StatusDelivered }) {
				delivered++
			}
		}
		return delivered == 3 && slices.ContainsFunc(m[ids[2]], func(o outbox.Outcome) bool { return o.LeaseLost })
	})
	for _, id := range ids {
		var n, attempt int
		if err := pool.QueryRow(ctx, "SELECT count(*), max(attempt) FROM consumed WHERE event_id = $1", id).Scan(&n, &attempt); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Fatalf("event %s consumed %d times, want exactly once", id, n)
		}
	}
}

// A HandleTx that ends its transaction itself fails its attempt with an
// error saying so in HandleTx's terms; it blamed "the function" of an InTx
// the user never called. The next attempt, which leaves tx open, delivers.
func TestHandleTxThatEndsItsTransaction(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	ids := enqueueN(t, client, tdb.Provider.Pool, 2)
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic,
		HandleTx: func(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
			switch {
			case d.Attempt > 1:
				return nil
			case d.ID == ids[0]:
				return tx.Commit(ctx)
			default:
				if err := tx.Rollback(ctx); err != nil {
					return err
				}
				return errors.New("handler failed")
			}
		}})
	var byID map[uuid.UUID][]outbox.Outcome
	log.waitFor(t, "both delivered on their second attempt", func(m map[uuid.UUID][]outbox.Outcome) bool {
		byID = maps.Clone(m)
		return finalCount(outbox.StatusDelivered, 2)(m)
	})
	for i, want := range []string{"HandleTx committed or rolled back tx itself", "handler failed (and the handler committed or rolled back tx itself first"} {
		outs := byID[ids[i]]
		if len(outs) != 2 || outs[0].Status != outbox.StatusPending || !strings.Contains(outs[0].Error, want) || strings.Contains(outs[0].Error, "InTx") {
			t.Fatalf("event %d: outcomes %+v; want a retry whose error says %q and does not name InTx", i, outs, want)
		}
	}
}

func TestDispatcherConfigValidation(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	noop := func(context.Context, outbox.Delivery) error { return nil }
	chat := outbox.Publisher{Topic: testTopic, Publish: noop, Name: "chat"}
	_, err := client.NewDispatcher(outbox.DispatcherConfig{}, chat, outbox.Publisher{Topic: testTopic, Publish: noop, Name: "billing"})
	if !errors.Is(err, outbox.ErrDuplicatePublisher) || !errors.Is(err, outbox.ErrInvalidConfig) ||
		!strings.Contains(err.Error(), "chat") || !strings.Contains(err.Error(), "billing") {
		t.Fatalf("duplicate publisher: %v", err)
	}
	badPubs := map[string]outbox.Publisher{
		"without a function": {Topic: outbox.Topic{Namespace: "x", Topic: "y"}},
		"with both functions": {Topic: outbox.Topic{Namespace: "x", Topic: "y"}, Publish: noop,
			HandleTx: func(context.Context, pgx.Tx, outbox.Delivery) error { return nil }},
		"with an invalid topic":          {Topic: outbox.Topic{Namespace: "X Y", Topic: "y"}, Publish: noop},
		"with a negative concurrency":    {Topic: outbox.Topic{Namespace: "x", Topic: "y"}, Publish: noop, Concurrency: -1},
		"above the dispatcher's workers": {Topic: outbox.Topic{Namespace: "x", Topic: "y"}, Publish: noop, Concurrency: 33},
	}
	for what, p := range badPubs {
		if _, err := client.NewDispatcher(outbox.DispatcherConfig{}, chat, p); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Errorf("publisher %s: %v, want ErrInvalidConfig", what, err)
		}
	}
	bad := []outbox.DispatcherConfig{
		{LeaseDuration: 3 * time.Second, PollInterval: 2 * time.Second}, // poll > lease/3
		{BatchSize: -1},
		{LeaseDuration: 10 * time.Second, LeaseHeadroom: 10 * time.Second},
		{LeaseDuration: time.Second, LeaseHeadroom: 990 * time.Millisecond}, // 10ms left to publish
		{LeaseHeadroom: time.Millisecond},                                   // every claim would time out
		{Concurrency: -2},
		{MaxAttempts: -1},
		{Retry: outbox.RetryPolicy{BaseDelay: time.Minute, MaxDelay: time.Second}},
	}
	for _, cfg := range bad {
		if _, err := client.NewDispatcher(cfg, chat); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Errorf("config %+v: %v, want ErrInvalidConfig", cfg, err)
		}
	}
	if _, err := outbox.New(nil, outbox.Config{}); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Errorf("client without a driver: %v", err)
	}
	if _, err := outbox.New(outboxpg.New(tdb.Provider.Pool), outbox.Config{Schema: "bad schema"}); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Errorf("client with a bad schema: %v", err)
	}
	if _, err := client.NewDispatcher(outbox.DispatcherConfig{}); err == nil {
		t.Error("dispatcher without publishers accepted")
	}
	d, err := client.NewDispatcher(outbox.DispatcherConfig{}, chat)
	if err != nil {
		t.Fatalf("zero config: %v", err)
	}
	if c := d.Config(); c.PollInterval > c.LeaseDuration/3 || c.BatchSize == 0 || c.MaxAttempts != 10 ||
		c.LeaseDuration != 30*time.Second || c.WorkerID == uuid.Nil || c.LeaseHeadroom <= 0 || c.LeaseHeadroom >= c.LeaseDuration {
		t.Fatalf("defaults: %+v", c)
	}
}

func TestDispatcherFailsFastWithoutTable(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, "DROP TABLE modkit_outbox_events"); err != nil {
		t.Fatal(err)
	}
	d, err := client.NewDispatcher(outbox.DispatcherConfig{Logger: quietLog},
		outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "migrations") {
		t.Fatalf("start without the table: %v", err)
	}
	_ = d.Stop(ctx)
}

// A stale result of an event (a give-back of an earlier claim that reached
// the completer after its lease ended) and the result of the event's next
// claim in one batch: the stale one is refused as lease lost and the
// delivery is recorded. In one write the stale one was tried and the
// delivery dropped, so the event was published again.
func TestStaleResultBesideTheNextClaimsResult(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	id := enqueueN(t, client, pool, 1)[0]
	outcomes := newOutcomeLog()
	cfg := testConfig(outcomes)
	cfg.WorkerID = uuid.New()
	d, err := client.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	if err != nil {
		t.Fatal(err)
	}
	st := admStore(t, pool, "public", nil)
	claim := func() driver.Claimed {
		t.Helper()
		got, err := st.Claim(ctx, driver.ClaimParams{Topics: []string{testTopic.Namespace + ":" + testTopic.Topic}, Limit: 1,
			MaxAttempts: 3, Worker: cfg.WorkerID, Lease: time.Minute})
		if err != nil || len(got) != 1 || got[0].ID != id {
			t.Fatalf("claim: %+v %v, want the event", got, err)
		}
		return got[0]
	}
	stale := claim()
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET locked_until = now() - interval '1 second' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	fresh := claim()
	if fresh.LeaseToken == stale.LeaseToken {
		t.Fatal("the second claim has the first one's lease token")
	}

	outbox.SettleInOneBatch(ctx, d, outbox.SettleItem{Claim: stale}, outbox.SettleItem{Claim: fresh, Deliver: true})
	if ev := get(t, client, id); ev.Status != outbox.StatusDelivered {
		t.Fatalf("the event after the two results: %+v, want delivered", ev)
	}
	outcomes.mu.Lock()
	defer outcomes.mu.Unlock()
	got := outcomes.byID[id]
	if len(got) != 2 || !got[0].LeaseLost || got[1].LeaseLost || got[1].Status != outbox.StatusDelivered {
		t.Fatalf("outcomes %+v, want the stale give-back's lease lost, then the delivery", got)
	}
}

// A topic drains its backlog claim after claim, as its lane frees room,
// beside an idle topic: with no poll or wake-up to fall back on (a poll an
// hour away, a wake window of a nanosecond, no NOTIFY), an empty claim for
// the idle topic, made while the busy topic's lane was full, ended the
// drain until the poll.
func TestDrainBesideAnIdleTopic(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	emptyClaim := make(chan struct{}, 1)
	client := clientWrappingStore(t, pool, func(st driver.Store) driver.Store {
		return &emptyClaimStore{Store: st, empty: emptyClaim}
	})
	enqueueN(t, client, pool, 50)
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.LeaseDuration, cfg.PollInterval = 3*time.Hour, time.Hour
	cfg.WakeWindow, cfg.WakeRecheck = time.Nanosecond, time.Nanosecond
	// Claims of one event, and a lane of one publish and one queued
	// event: the busy topic's lane is full after two claims, and the
	// next claim is for the idle topic alone.
	cfg.BatchSize, cfg.Concurrency = 1, 2
	gate := make(chan struct{})
	busy := func(ctx context.Context, _ outbox.Delivery) error {
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	noop := func(context.Context, outbox.Delivery) error { return nil }
	startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, Publish: busy},
		outbox.Publisher{Topic: outbox.Topic{Namespace: "idle", Topic: "events"}, Publish: noop})
	// The busy topic's lane fills with publishes that wait for the gate,
	// and a claim for the idle topic alone finds nothing.
	select {
	case <-emptyClaim:
	case <-time.After(guard):
		t.Fatal("no claim for the idle topic alone")
	}
	close(gate)
	log.waitFor(t, "the backlog drained", finalCount(outbox.StatusDelivered, 50))
}

// emptyClaimStore reports claims that leased nothing.
type emptyClaimStore struct {
	driver.Store
	empty chan struct{}
}

func (s *emptyClaimStore) Claim(ctx context.Context, p driver.ClaimParams) ([]driver.Claimed, error) {
	got, err := s.Store.Claim(ctx, p)
	if err == nil && len(got) == 0 {
		select {
		case s.empty <- struct{}{}:
		default:
		}
	}
	return got, err
}

// hungResignStore's Resign gets no answer: it waits for its context's end.
type hungResignStore struct{ driver.Store }

func (s hungResignStore) Resign(ctx context.Context, _ uuid.UUID, _ []string) error {
	<-ctx.Done()
	return ctx.Err()
}

// A stop fits its StopTimeout when the database does not answer the
// resign of the maintenance leases: the resign gets what the stop has
// left, not the whole LeaseHeadroom (5s here, beyond the 3s stop).
func TestStopFitsItsTimeoutWhenResignHangs(t *testing.T) {
	d := startOnStore(t, func(st driver.Store) driver.Store { return hungResignStore{st} })
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("stop with a resign that gets no answer: %v; want it within StopTimeout", err)
	}
}

// startOnStore starts a dispatcher with a 3s StopTimeout on a client whose
// store wrap wraps; the test stops it.
func startOnStore(t *testing.T, wrap func(driver.Store) driver.Store) *outbox.Dispatcher {
	t.Helper()
	_, tdb := newClient(t, outbox.Config{})
	client := clientWrappingStore(t, tdb.Provider.Pool, wrap)
	cfg := testConfig(newOutcomeLog())
	cfg.StopTimeout = 3 * time.Second
	d, err := client.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return d
}

// hungClaimStore serves the first claim and gets no answer to the next ones
// (a database that stopped answering), which end only with their context.
type hungClaimStore struct {
	driver.Store
	claims atomic.Int32
	hung   chan struct{} // closed when a claim hangs
	once   sync.Once
}

func (s *hungClaimStore) Claim(ctx context.Context, p driver.ClaimParams) ([]driver.Claimed, error) {
	if s.claims.Add(1) == 1 {
		return s.Store.Claim(ctx, p)
	}
	s.once.Do(func() { close(s.hung) })
	<-ctx.Done()
	return nil, ctx.Err()
}

// A stop fits its StopTimeout when the database does not answer the claim
// in flight: the claim gets what the stop has left, not the whole
// LeaseHeadroom (5s here, beyond the 3s stop).
func TestStopFitsItsTimeoutWhenAClaimHangs(t *testing.T) {
	store := &hungClaimStore{hung: make(chan struct{})}
	d := startOnStore(t, func(st driver.Store) driver.Store { store.Store = st; return store })
	recv(t, "a claim that hangs", store.hung)
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("stop with a claim in flight that gets no answer: %v; want it within StopTimeout", err)
	}
}

// A lane that stays hungry (its claims came back full, and it has no room:
// a slow publisher with a backlog) does not stop the wake window's
// re-checks, which catch another topic's events enqueued without a NOTIFY
// (the producer announces a topic once per NotifyInterval). With a poll an
// hour away, the second idle event below is found by a re-check or never.
func TestRecheckBesideAHungryLane(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	producer := clientOn(t, pool, outbox.Config{NotifyInterval: time.Hour, Logger: quietLog})
	enqueueN(t, producer, pool, 100)
	cfg := testConfig(newOutcomeLog())
	cfg.LeaseDuration, cfg.PollInterval = 3*time.Hour, time.Hour
	cfg.WakeWindow, cfg.WakeRecheck = time.Hour, time.Millisecond
	gate, started := make(chan struct{}), make(chan struct{}, 1)
	defer close(gate)
	busy := func(ctx context.Context, _ outbox.Delivery) error {
		select {
		case started <- struct{}{}:
		default:
		}
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	idle := outbox.Topic{Namespace: "idle", Topic: "events"}
	delivered := make(chan struct{}, 2)
	noop := func(context.Context, outbox.Delivery) error { delivered <- struct{}{}; return nil }
	startDispatcher(t, producer, cfg, outbox.Publisher{Topic: testTopic, Publish: busy, Concurrency: 1},
		outbox.Publisher{Topic: idle, Publish: noop})
	wait := func(ch <-chan struct{}, what string) {
		t.Helper()
		select {
		case <-ch:
		case <-time.After(guard):
			t.Fatalf("timed out waiting for %s", what)
		}
	}
	wait(started, "the busy topic's first publish") // its lane holds a full claim
	enqueueTopic(t, producer, pool, idle, 1)        // the first of the topic: announced
	wait(delivered, "the first idle event")
	enqueueTopic(t, producer, pool, idle, 1) // within NotifyInterval: not announced
	wait(delivered, "the second idle event (found by a re-check)")
}

// A server that cannot be reached is retried until Start's context ends;
// Start's error then carries the last claim's error, which says why (it
// said only that the context ended, the cause being in Health and the log).
func TestDispatcherStartOnAnUnreachableServerSaysWhy(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	cfg := tdb.Provider.Pool.Config().Copy()
	cfg.ConnConfig.Host = t.TempDir() // a socket directory with no server
	cfg.ConnConfig.Fallbacks = nil
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	d, err := clientOn(t, pool, outbox.Config{}).NewDispatcher(outbox.DispatcherConfig{Logger: quietLog},
		outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	if err != nil {
		t.Fatal(err)
	}
	// Start's context ends once a claim has failed.
	startCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // polls Health; the guard ends a hang, and the assertion below fails
		defer cancel()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		hang := time.After(guard)
		for d.Health().ClaimError == nil {
			select {
			case <-tick.C:
			case <-hang:
				return
			}
		}
	}()
	err = d.Start(startCtx)
	var connErr *pgconn.ConnectError
	if !errors.Is(err, context.Canceled) || !errors.As(err, &connErr) || !strings.Contains(err.Error(), "the last claim failed") {
		t.Fatalf("start: %v; want the start's end and the last claim's connect error", err)
	}
	if err := d.Stop(ctx); err != nil {
		t.Fatalf("stop after the failed start: %v", err)
	}
}

// A pool whose database does not exist (or whose login the server refuses)
// fails Start with an error that says what to check; Start used to wait
// for ever, logging the claim's failure and retrying it.
func TestDispatcherFailsFastOnAMissingDatabase(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	for _, tc := range []struct {
		name string
		set  func(*pgxpool.Config)
		code string
	}{
		{"no such database", func(c *pgxpool.Config) { c.ConnConfig.Database = "modkit_no_such_database" }, "3D000"},
		// Class 28: refused even where the server trusts every login.
		{"no such role", func(c *pgxpool.Config) { c.ConnConfig.User = "modkit_no_such_role" }, "28000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tdb.Provider.Pool.Config().Copy()
			tc.set(cfg)
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			client := clientOn(t, pool, outbox.Config{})
			d, err := client.NewDispatcher(outbox.DispatcherConfig{Logger: quietLog},
				outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
			if err != nil {
				t.Fatal(err)
			}
			startCtx, cancel := context.WithTimeout(ctx, guard)
			defer cancel()
			err = d.Start(startCtx)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != tc.code || !strings.Contains(err.Error(), "check the database name, role and password") {
				t.Fatalf("start: %v; want its %s error and what to check", err, tc.code)
			}
			if err := d.Stop(ctx); err != nil {
				t.Fatalf("stop after the failed start: %v", err)
			}
		})
	}
}
