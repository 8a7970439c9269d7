package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// incident is a fault the soak injected.
type incident struct {
	kind       string // "kill" or "restart"
	pid        int    // the killed dispatcher
	begin, end time.Time
}

// run is the soak: set up, produce under faults, drain, verify. It reports
// whether every check passed.
func run(ctx context.Context, o options) (bool, error) {
	start := time.Now()
	rng := rand.New(rand.NewPCG(o.seed, o.seed>>32|1))
	tgt, err := openTarget(ctx, o.dsn)
	if err != nil {
		return false, err
	}
	defer tgt.close()
	if tgt.cluster == nil && o.restartEvery > 0 {
		logf("external server: PostgreSQL restarts disabled")
		o.restartEvery = 0
	}
	mode := ""
	if o.deleteOnDelivery {
		mode = ", events deleted on delivery"
	}
	logf("soak%s: %v on %s; %d dispatchers, %d producers, %d events/s (every %d-th poison), kills every ~%v, restarts every ~%v, lease %v, max attempts %d%s, seed %d",
		presetNote(o.preset), o.duration, tgt.server, o.dispatchers, o.producers, o.rate, o.poisonEvery, o.killEvery, o.restartEvery, o.lease, o.maxAttempts, mode, o.seed)

	pool, err := pgxpool.New(ctx, tgt.dsn)
	if err != nil {
		return false, err
	}
	defer pool.Close()
	client, err := outbox.New(outboxpg.New(pool), outbox.Config{})
	if err != nil {
		return false, err
	}
	sup, err := newSupervisor(o, tgt.dsn)
	if err != nil {
		return false, err
	}
	for range o.dispatchers {
		if _, err := sup.start(ctx); err != nil {
			sup.killAll()
			return false, err
		}
	}

	prod := startProducers(ctx, client, pool, o)
	incidents, crashes, chaosErr := chaos(ctx, o, rng, tgt, sup, pool, prod)
	prod.stop()
	if chaosErr != nil {
		sup.killAll()
		return false, chaosErr
	}
	logf("producers stopped after %d events; draining", prod.count())
	drained := drain(ctx, pool, o.drainTimeout)
	// A dispatcher that exited on its own during the drain, before the
	// stop, is a crash too.
	crashes = append(crashes, sup.crashed()...)
	stopErrs := sup.stopAll(30 * time.Second)
	if ctx.Err() != nil {
		sup.killAll()
		return false, errInterrupted
	}

	r := verify(ctx, pool, o, incidents, prod.committedSeqs())
	r.elapsed = time.Since(start)
	r.seed = o.seed
	r.generations = sup.gens
	r.logDir = sup.logDir
	r.producerRetries = prod.retries.Load()
	if !drained {
		r.fail("the outbox did not drain within %v", o.drainTimeout)
	}
	for _, c := range crashes {
		r.fail("dispatcher %d exited on its own: %v", c.gen, c.exitErr)
	}
	for _, err := range stopErrs {
		r.fail("graceful stop: %v", err)
	}
	passed := len(r.failures) == 0
	if passed {
		_ = os.RemoveAll(sup.logDir) // kept for inspection when the run fails
		r.logDir = "(removed: the run passed)"
	}
	r.print()
	return passed, nil
}

// chaos waits for the run's duration, killing a random dispatcher (and
// starting a replacement) and restarting PostgreSQL at random times, each
// drawn uniformly from half to one and a half times its mean interval.
func chaos(ctx context.Context, o options, rng *rand.Rand, tgt *target, sup *supervisor, pool *pgxpool.Pool, prod *producers) ([]incident, []*child, error) {
	next := func(mean time.Duration) <-chan time.Time {
		if mean <= 0 {
			return nil
		}
		return time.After(mean/2 + time.Duration(rng.Int64N(int64(mean)))) // uniform in [mean/2, 3·mean/2)
	}
	var incidents []incident
	var crashes []*child
	end := time.After(o.duration)
	kill, restart := next(o.killEvery), next(o.restartEvery)
	check := time.NewTicker(time.Second)
	defer check.Stop()
	progress := time.NewTicker(15 * time.Second)
	defer progress.Stop()
	replace := func() error {
		if _, err := sup.start(ctx); err != nil {
			return fmt.Errorf("start a replacement dispatcher: %w", err)
		}
		return nil
	}
	for {
		select {
		case <-ctx.Done():
			return incidents, crashes, errInterrupted
		case <-end:
			return incidents, crashes, nil
		case <-kill:
			live := sup.live()
			if len(live) == 0 { // every one exited on its own: the next check reports and replaces them
				kill = next(o.killEvery)
				continue
			}
			c := live[rng.IntN(len(live))]
			pid, sent, dead := sup.kill(c)
			incidents = append(incidents, incident{kind: "kill", pid: pid, begin: sent, end: dead})
			if o.verbose {
				logf("SIGKILL dispatcher %d (pid %d)", c.gen, pid)
			}
			if err := replace(); err != nil {
				return incidents, crashes, err
			}
			kill = next(o.killEvery)
		case <-restart:
			begin := time.Now()
			err := tgt.restart(ctx)
			incidents = append(incidents, incident{kind: "restart", begin: begin, end: time.Now()})
			if err != nil {
				return incidents, crashes, err
			}
			if o.verbose {
				logf("PostgreSQL restarted (immediate shutdown) in %v", time.Since(begin).Round(time.Millisecond))
			}
			restart = next(o.restartEvery)
		case <-check.C:
			for _, c := range sup.crashed() {
				crashes = append(crashes, c)
				logf("dispatcher %d exited on its own: %v", c.gen, c.exitErr)
				if err := replace(); err != nil {
					return incidents, crashes, err
				}
			}
		case <-progress.C:
			logf("progress: %d enqueued, %s; %d faults so far", prod.count(), outboxCounts(ctx, pool), len(incidents))
		}
	}
}

