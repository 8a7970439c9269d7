package outbox

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// The claimer leases due events in batches and hands them to the worker
// pool. It claims only for topics whose lanes have room and never more than
// they can start before the publish deadline (see workerPool.plan: lanes
// with less room than a shared claim's size get claims of their own), so a
// paused topic holds none of the others' slots and nothing queued locally
// is ever found expired and claimed again. (A paused topic's due events
// still cost the other topics' claims, which walk past them: doc.go,
// "Topic isolation".)
//
// It claims while it knows of due work and there is room, then waits for
// room, a wake-up, a re-check or the poll timer. A wake-up opens a wake
// window (WakeWindow) in which it re-checks at short, growing intervals;
// each claim that finds events extends the window. A retry recorded by the
// completer arms a timer for its due time, which opens a wake window too,
// so a retry is claimed when it falls due rather than at the next poll.
func (d *Dispatcher) claimer(ctx context.Context, ready func(), pool *workerPool, wake <-chan struct{}, due *dueTimes) error {
	poll := time.NewTimer(d.cfg.PollInterval)
	defer poll.Stop()
	recheck := time.NewTimer(time.Hour)
	recheck.Stop()
	defer recheck.Stop()
	dueTimer := time.NewTimer(time.Hour)
	dueTimer.Stop()
	defer dueTimer.Stop()
	var armedFor time.Time // when dueTimer fires; zero when stopped
	armDue := func() {
		if next, ok := due.earliest(); ok && (armedFor.IsZero() || next.Before(armedFor)) {
			armedFor = next
			resetTimer(dueTimer, time.Until(next))
		}
	}
	var hotUntil time.Time // end of the wake window
	recheckIn := d.cfg.WakeRecheck
	isReady, errDelay := false, time.Duration(0)
	// wanted: a wake-up, re-check, due retry or poll asked the topic's
	// lane to claim, and it has not claimed since. Kept per lane: a lane
	// without room when the news came claims once it has room, rather than
	// waiting for the poll because other lanes claimed meanwhile.
	wanted := make(map[string]bool, len(d.reg.keys))
	wantAll := func() {
		for _, t := range d.reg.keys {
			wanted[t] = true
		}
	}
	wantAll()
	// hungry: the topic's last claim came back full.
	hungry := make(map[string]bool, len(d.reg.keys))
	// Held events are released once per PollInterval by the clock, not
	// by the poll timer, which every claim that is not full pushes back
	// (under steady traffic it would never fire). The first release, once
	// the dispatcher is ready, repairs what an earlier process left held;
	// later ones run when this dispatcher has claimed ordered events (the
	// release walks every key with held events, whatever its topic). The
	// maintenance pass releases its topics' held events too, so that a
	// dispatcher that started while a key's head was dead, and so claims
	// none of its events, still frees them.
	var releaseAt time.Time
	releasedOnce := false
	for {
		if now := time.Now(); isReady && !now.Before(releaseAt) {
			releaseAt = now.Add(d.cfg.PollInterval)
			if !releasedOnce || d.sawOrdered.Load() {
				releasedOnce = true
				if d.releaseHeld(ctx) > 0 {
					wantAll()
				}
			}
		}
		groups := pool.plan()
		// A wake-up, a re-check or the poll claims for every lane with
		// room; otherwise only the lanes whose last claim came back full
		// (more is likely due) claim again, as soon as they have room, and
		// an empty claim for an idle topic cannot end another's drain.
		round := groups[:0:0]
		for _, g := range groups {
			if g.claimable() && slices.ContainsFunc(g.topics, func(t string) bool { return wanted[t] || hungry[t] }) {
				round = append(round, g)
			}
		}
		if len(round) > 0 {
			found, failed, sizedFull, leased := false, false, false, 0
			for _, g := range round {
				claimStart := time.Now()
				got, err := d.claim(ctx, g.topics, g.chains, g.room)
				switch {
				case ctx.Err() != nil:
					if len(got) > 0 {
						// Bounded as a claim is, so that the stop's stages
						// start however slow the database is; events not
						// given back return when their lease ends.
						gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.stopBound(ctx, d.cfg.LeaseHeadroom))
						d.giveBack(gctx, got, whyClaimAfter)
						cancel()
					}
					return nil
				case err != nil:
					if !isReady && notMigrated(err) {
						return fmt.Errorf("outbox dispatcher cannot claim: %w", &notMigratedError{schema: d.c.cfg.Schema, err: err})
					}
					if !isReady && d.c.store.Fatal(err) {
						return fmt.Errorf("outbox dispatcher cannot claim from schema %q: %w (%s)", d.c.cfg.Schema, err, fatalHint(err, roleDispatcher))
					}
					// The round goes on: one claim failing (one topic's
					// slow walk, say) does not hold back the others.
					d.setClaimErr(err)
					d.log.Warn("claim failed; retrying", append(d.errorAttrs(err), "topics", slices.Sorted(slices.Values(g.topics)),
						"retry_in", nextErrDelay(errDelay, d.cfg.PollInterval))...)
					d.metrics.claimErrors.Add(ctx, 1)
					failed = true
					continue
				}
				if !isReady {
					d.setClaimErr(nil)
					isReady = true
					ready()
					d.log.Info("dispatcher ready", "topics", d.reg.keys, "batch_size", d.cfg.BatchSize,
						"lease", d.cfg.LeaseDuration, "poll_interval", d.cfg.PollInterval, "poll_only", d.cfg.PollOnly)
				}
				deadline := claimStart.Add(d.cfg.LeaseDuration - d.cfg.LeaseHeadroom)
				batch := make([]claimed, len(got))
				skew, skewKnown := d.claimSkew(got, claimStart)
				for k, c := range got {
					batch[k] = claimed{d: d.delivery(c), deadline: deadline, enqueued: c.CreatedAt}
					if skewKnown {
						batch[k].enqueued = c.CreatedAt.Add(-skew)
					}
				}
				pool.submit(batch, deadline)
				found = found || len(got) > 0
				sizedFull = sizedFull || (g.sized && len(got) == g.room)
				leased += len(got)
				for _, t := range g.topics {
					hungry[t] = len(got) == g.room // a full claim suggests more is due
				}
			}
			if failed {
				errDelay = nextErrDelay(errDelay, d.cfg.PollInterval)
				if !sleepCtx(ctx, errDelay) {
					return nil
				}
				wantAll() // the whole round again
				continue
			}
			pool.adapt(sizedFull, leased)
			// Every claim of the round worked: only now is a failing
			// claim known to have recovered.
			if errDelay > 0 {
				d.setClaimErr(nil)
				errDelay = 0
			}
			now := time.Now()
			if found {
				hotUntil, recheckIn = now.Add(d.cfg.WakeWindow), d.cfg.WakeRecheck
			} else {
				recheckIn = min(2*recheckIn, 8*d.cfg.WakeRecheck)
			}
			// Claim again once a hungry lane has room. Otherwise wait for
			// news, re-checking inside the window.
			// (A hungry lane with no room must not stop the re-checks that
			// catch other topics' events enqueued without a NOTIFY.)
			for _, g := range round {
				for _, t := range g.topics {
					wanted[t] = false
				}
			}
			if d.onClaimRound != nil {
				var topics []string
				for _, g := range round {
					topics = append(topics, g.topics...)
				}
				d.onClaimRound(topics)
			}
			if !slices.ContainsFunc(d.reg.keys, func(t string) bool { return hungry[t] }) {
				resetTimer(poll, d.cfg.PollInterval)
			}
			if now.Before(hotUntil) {
				resetTimer(recheck, recheckIn)
			}
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-pool.roomFreed: // matters when waiting for room
		case <-wake:
			wantAll()
			hotUntil, recheckIn = time.Now().Add(d.cfg.WakeWindow), d.cfg.WakeRecheck
		case <-recheck.C:
			wantAll()
		case <-due.added:
			armDue()
		case <-dueTimer.C:
			now := time.Now()
			armedFor = time.Time{}
			if d.onDueWake != nil {
				d.onDueWake()
			}
			due.popDue(now)
			armDue()
			wantAll()
			hotUntil, recheckIn = now.Add(d.cfg.WakeWindow), d.cfg.WakeRecheck
		case <-poll.C:
			wantAll()
			resetTimer(poll, d.cfg.PollInterval)
		}
	}
}

