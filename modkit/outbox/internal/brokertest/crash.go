package brokertest

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// childDSNEnv carries the test database to the child; its presence makes
// the process a child.
const childDSNEnv = "BROKERTEST_CHILD_DSN"

// deliveredLine is what the child prints after each delivered event.
const deliveredLine = "brokertest: delivered"

// Child is the body of the test function that a crash scenario re-executes
// the test binary to run: it runs a dispatcher for newPublisher's publisher
// on the parent's database until it is killed (or its stdin closes). It
// skips when the process is not a crash scenario's child.
func Child(t *testing.T, newPublisher func(t testing.TB) outbox.Publisher) {
	dsn := os.Getenv(childDSNEnv)
	if dsn == "" {
		t.Skip("the crash scenario's dispatcher process; runs only when the scenario starts it")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	c, err := outbox.New(outboxpg.New(pool), outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	out := bufio.NewWriter(os.Stdout)
	lines := make(chan struct{}, 1<<16)
	d, err := c.NewDispatcher(Config(func(_ outbox.Delivery, o outbox.Outcome) {
		if o.Status == outbox.StatusDelivered && !o.LeaseLost {
			lines <- struct{}{}
		}
	}), newPublisher(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	for {
		select {
		case <-lines:
			_, _ = out.WriteString(deliveredLine + "\n")
			if len(lines) == 0 {
				_ = out.Flush()
			}
		case <-stdinClosed:
			_ = d.Stop(ctx)
			return
		}
	}
}

// Crash describes a crash scenario.
type Crash struct {
	// ChildTest is the name of the test function that calls Child.
	ChildTest string
	// Env is added to the child's environment (the broker's address).
	Env []string
	// KillAfter is how many deliveries the child reports before it is
	// SIGKILLed. Default: a third of the events.
	KillAfter int
}

// RunCrash delivers the events already enqueued on c with a dispatcher in
// a child process that is SIGKILLed mid-run, then with survivor in this
// process until none is left. It returns how many deliveries the child
// reported.
func RunCrash(t *testing.T, c *outbox.Client, d *outboxtest.DB, n int, cr Crash, survivor outbox.Publisher) int {
	t.Helper()
	killAfter := cr.KillAfter
	if killAfter == 0 {
		killAfter = n / 3
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+cr.ChildTest+"$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(append(os.Environ(), childDSNEnv+"="+d.DSN, "TEST_DATABASE_URL="+d.DSN), cr.Env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr := new(bytes.Buffer)
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := cmd.StdinPipe() // never written: the child stops when it closes
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 1024)
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
		}
		for range lines {
		}
		<-readerDone
		_ = cmd.Wait()
		_ = stdin.Close()
	}()
	seen := 0
	timeout := time.NewTimer(guard)
	defer timeout.Stop()
	for seen < killAfter {
		select {
		case line, ok := <-lines:
			if !ok {
				_ = cmd.Wait()
				t.Fatalf("the dispatcher process exited after %d deliveries:\n%s", seen, stderr)
			}
			if line == deliveredLine {
				seen++
			}
		case <-timeout.C:
			t.Fatalf("the dispatcher process reported %d deliveries in %v", seen, guard)
		}
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed = true
	for line := range lines {
		if line == deliveredLine {
			seen++
		}
	}
	if err := cmd.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("the dispatcher process ended with %v, want killed", err)
	}
	t.Logf("dispatcher process SIGKILLed after it reported %d deliveries", seen)
	Delivered(t, c, survivor, nil)
	return seen
}
