package outbox

import (
	"cmp"
	"context"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"
	"time"
)

// The worker pool runs publishes: one lane per topic, each with its own
// limit of publishes in flight under the dispatcher's overall Concurrency,
// so that a slow or hung topic cannot take another topic's workers.
//
// A publish that outlives its deadline is abandoned: its slot is freed, its
// attempt is recorded as failed (retried with backoff, dead after the last)
// and its goroutine is left to return whenever it does, counted until then. A lane
// whose abandoned publishes reach its limit is paused: it starts nothing
// and claims nothing until some of them return, which bounds the
// goroutines a publisher that ignores its context can pile up to twice its
// limit. Queued events that cannot start before their deadline are given
// back the same way, before their lease can expire, so the claimer never
// finds its own queued events expired and claims them again.
//
// Events of one ordering key claimed together (a chain, see
// driver.ClaimParams.Chains) run as one call on one slot: each is published
// only after the one before it was delivered, and the rest go back
// unpublished as soon as one is not (or the deadline passes, or the
// dispatcher stops).

// claimed is one event on its way through the dispatcher.
type claimed struct {
	d        Delivery
	deadline time.Time       // publish deadline by the local clock (lease end minus headroom)
	ctx      context.Context // the publish context of its claim's batch: ends at deadline
	// enqueued is d.CreatedAt (the database's clock) by this process's
	// clock, for delivery.lag (see claimSkew).
	enqueued time.Time
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
	pub     *Publisher // whose publish it was; nil when not published
	kind    resultKind
	err     error
	why     string // why a released event was not published (its history's detail)
	started time.Time
	elapsed time.Duration
}

type lane struct {
	pub       *Publisher
	topic     Topic
	limit     int
	inflight  int
	abandoned int
	// queue holds the claimed events waiting for a slot, in units: one
	// event, or a chain of one ordering key's events in sequence.
	queue [][]claimed
	// waiting counts events not started: those queued and the rest of the
	// running chains.
	waiting int
	avg     time.Duration // moving average of publish durations; 0 before the first
	keyed   bool          // an event with an ordering key was claimed for the lane
	// failed counts the publishes that failed (returned an error or
	// outlived their deadline) since the last that delivered, the first
	// and last of them at failedFirst and failedLast (Dispatcher.Health).
	failed                  int
	failedFirst, failedLast time.Time
}

// failingAfter is how many publishes of a topic in a row must fail for
// Dispatcher.Health to report it: one or two failures are everyday
// retries. failingFor is how long after the last of them it still does: a
// topic whose events stopped coming (all dead, say) is not failing now.
const (
	failingAfter = 3
	failingFor   = 10 * time.Minute
)

// notePublish counts a publish's end towards the lane's failures in a
// row: a delivery ends them; an error or an abandonment adds one. A
// Permanent error says the event is at fault, not the endpoint, and counts
// for nothing; so do events given back unpublished and lost leases.
func (l *lane) notePublish(r result, now time.Time) {
	switch {
	case delivered(r):
		l.failed = 0
	case (r.kind == published && r.err != nil && !IsPermanent(r.err)) || r.kind == abandoned:
		if l.failed == 0 {
			l.failedFirst = now
		}
		l.failed++
		l.failedLast = now
	}
}

// paused: as many abandoned publishes as the lane's limit are still
// running.
func (l *lane) paused() bool { return l.abandoned >= l.limit }

type call struct {
	c     claimed   // the event being published
	rest  []claimed // the rest of its chain, in sequence
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
	batch     int // the claim size: see adapt
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
		byKey: map[string]*lane{}, limit: d.cfg.Concurrency, calls: map[*call]struct{}{}, timers: map[*time.Timer]struct{}{},
		batch: min(d.cfg.BatchSize, claimSizeMin)}
	for _, t := range d.reg.topics {
		pub := d.reg.byKey[t.key()]
		l := &lane{pub: pub, topic: t, limit: d.laneLimit(pub)}
		p.lanes = append(p.lanes, l)
		p.byKey[t.key()] = l
	}
	return p
}

// claimGroup is one claim the claimer may make: the topics, the longest
// chain of one ordering key to claim for each, how many events in all, and
// the capacity that number is out of (for the claim threshold, see
// claimable).
type claimGroup struct {
	topics         []string
	chains         []int
	room, capacity int
	sized          bool // room is the claim size (see adapt)
}

