package lifecycle

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// StopTimeoutDefault is how long Stop waits for a task to end when
// Config.StopTimeout is zero.
const StopTimeoutDefault = 30 * time.Second

// Errors returned by Task methods.
var (
	// ErrAlreadyStarted is returned by Start on a task that is not Stopped.
	// Stop it first (a task can be started again once Stop returned).
	ErrAlreadyStarted = errors.New("lifecycle: task already started; stop it before starting it again")
	// ErrStopTimeout is returned by Stop when the task did not end within
	// its stop timeout (or before the context passed to Stop expired). The
	// task's goroutine is still running; its Status stays Stopping until it
	// returns.
	ErrStopTimeout = errors.New("lifecycle: task did not stop within its stop timeout")
	// ErrStillStopping is returned by Start while an earlier run has not
	// returned yet: its Stop timed out and the run is still finishing. Wait
	// for Done() to close, then start again.
	ErrStillStopping = errors.New("lifecycle: task is still stopping: its previous run has not returned after a stop timeout; wait for Done() and start again")
	// ErrExitedBeforeReady is returned by Start (with AwaitReady) when the
	// task returned nil before signalling ready.
	ErrExitedBeforeReady = errors.New("lifecycle: task returned before signalling ready")
)

// Status is where a task is in its life: Stopped → Starting → Running →
// Stopping → Stopped.
type Status int32

// Task statuses.
const (
	Stopped Status = iota
	Starting
	Running
	Stopping
)

// String returns the status in lower case: "stopped", "starting", …
func (s Status) String() string {
	switch s {
	case Stopped:
		return "stopped"
	case Starting:
		return "starting"
	case Running:
		return "running"
	case Stopping:
		return "stopping"
	}
	return fmt.Sprintf("Status(%d)", int32(s))
}

// StopReason says why a task's run ended, as reported by Stop.
type StopReason int

// Stop reasons.
const (
	// NotRunning: Stop found no run to stop (never started, or already
	// stopped by an earlier Stop).
	NotRunning StopReason = iota
	// Finished: the run returned nil on its own, before Stop asked it to.
	Finished
	// Cancelled: Stop cancelled the run and it returned within the timeout.
	Cancelled
	// TimedOut: Stop cancelled the run and it did not return in time.
	TimedOut
	// Failed: the run returned an error (on its own, or while stopping with
	// an error other than the cancellation).
	Failed
)

// String returns the reason in words: "not running", …
func (r StopReason) String() string {
	switch r {
	case NotRunning:
		return "not running"
	case Finished:
		return "finished"
	case Cancelled:
		return "cancelled"
	case TimedOut:
		return "timed out"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("StopReason(%d)", int(r))
}

// RunFunc is a task's body. It runs until ctx is cancelled (or its work is
// done), calls ready once it can serve (only waited for with
// Config.AwaitReady; calling it more than once is harmless), and returns
// nil or ctx.Err() after a cancellation, or the error that stopped it.
type RunFunc func(ctx context.Context, ready func()) error

// Config configures a Task.
type Config struct {
	// Name identifies the task in logs and errors. Required.
	Name string
	// AwaitReady makes Start wait until the run calls ready (or fails, or
	// Start's context ends). Without it the task is Running as soon as its
	// goroutine is started.
	AwaitReady bool
	// StopTimeout bounds how long Stop waits for the run to return.
	// Default StopTimeoutDefault.
	StopTimeout time.Duration
	// Logger receives start, stop and failure records. Default
	// slog.Default().
	Logger *slog.Logger
	// OnFailure, if set, is called (from the task's goroutine) when a run
	// that was started successfully returns an error on its own, that is,
	// not because Stop cancelled it. Failures are logged either way.
	OnFailure func(name string, err error)
	// NotReadyCause, if set, is asked when Start's context ends before the
	// run is ready, for what holds the run back (the last error of
	// something it retries, say; nil when it does not know). Its error is
	// added to Start's, which then matches both.
	NotReadyCause func() error
}

// Task runs a RunFunc in the background under a start/stop contract: the
// Go form of a ModKit stateful task. A Task is safe for concurrent use; it
// can be started again after it stopped.
type Task struct {
	cfg Config
	fn  RunFunc
	log *slog.Logger

	mu        sync.Mutex
	status    Status
	cur       *run // current or last run; nil before the first Start
	lastErr   error
	onFailure []func(name string, err error)
}

// run is one execution of the task's RunFunc.
type run struct {
	cancel    context.CancelCauseFunc
	ready     chan struct{}
	readyOnce sync.Once
	done      chan struct{}
	err       error // set before done is closed
	stopping  bool  // Stop asked it to end (guarded by Task.mu)
	started   bool  // Start returned nil (guarded by Task.mu)
}

// New returns a stopped Task that runs fn.
func New(cfg Config, fn RunFunc) (*Task, error) {
	if cfg.Name == "" {
		return nil, errors.New("lifecycle: Config.Name is required")
	}
	if fn == nil {
		return nil, fmt.Errorf("lifecycle: task %q has a nil RunFunc", cfg.Name)
	}
	if cfg.StopTimeout < 0 {
		return nil, fmt.Errorf("lifecycle: task %q: StopTimeout is %v; it must not be negative", cfg.Name, cfg.StopTimeout)
	}
	cfg.StopTimeout = cmp.Or(cfg.StopTimeout, StopTimeoutDefault)
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	t := &Task{cfg: cfg, fn: fn, log: log.With("task", cfg.Name)}
	if cfg.OnFailure != nil {
		t.onFailure = append(t.onFailure, cfg.OnFailure)
	}
	return t, nil
}

// Name returns the task's name.
func (t *Task) Name() string { return t.cfg.Name }

// Status returns the task's current status.
func (t *Task) Status() Status {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.status
}

// Err returns the error the last finished run returned (nil while a run is
// going on, or if it returned nil or was cancelled).
func (t *Task) Err() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.lastErr
}