// nextErrDelay is the wait before claims are tried again after a round in
// which one failed, the last such wait having been prev: from 50 ms,
// doubling, up to PollInterval or 5 s, whichever is longer.
func nextErrDelay(prev, pollInterval time.Duration) time.Duration {
	return min(max(2*prev, 50*time.Millisecond), max(pollInterval, 5*time.Second))
}

// claim runs one claim on a context that a stop does not cancel at once: a
// claim cancelled mid-flight may have committed, stranding its events until
// their lease expires, whereas a finished one can be given back at once. A
// stop bounds it as it bounds the statements after it (see outlastStop).
//
// The claimer waits LeaseHeadroom for the answer. A claim that has not
// answered by then (a frozen or overloaded server) is not cancelled: it
// goes on, for as long as its leases would be of use, on a goroutine of its
// own, and the claimer moves on with errClaimLate. If it commits, its events
// are given back when it answers, without using an attempt. Cancelled, it
// could still commit once the server went on, and each of its events,
// leased to no one who knew, used an attempt when its lease expired (a
// trial froze the server for 45 s: events delivered once were then
// dead-lettered with MaxAttempts 2). One such claim runs at a time, as it
// holds a connection; while it does, a claim that does not answer in time
// is cancelled, as before.
func (d *Dispatcher) claim(ctx context.Context, topics []string, chains []int, limit int) ([]driver.Claimed, error) {
	params := driver.ClaimParams{Topics: topics, Limit: limit, MaxAttempts: d.cfg.MaxAttempts,
		Worker: d.cfg.WorkerID, Lease: d.cfg.LeaseDuration, SkipDeadTopics: d.reg.skipDead, Chains: chains}
	var got []driver.Claimed
	var err error
	if d.lateClaim.CompareAndSwap(false, true) {
		got, err = d.claimOutlasting(ctx, params)
	} else {
		cctx, cancel := d.outlastStop(ctx, d.cfg.LeaseHeadroom)
		got, err = d.c.store.Claim(cctx, params)
		cancel()
	}
	d.metrics.observeClaim(got)
	for _, c := range got {
		if c.OrderingKey != nil {
			d.sawOrdered.Store(true)
			break
		}
	}
	return got, err
}

