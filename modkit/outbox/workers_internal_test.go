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

// byKeyForTest finds a lane by its topic key.
func (p *workerPool) byKeyForTest(key string) *lane {
	for _, l := range p.lanes {
		if l.topic.key() == key {
			return l
		}
	}
	return nil
}