// Done returns a channel closed when the current run returns; with no run
// going on it returns a closed channel.
func (t *Task) Done() <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.cur == nil {
		c := make(chan struct{})
		close(c)
		return c
	}
	return t.cur.done // closed already if the last run has ended
}

// Start starts the task on a context of its own that keeps ctx's values but
// not its cancellation or deadline, so the task outlives a start timeout.
// Without AwaitReady it returns at once. With AwaitReady it returns nil when
// the task signals ready, the task's error if it ends first, or ctx's error
// (after cancelling the task and waiting up to the stop timeout for it) if
// ctx ends first, joined with that stop's error when it has one
// (ErrStopTimeout: the run goes on; or how the run failed). Starting a task that is Starting or Running returns
// ErrAlreadyStarted; one whose last Stop timed out and whose run has not
// returned yet returns ErrStillStopping.
func (t *Task) Start(ctx context.Context) error {
	t.mu.Lock()
	if t.status != Stopped {
		st := t.status
		t.mu.Unlock()
		if st == Stopping {
			return fmt.Errorf("%w (task %q)", ErrStillStopping, t.cfg.Name)
		}
		return fmt.Errorf("%w (task %q is %s)", ErrAlreadyStarted, t.cfg.Name, st)
	}
	runCtx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	r := &run{cancel: cancel, ready: make(chan struct{}), done: make(chan struct{})}
	t.cur, t.status, t.lastErr = r, Starting, nil
	if !t.cfg.AwaitReady {
		t.status, r.started = Running, true
	}
	t.mu.Unlock()

	t.log.Debug("task starting")
	go t.execute(runCtx, r)
	if !t.cfg.AwaitReady {
		return nil
	}

	select {
	case <-r.ready:
		t.mu.Lock()
		if t.status == Starting && t.cur == r {
			t.status, r.started = Running, true
			t.mu.Unlock()
			t.log.Debug("task ready")
			return nil
		}
		t.mu.Unlock()
		// It ended, or a concurrent Stop began, right after signalling ready.
		select {
		case <-r.done:
			return t.endedAfterReady(r)
		default:
			return fmt.Errorf("lifecycle: task %q was stopped while starting", t.cfg.Name)
		}
	case <-r.done:
		select {
		case <-r.ready:
			// Both happened before this select ran, and it picked done
			// (Go picks either): the task became ready, then ended.
			return t.endedAfterReady(r)
		default:
		}
		t.mu.Lock()
		stopped := r.stopping // a Stop ended it, and reports how
		t.mu.Unlock()
		if stopped && (r.err == nil || errors.Is(r.err, context.Canceled)) {
			return fmt.Errorf("lifecycle: task %q was stopped while starting", t.cfg.Name)
		}
		t.reported(r)
		if r.err != nil {
			return fmt.Errorf("lifecycle: task %q failed before it was ready: %w", t.cfg.Name, r.err)
		}
		return fmt.Errorf("%w (task %q)", ErrExitedBeforeReady, t.cfg.Name)
	case <-ctx.Done():
		notReady := fmt.Errorf("lifecycle: task %q was not ready before the start context ended: %w", t.cfg.Name, context.Cause(ctx))
		attrs := []any{"err", context.Cause(ctx)}
		if t.cfg.NotReadyCause != nil {
			if why := t.cfg.NotReadyCause(); why != nil {
				notReady = fmt.Errorf("lifecycle: task %q was not ready before the start context ended (%w): %w", t.cfg.Name, context.Cause(ctx), why)
				attrs = append(attrs, "not_ready_because", why)
			}
		}
		// Logged as well as returned: fx reports its start timeout as
		// soon as it passes, without waiting for this hook's error, which
		// names the task and says how its stop went.
		t.log.Error("task not ready before the start context ended; stopping it", attrs...)
		// The stop's own error says whether the run is gone (a timeout
		// leaves it running, and fx runs no stop hook for a failed start)
		// or how it failed.
		if _, err := t.Stop(context.Background()); err != nil {
			t.log.Error("task's stop after a failed start", "err", err)
			return errors.Join(notReady, err)
		}
		return notReady
	}
}

// reported marks an ended run's end as told to Start's caller, so that the
// Stop that follows (a deferred one, say) does not report it again.
func (t *Task) reported(r *run) {
	t.mu.Lock()
	r.stopping = true
	t.mu.Unlock()
}

