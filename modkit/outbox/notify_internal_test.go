package outbox

import (
	"math"
	"slices"
	"sync"
	"testing"
	"time"
)

// The gate lets one NOTIFY per topic through per interval, each topic on
// its own, the first at once whenever it comes. The times are given, not
// read from the clock, so every case is exact.
func TestNotifyGateOncePerInterval(t *testing.T) {
	var g notifyGate
	allow := func(key string, at time.Duration, want bool, why string) {
		t.Helper()
		// 1 ns after the clock's origin, as monotonicNanos can give.
		if got := g.allow(key, 1+int64(at), time.Millisecond); got != want {
			t.Fatalf("%s at %v: allow = %v, want %v (%s)", key, at, got, want, why)
		}
	}
	allow("a", 0, true, "the topic's first enqueue, at the clock's origin")
	allow("a", 0, false, "the same instant")
	allow("b", 0, true, "another topic's first enqueue")
	// An enqueue every 0.5 ms: every second one is an interval after the
	// last announcement.
	for at := 500 * time.Microsecond; at <= 5*time.Millisecond; at += 500 * time.Microsecond {
		allow("a", at, at%time.Millisecond == 0, "one per interval")
	}
	allow("b", 5*time.Millisecond, true, "b's own interval")
}

// A slot given back leaves the gate as it was before the slot was taken;
// one given back after a later enqueue took the gate changes nothing.
func TestNotifySlotGiveBack(t *testing.T) {
	var g notifyGate
	ms := int64(time.Millisecond)
	first, ok := g.take("k", 1, time.Millisecond)
	if !ok {
		t.Fatal("the first enqueue was not let through")
	}
	first.giveBack()
	again, ok := g.take("k", 2, time.Millisecond)
	if !ok {
		t.Fatal("the gate stayed closed after its only slot was given back")
	}
	if g.allow("k", 2+ms/2, time.Millisecond) {
		t.Fatal("a second NOTIFY within the interval of one that stands")
	}
	later, ok := g.take("k", 2+ms, time.Millisecond)
	if !ok {
		t.Fatal("no NOTIFY an interval after the last")
	}
	again.giveBack() // stale: a later enqueue holds the gate
	if g.allow("k", 2+ms+ms/2, time.Millisecond) {
		t.Fatal("a stale give-back reopened the gate")
	}
	later.giveBack() // the gate is as after "again", an interval ago
	if !g.allow("k", 2+ms+ms/2, time.Millisecond) {
		t.Fatal("after the latest slot was given back, the gate stayed closed an interval after the one before")
	}
	notifySlot{}.giveBack() // no slot: nothing to give back
}

// An interval of the largest duration announces the first enqueue only.
func TestNotifyGateHugeInterval(t *testing.T) {
	var g notifyGate
	huge := time.Duration(math.MaxInt64)
	if !g.allow("k", 1, huge) {
		t.Fatal("the first enqueue was not announced")
	}
	for i := int64(1); i < 1000; i++ {
		if g.allow("k", 1+i*int64(time.Hour), huge) {
			t.Fatalf("an enqueue %dh later was announced with an interval of %v", i, huge)
		}
	}
}

// Concurrent first enqueues of one topic announce it once.
func TestNotifyGateConcurrent(t *testing.T) {
	var g notifyGate
	var (
		mu        sync.Mutex
		announced int
		wg        sync.WaitGroup
	)
	for range 16 {
		wg.Go(func() {
			if g.allow("k", 1, time.Millisecond) {
				mu.Lock()
				announced++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if announced != 1 {
		t.Fatalf("%d of 16 concurrent enqueues announced the topic, want 1", announced)
	}
}

// The listener's reconnect delay grows while reconnects fail and starts
// again from the shortest once a listen worked: it never reset, so after
// six drops in a process's life every reconnect waited 5 s.
func TestReconnectDelay(t *testing.T) {
	var delays []time.Duration
	d := time.Duration(0)
	for range 8 {
		d = reconnectDelay(d, false)
		delays = append(delays, d)
	}
	want := []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond,
		1600 * time.Millisecond, 3200 * time.Millisecond, 5 * time.Second, 5 * time.Second}
	if !slices.Equal(delays, want) {
		t.Fatalf("delays while failing %v, want %v", delays, want)
	}
	if got := reconnectDelay(5*time.Second, true); got != 100*time.Millisecond {
		t.Fatalf("after a listen that worked: %v, want 100ms", got)
	}
}
