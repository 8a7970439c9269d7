package outbox

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// With no publish running, wait reports so even on a context already
// ended (a stop whose stages came late): it said "still running" at
// random, and the stop then logged publishes it was abandoning.
func TestWaitWithNothingRunning(t *testing.T) {
	p := &workerPool{calls: map[*call]struct{}{}}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 100 {
		if !p.wait(ctx) {
			t.Fatalf("wait %d with nothing running on an ended context: false", i)
		}
	}
}

// No claim the plan allows can hand a lane more than its room: a claim
// takes events of any of its topics, oldest first, so each of its topics
// has room for the whole claim, and every lane with room is in exactly one
// claim. (One claim for all topics let a slow topic with old events take
// a whole batch, most of which waited out the lease and went back.)
func TestPlanNeverOverfillsALane(t *testing.T) {
	d := &Dispatcher{cfg: DispatcherConfig{BatchSize: 500, LeaseDuration: 30 * time.Second, LeaseHeadroom: time.Second}}
	newPool := func(batch int, lanes ...*lane) *workerPool {
		p := &workerPool{d: d, batch: batch}
		for i, l := range lanes {
			l.topic = Topic{"plan", fmt.Sprintf("t%d", i)}
			p.lanes = append(p.lanes, l)
			p.limit, p.inflight = p.limit+l.limit, p.inflight+l.inflight
		}
		return p
	}
	room := func(p *workerPool, l *lane) int { return p.laneCapacity(l) - l.inflight - l.waiting }
	check := func(name string, p *workerPool, want [][]string) {
		t.Helper()
		groups := p.plan()
		var got [][]string
		seen := map[string]bool{}
		for _, g := range groups {
			got = append(got, g.topics)
			for _, topic := range g.topics {
				l := p.byKeyForTest(topic)
				if r := room(p, l); g.room > r {
					t.Errorf("%s: a claim of %d for %v, whose lane %s has room for %d", name, g.room, g.topics, topic, r)
				}
				if seen[topic] {
					t.Errorf("%s: %s in two claims", name, topic)
				}
				seen[topic] = true
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%s: claims for %v, want %v", name, got, want)
		}
	}
	fast := func() *lane { return &lane{limit: 16, avg: time.Millisecond} }
	slow := &lane{limit: 2, avg: 10 * time.Second} // 2 rounds before the deadline: room for 4
	check("one topic", newPool(100, &lane{limit: 16, inflight: 16, waiting: 50}), [][]string{{"plan:t0"}})
	check("two idle fast topics share a claim", newPool(100, fast(), fast()), [][]string{{"plan:t0", "plan:t1"}})
	check("a slow topic claims for itself", newPool(100, fast(), slow), [][]string{{"plan:t0"}, {"plan:t1"}})
	busy := fast()
	busy.inflight, busy.waiting = 16, 170 // room 30 of 216
	check("a busy topic claims for itself, after the roomier ones", newPool(100, busy, fast(), fast()),
		[][]string{{"plan:t1", "plan:t2"}, {"plan:t0"}})
	full := fast()
	full.inflight, full.waiting = 16, 200
	paused := fast()
	paused.abandoned = paused.limit
	check("full and paused topics claim nothing", newPool(100, full, paused, fast()), [][]string{{"plan:t2"}})
	// Random lanes: the invariants hold whatever the rooms.
	rng := rand.New(rand.NewPCG(1, 2))
	for range 1000 {
		var lanes []*lane
		for range 1 + rng.IntN(6) {
			l := &lane{limit: 1 + rng.IntN(32)}
			if rng.IntN(2) == 0 {
				l.avg = time.Duration(1+rng.IntN(20_000)) * time.Millisecond
			}
			l.inflight = rng.IntN(l.limit + 1)
			l.waiting = rng.IntN(300)
			lanes = append(lanes, l)
		}
		p := newPool(32+rng.IntN(469), lanes...)
		p.limit = p.inflight + rng.IntN(p.limit-p.inflight+1) // other lanes may hold a lane's slots
		groups := p.plan()
		open := 0
		for _, l := range lanes {
			if room(p, l) > 0 {
				open++
			}
		}
		n := 0
		for _, g := range groups {
			n += len(g.topics)
			for _, topic := range g.topics {
				if r := room(p, p.byKeyForTest(topic)); g.room > r || g.room < 1 {
					t.Fatalf("a claim of %d for %v; lane %s has room for %d", g.room, g.topics, topic, r)
				}
			}
		}
		if n != open {
			t.Fatalf("%d lanes with room, %d in the plan's claims", open, n)
		}
	}
}

// A lane is sized by the publish slots it can get, not by its limit alone:
// beside a topic whose publishes hang on six of the pool's eight slots, a
// lane whose publishes take 50ms holds one slot and may take one more only
// if no other topic is idle; with one idle, it can start 32 publishes on
// its slot before a claim's 1.6s deadline, and may hold no more. Sized by
// its limit of four slots it held 68, and 36 went back unpublished at the
// deadline. With the pool to itself it holds its limit's worth again.
func TestLaneSizedBySlotsItCanGet(t *testing.T) {
	d := &Dispatcher{cfg: DispatcherConfig{BatchSize: 100, LeaseDuration: 2 * time.Second, LeaseHeadroom: 400 * time.Millisecond}}
	hung := &lane{limit: 8, inflight: 6, avg: time.Minute}
	slow := &lane{limit: 4, inflight: 1, avg: 50 * time.Millisecond}
	idle := &lane{limit: 4} // no publish finished yet
	p := &workerPool{d: d, batch: 32, limit: 8, inflight: 7, lanes: []*lane{hung, slow, idle}}
	for _, c := range []struct {
		name       string
		l          *lane
		slots, cap int
	}{
		{"beside the hung lane and an idle one", slow, 1, 32},
		{"the hung lane, which leaves the last slot to the idle one", hung, 6, 6},
		{"the idle lane, whose first slot may be the last", idle, 1, 1 + 32},
	} {
		if s, n := p.laneSlots(c.l), p.laneCapacity(c.l); s != c.slots || n != c.cap {
			t.Errorf("%s: %d slots, capacity %d; want %d and %d", c.name, s, n, c.slots, c.cap)
		}
	}
	hung.inflight, p.inflight = 0, 1 // its publishes returned
	if s, n := p.laneSlots(slow), p.laneCapacity(slow); s != 4 || n != 4+2*32 {
		t.Errorf("with the pool to itself: %d slots, capacity %d; want 4 and %d", s, n, 4+2*32)
	}
}

// laneSlots is what mayStartLocked lets a lane reach: starting publishes on
// one lane alone until it may start no more leaves it holding laneSlots
// (or nothing, where no slot is free: laneSlots then counts the one that
// will free), whatever the other lanes hold, and paused lanes, idle lanes
// and lanes whose publishes were all abandoned are counted as they should
// be.
func TestLaneSlotsIsWhatALaneCanStart(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 5000 {
		p := &workerPool{}
		for range 1 + rng.IntN(5) {
			l := &lane{limit: 1 + rng.IntN(8)}
			switch rng.IntN(4) {
			case 0: // paused: every slot's publish abandoned
				l.abandoned = l.limit
			case 1: // some abandoned, not paused
				l.abandoned = rng.IntN(l.limit)
			}
			if !l.paused() {
				l.inflight = rng.IntN(l.limit + 1)
			}
			p.lanes = append(p.lanes, l)
			p.inflight += l.inflight
		}
		p.limit = max(1, p.inflight+rng.IntN(10))
		for _, l := range p.lanes {
			if l.paused() {
				continue
			}
			want := p.laneSlots(l)
			held, pool := l.inflight, p.inflight
			for p.mayStartLocked(l) {
				l.inflight++
				p.inflight++
			}
			if got := l.inflight; got != want && !(got == 0 && want == 1 && p.inflight == p.limit) {
				t.Fatalf("case %d: a lane of limit %d holding %d reached %d slots of a pool of %d holding %d; laneSlots said %d",
					i, l.limit, held, got, p.limit, pool, want)
			}
			l.inflight, p.inflight = held, pool
		}
	}
	// Two lanes whose publishes hang cannot take the last slot from a third
	// with nothing in flight, nor from one whose publishes were all
	// abandoned without pausing it, but may from a paused one.
	a, b, c := &lane{limit: 4, inflight: 4}, &lane{limit: 4, inflight: 3}, &lane{limit: 2}
	p := &workerPool{limit: 8, inflight: 7, lanes: []*lane{a, b, c}}
	if p.mayStartLocked(b) || !p.mayStartLocked(c) {
		t.Fatalf("beside an idle lane: the busy lane may start %v (want false), the idle one %v (want true)", p.mayStartLocked(b), p.mayStartLocked(c))
	}
	c.abandoned = 1
	if p.mayStartLocked(b) {
		t.Fatal("beside a lane with an abandoned publish, not paused: the busy lane may take the last slot")
	}
	c.abandoned = 2
	if !p.mayStartLocked(b) {
		t.Fatal("beside a paused lane only: the busy lane may not take the last slot")
	}
}

// byKeyForTest finds a lane by its topic key.
func (p *workerPool) byKeyForTest(key string) *lane {
	for _, l := range p.lanes {
		if l.topic.key() == key {
			return l
		}
	}
	return nil
}
