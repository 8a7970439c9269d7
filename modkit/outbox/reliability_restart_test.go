package outbox_test

// Server restart (issue 7, item 5). The test restarts the whole throwaway
// cluster, so it must not overlap any other test of this package: it does
// not call t.Parallel, and Go runs serial tests only while no parallel test
// runs (parallel tests resume after every serial one has finished), so this
// holds even if other tests become parallel.

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// PostgreSQL is stopped the way a crash stops it (immediate shutdown) and
// started again while producers enqueue and a dispatcher delivers. Delivery
// resumes by itself, the dispatcher backs off rather than spinning (few
// warnings per failure kind), no goroutine outlives the test, nothing is
// lost, and every settlement the server kept was made under a valid lease.
//
// Two variants: the default, where claims and outcomes commit
// asynchronously (a crash may roll the last of them back, so an event can
// be published again while a publish whose claim was rolled back is still
// running), and durable claims (SynchronousCommit, on a session with
// synchronous_commit on), where no two publishes of one event may overlap.
func TestReliabilityServerRestart(t *testing.T) {
	cluster := pgtest.Cluster()
	if cluster == nil {
		t.Skip("restarts the server: needs the throwaway cluster (TEST_DATABASE_URL or DATABASE_URL is set)")
	}
	for _, durable := range []bool{false, true} {
		t.Run(fmt.Sprintf("durable-claims=%v", durable), func(t *testing.T) { restartWhileFlowing(t, durable) })
	}
}

func restartWhileFlowing(t *testing.T, durable bool) {
	// Registered first, so it runs after every other cleanup: nothing this
	// test started may survive it. The cluster's own supervisor goroutine
	// is replaced by the restart and belongs to the test binary.
	leakOpts := []goleak.Option{goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("github.com/modkit-go/modkit/internal/pgserver.(*Cluster).start.func1")}
	t.Cleanup(func() { goleak.VerifyNone(t, leakOpts...) })

	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	installAudit(t, pool)

	dcfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if durable {
		// The test cluster runs with synchronous_commit off; durable
		// claims need it on for the dispatcher's sessions.
		dcfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
	}
	dpool, err := pgxpool.NewWithConfig(ctx, dcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dpool.Close)

	logs, pubs := newLogCapture(slog.LevelWarn), newPublishLog(pool)
	cfg := testConfig(newOutcomeLog())
	cfg.LeaseDuration, cfg.PollInterval, cfg.Logger = 2*time.Second, 100*time.Millisecond, logs.logger()
	d := startDispatcher(t, clientOn(t, dpool, outbox.Config{SynchronousCommit: durable}), cfg,
		outbox.Publisher{Topic: testTopic, Publish: pubs.wrap("d", noopPublish)})

	prod := startProducer(t, client, pool, fmt.Sprintf("restart/%v", durable))
	eventually(t, "events flowing", func() bool { return prod.count() >= 300 && pubs.total.Load() >= 100 })
	if err := pgtest.Cluster().Restart(ctx); err != nil {
		t.Fatal(err)
	}
	restartedAt := prod.count()
	eventually(t, "producers resuming", func() bool { return prod.count() >= restartedAt+300 })
	ids := prod.stop()

	eventually(t, "every event delivered", func() bool {
		var undelivered int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events WHERE status <> 'delivered'").Scan(&undelivered)
		return err == nil && undelivered == 0
	})
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	if n := countRows(t, pool, "true"); n != len(ids) {
		t.Errorf("%d rows, want the %d enqueued", n, len(ids))
	}
	pubs.checkDelivered(t, ids)
	checkLeaseFencing(t, pool, pubs.okTokens())
	checkFinalState(t, pool, allStatus(ids, outbox.StatusDelivered))
	pubs.mu.Lock()
	overlaps, unleased, twice := len(pubs.overlaps), len(pubs.unleased), 0
	for _, calls := range pubs.calls {
		if len(calls) > 1 {
			twice++
		}
	}
	pubs.mu.Unlock()
	if durable {
		// No claim can be rolled back: no publish may run without its
		// lease, nor overlap another.
		pubs.checkNoOverlap(t)
	}

	// Backoff, not a hot loop: a handful of warnings per retry loop for one
	// restart (each backs off exponentially from 20-100 ms). Per-event
	// warnings (a lease lost to a rolled-back claim) are not retries.
	kinds := map[string]int{}
	for _, r := range logs.records() {
		kinds[r.Msg]++
	}
	for _, msg := range []string{
		"claim failed; retrying",
		"recording outcomes failed; retrying",
		"notification listener lost; polling continues, reconnecting",
		"sweep of exhausted events failed",
		"purge of delivered events failed",
	} {
		if n := kinds[msg]; n > 25 {
			t.Errorf("%d warnings %q for one restart: a hot error loop", n, msg)
		}
	}
	if kinds["claim failed; retrying"] == 0 {
		t.Error("no claim failed: the restart did not hit the dispatcher, so the test shows nothing")
	}
	t.Logf("%d events (%d enqueued before the restart); %d published more than once, %d overlapping publishes, "+
		"%d publishes refused for a claim rolled back; warnings: %v", len(ids), restartedAt, twice, overlaps, unleased, kinds)
}

// producer enqueues events continuously, ten per transaction every few
// milliseconds, each transaction committed durably (synchronous_commit on:
// the test cluster runs with it off, and an immediate shutdown loses
// asynchronous commits). A failed transaction is retried with the same
// dedupe keys until it commits, so an event whose commit outcome was
// unknown is neither lost nor doubled.
type producer struct {
	mu     sync.Mutex
	ids    []uuid.UUID
	n      atomic.Int64
	halt   chan struct{} // stop after the batch in progress
	cancel context.CancelFunc
	done   chan struct{}
}

func startProducer(t *testing.T, c *outbox.Client, pool *pgxpool.Pool, prefix string) *producer {
	t.Helper()
	pctx, cancel := context.WithCancel(ctx)
	p := &producer{halt: make(chan struct{}), cancel: cancel, done: make(chan struct{})}
	go func() { defer close(p.done); p.run(pctx, c, pool, prefix) }()
	t.Cleanup(func() { cancel(); <-p.done })
	return p
}

func (p *producer) count() int { return int(p.n.Load()) }

// stop lets the batch in progress commit, stops, and returns the ids of
// every committed event.
func (p *producer) stop() []uuid.UUID {
	close(p.halt)
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ids
}

func (p *producer) run(ctx context.Context, c *outbox.Client, pool *pgxpool.Pool, prefix string) {
	tick := time.NewTicker(5 * time.Millisecond) // pacing, so events flow across the restart
	defer tick.Stop()
	for batch := 0; ; batch++ {
		select {
		case <-p.halt:
			return
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		msgs := make([]outbox.Message, 10)
		for i := range msgs {
			msgs[i] = keyed(batch*10+i, fmt.Sprintf("%s/%d/%d", prefix, batch, i))
		}
		for {
			var res []outbox.Enqueued
			err := db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = on"); err != nil {
					return err
				}
				var err error
				res, err = c.EnqueueBatch(ctx, tx, msgs)
				return err
			})
			if err == nil {
				p.mu.Lock()
				for _, r := range res {
					p.ids = append(p.ids, r.ID)
				}
				p.mu.Unlock()
				p.n.Add(int64(len(res)))
				break
			}
			// The server is down or restarting: retry the same keys.
			select {
			case <-ctx.Done():
				return // the test is over; this batch's outcome does not matter
			case <-tick.C:
			}
		}
	}
}
