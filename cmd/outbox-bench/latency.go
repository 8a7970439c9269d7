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
	early              int             // publishes seen before the producer's commit returned (counted as 0)
	achieved           float64         // enqueues per second the producers kept up
	claims             []time.Duration // how long each of the dispatcher's claim statements took
	pollInterval       time.Duration   // the dispatcher's PollInterval
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
// dispatcher does not LISTEN (it polls every PollInterval, 1s by default).
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
	onPublish := func(d outbox.Delivery) {
		v, ok := byID.Load(d.ID)
		if !ok {
			return
		}
		if v.(*latencyRecord).published.CompareAndSwap(0, stamp()) && published.Add(1) == int64(total) {
			close(allPublished)
		}
	}

	timer := &claimTimer{}
	dpool, err := b.t.newPool(ctx, poolSpec{maxConns: b.opts.dispatcherConns, warm: 1, settings: setup.settings, tracer: timer})
	if err != nil {
		return latencyStats{}, err
	}
	defer dpool.Close()
	d, err := b.newDispatcher(dpool, outbox.DispatcherConfig{PollOnly: pollOnly, Logger: b.dispatcherLog}, onPublish)
	if err != nil {
		return latencyStats{}, err
	}
	if err := d.Start(ctx); err != nil {
		return latencyStats{}, fmt.Errorf("start dispatcher: %w", err)
	}
	defer func() { _ = d.Stop(context.WithoutCancel(ctx)) }()

	workers := b.opts.latencyProducers
	ppool, err := b.t.newPool(ctx, poolSpec{maxConns: int32(workers), warm: workers})
	if err != nil {
		return latencyStats{}, err
	}
	defer ppool.Close()
	producer, err := b.newClient(ppool, outbox.Config{DisableNotify: pollOnly, NotifyInterval: setup.notifyInterval})
	if err != nil {
		return latencyStats{}, err
	}

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
	st.claims = timer.durations()
	st.pollInterval = d.Config().PollInterval
	return st, nil
}

// latencyRounds is one latency phase measured in several rounds, in run
// order.
type latencyRounds []latencyStats

// ms is one percentile of every round, in milliseconds.
func (l latencyRounds) ms(percentile func(latencyStats) time.Duration) series {
	return mapSeries(l, func(st latencyStats) float64 { return ms(percentile(st)) })
}

func p50(st latencyStats) time.Duration { return st.p50 }
func p90(st latencyStats) time.Duration { return st.p90 }
func p99(st latencyStats) time.Duration { return st.p99 }

// max is the highest latency seen in any round.
func (l latencyRounds) max() time.Duration {
	return slices.MaxFunc(l, func(a, b latencyStats) int { return cmp.Compare(a.max, b.max) }).max
}

// String gives the median p50 and p99 of the rounds with their min–max,
// and the highest latency of any round: "p50 2.05 ms (1.90–2.31), p99
// 6.87 ms (6.10–9.20), max 19.0 ms".
func (l latencyRounds) String() string {
	return fmt.Sprintf("p50 %s, p99 %s, max %s", l.ms(p50).withSpread(fmtMsValue, " ms"), l.ms(p99).withSpread(fmtMsValue, " ms"), fmtMs(l.max()))
}

// values are the figures of a latency row, for JSON.
func (l latencyRounds) values() (map[string]float64, map[string][]float64) {
	values := map[string]float64{"max_ms": ms(l.max()), "rounds": float64(len(l))}
	runs := map[string][]float64{}
	for name, percentile := range map[string]func(latencyStats) time.Duration{"p50_ms": p50, "p90_ms": p90, "p99_ms": p99} {
		s := l.ms(percentile)
		values[name], runs[name] = s.median(), s
		if len(s) > 1 {
			values[name+"_min"], values[name+"_max"] = s.lo(), s.hi()
		}
	}
	return values, runs
}

