package outboxtest_test

import (
	"fmt"
	"runtime"
	"sync"
	"testing"

	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

// failT stands in for a *testing.T to watch an assertion fail: Fatalf
// records the message and ends the goroutine, as testing.T's does.
type failT struct {
	*testing.T // Cleanup, Helper and Logf go to the real test
	mu         sync.Mutex
	failure    string
}

func (f *failT) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.failure = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

// failure runs fn on its own goroutine and returns the message it failed
// with, or "" if it passed.
func failure(t *testing.T, fn func(outboxtest.TB)) string {
	t.Helper()
	f := &failT{T: t}
	done := make(chan struct{})
	go func() { defer close(done); fn(f) }()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failure
}
