package outbox

import (
	"context"
	"fmt"
	"runtime/debug"
	"sync"
	"time"
)

// The worker pool runs publishes: one lane per topic, each with its own
// limit of publishes in flight under the dispatcher's overall Concurrency,
// so that a slow or hung topic cannot take another topic's workers.
//
// A publish that outlives its deadline is abandoned: its slot is freed, its
// event goes back unpublished (the claim's attempt undone) and its
// goroutine is left to return whenever it does, counted until then. A lane
// whose abandoned publishes reach its limit is paused: it starts nothing
// and claims nothing until some of them return, which bounds the
// goroutines a publisher that ignores its context can pile up to twice its
// limit. Queued events that cannot start before their deadline are given
// back the same way, before their lease can expire, so the claimer never
// finds its own queued events expired and claims them again.

// claimed is one event on its way through the dispatcher.
type claimed struct {
	d        Delivery
	deadline time.Time       // publish deadline by the local clock (lease end minus headroom)
	ctx      context.Context // the publish context of its claim's batch: ends at deadline
}

// resultKind says how a publish ended.
type resultKind uint8

const (
	published resultKind = iota // err says how
	released                    // not started (stop, deadline passed while queued)
	abandoned                   // outlived its deadline; given back unpublished
	ackedInTx                   // a transactional handler committed its outcome
	lostInTx                    // a transactional handler found its lease lost
	cutByStop                   // cut short by a hard stop: outcome unknown, given back
)

// result is one publish's end, for the completer.
type result struct {
	c       claimed
	kind    resultKind
	err     error
	started time.Time
	elapsed time.Duration
}

type lane struct {
	pub       *Publisher
	topic     Topic
	limit     int
	inflight  int
	abandoned int
	queue     []claimed
	avg       time.Duration // moving average of publish durations; 0 before the first
}

// paused: as many abandoned publishes as the lane's limit are still
// running.
func (l *lane) paused() bool { return l.abandoned >= l.limit }

type call struct {
	c     claimed
	lane  *lane
	state uint8 // callRunning, callDone, callAbandoned
}

const (
	callRunning uint8 = iota
	callDone
	callAbandoned
)

type workerPool struct {
	d       *Dispatcher
	pubCtx  context.Context // parent of every publish context; a hard stop cancels it
	results chan<- result
	// roomFreed wakes the claimer when a slot or queue place frees.
	roomFreed chan struct{}

	mu        sync.Mutex
	lanes     []*lane
	byKey     map[string]*lane
	limit     int // Concurrency
	inflight  int
	calls     map[*call]struct{} // running, not abandoned
	next      int                // round-robin start
	stopping  bool
	closed    bool
	timers    map[*time.Timer]struct{} // per-batch expiry and abandonment timers not yet fired
	emitting  sync.WaitGroup
	running   sync.WaitGroup // calls not yet done or abandoned
	abandoned int
}

func newWorkerPool(d *Dispatcher, pubCtx context.Context, results chan<- result) *workerPool {
	p := &workerPool{d: d, pubCtx: pubCtx, results: results, roomFreed: make(chan struct{}, 1),
		byKey: map[string]*lane{}, limit: d.cfg.Concurrency, calls: map[*call]struct{}{}, timers: map[*time.Timer]struct{}{}}
	for _, t := range d.reg.topics {
		pub := d.reg.byKey[t.key()]
		l := &lane{pub: pub, topic: t, limit: d.laneLimit(pub)}
		p.lanes = append(p.lanes, l)
		p.byKey[t.key()] = l
	}
	return p
}

// room says which topics the claimer may claim for and how many events in
// all, and the capacity that number is out of (for the claim threshold).
func (p *workerPool) room() (topics []string, room, capacity int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping {
		return nil, 0, 0
	}
	for _, l := range p.lanes {
		if l.paused() {
			continue
		}
		c := p.laneCapacity(l)
		capacity += c
		if r := c - l.inflight - len(l.queue); r > 0 {
			room += r
			topics = append(topics, l.topic.key())
		}
	}
	return topics, min(room, p.d.cfg.BatchSize), min(capacity, p.d.cfg.BatchSize)
}

// laneCapacity is how many events a lane may hold, running and queued: its
// limit plus one batch until a publish of the lane has finished; then what
// it can start before a claim's publish deadline at its recent pace, at
// most its limit plus two batches (so that the next full batch can be
// claimed while the last one is still being worked through).
func (p *workerPool) laneCapacity(l *lane) int {
	if l.avg <= 0 {
		return l.limit + p.d.cfg.BatchSize
	}
	most := l.limit + 2*p.d.cfg.BatchSize
	window := p.d.cfg.LeaseDuration - p.d.cfg.LeaseHeadroom
	rounds := int(window / l.avg)
	return max(l.limit, min(l.limit*rounds, most))
}