// endedAfterReady is Start's result for a run that signalled ready and then
// ended before Start saw it ready.
func (t *Task) endedAfterReady(r *run) error {
	if r.err != nil && !errors.Is(r.err, context.Canceled) {
		t.reported(r)
		return fmt.Errorf("lifecycle: task %q failed as it became ready: %w", t.cfg.Name, r.err)
	}
	return nil
}

// execute runs fn and records how it ended.
func (t *Task) execute(ctx context.Context, r *run) {
	var err error
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("lifecycle: task %q panicked: %v", t.cfg.Name, p)
		}
		r.cancel(nil)
		t.finish(r, err)
	}()
	err = t.fn(ctx, func() { r.readyOnce.Do(func() { close(r.ready) }) })
}

func (t *Task) finish(r *run, err error) {
	t.mu.Lock()
	r.err = err
	stopping := r.stopping
	onFailure := !stopping && r.started && err != nil
	hooks := t.onFailure
	if t.cur == r {
		t.status = Stopped
	}
	if !(stopping && errors.Is(err, context.Canceled)) {
		t.lastErr = err
	}
	close(r.done)
	t.mu.Unlock()

	switch {
	case onFailure:
		t.log.Error("task failed", "err", err)
		for _, h := range hooks {
			h(t.cfg.Name, err)
		}
	case err != nil && !errors.Is(err, context.Canceled):
		t.log.Warn("task ended with an error", "err", err)
	case !stopping:
		t.log.Info("task finished")
	}
}

// Stop cancels the task's context and waits for its run to return, up to
// the stop timeout or until ctx ends, whichever comes first. It reports why
// the run ended; the error is ErrStopTimeout (wrapped) on a timeout, the
// run's error if it failed, nil otherwise. A run that ended on its own
// after Start returned is reported by the first Stop after it (Failed or
// Finished). Stop on a task that was never started, is already stopped, or
// whose Start already returned how its run ended (an error before ready)
// returns NotRunning and nil; concurrent Stops all wait for the same run.
// A Stop after one that timed out waits again, as long, for the run that
// is still going.
func (t *Task) Stop(ctx context.Context) (StopReason, error) {
	t.mu.Lock()
	r := t.cur
	if r == nil {
		t.mu.Unlock()
		return NotRunning, nil
	}
	select {
	case <-r.done:
		already := r.stopping
		r.stopping = true
		t.mu.Unlock()
		if already {
			return NotRunning, nil
		}
		// The run ended on its own: the first Stop after it says how.
		return endedOnItsOwn(r.err)
	default:
	}
	already := r.stopping
	r.stopping = true
	deadline := time.Now().Add(t.cfg.StopTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	// Cancelled before the status says Stopping, so that whoever sees
	// Stopping (a dispatcher's Health, say) knows the run's context has
	// ended. Cancelling runs no code of the task's: it closes the
	// context's channel and starts its AfterFuncs on goroutines of their
	// own.
	r.cancel(&stopCause{deadline: deadline})
	t.status = Stopping
	t.mu.Unlock()
	if !already {
		t.log.Debug("task stopping")
	}

	timer := time.NewTimer(t.cfg.StopTimeout)
	defer timer.Stop()
	select {
	case <-r.done:
	case <-timer.C:
		return TimedOut, fmt.Errorf("%w (task %q, timeout %v)", ErrStopTimeout, t.cfg.Name, t.cfg.StopTimeout)
	case <-ctx.Done():
		return TimedOut, fmt.Errorf("%w (task %q): %w", ErrStopTimeout, t.cfg.Name, context.Cause(ctx))
	}
	if r.err == nil || errors.Is(r.err, context.Canceled) {
		return Cancelled, nil
	}
	return Failed, r.err
}

// stopCause is the cause with which Stop cancels a run's context. It
// carries the time at which that Stop stops waiting, and matches
// context.Canceled, the error of the context it cancels.
type stopCause struct{ deadline time.Time }

func (c *stopCause) Error() string        { return "lifecycle: the task was stopped" }
func (c *stopCause) Is(target error) bool { return target == context.Canceled }

// StopDeadline reports, for a task's run context or a context derived from
// it, when the Stop that cancelled it stops waiting for the run to return:
// Config.StopTimeout after the Stop began, or the Stop context's deadline
// if that comes first (fx's stop timeout, for a task hooked into fx). A
// RunFunc that winds down in stages fits them in before it. ok is false
// while ctx is not cancelled, and when something other than Stop cancelled
// it (a context the RunFunc derived and cancelled itself, say).
func StopDeadline(ctx context.Context) (deadline time.Time, ok bool) {
	var c *stopCause
	if errors.As(context.Cause(ctx), &c) {
		return c.deadline, true
	}
	return time.Time{}, false
}

func endedOnItsOwn(err error) (StopReason, error) {
	if err != nil {
		return Failed, err
	}
	return Finished, nil
}

// addFailureHook registers another OnFailure callback.
func (t *Task) addFailureHook(h func(name string, err error)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.onFailure = append(t.onFailure, h)
}
