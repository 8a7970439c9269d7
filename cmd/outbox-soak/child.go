package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// childDSNEnv carries the run database to dispatcher processes (not on the
// command line, where a password would show in ps).
const childDSNEnv = "OUTBOX_SOAK_DSN"

// soakTopic is the one topic of the run, poison events included.
var soakTopic = outbox.Topic{Namespace: "soak", Topic: "events"}

// recordDelivery records one delivery in soak_deliveries ($1 event id, $2
// worker id, $3 attempt, $4 pid) with the lease token it was made under. A
// publisher is not told its lease token (outbox.Delivery keeps it to
// itself), so the statement reads it from the event's row: the token of the
// unexpired lease this dispatcher holds on the event for this attempt. It
// records NULL when that lease has already ended; such a lease can no
// longer mark the event delivered, so the audit checks lose nothing. $5 is
// the dispatcher's clock just before it hands the insert to its pool: the
// server may run the insert after this process is dead (see
// attributeDuplicates), but never sent after it.
const recordDelivery = `INSERT INTO soak_deliveries (event_id, lease_token, attempt, pid, sent_at)
SELECT $1, (SELECT lease_token FROM modkit_outbox_events
	WHERE id = $1 AND status = 'processing' AND locked_by = $2 AND attempts = $3 AND locked_until > now()), $3, $4, $5`

// payload is what producers put in each event.
type payload struct {
	Seq    int64  `json:"seq"`
	Poison string `json:"poison,omitempty"` // "transient", "permanent" or empty
}

// runChild is a dispatcher process: it delivers events until its stdin
// closes (the soak asks it to stop, or died) or it gets SIGTERM, then stops
// gracefully. Each delivery is an insert into soak_deliveries, made by the
// publisher before it returns: a delivery the downstream has, whether or
// not the ack follows.
func runChild(ctx context.Context, o options) error {
	pool, err := pgxpool.New(ctx, os.Getenv(childDSNEnv))
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	pid := os.Getpid()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With("pid", pid)
	client, err := outbox.New(outboxpg.New(pool), outbox.Config{Logger: log})
	if err != nil {
		return err
	}
	workerID := uuid.New()
	publish := func(ctx context.Context, d outbox.Delivery) error {
		var p payload
		if err := json.Unmarshal(d.Payload, &p); err != nil {
			return outbox.Permanent(fmt.Errorf("decode payload: %w", err))
		}
		switch p.Poison {
		case "transient":
			return fmt.Errorf("poison event %d: the consumer rejects it", p.Seq)
		case "permanent":
			return outbox.Permanent(fmt.Errorf("poison event %d: malformed", p.Seq))
		}
		// The publish's own work, so that kills land inside publishes too.
		time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
		if _, err := pool.Exec(ctx, recordDelivery, d.ID, workerID, d.Attempt, pid, time.Now()); err != nil {
			return fmt.Errorf("record delivery: %w", err)
		}
		return nil
	}
	d, err := client.NewDispatcher(outbox.DispatcherConfig{
		WorkerID:      workerID,
		Retry:         outbox.RetryPolicy{BaseDelay: 50 * time.Millisecond, MaxDelay: time.Second},
		LeaseDuration: o.lease,
		PollInterval:  o.lease / 5,
		MaxAttempts:   o.maxAttempts,
		BatchSize:     50,
		Concurrency:   16,
		SweepInterval: time.Second,
		StopTimeout:   10 * time.Second,
	}, outbox.Publisher{Topic: soakTopic, Publish: publish, Name: "soak", DeleteOnDelivery: o.deleteOnDelivery})
	if err != nil {
		return err
	}
	if err := d.Start(ctx); err != nil {
		return fmt.Errorf("start the dispatcher: %w", err)
	}
	fmt.Println("ready")
	stdinClosed := make(chan struct{})
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); close(stdinClosed) }()
	select {
	case <-stdinClosed:
	case <-ctx.Done():
	}
	if err := d.Stop(context.Background()); err != nil {
		return fmt.Errorf("stop the dispatcher: %w", err)
	}
	return nil
}

// child is one dispatcher process, as the supervisor sees it.
type child struct {
	gen     int
	cmd     *exec.Cmd
	stdin   io.Closer
	done    chan struct{} // closed when it has exited
	exitErr error         // valid after done
	stopped bool          // the soak stopped or killed it on purpose
}

// supervisor starts, kills and stops the dispatcher processes.
type supervisor struct {
	exe, dsn string
	o        options
	logDir   string

	mu       sync.Mutex
	gens     int
	children []*child
}

