package main

import (
	"context"
	"fmt"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// xactCommits reads the database's committed transaction count. The
// statistics are flushed by each backend at most once a second, so deltas
// are approximate; they include every session (autovacuum too).
func (b *bench) xactCommits(ctx context.Context) (int64, error) {
	var n int64
	err := b.t.admin.QueryRow(ctx, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").Scan(&n)
	return n, err
}

// runIdle is the idle workload: a dispatcher with NOTIFY on against an
// empty table, counting what it sends to the server over a window.
func (b *bench) runIdle(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	if err := b.t.settle(ctx); err != nil {
		return err
	}
	qc := &queryCounter{}
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: b.opts.dispatcherConns, tracer: qc, settings: b.opts.dispatcherSettings})
	if err != nil {
		return err
	}
	defer pool.Close()
	d, err := b.newDispatcher(pool, outbox.DispatcherConfig{Logger: b.dispatcherLog}, nil)
	if err != nil {
		return err
	}
	if err := d.Start(ctx); err != nil {
		return fmt.Errorf("start dispatcher: %w", err)
	}
	defer func() { _ = d.Stop(context.WithoutCancel(ctx)) }()
	// Let the start-up work (LISTEN, first claim, first sweep) pass.
	if !sleepCtx(ctx, 2*time.Second) {
		return ctx.Err()
	}
	window := b.opts.idle
	b.log.Info("idle: counting the dispatcher's statements", "window", window)
	before, x0 := qc.snapshot(), int64(0)
	if x0, err = b.xactCommits(ctx); err != nil {
		return err
	}
	if !sleepCtx(ctx, window) {
		return ctx.Err()
	}
	x1, err := b.xactCommits(ctx)
	if err != nil {
		return err
	}
	delta := qc.snapshot().sub(before)
	secs := window.Seconds()
	perSecond := float64(delta.statements()) / secs
	roundTrips := float64(delta.statements()+delta.pings) / secs
	xacts := float64(x1-x0-1) / secs // minus the first xactCommits query itself

	cfg := d.Config()
	r := row{
		Workload: "idle",
		Measure:  fmt.Sprintf("statements/s, empty table, NOTIFY on, %v window", window),
		Outbox:   fmtRate(perSecond),
		Target:   "≤ 2/s",
		Met:      ptr(perSecond <= 2),
		Values: map[string]float64{
			"statements_per_s": perSecond, "round_trips_per_s": roundTrips, "xact_commit_per_s": xacts,
			"window_s": secs,
		},
	}
	r.Note = fmt.Sprintf("Counted with a pgx QueryTracer on the dispatcher's pool (its LISTEN connection included): %s in %v "+
		"(PollInterval %v, SweepInterval %v). With pgxpool's liveness pings (sent when a connection idled over 1s): %s round trips. "+
		"Cross-check, pg_stat_database.xact_commit of the run database (all sessions, flushed about once a second): %s.",
		delta.breakdown(), window, cfg.PollInterval, cfg.SweepInterval, fmtRate(roundTrips), fmtRate(xacts))
	b.add(r)
	return nil
}

// sleepCtx sleeps for d or until ctx ends, and reports whether it slept.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
