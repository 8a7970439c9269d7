package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// stamps are one event's producer commit and first work/publish call, in
// nanoseconds after the phase began (0: not yet).
type stamps struct{ committed, worked atomic.Int64 }

// latency is one phase's percentiles, in milliseconds: over all events and
// over the second half of the run (the steady part, past the warm-up of a
// cold table).
type latency struct {
	p50, p99, max, p50Late, p99Late float64
	achieved                        float64
}

func percentile(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(sorted[int(q*float64(len(sorted)-1)+0.5)]) / float64(time.Millisecond)
}

func summarize(recs []stamps) latency {
	all := make([]time.Duration, len(recs))
	for i := range recs {
		all[i] = max(0, time.Duration(recs[i].worked.Load()-recs[i].committed.Load()))
	}
	late := slices.Clone(all[len(all)/2:])
	slices.Sort(all)
	slices.Sort(late)
	return latency{p50: percentile(all, 0.5), p99: percentile(all, 0.99), max: percentile(all, 1),
		p50Late: percentile(late, 0.5), p99Late: percentile(late, 0.99)}
}

// produceAtRate runs latencyProds producers sharing rate events/s for dur,
// each event in its own transaction by write(tx, i), stamping the commit of
// event i; it returns the rate kept.
func (b *bench) produceAtRate(ctx context.Context, pool *pgxpool.Pool, rate int, dur time.Duration, recs []stamps, base time.Time,
	write func(ctx context.Context, tx pgx.Tx, i int) error) (float64, error) {
	total := len(recs)
	pctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	jobs := make(chan int, total)
	var wg sync.WaitGroup
	for range b.opts.latencyProds {
		wg.Go(func() {
			for i := range jobs {
				if pctx.Err() != nil {
					continue
				}
				if err := pgx.BeginFunc(pctx, pool, func(tx pgx.Tx) error { return write(pctx, tx, i) }); err != nil {
					cancel(err)
					continue
				}
				recs[i].committed.Store(since(base))
			}
		})
	}
	period := time.Second / time.Duration(rate)
	start := time.Now()
	for i := 0; i < total && pctx.Err() == nil; i++ {
		if wait := time.Until(start.Add(time.Duration(i) * period)); wait > 0 {
			time.Sleep(wait)
		}
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	return float64(total) / time.Since(start).Seconds(), context.Cause(pctx)
}

func waitAll(ctx context.Context, done <-chan struct{}, got *atomic.Int64, total int) error {
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(15 * time.Second):
		return fmt.Errorf("%d of %d events worked 15s after the last commit", got.Load(), total)
	}
}

// latencyOutbox: a dispatcher with library defaults (NOTIFY on) and
// producers calling Client.Enqueue with its defaults.
func (b *bench) latencyOutbox(ctx context.Context, rate int, dur time.Duration) (latency, error) {
	if err := b.env.reset(ctx); err != nil {
		return latency{}, err
	}
	total := max(1, int(float64(rate)*dur.Seconds()))
	recs := make([]stamps, total)
	var byID sync.Map
	var got atomic.Int64
	done := make(chan struct{})
	base := time.Now()
	dpool, err := b.env.newPool(ctx, 0, 1, nil)
	if err != nil {
		return latency{}, err
	}
	defer dpool.Close()
	d, err := b.newDispatcher(dpool, outbox.Config{}, b.opts.latencyDelete, outbox.DispatcherConfig{BatchSize: b.opts.latencyBatch}, func(dl outbox.Delivery) {
		if v, ok := byID.Load(dl.ID); ok && v.(*stamps).worked.CompareAndSwap(0, since(base)) && got.Add(1) == int64(total) {
			close(done)
		}
	})
	if err != nil {
		return latency{}, err
	}
	if err := d.Start(ctx); err != nil {
		return latency{}, err
	}
	defer func() { _ = d.Stop(context.WithoutCancel(ctx)) }()
	ppool, err := b.env.newPool(ctx, int32(b.opts.latencyProds), b.opts.latencyProds, nil)
	if err != nil {
		return latency{}, err
	}
	defer ppool.Close()
	producer, err := b.newOutbox(ppool, outbox.Config{NotifyInterval: b.opts.notifyInterval})
	if err != nil {
		return latency{}, err
	}
	run := fmt.Sprintf("latency-%d-%d", rate, time.Now().UnixNano())
	achieved, err := b.produceAtRate(ctx, ppool, rate, dur, recs, base, func(ctx context.Context, tx pgx.Tx, i int) error {
		res, err := producer.Enqueue(ctx, tx, b.src.message(run, int64(i)))
		if err == nil {
			byID.Store(res.ID, &recs[i])
		}
		return err
	})
	if err != nil {
		return latency{}, err
	}
	if err := waitAll(ctx, done, &got, total); err != nil {
		return latency{}, err
	}
	l := summarize(recs)
	l.achieved = achieved
	return l, nil
}