// outboxCounts summarises the outbox by status, for progress lines.
func outboxCounts(ctx context.Context, pool *pgxpool.Pool) string {
	var pending, processing, delivered, dead int
	// finalEvents counts the events deleted on delivery too (from the
	// ledger).
	err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE f.status = 'pending'), count(*) FILTER (WHERE f.status = 'processing'),
		count(*) FILTER (WHERE f.status = 'delivered'), count(*) FILTER (WHERE f.status = 'dead') FROM `+finalEvents).
		Scan(&pending, &processing, &delivered, &dead)
	if err != nil {
		return "counts unavailable (" + err.Error() + ")"
	}
	return fmt.Sprintf("%d delivered, %d dead, %d pending, %d processing", delivered, dead, pending, processing)
}

// drain waits until no event is pending or processing.
func drain(ctx context.Context, pool *pgxpool.Pool, timeout time.Duration) bool {
	deadline := time.After(timeout)
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	progress := time.NewTicker(10 * time.Second)
	defer progress.Stop()
	for {
		var open int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM modkit_outbox_events WHERE status IN ('pending', 'processing')`).Scan(&open)
		if err == nil && open == 0 {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-deadline:
			return false
		case <-progress.C:
			logf("draining: %s", outboxCounts(ctx, pool))
		case <-tick.C:
		}
	}
}

// producers enqueue events at the configured rate. Each event is enqueued
// with a unique dedupe key and recorded in soak_enqueued in the same
// transaction; a failed transaction is retried with the same key until it
// commits, so a commit whose outcome was unknown is neither lost nor
// doubled.
type producers struct {
	client  *outbox.Client
	seq     atomic.Int64
	n       atomic.Int64
	retries atomic.Int64
	halt    chan struct{}
	wg      sync.WaitGroup

	mu sync.Mutex
	// committed are the sequence numbers whose transaction reported its
	// commit: the verifier's record of what was enqueued that does not
	// live in the database it checks.
	committed []int64
}

func startProducers(ctx context.Context, client *outbox.Client, pool *pgxpool.Pool, o options) *producers {
	p := &producers{client: client, halt: make(chan struct{})}
	interval := time.Second * time.Duration(o.producers) / time.Duration(o.rate)
	for range o.producers {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.run(ctx, pool, o, interval)
		}()
	}
	return p
}

func (p *producers) count() int64 { return p.n.Load() }

// committedSeqs returns the sequence numbers committed so far.
func (p *producers) committedSeqs() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.committed)
}

// stop lets the transactions in progress commit and stops.
func (p *producers) stop() {
	close(p.halt)
	p.wg.Wait()
}

func (p *producers) run(ctx context.Context, pool *pgxpool.Pool, o options, interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-p.halt:
			return
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		seq := p.seq.Add(1)
		pl := payload{Seq: seq}
		if o.poisonEvery > 0 && seq%int64(o.poisonEvery) == 0 {
			pl.Poison = [2]string{"transient", "permanent"}[(seq/int64(o.poisonEvery))%2]
		}
		if !p.enqueue(ctx, pool, pl) {
			return
		}
		p.n.Add(1)
		p.mu.Lock()
		p.committed = append(p.committed, seq)
		p.mu.Unlock()
	}
}

// enqueue commits one event, retrying until it does; false if ctx ended
// first.
func (p *producers) enqueue(ctx context.Context, pool *pgxpool.Pool, pl payload) bool {
	body := fmt.Appendf(nil, `{"seq":%d,"poison":%q}`, pl.Seq, pl.Poison)
	if pl.Poison == "" {
		body = fmt.Appendf(nil, `{"seq":%d}`, pl.Seq)
	}
	msg := outbox.Message{Namespace: soakTopic.Namespace, Topic: soakTopic.Topic,
		DedupeKey: outbox.Key(fmt.Sprintf("soak/%d", pl.Seq)), Payload: body}
	var poison *string
	if pl.Poison != "" {
		poison = &pl.Poison
	}
	for delay := 50 * time.Millisecond; ; delay = min(2*delay, time.Second) {
		err := db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
			res, err := p.client.Enqueue(ctx, tx, msg)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO soak_enqueued (event_id, seq, poison) VALUES ($1, $2, $3) ON CONFLICT (event_id) DO NOTHING`,
				res.ID, pl.Seq, poison)
			return err
		})
		if err == nil {
			return true
		}
		p.retries.Add(1)
		t := time.NewTimer(delay) // the server is down or restarting
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
	}
}

func presetNote(preset string) string {
	if preset == "" {
		return ""
	}
	return " (preset " + preset + ")"
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