// claimable: the group has room for at least half its capacity (and for
// one event), so claims come in chunks rather than one per freed slot.
func (g claimGroup) claimable() bool { return g.room >= max(1, g.capacity/2) }

// plan says which claims the claimer may make now. A claim takes events of
// any of its topics, oldest first, so every topic in it must have room for
// the whole claim, or a topic with old events could be handed more than
// its lane can start before the claim's deadline (the rest would wait out
// the lease and go back unpublished). The lanes with room are taken in
// order of room, largest first, into one claim while the smallest of them
// still has room for the claim's size (the claim size bounds it); each
// lane left (a slow publisher's, whose pace allows few events, or a busy
// one's) gets a claim of its own, for its room. With one topic, or lanes
// with room for a full claim each, that is one claim.
func (p *workerPool) plan() []claimGroup {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping {
		return nil
	}
	type open struct {
		l              *lane
		room, capacity int
	}
	var lanes []open
	for _, l := range p.lanes {
		if l.paused() {
			continue
		}
		c := p.laneCapacity(l)
		if r := c - l.inflight - l.waiting; r > 0 {
			lanes = append(lanes, open{l, r, c})
		}
	}
	if len(lanes) == 0 {
		return nil
	}
	slices.SortStableFunc(lanes, func(a, b open) int { return cmp.Compare(b.room, a.room) })
	shared, room, capacity := 0, 0, 0
	for _, o := range lanes {
		if o.room < min(p.batch, room+o.room) {
			break // as is every lane after it: less room, a larger claim
		}
		shared, room, capacity = shared+1, room+o.room, capacity+o.capacity
	}
	groups := make([]claimGroup, 0, 1+len(lanes)-shared)
	g := claimGroup{room: min(room, p.batch), capacity: min(capacity, p.batch), sized: room >= p.batch}
	for _, o := range lanes[:shared] {
		g.topics, g.chains = append(g.topics, o.l.topic.key()), append(g.chains, p.chainLimit(o.l))
	}
	groups = append(groups, g)
	for _, o := range lanes[shared:] {
		groups = append(groups, claimGroup{topics: []string{o.l.topic.key()}, chains: []int{p.chainLimit(o.l)},
			room: min(o.room, p.batch), capacity: min(o.capacity, p.batch), sized: o.room >= p.batch})
	}
	return groups
}

// claimSizeMin is the claim size a dispatcher starts with and never goes
// below (unless BatchSize is smaller).
const claimSizeMin = 32

// adapt sizes the next claims after a round of claims that leased got
// events in all: a round in which a claim was held back by the claim size
// (it came back full, asking for the whole size: sizedFull) doubles it, up
// to BatchSize, so the size grows with the publish rate; one that leased
// less than a quarter of it halves it, down to claimSizeMin. Besides the
// size, what the lanes can start before a claim's deadline at their
// publishers' recent pace bounds every claim (see laneCapacity), so slow
// publishers get small claims.
func (p *workerPool) adapt(sizedFull bool, got int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case sizedFull:
		p.batch = min(2*p.batch, p.d.cfg.BatchSize)
	case got < p.batch/4:
		p.batch = max(p.batch/2, min(claimSizeMin, p.d.cfg.BatchSize))
	}
}

// chainLimit is the most events of one ordering key a claim takes for the
// lane. It is one until a publish of the lane has finished and an event
// with an ordering key has been claimed for it (topics without keys do not
// pay for what chains cost a claim). Then it is as many as the lane can
// publish one after another in half a claim's publish window at its recent
// pace (the other half is for waiting in the queue), and few enough that
// the events the lane may hold at the largest claim size make at least as
// many chains as it has publish slots. (Not the current claim size: claims
// of one hot key come back small and keep it small.)
func (p *workerPool) chainLimit(l *lane) int {
	if l.avg <= 0 || !l.keyed {
		return 1
	}
	window := p.d.cfg.LeaseDuration - p.d.cfg.LeaseHeadroom
	return max(1, min(int(window/l.avg/2), 1+2*p.d.cfg.BatchSize/l.limit))
}

