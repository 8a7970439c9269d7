package outboxtest_test

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

func TestMain(m *testing.M) {
	switch os.Getenv(leakMainEnv) {
	case "with":
		outboxtest.MainWith(m, outboxtest.MainOptions{IgnoreGoroutines: []goleak.Option{
			goleak.IgnoreTopFunction("github.com/modkit-go/modkit/modkit/outbox/outboxtest_test.leakOnPurpose")}})
	default:
		outboxtest.Main(m)
	}
}

// leakMainEnv tells a child run of this test binary (see
// TestMainWithIgnoresGoroutines) which Main to use: "main" or "with".
const leakMainEnv = "OUTBOXTEST_LEAK_MAIN"

var leakStop = make(chan struct{})

func leakOnPurpose() { <-leakStop }

// TestLeaksOnPurpose leaves a goroutine running, in a child run only.
func TestLeaksOnPurpose(t *testing.T) {
	if os.Getenv(leakMainEnv) == "" {
		t.Skip("run by TestMainWithIgnoresGoroutines, in a child process")
	}
	go leakOnPurpose()
}

// Main fails a test binary that leaves a goroutine running, and MainWith
// passes it when IgnoreGoroutines names the goroutine: a team whose
// dependency keeps a background goroutine could not use outboxtest.
func TestMainWithIgnoresGoroutines(t *testing.T) {
	for _, tc := range []struct {
		main string
		fail bool
	}{{"main", true}, {"with", false}} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestLeaksOnPurpose$", "-test.count=1")
		cmd.Env = append(os.Environ(), leakMainEnv+"="+tc.main)
		out, err := cmd.CombinedOutput()
		leaked := strings.Contains(string(out), "leaked goroutines") && strings.Contains(string(out), "leakOnPurpose")
		if tc.fail != (err != nil) || tc.fail != leaked {
			t.Errorf("%s: exit %v, leak reported %v; want a failure %v:\n%s", tc.main, err, leaked, tc.fail, out)
		}
	}
}

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
