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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// guard bounds every wait on a signal: reaching it fails the test. It is a
// hang detector, not a performance assertion.
const guard = 2 * time.Minute

// settledLog collects OnSettled callbacks and lets a test wait for a
// condition on them.
type settledLog struct {
	mu      sync.Mutex
	byID    map[uuid.UUID][]outbox.Settlement
	changed chan struct{}
}

func newSettledLog() *settledLog {
	return &settledLog{byID: map[uuid.UUID][]outbox.Settlement{}, changed: make(chan struct{}, 1)}
}

func (l *settledLog) hook(m outbox.ClaimedMessage, st outbox.Settlement) {
	l.mu.Lock()
	l.byID[m.ID] = append(l.byID[m.ID], st)
	l.mu.Unlock()
	select {
	case l.changed <- struct{}{}:
	default:
	}
}

// waitFor blocks until cond (called under the lock) holds.
func (l *settledLog) waitFor(t *testing.T, what string, cond func(map[uuid.UUID][]outbox.Settlement) bool) {
	t.Helper()
	timeout := time.After(guard)
	for {
		l.mu.Lock()
		ok := cond(l.byID)
		l.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-l.changed:
		case <-timeout:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func finalCount(status outbox.Status, n int) func(map[uuid.UUID][]outbox.Settlement) bool {
	return func(m map[uuid.UUID][]outbox.Settlement) bool {
		c := 0
		for _, sts := range m {
			if last := sts[len(sts)-1]; !last.LeaseLost && last.Status == status {
				c++
			}
		}
		return c >= n
	}
}

func testConfig(log *settledLog) outbox.DispatcherConfig {
	return outbox.DispatcherConfig{
		LeaseDuration: 30 * time.Second,
		PollInterval:  50 * time.Millisecond,
		Store:         outbox.Config{Retry: outbox.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: 4 * time.Millisecond}},
		MaxAttempts:   3,
		StopTimeout:   30 * time.Second,
		Logger:        quietLog,
		OnSettled:     log.hook,
	}
}

func startDispatcher(t *testing.T, pool *pgxpool.Pool, cfg outbox.DispatcherConfig, pubs ...outbox.Publisher) *outbox.Dispatcher {
	t.Helper()
	var reg outbox.Publishers
	for _, p := range pubs {
		if err := reg.Register(p); err != nil {
			t.Fatal(err)
		}
	}
	d, err := outbox.NewDispatcher(pool, &reg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return d
}

func TestDispatcherDelivers(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, pool, 300)
	log := newSettledLog()
	var published sync.Map
	var deadlineOK atomic.Bool
	deadlineOK.Store(true)
	startDispatcher(t, pool, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
		// The publish context ends before the lease does.
		if dl, ok := ctx.Deadline(); !ok || !dl.Before(m.LeaseExpiresAt) {
			deadlineOK.Store(false)
		}
		published.Store(m.ID, m.Attempts)
		return nil
	}})
	log.waitFor(t, "300 deliveries", finalCount(outbox.StatusDelivered, 300))
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
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	flaky := enqueueN(t, pool, 1)[0]
	poison, _ := outbox.Enqueue(ctx, pool, outbox.Message{Namespace: "test", Topic: "poison", Payload: []byte(`{}`)})
	log := newSettledLog()
	var calls sync.Map
	count := func(id uuid.UUID) int {
		v, _ := calls.LoadOrStore(id, new(atomic.Int32))
		return int(v.(*atomic.Int32).Add(1))
	}
	startDispatcher(t, pool, testConfig(log),
		outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
			if count(m.ID) < 3 {
				return fmt.Errorf("transient %d", m.Attempts)
			}
			return nil
		}},
		outbox.Publisher{Topic: outbox.Topic{Namespace: "test", Topic: "poison"}, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
			count(m.ID)
			return errors.New("always broken")
		}},
	)
	log.waitFor(t, "flaky delivered and poison dead", func(m map[uuid.UUID][]outbox.Settlement) bool {
		f, p := m[flaky], m[poison.ID]
		return len(f) > 0 && f[len(f)-1].Status == outbox.StatusDelivered && len(p) > 0 && p[len(p)-1].Status == outbox.StatusDead
	})
	log.mu.Lock()
	f, p := log.byID[flaky], log.byID[poison.ID]
	log.mu.Unlock()
	if len(f) != 3 || f[0].Status != outbox.StatusPending || f[1].Status != outbox.StatusPending || f[0].RetryIn <= 0 {
		t.Fatalf("flaky settlements: %+v", f)
	}
	if len(p) != 3 { // max attempts 3: two retries, then dead
		t.Fatalf("poison settled %d times, want 3: %+v", len(p), p)
	}
	s := nil2store(t, pool)
	e := get(t, s, poison.ID)
	if e.Status != outbox.StatusDead || e.Attempts != 3 || !strings.Contains(*e.LastError, "always broken") {
		t.Fatalf("poison row: %+v", e)
	}
}