// laneCapacity is how many events a lane may hold, running and queued: the
// slots it can get (laneSlots) plus one batch until a publish of the lane
// has finished; then what it can start on those slots before a claim's
// publish deadline at its recent pace, at most the slots plus two batches
// (so that the next full batch can be claimed while the last one is still
// being worked through).
func (p *workerPool) laneCapacity(l *lane) int {
	slots := p.laneSlots(l)
	if l.avg <= 0 {
		return slots + p.batch
	}
	most := slots + 2*p.batch
	window := p.d.cfg.LeaseDuration - p.d.cfg.LeaseHeadroom
	rounds := int(window / l.avg)
	return max(slots, min(slots*rounds, most))
}

// laneSlots is how many publish slots the lane can reach now by
// mayStartLocked: its limit, or fewer while other lanes hold the rest of
// the pool's, one fewer again when reaching them would take the pool's
// last slot from an idle lane; at least one (which frees when one of the
// others' publishes ends), and at least what it holds. Sized by its limit
// alone, a slow lane beside topics whose publishes hang claimed what it
// could not start before the deadline, and the rest went back unpublished.
func (p *workerPool) laneSlots(l *lane) int {
	free := p.limit - (p.inflight - l.inflight) // what the others leave it
	slots := min(l.limit, free)
	if slots == free && slots > 1 && p.idleBesidesLocked(l) {
		slots--
	}
	return max(1, l.inflight, slots)
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
	for _, unit := range chainUnits(batch) {
		l := p.byKey[Topic{unit[0].d.Namespace, unit[0].d.Topic}.key()]
		for i := range unit {
			unit[i].ctx = ctx
			if l == nil || p.stopping { // cannot happen for l: only registered topics are claimed
				back = append(back, result{c: unit[i], kind: released, why: whyStopped})
			}
		}
		if l != nil && !p.stopping {
			l.queue = append(l.queue, unit)
			l.waiting += len(unit)
			l.keyed = l.keyed || unit[0].d.OrderingKey != ""
		}
	}
	p.afterLocked(time.Until(deadline), p.expire)
	p.afterLocked(time.Until(deadline)+p.d.abandonGrace(), func() { cancel(); p.abandonOverdue() })
	p.pumpLocked()
	booked := len(back) > 0 && p.reserveLocked()
	p.mu.Unlock()
	p.send(booked, back...)
}