// claims summarises the dispatcher's claim statements over all rounds:
// their count and duration percentiles.
func (l latencyRounds) claims() string {
	var all []time.Duration
	for _, st := range l {
		all = append(all, st.claims...)
	}
	return fmt.Sprintf("%d, %s", len(all), percentiles(all))
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

// latencyPhase is one measured configuration of the latency workload.
type latencyPhase struct {
	rate     int
	pollOnly bool
}

func (p latencyPhase) mode() string {
	if p.pollOnly {
		return "poll-only"
	}
	return "NOTIFY on"
}

// runLatency is the end-to-end latency workload: each configured rate with
// NOTIFY on and in poll-only mode, plus the raw LISTEN/NOTIFY round trip as
// the baseline, in rounds: each round runs the first NOTIFY phase, the
// round trip, then the other phases.
// latencyTargets are the performance issue's end-to-end targets by enqueue
// rate (events/s), in milliseconds; the issue judges them on steady state,
// phases of 60 s or more.
var latencyTargets = map[int]struct{ p50, p99 float64 }{
	500:  {p50: 1.5, p99: 5},
	2000: {p50: 2, p99: 15},
}

func (b *bench) runLatency(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	var phases []latencyPhase
	for _, pollOnly := range []bool{false, true} {
		for _, rate := range b.opts.rates {
			phases = append(phases, latencyPhase{rate: rate, pollOnly: pollOnly})
		}
	}
	var sides []side[latencyStats]
	for i, p := range phases {
		sides = append(sides, side[latencyStats]{fmt.Sprintf("dispatcher, %s, %s/s for %v", p.mode(), itoa(int64(p.rate)), b.opts.duration),
			func(ctx context.Context, _ int) (latencyStats, error) {
				st, err := b.measureLatency(ctx, p.rate, b.opts.duration, latencySetup{pollOnly: p.pollOnly, settings: b.opts.dispatcherSettings})
				if err != nil {
					return st, fmt.Errorf("latency %d/s %s: %w", p.rate, p.mode(), err)
				}
				b.log.Info("latency: measured", "rate", p.rate, "mode", p.mode(), "stats", st.String())
				return st, nil
			}})
		if i == 0 {
			sides = append(sides, side[latencyStats]{"raw NOTIFY→LISTEN round trip", func(ctx context.Context, _ int) (latencyStats, error) {
				st, err := b.notifyRoundTrip(ctx, 1000)
				if err != nil {
					return st, fmt.Errorf("notify round trip: %w", err)
				}
				return st, nil
			}})
		}
	}
	results, err := alternate(ctx, b, "latency", b.opts.rounds, sides)
	if err != nil {
		return err
	}
	ping := latencyRounds(results[1])
	results = slices.Delete(results, 1, 2)
	pingText := "raw NOTIFY→LISTEN " + ping.String()
	for i, p := range phases {
		runs := latencyRounds(results[i])
		values, perRound := runs.values()
		total := 0
		for _, st := range runs {
			total += st.n
		}
		r := row{
			Workload: "end-to-end latency, " + p.mode(),
			Measure:  fmt.Sprintf("commit→publish at %s/s, %s events per round", itoa(int64(p.rate)), itoa(int64(runs[0].n))),
			Outbox:   runs.String(),
			Values:   values,
			Runs:     perRound,
		}
		r.Values["rate"], r.Values["events"] = float64(p.rate), float64(total)
		r.Values["achieved_rate"] = mapSeries(runs, func(st latencyStats) float64 { return st.achieved }).lo()
		if !p.pollOnly {
			r.Baseline = pingText
			r.Values["notify_p50_ms"], r.Values["notify_p99_ms"] = ping.ms(p50).median(), ping.ms(p99).median()
		}
		if target, ok := latencyTargets[p.rate]; ok && !p.pollOnly {
			r.Target = fmt.Sprintf("p50 ≤ %g ms, p99 ≤ %g ms", target.p50, target.p99)
			r.Met = ptr(runs.ms(p50).median() <= target.p50 && runs.ms(p99).median() <= target.p99)
		}
		notes := []string{"the dispatcher's claim statements (count, duration) " + runs.claims()}
		if r.Target != "" && b.opts.duration < time.Minute {
			notes = append(notes, "the target is for steady state, phases of 60 s or more (-duration 60s); these ran "+b.opts.duration.String())
		}
		if len(runs) > 1 {
			notes = append(notes, fmt.Sprintf("medians of %d rounds (min–max); max is the highest of any round; p50 by round %s, p99 by round %s",
				len(runs), joinSeries(runs.ms(p50), fmtMsValue), joinSeries(runs.ms(p99), fmtMsValue)))
		}
		if achieved := r.Values["achieved_rate"]; achieved < 0.95*float64(p.rate) {
			notes = append(notes, fmt.Sprintf("the %d producers kept up only %s in one round", b.opts.latencyProducers, fmtRate(achieved)))
		}
		early := 0
		for _, st := range runs {
			early += st.early
		}
		if early > 0 {
			notes = append(notes, fmt.Sprintf("%d events were published before their producer's commit returned (counted as 0)", early))
		}
		if p.pollOnly {
			notes = append(notes, "the dispatcher polls every PollInterval ("+runs[0].pollInterval.String()+"); latency is about half of it on average")
		}
		r.Note = "Latency " + p.mode() + " at " + itoa(int64(p.rate)) + "/s: p90 " + runs.ms(p90).withSpread(fmtMsValue, " ms") + "; " + strings.Join(notes, "; ") + "."
		b.add(r)
	}
	return nil
}

// joinSeries renders every value of s in run order, "2.05, 1.90, 2.31".
func joinSeries(s series, format func(float64) string) string {
	parts := make([]string, len(s))
	for i, v := range s {
		parts[i] = format(v)
	}
	return strings.Join(parts, ", ")
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
