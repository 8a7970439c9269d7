package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// latencyStats summarises commit-to-publish latencies.
type latencyStats struct {
	n                  int
	p50, p90, p99, max time.Duration
	early              int     // publishes seen before the producer's commit returned (counted as 0)
	achieved           float64 // enqueues per second the producers kept up
	claims             string  // how long the dispatcher's claim statements took
}

// percentiles sorts samples and summarises them (nearest rank).
func percentiles(samples []time.Duration) latencyStats {
	slices.Sort(samples)
	at := func(q float64) time.Duration {
		if len(samples) == 0 {
			return 0
		}
		return samples[int(q*float64(len(samples)-1)+0.5)]
	}
	return latencyStats{n: len(samples), p50: at(0.50), p90: at(0.90), p99: at(0.99), max: at(1)}
}

func (s latencyStats) String() string {
	return fmt.Sprintf("p50 %s, p99 %s, max %s", fmtMs(s.p50), fmtMs(s.p99), fmtMs(s.max))
}

// latencySetup is how a latency phase runs the library.
type latencySetup struct {
	pollOnly bool
	// settings are session settings of the dispatcher's pool.
	settings map[string]string
	// notifyInterval is the producers' Config.NotifyInterval (0: default).
	notifyInterval time.Duration
}

// latencyRecord is one event's two timestamps, in nanoseconds after the
// phase began (0: not yet).
type latencyRecord struct {
	committed, published atomic.Int64
}