// chainUnits splits a claim's events (in claim order) into units: each
// event without an ordering key alone, and the events of one ordering key
// together, in sequence, placed where the key's first event was. A unit of
// one event without a key is batch's own element (a slice of length and
// capacity one), not a copy.
func chainUnits(batch []claimed) [][]claimed {
	units := make([][]claimed, 0, len(batch))
	var byKey map[[3]string]int
	for i, c := range batch {
		if c.d.OrderingKey == "" {
			units = append(units, batch[i:i+1:i+1])
			continue
		}
		if byKey == nil {
			byKey = map[[3]string]int{}
		}
		k := [3]string{c.d.Namespace, c.d.Topic, c.d.OrderingKey}
		if i, ok := byKey[k]; ok {
			units[i] = append(units[i], c)
			continue
		}
		byKey[k] = len(units)
		units = append(units, []claimed{c})
	}
	for _, i := range byKey {
		if len(units[i]) > 1 {
			slices.SortFunc(units[i], func(a, b claimed) int { return cmp.Compare(a.d.Sequence, b.d.Sequence) })
		}
	}
	return units
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
// are free, each on a goroutine of its own.
func (p *workerPool) pumpLocked() { p.pumpTakingLocked(false) }

// pumpTakingLocked is pumpLocked, except that with take the first event it
// starts is returned for the calling goroutine to run, rather than given a
// new goroutine: a goroutine that finished a publish goes on with the next
// queued event, on a stack already grown to what publishing takes (a new
// goroutine's stack grew, by copying, in every publish: 5% of the client's
// CPU in a drain).
func (p *workerPool) pumpTakingLocked(take bool) (taken *call) {
	if p.stopping {
		return nil
	}
	for started := true; started && p.inflight < p.limit; {
		started = false
		for i := range p.lanes {
			l := p.lanes[(p.next+i)%len(p.lanes)]
			if len(l.queue) == 0 || !p.mayStartLocked(l) {
				continue
			}
			unit := l.queue[0]
			l.queue[0] = nil
			l.queue = l.queue[1:]
			k := p.startLocked(l, unit, take && taken == nil)
			if take && taken == nil {
				taken = k
			}
			started = true
			if p.inflight >= p.limit {
				break
			}
		}
		p.next++
	}
	return taken
}

// mayStartLocked reports whether the lane may start a publish now: it is
// not paused and has a slot free under its own limit and the pool's. A lane
// that already has a publish in flight must also leave the pool's last free
// slot to the other lanes while one of them has none in flight (and is not
// paused): so topics whose publishes hang together cannot hold every slot
// while a topic with nothing in flight gets work (it would wait for their
// deadline). A lane's first slot may be any free one, so topics allowed one
// slot each can still fill the pool together.
func (p *workerPool) mayStartLocked(l *lane) bool {
	if l.inflight >= l.limit || l.paused() || p.inflight >= p.limit {
		return false
	}
	return l.inflight == 0 || p.inflight+1 < p.limit || !p.idleBesidesLocked(l)
}

// idleBesidesLocked reports whether a lane other than l has nothing in
// flight and is not paused.
func (p *workerPool) idleBesidesLocked(l *lane) bool {
	for _, o := range p.lanes {
		if o != l && o.inflight == 0 && !o.paused() {
			return true
		}
	}
	return false
}

// expire gives back queued events whose deadline has passed.
func (p *workerPool) expire() {
	p.mu.Lock()
	var back []result
	now := time.Now()
	for _, l := range p.lanes {
		for len(l.queue) > 0 && !l.queue[0][0].deadline.After(now) {
			back = appendReleased(back, l, l.queue[0], whyDeadline)
			l.queue = l.queue[1:]
		}
	}
	booked := len(back) > 0 && p.reserveLocked()
	p.mu.Unlock()
	p.send(booked, back...)
	p.signalRoom()
}

// Why events went back unpublished, as their history records it.
const (
	whyStopped    = "not published: the dispatcher stopped first"
	whyDeadline   = "not published: it could not start before its publish deadline"
	whyChain      = "not published: an earlier event of its ordering key was not delivered"
	whyPaused     = "not published: its topic was paused, its publishes having outlived their deadline"
	whyAbandoned  = "abandoned: the publish outlived its deadline"
	whyStopLate   = "abandoned: the publish had not returned when the dispatcher's stop ran out of time"
	whyCutByStop  = "given back: the publish was cut short by a hard stop"
	whyClaimAfter = "not published: the claim finished after the dispatcher stopped"
	whyClaimLate  = "not published: the claim answered after the claimer had stopped waiting for it (the database slow or unavailable)"
)

// appendReleased appends results giving back events that never started,
// which stop waiting on the lane.
func appendReleased(back []result, l *lane, events []claimed, why string) []result {
	for _, c := range events {
		back = append(back, result{c: c, kind: released, why: why})
	}
	l.waiting -= len(events)
	return back
}

// startLocked starts a unit: its first event, and the rest of its chain
// after it. It runs on a new goroutine, unless the caller takes it to run
// on its own (inline).
func (p *workerPool) startLocked(l *lane, unit []claimed, inline bool) *call {
	k := &call{c: unit[0], rest: unit[1:], lane: l}
	l.waiting--
	l.inflight++
	p.inflight++
	p.calls[k] = struct{}{}
	p.running.Add(1)
	if !inline {
		go p.run(k)
	}
	return k
}

// run publishes a call's events, then those of the queued calls it takes
// over (see pumpTakingLocked), until none is left for it.
func (p *workerPool) run(k *call) {
	for k != nil {
		k = p.runOne(k)
	}
}

// runOne publishes the call's event and returns the call this goroutine
// runs next: the same one for the next event of its chain, a queued one
// it started, or nil.
func (p *workerPool) runOne(k *call) (next *call) {
	var res result
	if time.Now().Before(k.c.deadline) {
		// A publisher that ends this goroutine (runtime.Goexit) hands its
		// result to a new one, which goes on where this one would have.
		res = p.d.publish(k.c.ctx, k.c, func(r result) { go func() { p.run(p.settled(k, r)) }() })
	} else {
		// Its deadline passed while it was queued (the slot it waited for
		// freed only as the claim's other publishes timed out): published
		// now, it would fail at once on its ended context and be charged
		// an attempt. It goes back unpublished instead, as expire gives
		// back those still queued.
		res = result{c: k.c, kind: released, why: whyDeadline}
	}
	return p.settled(k, res)
}

// settled hands a call's result on and returns the call the goroutine runs
// next (see runOne).
func (p *workerPool) settled(k *call, res result) (next *call) {
	p.mu.Lock()
	switch k.state {
	case callRunning:
		// The slot stays taken until the completer has the result: when
		// recording outcomes falls behind, publishing (and so claiming)
		// waits for it instead of piling up leases it cannot settle.
		k.state = callDone
		if res.kind != released {
			k.lane.avg = movingAverage(k.lane.avg, res.elapsed)
		}
		k.lane.notePublish(res, time.Now())
		booked := p.reserveLocked()
		p.mu.Unlock()
		p.send(booked, res)
		p.mu.Lock()
		// The next event of a chain starts only after this one was
		// delivered, and before the deadline.
		if len(k.rest) > 0 && delivered(res) && !p.stopping && time.Now().Before(k.rest[0].deadline) {
			k.c, k.rest = k.rest[0], k.rest[1:]
			k.lane.waiting--
			k.state = callRunning
			p.mu.Unlock()
			return k
		}
		why := whyChain
		switch {
		case p.stopping:
			why = whyStopped
		case delivered(res), res.kind == released:
			why = whyDeadline
		}
		back := appendReleased(nil, k.lane, k.rest, why)
		k.rest = nil
		booked = len(back) > 0 && p.reserveLocked()
		p.finishLocked(k)
		if booked {
			// Handed over before this worker takes the next call: the
			// hand-over can wait for the completer, and a call taken
			// first would count as running meanwhile, and could be
			// abandoned at its deadline without having started.
			p.mu.Unlock()
			p.send(booked, back...)
			p.mu.Lock()
		}
		next = p.pumpTakingLocked(true)
		p.mu.Unlock()
	case callAbandoned:
		k.lane.abandoned--
		p.abandoned--
		if res.kind != released {
			k.lane.avg = movingAverage(k.lane.avg, res.elapsed)
		}
		p.pumpLocked()
		p.mu.Unlock()
		if res.kind != released {
			p.d.abandonedReturned(k.c, res)
		}
	default:
		p.mu.Unlock()
	}
	p.signalRoom()
	return next
}

// delivered reports whether a publish delivered its event, so that the next
// event of its ordering key may go.
func delivered(r result) bool {
	return (r.kind == published && r.err == nil) || r.kind == ackedInTx
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
		p.abandon(k, false)
	}
}

