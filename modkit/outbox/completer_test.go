package outbox

import (
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
)

// The completer's batching: a few results wait for more (up to
// completeLingerBelow), a result of an ordering key ends the wait, and a
// closed channel ends it too. The waits here are an hour long, so a test
// that returns did not return because a timer fired.
func TestGatherWaitsForMoreResults(t *testing.T) {
	unordered := result{}
	keyed := result{c: claimed{d: Delivery{OrderingKey: "k"}}}
	newLinger := func() *time.Timer {
		tm := time.NewTimer(time.Hour)
		tm.Stop()
		return tm
	}

	t.Run("fills up to the linger threshold", func(t *testing.T) {
		results := make(chan result)
		go func() {
			for range completeLingerBelow + 5 {
				results <- unordered
			}
		}()
		batch := gather([]result{<-results}, results, newLinger(), time.Hour)
		if len(batch) != completeLingerBelow {
			t.Fatalf("gathered %d results, want %d", len(batch), completeLingerBelow)
		}
		for range 5 { // the rest stay for the next batch
			<-results
		}
	})

	t.Run("a result of an ordering key is written at once", func(t *testing.T) {
		results := make(chan result, 1)
		go func() {
			results <- unordered
			results <- keyed
		}()
		batch := gather([]result{unordered}, results, newLinger(), time.Hour)
		if len(batch) != 3 || !ordered(batch[2]) {
			t.Fatalf("gathered %d results, want the two before the ordered one and it", len(batch))
		}
		if batch := gather([]result{keyed}, make(chan result), newLinger(), time.Hour); len(batch) != 1 {
			t.Fatalf("a batch that starts with an ordered result gathered %d", len(batch))
		}
	})

	t.Run("a closed channel ends the wait", func(t *testing.T) {
		results := make(chan result, 2)
		results <- unordered
		close(results)
		if batch := gather([]result{unordered}, results, newLinger(), time.Hour); len(batch) != 2 {
			t.Fatalf("gathered %d results, want 2", len(batch))
		}
	})

	t.Run("the wait ends", func(t *testing.T) {
		results := make(chan result)
		if batch := gather([]result{unordered}, results, newLinger(), time.Millisecond); len(batch) != 1 {
			t.Fatalf("gathered %d results, want 1", len(batch))
		}
	})

	t.Run("a full batch does not wait", func(t *testing.T) {
		results := make(chan result, completeLingerBelow)
		for range completeLingerBelow - 1 {
			results <- unordered
		}
		if batch := gather([]result{unordered}, results, newLinger(), time.Hour); len(batch) != completeLingerBelow {
			t.Fatalf("gathered %d results, want %d", len(batch), completeLingerBelow)
		}
	})
}

// Outcome writes: two batches of unordered results are written at once; a
// batch with a result of an ordering key waits for the writes before it
// and is written alone. In the bubble, time.Sleep moves the bubble's clock
// past the linger without waiting, and synctest.Wait returns once every
// other goroutine is blocked, so each check sees every write that could
// have started by then.
func TestWriteOutcomesConcurrency(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		unordered := result{}
		keyed := result{c: claimed{d: Delivery{OrderingKey: "k"}}}
		// Buffered: a result may wait while the gatherer writes an ordered
		// batch itself.
		results := make(chan result, 1)
		started := make(chan bool, 8) // whether each write's batch is ordered
		release := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			writeOutcomes(results, func(batch []result) {
				started <- slices.ContainsFunc(batch, ordered)
				<-release
			})
		}()
		writes := func(want int, what string) {
			t.Helper()
			time.Sleep(completeLinger) // the bubble's clock: the linger ends
			synctest.Wait()
			if got := len(started); got != want {
				t.Fatalf("%s: %d writes started, want %d", what, got, want)
			}
		}

		results <- unordered
		writes(1, "one unordered batch")
		results <- unordered
		writes(2, "a second unordered batch while the first is written")
		results <- keyed
		writes(2, "an ordered batch while two writes run")
		release <- struct{}{}
		writes(2, "an ordered batch while one write runs")
		release <- struct{}{}
		writes(3, "an ordered batch once the writes before it are done")
		results <- unordered
		writes(3, "an unordered batch while an ordered one is written")
		release <- struct{}{}
		writes(4, "an unordered batch after the ordered one")
		for _, wantOrdered := range []bool{false, false, true, false} {
			if got := <-started; got != wantOrdered {
				t.Fatalf("writes started out of order: ordered=%v, want %v", got, wantOrdered)
			}
		}
		close(results)
		synctest.Wait()
		select {
		case <-done:
			t.Fatal("writeOutcomes returned while a write was still running")
		default:
		}
		release <- struct{}{}
		<-done
	})
}

// splitRepeats keeps the first result of each event in a batch, in order,
// and puts the repeats after them, in order; a batch without repeats is
// returned as it is.
func TestSplitRepeats(t *testing.T) {
	ids := []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}
	of := func(idx ...int) []result {
		var rs []result
		for n, i := range idx {
			rs = append(rs, result{c: claimed{d: Delivery{ID: ids[i], Attempt: n}}})
		}
		return rs
	}
	attempts := func(rs []result) []int {
		var out []int
		for _, r := range rs {
			out = append(out, r.c.d.Attempt)
		}
		return out
	}
	batch := of(0, 1, 2)
	if first, later := splitRepeats(batch); &first[0] != &batch[0] || len(first) != 3 || later != nil {
		t.Fatalf("a batch without repeats: %v, %v", attempts(first), attempts(later))
	}
	// Events 0 1 0 2 1 0: positions 0 1 3 first; 2 4 5 later, of which 5
	// repeats 2's event again (a third write).
	first, later := splitRepeats(of(0, 1, 0, 2, 1, 0))
	if got := attempts(first); !slices.Equal(got, []int{0, 1, 3}) {
		t.Fatalf("first: %v, want positions 0 1 3", got)
	}
	if got := attempts(later); !slices.Equal(got, []int{2, 4, 5}) {
		t.Fatalf("later: %v, want positions 2 4 5", got)
	}
	second, third := splitRepeats(later)
	if !slices.Equal(attempts(second), []int{2, 4}) || !slices.Equal(attempts(third), []int{5}) {
		t.Fatalf("the repeats split again: %v, %v", attempts(second), attempts(third))
	}
}