// latencyRiver: a tuned River client, started, whose InsertTx the
// producers call (River's usual shape: one client inserts and works).
func (b *bench) latencyRiver(ctx context.Context, rate int, dur time.Duration) (latency, error) {
	if err := b.env.reset(ctx); err != nil {
		return latency{}, err
	}
	total := max(1, int(float64(rate)*dur.Seconds()))
	recs := make([]stamps, total)
	var got atomic.Int64
	done := make(chan struct{})
	base := time.Now()
	pool, err := b.env.newPool(ctx, int32(b.opts.riverConns+b.opts.latencyProds), b.opts.latencyProds, nil)
	if err != nil {
		return latency{}, err
	}
	defer pool.Close()
	client, err := b.newRiver(pool, func(seq int64) {
		if seq >= 0 && seq < int64(total) && recs[seq].worked.CompareAndSwap(0, since(base)) && got.Add(1) == int64(total) {
			close(done)
		}
	})
	if err != nil {
		return latency{}, err
	}
	if err := client.Start(ctx); err != nil {
		return latency{}, err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = client.Stop(sctx)
	}()
	achieved, err := b.produceAtRate(ctx, pool, rate, dur, recs, base, func(ctx context.Context, tx pgx.Tx, i int) error {
		_, err := client.InsertTx(ctx, tx, b.src.job(int64(i)), nil)
		return err
	})
	if err != nil {
		return latency{}, err
	}
	if err := waitAll(ctx, done, &got, total); err != nil {
		return latency{}, err
	}
	l := summarize(recs)
	l.achieved = achieved
	return l, nil
}

// runLatency: for every rate, the outbox and River alternated round by
// round.
func (b *bench) runLatency(ctx context.Context) error {
	dur := b.opts.latencyDuration
	for _, rate := range b.opts.rates {
		sides := []side[latency]{
			{fmt.Sprintf("outbox at %d/s for %v", rate, dur), func(ctx context.Context) (latency, error) {
				l, err := b.latencyOutbox(ctx, rate, dur)
				b.log.Info("latency: outbox", "rate", rate, "p50_ms", l.p50, "p99_ms", l.p99, "p99_second_half_ms", l.p99Late)
				return l, err
			}},
			{fmt.Sprintf("River at %d/s for %v", rate, dur), func(ctx context.Context) (latency, error) {
				l, err := b.latencyRiver(ctx, rate, dur)
				b.log.Info("latency: River", "rate", rate, "p50_ms", l.p50, "p99_ms", l.p99, "p99_second_half_ms", l.p99Late)
				return l, err
			}},
		}
		runs, err := alternate(ctx, b, "latency", sides)
		if err != nil {
			return err
		}
		pick := func(ls []latency, f func(latency) float64) series {
			s := make(series, len(ls))
			for i, l := range ls {
				s[i] = f(l)
			}
			return s
		}
		text := func(ls []latency) string {
			return fmt.Sprintf("p50 %s, p99 %s ms", pick(ls, func(l latency) float64 { return l.p50 }).text(fmtMs),
				pick(ls, func(l latency) float64 { return l.p99 }).text(fmtMs))
		}
		lateText := func(ls []latency) string {
			return fmt.Sprintf("p50 %s, p99 %s ms (max of the whole run %s ms)", pick(ls, func(l latency) float64 { return l.p50Late }).text(fmtMs),
				pick(ls, func(l latency) float64 { return l.p99Late }).text(fmtMs), pick(ls, func(l latency) float64 { return l.max }).text(fmtMs))
		}
		lib, riv := runs[0], runs[1]
		batchNote := ""
		if b.opts.latencyBatch > 0 {
			batchNote = fmt.Sprintf(" but BatchSize %d", b.opts.latencyBatch)
		}
		p50 := func(l latency) float64 { return l.p50 }
		p99 := func(l latency) float64 { return l.p99 }
		target := map[int]string{500: "p50 ≤ 1.5, p99 ≤ 5 ms", 2000: "p50 ≤ 2, p99 ≤ 15 ms"}[rate]
		b.add(row{workload: "e2e latency", measure: fmt.Sprintf("commit→work at %s/s, %v per round", itoa(int64(rate)), dur),
			outbox: text(lib), river: text(riv), raw: "-",
			vsRiver: "p50 " + ratioText(pick(lib, p50), pick(riv, p50)) + ", p99 " + ratioText(pick(lib, p99), pick(riv, p99)),
			vsRaw:   "-", target: cmpOr(target, "-"),
			note: fmt.Sprintf("Second half of each run (steady part): outbox %s; River %s. Rate kept: outbox %s/s, River %s/s (lowest round). "+
				"Outbox: dispatcher and Client with library defaults (%s)%s; River: tuned client, started, inserting by InsertTx. "+
				"%d producers, one event per transaction; a latency ratio below 1 means the outbox is faster.",
				lateText(lib), lateText(riv), fmtCount(slices.Min(pick(lib, func(l latency) float64 { return l.achieved }))),
				fmtCount(slices.Min(pick(riv, func(l latency) float64 { return l.achieved }))), b.notifyNote(), batchNote, b.opts.latencyProds)})
	}
	return nil
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