// abandon gives up on a running call: its slot is freed and its event
// given back. atStop tells a stop's last resort (abandonAll) from a
// publish that outlived its deadline.
func (p *workerPool) abandon(k *call, atStop bool) {
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
	paused := k.lane.paused() && !atStop
	why := whyAbandoned
	if atStop {
		why = whyStopLate
	}
	back := []result{{c: k.c, kind: abandoned, started: time.Now(), why: why}}
	if !atStop {
		k.lane.notePublish(back[0], back[0].started)
	}
	back = appendReleased(back, k.lane, k.rest, whyChain)
	k.rest = nil
	if paused { // nothing of this lane starts until an abandoned publish returns
		for _, unit := range k.lane.queue {
			back = appendReleased(back, k.lane, unit, whyPaused)
		}
		k.lane.queue = nil
	}
	p.pumpLocked()
	p.mu.Unlock()
	p.d.abandonedPublish(k.c, k.lane.pub, paused, atStop)
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
		for _, unit := range l.queue {
			back = appendReleased(back, l, unit, whyStopped)
		}
		l.queue = nil
	}
	booked := len(back) > 0 && p.reserveLocked()
	p.mu.Unlock()
	p.send(booked, back...)
}

// wait waits for the running publishes until ctx ends. With none running
// it returns true, also for a ctx already ended (a stop whose stages are
// late: a select would pick either).
func (p *workerPool) wait(ctx context.Context) bool {
	p.mu.Lock()
	idle := len(p.calls) == 0
	p.mu.Unlock()
	if idle {
		return true
	}
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
		p.abandon(k, true)
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
	topic                   Topic
	abandoned               int
	paused                  bool
	failed                  int // publishes in a row that failed
	failedFirst, failedLast time.Time
}

