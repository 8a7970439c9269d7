package outbox

import (
	"context"
	"testing"
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
