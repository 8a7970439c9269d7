package outbox

import (
	"math"
	"sync"
	"testing"
	"time"
)

// gateBase is an instant of the wall clock, as the gate is given in use.
var gateBase = time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC).UnixNano()

// The gate announces the first enqueue of a burst (one at least the
// interval after the topic's previous enqueue from the client), then once
// per ten intervals while the burst goes on, each topic on its own. The
// times are given, not read from the clock, so every case is exact.
func TestNotifyGateAnnouncesTheStartOfABurst(t *testing.T) {
	var g notifyGate
	allow := func(key string, at time.Duration, want bool, why string) {
		t.Helper()
		if got := g.allow(key, gateBase+int64(at), time.Millisecond); got != want {
			t.Fatalf("%s at %v: allow = %v, want %v (%s)", key, at, got, want, why)
		}
	}
	allow("a", 0, true, "the topic's first enqueue")
	allow("a", 0, false, "the same instant")
	allow("b", 0, true, "another topic's first enqueue")
	// A burst of a: an enqueue every 0.5 ms for 20 ms. Ten intervals after
	// the announcement at 0 it is announced again, and ten after that.
	at := time.Duration(0)
	for at < 20*time.Millisecond {
		at += 500 * time.Microsecond
		allow("a", at, at == 10*time.Millisecond || at == 20*time.Millisecond, "within a burst")
	}
	// The old gate (one NOTIFY per interval) announced every second
	// enqueue of that burst; this one announced two of forty.
	allow("a", at+time.Millisecond, true, "an interval after the burst's last enqueue: the next burst starts")
	allow("a", at+time.Millisecond+900*time.Microsecond, false, "less than an interval after the enqueue before")
	allow("b", at+time.Millisecond, true, "b's own previous enqueue was long before")
}

// An interval too long to multiply by ten does not wrap around into one
// that announces every enqueue.
func TestNotifyGateHugeInterval(t *testing.T) {
	var g notifyGate
	huge := time.Duration(math.MaxInt64)
	if !g.allow("k", gateBase, huge) {
		t.Fatal("the first enqueue was not announced")
	}
	for i := int64(1); i < 1000; i++ {
		if at := gateBase + i*int64(time.Second); g.allow("k", at, huge) {
			t.Fatalf("an enqueue %ds later was announced with an interval of %v", i, huge)
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
			if g.allow("k", gateBase, time.Millisecond) {
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