func TestDispatcherIsolatesPanics(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, pool, 20)
	log := newSettledLog()
	var panicked atomic.Bool
	startDispatcher(t, pool, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
		if m.ID == ids[7] && panicked.CompareAndSwap(false, true) {
			panic("publisher bug")
		}
		return nil
	}})
	log.waitFor(t, "20 deliveries", finalCount(outbox.StatusDelivered, 20))
	e := get(t, nil2store(t, pool), ids[7])
	if e.Attempts != 2 || !strings.Contains(*e.LastError, "panicked: publisher bug") {
		t.Fatalf("panicking event: %+v", e)
	}
}

// Two dispatchers on separate pools, like two replicas, share the work and
// never publish one event twice under valid leases at once.
func TestTwoDispatchersShareWork(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	ids := enqueueN(t, tdb.Provider.Pool, 2000)
	log := newSettledLog()
	var mu sync.Mutex
	inFlight := map[uuid.UUID]bool{}
	published := map[uuid.UUID]int{}
	var overlap atomic.Bool
	pub := func(ctx context.Context, m outbox.ClaimedMessage) error {
		mu.Lock()
		if inFlight[m.ID] {
			overlap.Store(true)
		}
		inFlight[m.ID] = true
		published[m.ID]++
		mu.Unlock()
		mu.Lock()
		delete(inFlight, m.ID)
		mu.Unlock()
		return nil
	}
	cfg := testConfig(log)
	cfg.BatchSize = 50
	for range 2 {
		startDispatcher(t, tdb.NewPool(t), cfg, outbox.Publisher{Topic: testTopic, Publish: pub})
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
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	log := newSettledLog()
	cfg := testConfig(log)
	// Polling alone would take ten minutes, far past the wait guard.
	cfg.LeaseDuration, cfg.PollInterval = time.Hour, 10*time.Minute
	delivered := make(chan uuid.UUID, 10)
	startDispatcher(t, pool, cfg, outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
		delivered <- m.ID
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
	first := enqueueN(t, pool, 1)[0]
	expect(first)
	pid := listenerPID()
	if pid == 0 {
		t.Fatal("no LISTEN connection found")
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	second := enqueueN(t, pool, 1)[0]
	expect(second)
}

func TestDispatcherPollOnly(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{DisableNotify: true})
	pool := tdb.Provider.Pool
	log := newSettledLog()
	cfg := testConfig(log)
	cfg.PollOnly = true
	startDispatcher(t, pool, cfg, outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.ClaimedMessage) error { return nil }})
	enqueueN(t, pool, 5)
	log.waitFor(t, "5 deliveries by polling", finalCount(outbox.StatusDelivered, 5))
	var listeners int
	pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND datname = current_database()`).Scan(&listeners)
	if listeners != 0 {
		t.Fatal("poll-only dispatcher opened a LISTEN connection")
	}
}

// Stop gives claimed-but-unstarted events back at once, lets the publish in
// flight finish, and records its outcome.
func TestStopReleasesUnstartedEvents(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, pool, 10)
	log := newSettledLog()
	cfg := testConfig(log)
	cfg.Concurrency, cfg.BatchSize = 1, 10
	entered, release := make(chan uuid.UUID, 1), make(chan struct{})
	var reg outbox.Publishers
	reg.Register(outbox.Publisher{Topic: testTopic, Publish: func(ctx context.Context, m outbox.ClaimedMessage) error {
		entered <- m.ID
		<-release
		return nil
	}})
	d, err := outbox.NewDispatcher(pool, &reg, cfg)
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
	log.waitFor(t, "9 releases", func(m map[uuid.UUID][]outbox.Settlement) bool { return len(m) >= 9 })
	for _, id := range ids {
		if id == inFlight {
			continue
		}
		if e := get(t, nil2store(t, pool), id); e.Status != outbox.StatusPending || e.Attempts != 0 || e.LockedBy != nil {
			t.Fatalf("unstarted event not released while the publish is in flight: %+v", e)
		}
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	if e := get(t, nil2store(t, pool), inFlight); e.Status != outbox.StatusDelivered {
		t.Fatalf("in-flight publish not recorded on stop: %+v", e)
	}
}

func TestTransactionalHandler(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, "CREATE TABLE consumed (event_id uuid NOT NULL, attempt int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	ids := enqueueN(t, pool, 3)
	log := newSettledLog()
	startDispatcher(t, pool, testConfig(log), outbox.Publisher{Topic: testTopic,
		HandleTx: func(ctx context.Context, tx pgx.Tx, m outbox.ClaimedMessage) error {
			if _, err := tx.Exec(ctx, "INSERT INTO consumed VALUES ($1, $2)", m.ID, m.Attempts); err != nil {
				return err
			}
			switch {
			case m.ID == ids[1] && m.Attempts == 1:
				return errors.New("handler failed") // its insert must roll back
			case m.ID == ids[2] && m.Attempts == 1:
				// The lease ends before the handler commits: the ack in
				// the same transaction fails and the insert rolls back.
				if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET locked_until = now() - interval '1 second' WHERE id = $1", m.ID); err != nil {
					return err
				}
			}
			return nil
		}})
	// The expired attempt's lease-lost report and the reclaimed attempt's
	// delivery race each other, so wait for both in either order.
	log.waitFor(t, "3 deliveries and one lost lease", func(m map[uuid.UUID][]outbox.Settlement) bool {
		delivered := 0
		for _, sts := range m {
			if slices.ContainsFunc(sts, func(st outbox.Settlement) bool { return !st.LeaseLost && st.Status == outbox.StatusDelivered }) {
				delivered++
			}
		}
		return delivered == 3 && slices.ContainsFunc(m[ids[2]], func(st outbox.Settlement) bool { return st.LeaseLost })
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

func TestDispatcherConfigValidation(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	var reg outbox.Publishers
	noop := func(context.Context, outbox.ClaimedMessage) error { return nil }
	if err := reg.Register(outbox.Publisher{Topic: testTopic, Publish: noop, Name: "chat"}); err != nil {
		t.Fatal(err)
	}
	err := reg.Register(outbox.Publisher{Topic: testTopic, Publish: noop, Name: "billing"})
	if !errors.Is(err, outbox.ErrDuplicatePublisher) || !strings.Contains(err.Error(), "chat") || !strings.Contains(err.Error(), "billing") {
		t.Fatalf("duplicate publisher: %v", err)
	}
	if err := reg.Register(outbox.Publisher{Topic: outbox.Topic{Namespace: "x", Topic: "y"}}); err == nil {
		t.Fatal("publisher without a function accepted")
	}
	bad := []outbox.DispatcherConfig{
		{LeaseDuration: 3 * time.Second, PollInterval: 2 * time.Second}, // poll > lease/3
		{BatchSize: -1},
		{LeaseDuration: 10 * time.Second, LeaseHeadroom: 10 * time.Second},
		{Concurrency: -2},
		{Store: outbox.Config{Schema: "bad schema"}},
	}
	for _, cfg := range bad {
		if _, err := outbox.NewDispatcher(tdb.Provider.Pool, &reg, cfg); err == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
	if _, err := outbox.NewDispatcher(tdb.Provider.Pool, &outbox.Publishers{}, outbox.DispatcherConfig{}); err == nil {
		t.Error("dispatcher without publishers accepted")
	}
	d, err := outbox.NewDispatcher(tdb.Provider.Pool, &reg, outbox.DispatcherConfig{})
	if err != nil {
		t.Fatalf("zero config: %v", err)
	}
	if c := d.Config(); c.PollInterval > c.LeaseDuration/3 || c.BatchSize == 0 {
		t.Fatalf("defaults: %+v", c)
	}
}

func TestDispatcherFailsFastWithoutTable(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, "DROP TABLE modkit_outbox_events"); err != nil {
		t.Fatal(err)
	}
	var reg outbox.Publishers
	reg.Register(outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.ClaimedMessage) error { return nil }})
	d, err := outbox.NewDispatcher(pool, &reg, outbox.DispatcherConfig{Logger: quietLog})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "migrations") {
		t.Fatalf("start without the table: %v", err)
	}
	d.Stop(ctx)
}

var _ = slog.Default