// errClaimLate is the error of a claim the claimer stopped waiting for.
var errClaimLate = errors.New("the claim had not answered after LeaseHeadroom; if it commits, its events are given back " +
	"when it answers")

// claimOutlasting runs a claim that may outlast the claimer's wait (see
// claim), with d.lateClaim set by the caller; it clears it once the claim
// is over.
func (d *Dispatcher) claimOutlasting(ctx context.Context, params driver.ClaimParams) ([]driver.Claimed, error) {
	type answer struct {
		got []driver.Claimed
		err error
	}
	answers := make(chan answer, 1)
	var mu sync.Mutex
	waiting := true
	cctx, cancel := d.outlastStop(ctx, max(d.cfg.LeaseDuration-d.cfg.LeaseHeadroom, d.cfg.LeaseHeadroom))
	d.lateClaims.Add(1)
	go func() {
		defer d.lateClaims.Done()
		defer d.lateClaim.Store(false)
		defer cancel()
		got, err := d.c.store.Claim(cctx, params)
		mu.Lock()
		late := !waiting
		if !late {
			answers <- answer{got, err}
		}
		mu.Unlock()
		if late && err == nil && len(got) > 0 {
			gctx, gcancel := context.WithTimeout(context.WithoutCancel(ctx), d.stopBound(ctx, d.cfg.LeaseHeadroom))
			defer gcancel()
			d.log.Warn("a claim answered after the claimer stopped waiting for it; its events are given back without using an attempt",
				"count", len(got))
			d.giveBack(gctx, got, whyClaimLate)
		}
	}()
	wait := time.NewTimer(d.cfg.LeaseHeadroom)
	defer wait.Stop()
	select {
	case a := <-answers:
		return a.got, a.err
	case <-wait.C:
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case a := <-answers: // it answered as the wait ended
		return a.got, a.err
	default:
		waiting = false
		return nil, errClaimLate
	}
}

// releaseHeldMax bounds one releaseHeld.
const releaseHeldMax = 1000

// releaseHeld repairs events held behind an ordering predecessor that has
// settled (see driver.Store.ReleaseHeld) and returns how many it let into
// the claim: a delivery frees its successor in the same statement, unless
// the successor's enqueue was still committing then, and a dead head of a
// SkipDeadHeads topic frees none. Run by the claimer once per PollInterval
// (see claimer), and by the completer after it records a dead head of such
// a topic.
func (d *Dispatcher) releaseHeld(ctx context.Context) int64 {
	rctx, cancel := context.WithTimeout(ctx, d.cfg.LeaseHeadroom)
	defer cancel()
	n, err := d.c.store.ReleaseHeld(rctx, d.reg.keys, d.reg.skipDead, releaseHeldMax)
	// Its own time running out is a failure to report (it waits for
	// nothing since migration 0042, so it means a slow or locked table);
	// the dispatcher stopping is not.
	if err != nil && ctx.Err() == nil {
		d.log.Warn("releasing ordered events held behind settled ones failed; retrying in a PollInterval", "error", err)
	}
	return n
}