// submit queues a claim's events on their lanes and starts what it can.
// The events share one publish context, ending at their common deadline;
// at the deadline what is still queued goes back, and a little later what
// still runs is abandoned: two timers a claim, none an event.
func (p *workerPool) submit(batch []claimed, deadline time.Time) {
	if len(batch) == 0 {
		return
	}
	ctx, cancel := context.WithDeadline(p.pubCtx, deadline)
	p.mu.Lock()
	var back []result
	for _, c := range batch {
		c.ctx = ctx
		l := p.byKey[Topic{c.d.Namespace, c.d.Topic}.key()]
		if l == nil || p.stopping { // cannot happen for l: only registered topics are claimed
			back = append(back, result{c: c, kind: released})
			continue
		}
		l.queue = append(l.queue, c)
	}
	p.afterLocked(time.Until(deadline), p.expire)
	p.afterLocked(time.Until(deadline)+p.d.abandonGrace(), func() { cancel(); p.abandonOverdue() })
	p.pumpLocked()
	booked := len(back) > 0 && p.reserveLocked()
	p.mu.Unlock()
	p.send(booked, back...)
}

// afterLocked runs fn after d on a timer that close stops.
func (p *workerPool) afterLocked(d time.Duration, fn func()) {
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		p.mu.Lock()
		_, live := p.timers[t]
		delete(p.timers, t)
		p.mu.Unlock()
		if live {
			fn()
		}
	})
	p.timers[t] = struct{}{}
}

// pumpLocked starts queued events, one lane at a time in turn, while slots
// are free.
func (p *workerPool) pumpLocked() {
	if p.stopping {
		return
	}
	for started := true; started && p.inflight < p.limit; {
		started = false
		for i := range p.lanes {
			l := p.lanes[(p.next+i)%len(p.lanes)]
			if len(l.queue) == 0 || l.inflight >= l.limit || l.paused() {
				continue
			}
			c := l.queue[0]
			l.queue[0] = claimed{}
			l.queue = l.queue[1:]
			p.startLocked(l, c)
			started = true
			if p.inflight >= p.limit {
				break
			}
		}
		p.next++
	}
}

// expire gives back queued events whose deadline has passed.
func (p *workerPool) expire() {
	p.mu.Lock()
	var back []result
	now := time.Now()
	for _, l := range p.lanes {
		for len(l.queue) > 0 && !l.queue[0].deadline.After(now) {
			back = append(back, result{c: l.queue[0], kind: released})
			l.queue = l.queue[1:]
		}
	}
	booked := len(back) > 0 && p.reserveLocked()
	p.mu.Unlock()
	p.send(booked, back...)
	p.signalRoom()
}

func (p *workerPool) startLocked(l *lane, c claimed) {
	k := &call{c: c, lane: l}
	l.inflight++
	p.inflight++
	p.calls[k] = struct{}{}
	p.running.Add(1)
	go p.run(k)
}

func (p *workerPool) run(k *call) {
	res := p.d.publish(k.c.ctx, k.c)
	p.mu.Lock()
	switch k.state {
	case callRunning:
		// The slot stays taken until the completer has the result: when
		// recording outcomes falls behind, publishing (and so claiming)
		// waits for it instead of piling up leases it cannot settle.
		k.state = callDone
		booked := p.reserveLocked()
		p.mu.Unlock()
		p.send(booked, res)
		p.mu.Lock()
		p.finishLocked(k)
		k.lane.avg = movingAverage(k.lane.avg, res.elapsed)
		p.pumpLocked()
		p.mu.Unlock()
	case callAbandoned:
		k.lane.abandoned--
		p.abandoned--
		k.lane.avg = movingAverage(k.lane.avg, res.elapsed)
		p.pumpLocked()
		p.mu.Unlock()
		p.d.abandonedReturned(k.c, res)
	default:
		p.mu.Unlock()
	}
	p.signalRoom()
}

func (p *workerPool) finishLocked(k *call) {
	k.lane.inflight--
	p.inflight--
	delete(p.calls, k)
	p.running.Done()
}

// abandonOverdue gives up on the calls that outlived their deadline by the
// grace period.
func (p *workerPool) abandonOverdue() {
	cutoff := time.Now().Add(-p.d.abandonGrace())
	p.mu.Lock()
	var overdue []*call
	for k := range p.calls {
		if k.state == callRunning && !k.c.deadline.After(cutoff) {
			overdue = append(overdue, k)
		}
	}
	p.mu.Unlock()
	for _, k := range overdue {
		p.abandon(k)
	}
}