func newSupervisor(o options, dsn string) (*supervisor, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this program to start dispatchers: %w", err)
	}
	dir, err := os.MkdirTemp("", "outbox-soak-")
	if err != nil {
		return nil, err
	}
	return &supervisor{exe: exe, dsn: dsn, o: o, logDir: dir}, nil
}

// start starts a dispatcher process and waits until it is ready (its first
// claim succeeded).
func (s *supervisor) start(ctx context.Context) (*child, error) {
	s.mu.Lock()
	s.gens++
	gen := s.gens
	s.mu.Unlock()
	args := []string{"-child", "-lease", s.o.lease.String(), "-max-attempts", fmt.Sprint(s.o.maxAttempts)}
	if s.o.deleteOnDelivery {
		args = append(args, "-delete-on-delivery")
	}
	cmd := exec.Command(s.exe, args...)
	cmd.Env = append(os.Environ(), childDSNEnv+"="+s.dsn)
	logFile, err := os.Create(filepath.Join(s.logDir, fmt.Sprintf("dispatcher-%03d.log", gen)))
	if err != nil {
		return nil, err
	}
	if s.o.verbose {
		cmd.Stderr = io.MultiWriter(logFile, prefixed(os.Stderr, fmt.Sprintf("dispatcher %d: ", gen)))
	} else {
		cmd.Stderr = logFile
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		logFile.Close()
		return nil, err
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		logFile.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start a dispatcher: %w", err)
	}
	c := &child{gen: gen, cmd: cmd, stdin: stdin, done: make(chan struct{})}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "ready" {
				close(ready)
			}
		}
		c.exitErr = cmd.Wait()
		logFile.Close()
		close(c.done)
	}()
	select {
	case <-ready:
	case <-c.done:
		return nil, fmt.Errorf("dispatcher %d exited before it was ready: %v (log: %s)", gen, c.exitErr, logFile.Name())
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		<-c.done
		return nil, ctx.Err()
	}
	s.mu.Lock()
	s.children = append(s.children, c)
	s.mu.Unlock()
	return c, nil
}

// kill SIGKILLs a dispatcher and waits until it is gone. It returns the
// process id and when the signal was sent and the process seen dead.
func (s *supervisor) kill(c *child) (pid int, sent, dead time.Time) {
	s.mu.Lock()
	c.stopped = true
	s.mu.Unlock()
	pid, sent = c.cmd.Process.Pid, time.Now()
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
	return pid, sent, time.Now()
}

// live returns the dispatchers that are running.
func (s *supervisor) live() []*child {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*child
	for _, c := range s.children {
		select {
		case <-c.done:
		default:
			out = append(out, c)
		}
	}
	return out
}

// crashed returns, once each, the dispatchers that exited without being
// stopped or killed by the soak.
func (s *supervisor) crashed() []*child {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*child
	for _, c := range s.children {
		select {
		case <-c.done:
			if !c.stopped {
				c.stopped = true
				out = append(out, c)
			}
		default:
		}
	}
	return out
}

// stopAll asks every dispatcher to stop gracefully (closes its stdin) and
// waits; those still running after timeout are killed. It returns the
// errors of those that did not exit cleanly.
func (s *supervisor) stopAll(timeout time.Duration) []error {
	live := s.live()
	s.mu.Lock()
	for _, c := range live {
		c.stopped = true
	}
	s.mu.Unlock()
	for _, c := range live {
		_ = c.stdin.Close()
	}
	var errs []error
	deadline := time.After(timeout)
	for _, c := range live {
		select {
		case <-c.done:
		case <-deadline:
			_ = c.cmd.Process.Kill()
			<-c.done
			errs = append(errs, fmt.Errorf("dispatcher %d did not stop within %v; killed", c.gen, timeout))
			continue
		}
		if c.exitErr != nil {
			errs = append(errs, fmt.Errorf("dispatcher %d: %w", c.gen, c.exitErr))
		}
	}
	return errs
}

// killAll is the emergency stop (interrupted run).
func (s *supervisor) killAll() {
	for _, c := range s.live() {
		s.kill(c)
	}
}

// prefixed writes each line to w with prefix in front.
func prefixed(w io.Writer, prefix string) io.Writer {
	pr, pw := io.Pipe()
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			fmt.Fprintln(w, prefix+strings.TrimSpace(sc.Text()))
		}
	}()
	return pw
}

var errInterrupted = errors.New("interrupted")