// measureLatency runs the dispatcher while producers enqueue at a fixed
// rate for dur, each event in its own transaction, and measures for every
// event the time from its producer's commit returning to its publisher
// being called. With pollOnly the producers send no NOTIFY and the
// dispatcher does not LISTEN (it polls every PollIntervalDefault).
func (b *bench) measureLatency(ctx context.Context, rate int, dur time.Duration, setup latencySetup) (latencyStats, error) {
	pollOnly := setup.pollOnly
	if err := b.t.truncate(ctx); err != nil {
		return latencyStats{}, err
	}
	if err := b.t.settle(ctx); err != nil {
		return latencyStats{}, err
	}
	total := max(1, int(float64(rate)*dur.Seconds()))
	records := make([]latencyRecord, total)
	var byID sync.Map // event id -> *latencyRecord, stored before the commit
	base := time.Now()
	stamp := func() int64 { return int64(time.Since(base)) + 1 }
	var published atomic.Int64
	allPublished := make(chan struct{})
	pubs := noopPublishers(func(m outbox.ClaimedMessage) {
		v, ok := byID.Load(m.ID)
		if !ok {
			return
		}
		if v.(*latencyRecord).published.CompareAndSwap(0, stamp()) && published.Add(1) == int64(total) {
			close(allPublished)
		}
	})

	timer := &claimTimer{}
	dpool, err := b.t.newPool(ctx, poolSpec{maxConns: b.opts.dispatcherConns, warm: 1, settings: setup.settings, tracer: timer})
	if err != nil {
		return latencyStats{}, err
	}
	defer dpool.Close()
	d, err := outbox.NewDispatcher(dpool, pubs, outbox.DispatcherConfig{
		Store: outbox.Config{DisableNotify: pollOnly}, PollOnly: pollOnly, Logger: b.dispatcherLog,
	})
	if err != nil {
		return latencyStats{}, err
	}
	if err := d.Start(ctx); err != nil {
		return latencyStats{}, fmt.Errorf("start dispatcher: %w", err)
	}
	defer func() { _ = d.Stop(context.WithoutCancel(ctx)) }()

	producer, err := outbox.NewProducer(outbox.Config{DisableNotify: pollOnly, NotifyInterval: setup.notifyInterval})
	if err != nil {
		return latencyStats{}, err
	}
	workers := b.opts.latencyProducers
	ppool, err := b.t.newPool(ctx, poolSpec{maxConns: int32(workers), warm: workers})
	if err != nil {
		return latencyStats{}, err
	}
	defer ppool.Close()

	run := fmt.Sprintf("latency-%d-%t", rate, pollOnly)
	enqueue := func(ctx context.Context, i int) error {
		return pgx.BeginFunc(ctx, ppool, func(tx pgx.Tx) error {
			res, err := producer.Enqueue(ctx, tx, b.src.message(run, int64(i)))
			if err == nil {
				byID.Store(res.ID, &records[i])
			}
			return err
		})
	}
	pctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	jobs := make(chan int, total)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range jobs {
				if pctx.Err() != nil {
					continue
				}
				if err := enqueue(pctx, i); err != nil {
					cancel(fmt.Errorf("enqueue: %w", err))
					continue
				}
				records[i].committed.Store(stamp())
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
	if err := context.Cause(pctx); err != nil {
		return latencyStats{}, err
	}
	producing := time.Since(start)

	timeout := 3*d.Config().PollInterval + 10*time.Second
	select {
	case <-allPublished:
	case <-ctx.Done():
		return latencyStats{}, ctx.Err()
	case <-time.After(timeout):
		return latencyStats{}, fmt.Errorf("%d of %d events published %v after the last enqueue", published.Load(), total, timeout)
	}

	samples := make([]time.Duration, total)
	early := 0
	for i := range records {
		lat := time.Duration(records[i].published.Load() - records[i].committed.Load())
		if lat < 0 {
			early, lat = early+1, 0
		}
		samples[i] = lat
	}
	st := percentiles(samples)
	st.early = early
	st.achieved = float64(total) / producing.Seconds()
	claims := timer.durations()
	st.claims = fmt.Sprintf("%d, %s", len(claims), percentiles(claims))
	return st, nil
}

// latencyRuns runs measureLatency -repeat times and returns the run with
// the median p99, and for several runs a note on the range of their p50s
// and p99s.
func (b *bench) latencyRuns(ctx context.Context, rate int, setup latencySetup) (latencyStats, string, error) {
	var runs []latencyStats
	for range b.opts.repeat {
		st, err := b.measureLatency(ctx, rate, b.opts.duration, setup)
		if err != nil {
			return st, "", err
		}
		b.log.Info("latency: measured", "rate", rate, "poll_only", setup.pollOnly, "stats", st.String())
		runs = append(runs, st)
	}
	st, note := summarize(runs)
	return st, note, nil
}

// summarize returns the run with the median p99 and, for several runs, a
// note on the range of their p50s and p99s.
func summarize(runs []latencyStats) (latencyStats, string) {
	runs = slices.Clone(runs)
	slices.SortFunc(runs, func(a, b latencyStats) int { return cmp.Compare(a.p99, b.p99) })
	mid := runs[(len(runs)-1)/2]
	if len(runs) == 1 {
		return mid, ""
	}
	p50 := func(a, b latencyStats) int { return cmp.Compare(a.p50, b.p50) }
	return mid, fmt.Sprintf("the run with the median p99 of %d; p50 ranged %s–%s, p99 %s–%s", len(runs),
		fmtMs(slices.MinFunc(runs, p50).p50), fmtMs(slices.MaxFunc(runs, p50).p50), fmtMs(runs[0].p99), fmtMs(runs[len(runs)-1].p99))
}

// notifyRoundTrip measures raw LISTEN/NOTIFY: the time from one connection
// sending pg_notify (autocommit) to another, listening, receiving it.
func (b *bench) notifyRoundTrip(ctx context.Context, n int) (latencyStats, error) {
	listener, err := pgx.ConnectConfig(ctx, b.t.template.ConnConfig.Copy())
	if err != nil {
		return latencyStats{}, err
	}
	defer listener.Close(context.WithoutCancel(ctx))
	sender, err := pgx.ConnectConfig(ctx, b.t.template.ConnConfig.Copy())
	if err != nil {
		return latencyStats{}, err
	}
	defer sender.Close(context.WithoutCancel(ctx))
	if _, err := listener.Exec(ctx, "LISTEN outbox_bench_ping"); err != nil {
		return latencyStats{}, err
	}
	lctx, stop := context.WithCancel(ctx)
	received := make(chan time.Time)
	listenDone := make(chan error, 1)
	go func() {
		for {
			if _, err := listener.WaitForNotification(lctx); err != nil {
				listenDone <- err
				return
			}
			received <- time.Now()
		}
	}()
	defer func() {
		stop()
		<-listenDone
	}()
	samples := make([]time.Duration, 0, n)
	for range n {
		sent := time.Now()
		if _, err := sender.Exec(ctx, "SELECT pg_notify('outbox_bench_ping', '')"); err != nil {
			return latencyStats{}, err
		}
		select {
		case got := <-received:
			samples = append(samples, got.Sub(sent))
		case err := <-listenDone:
			listenDone <- err
			return latencyStats{}, errors.Join(errors.New("listener stopped"), err)
		case <-time.After(5 * time.Second):
			return latencyStats{}, errors.New("a notification did not arrive within 5s")
		}
	}
	return percentiles(samples), nil
}

// runLatency is the end-to-end latency workload: each configured rate with
// NOTIFY on and in poll-only mode, plus the raw LISTEN/NOTIFY round trip.
func (b *bench) runLatency(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	ping, err := b.notifyRoundTrip(ctx, 1000)
	if err != nil {
		return fmt.Errorf("notify round trip: %w", err)
	}
	pingText := "raw NOTIFY→LISTEN " + ping.String()
	for _, pollOnly := range []bool{false, true} {
		for _, rate := range b.opts.rates {
			mode := "NOTIFY on"
			if pollOnly {
				mode = "poll-only"
			}
			b.log.Info("latency: producing", "rate", rate, "mode", mode, "duration", b.opts.duration)
			st, repeated, err := b.latencyRuns(ctx, rate, latencySetup{pollOnly: pollOnly, settings: b.opts.dispatcherSettings})
			if err != nil {
				return fmt.Errorf("latency %d/s %s: %w", rate, mode, err)
			}
			r := row{
				Workload: "end-to-end latency, " + mode,
				Measure:  fmt.Sprintf("commit→publish at %s/s, %s events", itoa(int64(rate)), itoa(int64(st.n))),
				Outbox:   st.String(),
				Values: map[string]float64{
					"rate": float64(rate), "achieved_rate": st.achieved, "events": float64(st.n),
					"p50_ms": ms(st.p50), "p90_ms": ms(st.p90), "p99_ms": ms(st.p99), "max_ms": ms(st.max),
				},
			}
			if !pollOnly {
				r.Baseline = pingText
				r.Values["notify_p50_ms"], r.Values["notify_p99_ms"] = ms(ping.p50), ms(ping.p99)
			}
			if !pollOnly && rate == 500 {
				r.Target = "p50 ≤ 2 ms, p99 ≤ 10 ms"
				r.Met = ptr(st.p50 <= 2*time.Millisecond && st.p99 <= 10*time.Millisecond)
			}
			notes := []string{"the dispatcher's claim statements (count, duration) " + st.claims}
			if repeated != "" {
				notes = append(notes, repeated)
			}
			if st.achieved < 0.95*float64(rate) {
				notes = append(notes, fmt.Sprintf("the %d producers kept up only %s", b.opts.latencyProducers, fmtRate(st.achieved)))
			}
			if st.early > 0 {
				notes = append(notes, fmt.Sprintf("%d events were published before their producer's commit returned (counted as 0)", st.early))
			}
			if pollOnly {
				notes = append(notes, "the dispatcher polls every PollIntervalDefault ("+outbox.PollIntervalDefault.String()+"); latency is about half of it on average")
			}
			r.Note = "Latency " + mode + " at " + itoa(int64(rate)) + "/s: p90 " + fmtMs(st.p90) + "; " + strings.Join(notes, "; ") + "."
			b.add(r)
		}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