// claimSkew returns how far the database's clock is ahead of this
// process's (see clockSkew), after a claim that started at claimStart by
// this process's clock returned got; false when it cannot tell: no event
// claimed, a driver that returns no lease end, or a test clock
// (Config.Now), which sets leases but not created_at. delivery.lag takes it
// off each event's created_at, so that the lag does not carry the skew
// between the two hosts' clocks. Called by the claimer only.
func (d *Dispatcher) claimSkew(got []driver.Claimed, claimStart time.Time) (time.Duration, bool) {
	if d.c.cfg.Now != nil || len(got) == 0 || got[0].LockedTill.IsZero() {
		return 0, false
	}
	return d.skew.observe(got[0].LockedTill.Add(-d.cfg.LeaseDuration).Sub(claimStart)), true
}

// clockSkewReadings is how many claims' readings clockSkew keeps.
const clockSkewReadings = 64

// clockSkew estimates how far the database's clock is ahead of this
// process's (negative: behind). A claim sets its leases to end at the
// database's clock at its statement's start plus LeaseDuration, and the
// claimer read its own clock before the claim, so each claim reads the
// skew plus the time until its statement started (a wait for a pool
// connection, the one-way latency). The estimate is the smallest of the
// last clockSkewReadings readings, the one that delay inflates least; a
// drift between the clocks is followed within as many claims.
type clockSkew struct {
	readings [clockSkewReadings]time.Duration
	n        int
}

// observe records a claim's reading and returns the estimate.
func (s *clockSkew) observe(reading time.Duration) time.Duration {
	s.readings[s.n%clockSkewReadings] = reading
	s.n++
	est := reading
	for _, r := range s.readings[:min(s.n, clockSkewReadings)] {
		est = min(est, r)
	}
	return est
}

func (d *Dispatcher) delivery(c driver.Claimed) Delivery {
	return Delivery{ID: c.ID, Namespace: c.Namespace, Topic: c.Topic, TenantID: c.TenantID, DedupeKey: c.DedupeKey,
		Payload: c.Payload, Attempt: c.Attempts, MaxAttempts: d.cfg.MaxAttempts, CreatedAt: c.CreatedAt, Headers: c.Headers,
		OrderingKey: deref(c.OrderingKey), Sequence: c.OrderingSeq, leaseToken: c.LeaseToken}
}

// giveBack releases events claimed by a claim that finished after a stop,
// and reports each outcome (OnOutcome, metrics) as the completer does.
func (d *Dispatcher) giveBack(ctx context.Context, got []driver.Claimed, why string) {
	results := make([]result, len(got))
	outcomes := make([]driver.Outcome, len(got))
	reports := make([]Outcome, len(got))
	for i, c := range got {
		results[i] = result{c: claimed{d: d.delivery(c)}, kind: released, why: why}
		outcomes[i], reports[i] = d.decide(results[i])
	}
	settled, err := d.c.store.Complete(ctx, nil, d.cfg.WorkerID, outcomes)
	if err != nil {
		d.log.Warn("could not give back claimed events; they are delivered again when their lease ends",
			"count", len(got), "reason", why, "error", err)
		return
	}
	for i, ok := range settled {
		if !ok {
			reports[i] = Outcome{LeaseLost: true}
		}
		d.record(results[i], reports[i])
	}
}

// dueTimesMax bounds the retry due times a dispatcher remembers; retries
// beyond it wait for the poll.
const dueTimesMax = 4096

// dueTimes holds the due times of the retries this dispatcher recorded, for
// the claimer's wake-up timer.
type dueTimes struct {
	mu    sync.Mutex
	times timeHeap
	// added is signalled (without blocking) when a time is added.
	added chan struct{}
}

func newDueTimes() *dueTimes { return &dueTimes{added: make(chan struct{}, 1)} }

func (q *dueTimes) add(t time.Time) {
	q.mu.Lock()
	if len(q.times) < dueTimesMax {
		heap.Push(&q.times, t)
	}
	q.mu.Unlock()
	select {
	case q.added <- struct{}{}:
	default:
	}
}

func (q *dueTimes) earliest() (time.Time, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.times) == 0 {
		return time.Time{}, false
	}
	return q.times[0], true
}

// popDue forgets the times at or before now.
func (q *dueTimes) popDue(now time.Time) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.times) > 0 && !q.times[0].After(now) {
		heap.Pop(&q.times)
	}
}

// timeHeap is a min-heap of times (container/heap).
type timeHeap []time.Time

func (h timeHeap) Len() int           { return len(h) }
func (h timeHeap) Less(i, j int) bool { return h[i].Before(h[j]) }
func (h timeHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timeHeap) Push(x any)        { *h = append(*h, x.(time.Time)) }
func (h *timeHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	*h = old[:len(old)-1]
	return t
}