// abandon gives up on a running call: its slot is freed and its event
// given back.
func (p *workerPool) abandon(k *call) {
	p.mu.Lock()
	if k.state != callRunning {
		p.mu.Unlock()
		return
	}
	k.state = callAbandoned
	booked := p.reserveLocked()
	p.finishLocked(k)
	k.lane.abandoned++
	p.abandoned++
	paused := k.lane.paused()
	back := []result{{c: k.c, kind: abandoned, started: time.Now()}}
	if paused { // nothing of this lane starts until an abandoned publish returns
		for _, c := range k.lane.queue {
			back = append(back, result{c: c, kind: released})
		}
		k.lane.queue = nil
	}
	p.pumpLocked()
	p.mu.Unlock()
	p.d.abandonedPublish(k.c, k.lane.pub, paused)
	p.send(booked, back...)
	p.signalRoom()
}

// reserveLocked books a hand-over of results to the completer; close waits
// for every booked hand-over. Book it under the same lock hold as the state
// change that produced the results, so that a stop cannot slip between the
// two and drop them. It returns false after close (the events' leases
// expire and they are delivered again).
func (p *workerPool) reserveLocked() bool {
	if p.closed {
		return false
	}
	p.emitting.Add(1)
	return true
}

// send delivers results booked with reserveLocked.
func (p *workerPool) send(booked bool, rs ...result) {
	if !booked {
		return
	}
	defer p.emitting.Done()
	for _, r := range rs {
		p.results <- r
	}
}

func (p *workerPool) signalRoom() {
	select {
	case p.roomFreed <- struct{}{}:
	default:
	}
}

// stop starts no more publishes and gives every queued event back.
func (p *workerPool) stop() {
	p.mu.Lock()
	p.stopping = true
	var back []result
	for _, l := range p.lanes {
		for _, c := range l.queue {
			back = append(back, result{c: c, kind: released})
		}
		l.queue = nil
	}
	booked := len(back) > 0 && p.reserveLocked()
	p.mu.Unlock()
	p.send(booked, back...)
}

// wait waits for the running publishes until ctx ends.
func (p *workerPool) wait(ctx context.Context) bool {
	done := make(chan struct{})
	go func() { p.running.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-ctx.Done():
		return false
	}
}

// abandonAll abandons every running publish (a stop's last resort).
func (p *workerPool) abandonAll() {
	p.mu.Lock()
	calls := make([]*call, 0, len(p.calls))
	for k := range p.calls {
		calls = append(calls, k)
	}
	p.mu.Unlock()
	for _, k := range calls {
		p.abandon(k)
	}
}

// close waits for results in flight to reach the completer; later ones are
// dropped.
func (p *workerPool) close() {
	p.mu.Lock()
	p.closed = true
	for t := range p.timers {
		t.Stop()
	}
	clear(p.timers)
	p.mu.Unlock()
	p.emitting.Wait()
}

// laneState is one lane's health, for Dispatcher.Health.
type laneState struct {
	topic     Topic
	abandoned int
	paused    bool
}

func (p *workerPool) state() (lanes []laneState, abandoned int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.lanes {
		lanes = append(lanes, laneState{topic: l.topic, abandoned: l.abandoned, paused: l.paused()})
	}
	return lanes, p.abandoned
}

func movingAverage(avg, sample time.Duration) time.Duration {
	if avg == 0 {
		return sample
	}
	return avg + (sample-avg)/8
}

// publish runs one publisher call, isolating panics.
func (d *Dispatcher) publish(ctx context.Context, c claimed) result {
	m := c.d
	res := result{c: c, started: time.Now()}
	p := d.reg.byKey[Topic{m.Namespace, m.Topic}.key()]
	ctx, span := startPublishSpan(ctx, m)
	if p.HandleTx != nil {
		res.kind, res.err = d.handleTx(ctx, p, m)
	} else {
		res.err = d.callSafely(p, m, func() error { return p.Publish(ctx, m) })
	}
	endSpan(span, res.err)
	res.elapsed = time.Since(res.started)
	if res.kind == published && res.err != nil && d.hardStop.Load() {
		// Cut short by a hard stop: the outcome is unknown, so the event
		// goes back without using up an attempt.
		res.kind = cutByStop
	}
	return res
}

func (d *Dispatcher) callSafely(p *Publisher, m Delivery, call func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("publisher %s panicked: %v", p.name(), r)
			d.log.Error("publisher panicked; the event will be retried", "publisher", p.name(),
				"namespace", m.Namespace, "topic", m.Topic, "event_id", m.ID, "attempt", m.Attempt,
				"panic", SanitizeError(err, d.c.cfg.ErrorMaxLen), "stack", string(debug.Stack()))
		}
	}()
	return call()
}