func (p *workerPool) state() (lanes []laneState, abandoned int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.lanes {
		lanes = append(lanes, laneState{topic: l.topic, abandoned: l.abandoned, paused: l.paused(),
			failed: l.failed, failedFirst: l.failedFirst, failedLast: l.failedLast})
	}
	return lanes, p.abandoned
}

func movingAverage(avg, sample time.Duration) time.Duration {
	if avg == 0 {
		return sample
	}
	return avg + (sample-avg)/8
}

// publish calls the event's publisher, isolating panics, and returns the
// result. When the publisher ends the goroutine instead of returning
// (runtime.Goexit, as t.Fatal does), exited gets the result, a failed
// attempt, as the goroutine unwinds.
func (d *Dispatcher) publish(ctx context.Context, c claimed, exited func(result)) result {
	m := c.d
	res := result{c: c, started: time.Now()}
	p := d.reg.byKey[Topic{m.Namespace, m.Topic}.key()]
	res.pub = p
	ctx, span := startPublishSpan(ctx, m, d.reg.telemetryOf(Topic{m.Namespace, m.Topic}).spanOptions)
	onGoexit := func(err error) {
		res.err = err
		endSpan(span, err)
		res.elapsed = time.Since(res.started)
		exited(res)
	}
	if p.HandleTx != nil {
		res.kind, res.err = d.handleTx(ctx, p, m, onGoexit)
	} else {
		res.err = d.callSafely(p, m, onGoexit, func() error { return p.Publish(ctx, m) })
	}
	spanErr := res.err
	if res.kind == lostInTx { // rolled back: nothing was delivered
		spanErr = ErrLeaseLost
	}
	endSpan(span, spanErr)
	res.elapsed = time.Since(res.started)
	if res.kind == published && res.err != nil && d.hardStop.Load() {
		// Cut short by a hard stop: the outcome is unknown, so the event
		// goes back without using up an attempt.
		res.kind, res.why = cutByStop, whyCutByStop
	}
	return res
}

// callSafely runs a publisher's call. A panic is recovered and returned as
// an error. A call that ends the goroutine (runtime.Goexit: t.Fatal or
// t.FailNow in a publisher under test) cannot be stopped from ending it:
// exited gets the error that stands for it, while the goroutine unwinds
// (the call never returned, and would otherwise count as running until it
// was abandoned at its deadline, and hold its slot for good).
func (d *Dispatcher) callSafely(p *Publisher, m Delivery, exited func(error), call func() error) (err error) {
	returned := false
	defer func() {
		r := recover()
		switch {
		case r != nil:
			err = fmt.Errorf("publisher %s panicked: %v", p.name(), r)
			d.log.Error("publisher panicked; the event will be retried", "publisher", p.name(),
				"namespace", m.Namespace, "topic", m.Topic, "event_id", m.ID, "attempt", m.Attempt,
				"panic", SanitizeError(err, d.c.cfg.ErrorMaxLen), "stack", string(debug.Stack()))
		case !returned:
			err = fmt.Errorf("publisher %s ended its goroutine with runtime.Goexit (t.Fatal or t.FailNow in a publisher?) instead of returning", p.name())
			d.log.Error("publisher ended its goroutine instead of returning; the event will be retried", "publisher", p.name(),
				"namespace", m.Namespace, "topic", m.Topic, "event_id", m.ID, "attempt", m.Attempt, "stack", string(debug.Stack()))
			exited(err)
		}
	}()
	err = call()
	returned = true
	if err != nil {
		err = usableError(p, err)
	}
	return err
}

// usableError returns err, or, when reading it panics, an error that says
// so. The dispatcher reads an error's text, its Permanent mark and its
// RetryAfter after the publisher's call, on goroutines where a panic would
// end the process: a nil pointer returned as an error (var err *MyError;
// return err) whose Error method reads its receiver took every topic down,
// and again after each restart.
func usableError(p *Publisher, err error) (out error) {
	defer func() {
		if r := recover(); r != nil {
			out = fmt.Errorf("publisher %s returned an error of type %T whose methods panic (a nil pointer returned as an error?): %v",
				p.name(), err, r)
		}
	}()
	_ = err.Error()
	_ = IsPermanent(err)
	_ = retryAfter(err)
	return err
}
