package outbox

import (
	"testing"
	"time"
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
