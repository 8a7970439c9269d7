package brokertest

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// childDSNEnv carries the test database to the child; its presence makes
// the process a child.
const childDSNEnv = "BROKERTEST_CHILD_DSN"

// childLease is the lease of the child's dispatcher: the survivor takes
// its events over this long after the kill.
const childLease = 2 * time.Second

// The child's report lines.
const (
	publishPrefix = "brokertest: publish " // + event id, before each publish call
	deliveredLine = "brokertest: delivered"
)

// Child is the body of the test function that a crash scenario re-executes
// the test binary to run: it runs a dispatcher for newPublisher's publisher
// on the parent's database until it is killed (or its stdin closes),
// reporting each publish call before making it and each delivery. It
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
	// Each line is written before what it reports is done, unbuffered, so
	// that the parent has seen it whenever the kill comes.
	var mu sync.Mutex
	say := func(line string) {
		mu.Lock()
		defer mu.Unlock()
		_, _ = os.Stdout.WriteString(line + "\n")
	}
	pub := newPublisher(t)
	publish := pub.Publish
	pub.Publish = func(ctx context.Context, d outbox.Delivery) error {
		say(publishPrefix + d.ID.String())
		return publish(ctx, d)
	}
	d, err := c.NewDispatcher(Config(childLease, func(_ outbox.Delivery, o outbox.Outcome) {
		if o.Status == outbox.StatusDelivered && !o.LeaseLost {
			say(deliveredLine)
		}
	}), pub)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = d.Stop(ctx)
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
// process until none is left. It returns the publish calls of both.
func RunCrash(t *testing.T, c *outbox.Client, d *outboxtest.DB, n int, cr Crash, survivor outbox.Publisher) *Calls {
	t.Helper()
	killAfter := cr.KillAfter
	if killAfter == 0 {
		killAfter = n / 3
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+cr.ChildTest+"$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(append(os.Environ(), childDSNEnv+"="+d.DSN, "TEST_DATABASE_URL="+d.DSN), cr.Env...)
	cmd.SysProcAttr = deathSignal()
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
	start := time.Now()
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
	calls := NewCalls()
	seen := 0
	read := func(line string) {
		if line == deliveredLine {
			seen++
		} else if id, ok := strings.CutPrefix(line, publishPrefix); ok {
			calls.add(uuid.MustParse(id))
		}
	}
	timeout := time.NewTimer(guard)
	defer timeout.Stop()
	for seen < killAfter {
		select {
		case line, ok := <-lines:
			if !ok {
				_ = cmd.Wait()
				t.Fatalf("the dispatcher process exited after %d deliveries:\n%s", seen, stderr)
			}
			read(line)
		case <-timeout.C:
			t.Fatalf("the dispatcher process reported %d deliveries in %v", seen, guard)
		}
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed = true
	for line := range lines {
		read(line)
	}
	if err := cmd.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("the dispatcher process ended with %v, want killed", err)
	}
	killedAt := time.Now()
	t.Logf("dispatcher process SIGKILLed after it reported %d deliveries, %v after it started", seen, killedAt.Sub(start).Round(time.Millisecond))
	Delivered(t, c, survivor, calls, nil)
	t.Logf("the survivor delivered the rest in %v (the child's leases last %v)", time.Since(killedAt).Round(time.Millisecond), childLease)
	return calls
}
