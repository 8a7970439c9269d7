package lifecycle_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"
	"go.uber.org/goleak"

	"github.com/modkit-go/modkit/modkit/lifecycle"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func newTask(t *testing.T, cfg lifecycle.Config, fn lifecycle.RunFunc) *lifecycle.Task {
	t.Helper()
	if cfg.Name == "" {
		cfg.Name = "test-task"
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	task, err := lifecycle.New(cfg, fn)
	if err != nil {
		t.Fatal(err)
	}
	return task
}

// untilCancelled is a task body that is ready at once and runs until
// cancelled.
func untilCancelled(ctx context.Context, ready func()) error {
	ready()
	<-ctx.Done()
	return ctx.Err()
}

func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := lifecycle.New(lifecycle.Config{}, untilCancelled); err == nil {
		t.Error("no error for a missing name")
	}
	if _, err := lifecycle.New(lifecycle.Config{Name: "x"}, nil); err == nil {
		t.Error("no error for a nil RunFunc")
	}
	if _, err := lifecycle.New(lifecycle.Config{Name: "x", StopTimeout: -time.Second}, untilCancelled); err == nil {
		t.Error("no error for a negative stop timeout")
	}
}

func TestStatusesAndStop(t *testing.T) {
	release := make(chan struct{})
	var task *lifecycle.Task
	var seenInRun atomic.Value
	task = newTask(t, lifecycle.Config{AwaitReady: true}, func(ctx context.Context, ready func()) error {
		seenInRun.Store(task.Status())
		<-release
		ready()
		ready() // harmless
		<-ctx.Done()
		return ctx.Err()
	})
	if s := task.Status(); s != lifecycle.Stopped {
		t.Fatalf("new task is %s", s)
	}
	started := make(chan error, 1)
	go func() { started <- task.Start(context.Background()) }()
	close(release)
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	if s := seenInRun.Load().(lifecycle.Status); s != lifecycle.Starting {
		t.Errorf("status before ready = %s, want starting", s)
	}
	if s := task.Status(); s != lifecycle.Running {
		t.Fatalf("status after ready = %s, want running", s)
	}
	if err := task.Start(context.Background()); !errors.Is(err, lifecycle.ErrAlreadyStarted) {
		t.Fatalf("second start: %v, want ErrAlreadyStarted", err)
	}
	reason, err := task.Stop(context.Background())
	if reason != lifecycle.Cancelled || err != nil {
		t.Fatalf("stop = %s, %v; want cancelled, nil", reason, err)
	}
	if s := task.Status(); s != lifecycle.Stopped {
		t.Fatalf("status after stop = %s", s)
	}
	if reason, err := task.Stop(context.Background()); reason != lifecycle.NotRunning || err != nil {
		t.Fatalf("second stop = %s, %v; want not running, nil", reason, err)
	}
	select {
	case <-task.Done():
	default:
		t.Fatal("Done not closed after stop")
	}
}

func TestStopNeverStarted(t *testing.T) {
	task := newTask(t, lifecycle.Config{}, untilCancelled)
	if reason, err := task.Stop(context.Background()); reason != lifecycle.NotRunning || err != nil {
		t.Fatalf("stop = %s, %v", reason, err)
	}
}

func TestRestartAfterStop(t *testing.T) {
	var runs atomic.Int32
	task := newTask(t, lifecycle.Config{}, func(ctx context.Context, ready func()) error {
		runs.Add(1)
		return untilCancelled(ctx, ready)
	})
	for range 3 {
		if err := task.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		if _, err := task.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := runs.Load(); n != 3 {
		t.Fatalf("%d runs, want 3", n)
	}
}

func TestRunOutlivesStartContext(t *testing.T) {
	type key struct{}
	gotValue := make(chan any, 1)
	task := newTask(t, lifecycle.Config{AwaitReady: true}, func(ctx context.Context, ready func()) error {
		gotValue <- ctx.Value(key{})
		return untilCancelled(ctx, ready)
	})
	startCtx, cancel := context.WithCancel(context.WithValue(context.Background(), key{}, "v"))
	if err := task.Start(startCtx); err != nil {
		t.Fatal(err)
	}
	cancel()
	if v := <-gotValue; v != "v" {
		t.Errorf("run context lost the start context's values: %v", v)
	}
	if s := task.Status(); s != lifecycle.Running {
		t.Fatalf("cancelling the start context changed the status to %s", s)
	}
	if reason, err := task.Stop(context.Background()); reason != lifecycle.Cancelled || err != nil {
		t.Fatalf("stop = %s, %v", reason, err)
	}
}

func TestStartFailsWhenTaskFailsBeforeReady(t *testing.T) {
	boom := errors.New("boom")
	var failures atomic.Int32
	task := newTask(t, lifecycle.Config{AwaitReady: true, OnFailure: func(string, error) { failures.Add(1) }},
		func(context.Context, func()) error { return boom })
	if err := task.Start(context.Background()); !errors.Is(err, boom) {
		t.Fatalf("start = %v, want boom", err)
	}
	if s := task.Status(); s != lifecycle.Stopped {
		t.Fatalf("status = %s", s)
	}
	if failures.Load() != 0 {
		t.Fatal("OnFailure called for a start failure, which Start already reported")
	}
	// Start said how the run ended: a deferred Stop does not say it again.
	if reason, err := task.Stop(context.Background()); reason != lifecycle.NotRunning || err != nil {
		t.Fatalf("stop after the failed start = %v, %v; want NotRunning and nil", reason, err)
	}

	task = newTask(t, lifecycle.Config{AwaitReady: true}, func(context.Context, func()) error { return nil })
	if err := task.Start(context.Background()); !errors.Is(err, lifecycle.ErrExitedBeforeReady) {
		t.Fatalf("start = %v, want ErrExitedBeforeReady", err)
	}
	if reason, err := task.Stop(context.Background()); reason != lifecycle.NotRunning || err != nil {
		t.Fatalf("stop after the run ended before ready = %v, %v; want NotRunning and nil", reason, err)
	}
}

func TestStartContextEndsBeforeReady(t *testing.T) {
	cancelled := make(chan struct{})
	task := newTask(t, lifecycle.Config{AwaitReady: true}, func(ctx context.Context, ready func()) error {
		<-ctx.Done() // never ready
		close(cancelled)
		return ctx.Err()
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := task.Start(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("start = %v, want context.Canceled", err)
	}
	<-cancelled // the task was cancelled, not left running
	if s := task.Status(); s != lifecycle.Stopped {
		t.Fatalf("status = %s", s)
	}
}

// NotReadyCause's answer joins Start's error when its context ends first:
// what holds the run back, which the context's error does not say.
func TestStartContextEndsBeforeReadyWithACause(t *testing.T) {
	refused := errors.New("connection refused")
	task := newTask(t, lifecycle.Config{AwaitReady: true, NotReadyCause: func() error { return refused }},
		func(ctx context.Context, ready func()) error {
			<-ctx.Done() // never ready
			return ctx.Err()
		})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := task.Start(ctx); !errors.Is(err, context.Canceled) || !errors.Is(err, refused) {
		t.Fatalf("start = %v, want context.Canceled and the cause", err)
	}
	none := newTask(t, lifecycle.Config{AwaitReady: true, NotReadyCause: func() error { return nil }},
		func(ctx context.Context, ready func()) error { <-ctx.Done(); return ctx.Err() })
	if err := none.Start(ctx); !errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "(") {
		t.Fatalf("start without a cause = %v, want context.Canceled alone", err)
	}
}

// A Stop while the task is starting ends its Start with an error that
// says it was stopped; it said the task failed ("failed before it was
// ready: context canceled"). The Stop reports the run cancelled.
func TestStopWhileStarting(t *testing.T) {
	entered := make(chan struct{})
	task := newTask(t, lifecycle.Config{AwaitReady: true}, func(ctx context.Context, ready func()) error {
		close(entered)
		<-ctx.Done() // never ready
		return ctx.Err()
	})
	started := make(chan error, 1)
	go func() { started <- task.Start(context.Background()) }()
	<-entered
	if reason, err := task.Stop(context.Background()); reason != lifecycle.Cancelled || err != nil {
		t.Fatalf("stop while starting = %s, %v; want cancelled", reason, err)
	}
	if err := <-started; err == nil || !strings.Contains(err.Error(), "was stopped while starting") || strings.Contains(err.Error(), "failed") {
		t.Fatalf("start = %v, want it to say the task was stopped while starting", err)
	}
}

// A task that is not ready when the start context ends, and does not stop
// when cancelled: Start says both, so that a caller (fx runs no stop hook
// for a failed start) knows the run goes on.
func TestStartContextEndsBeforeReadyAndStopTimesOut(t *testing.T) {
	release := make(chan struct{})
	task := newTask(t, lifecycle.Config{AwaitReady: true, StopTimeout: time.Millisecond}, func(ctx context.Context, ready func()) error {
		<-release // never ready, deaf to cancellation
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := task.Start(ctx)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, lifecycle.ErrStopTimeout) {
		t.Fatalf("start = %v, want context.Canceled and ErrStopTimeout", err)
	}
	if s := task.Status(); s != lifecycle.Stopping {
		t.Fatalf("status = %s, want stopping while the run goes on", s)
	}
	close(release)
	<-task.Done()
}

func TestStopTimesOut(t *testing.T) {
	release := make(chan struct{})
	task := newTask(t, lifecycle.Config{StopTimeout: time.Millisecond}, func(ctx context.Context, ready func()) error {
		<-release // ignores cancellation
		return nil
	})
	if err := task.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	reason, err := task.Stop(context.Background())
	if reason != lifecycle.TimedOut || !errors.Is(err, lifecycle.ErrStopTimeout) {
		t.Fatalf("stop = %s, %v; want timed out, ErrStopTimeout", reason, err)
	}
	if s := task.Status(); s != lifecycle.Stopping {
		t.Fatalf("status = %s, want stopping while the run goes on", s)
	}
	if err := task.Start(context.Background()); !errors.Is(err, lifecycle.ErrStillStopping) {
		t.Fatalf("start while still stopping = %v, want ErrStillStopping", err)
	}
	// A second Stop waits again for the run, which still goes on.
	if reason, err := task.Stop(context.Background()); reason != lifecycle.TimedOut || !errors.Is(err, lifecycle.ErrStopTimeout) {
		t.Fatalf("second stop = %s, %v; want timed out again, ErrStopTimeout", reason, err)
	}
	close(release)
	<-task.Done()
	if s := task.Status(); s != lifecycle.Stopped {
		t.Fatalf("status = %s after the run returned", s)
	}
	if reason, err := task.Stop(context.Background()); reason != lifecycle.NotRunning || err != nil {
		t.Fatalf("stop after the run returned = %s, %v; want NotRunning", reason, err)
	}
	// Once the old run has returned, the task starts again.
	if err := task.Start(context.Background()); err != nil {
		t.Fatalf("start after the old run returned: %v", err)
	}
}

func TestStopHonoursContext(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	task := newTask(t, lifecycle.Config{}, func(ctx context.Context, ready func()) error {
		<-release
		return nil
	})
	if err := task.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	reason, err := task.Stop(ctx)
	if reason != lifecycle.TimedOut || !errors.Is(err, lifecycle.ErrStopTimeout) || !errors.Is(err, context.Canceled) {
		t.Fatalf("stop = %s, %v", reason, err)
	}
}

// StopDeadline tells the run when the Stop that cancelled it gives up:
// StopTimeout after it began, or the Stop context's deadline if sooner; and
// nothing before a Stop. The run's error still matches context.Canceled.
func TestStopDeadline(t *testing.T) {
	const timeout = time.Hour
	for _, tc := range []struct {
		name    string
		stopCtx func() (context.Context, context.CancelFunc)
	}{
		{"stop timeout", func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) }},
		{"earlier context deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), time.Minute)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := make(chan bool, 1)
			got := make(chan time.Time, 1)
			task := newTask(t, lifecycle.Config{StopTimeout: timeout}, func(ctx context.Context, ready func()) error {
				_, ok := lifecycle.StopDeadline(ctx)
				before <- ok
				ready()
				<-ctx.Done()
				d, ok := lifecycle.StopDeadline(ctx)
				if !ok {
					d = time.Time{}
				}
				got <- d
				return ctx.Err()
			})
			if err := task.Start(context.Background()); err != nil {
				t.Fatal(err)
			}
			if <-before {
				t.Error("StopDeadline reported a deadline before any Stop")
			}
			stopCtx, cancel := tc.stopCtx()
			defer cancel()
			from := time.Now()
			reason, err := task.Stop(stopCtx)
			to := time.Now()
			if reason != lifecycle.Cancelled || err != nil {
				t.Fatalf("stop = %s, %v; want cancelled, nil (the run's ctx.Err() must still be context.Canceled)", reason, err)
			}
			d := <-got
			if want, ok := stopCtx.Deadline(); ok {
				if !d.Equal(want) {
					t.Fatalf("StopDeadline = %v, want the Stop context's deadline %v", d, want)
				}
				return
			}
			if d.Before(from.Add(timeout)) || d.After(to.Add(timeout)) {
				t.Fatalf("StopDeadline = %v, want StopTimeout after the Stop began (between %v and %v)", d, from.Add(timeout), to.Add(timeout))
			}
		})
	}
}

func TestFailureOnItsOwn(t *testing.T) {
	boom := errors.New("boom")
	fail := make(chan struct{})
	failed := make(chan string, 1)
	task := newTask(t, lifecycle.Config{OnFailure: func(name string, err error) {
		if errors.Is(err, boom) {
			failed <- name
		}
	}}, func(ctx context.Context, ready func()) error {
		<-fail
		return boom
	})
	if err := task.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	close(fail)
	if name := <-failed; name != "test-task" {
		t.Fatalf("OnFailure got name %q", name)
	}
	<-task.Done()
	if !errors.Is(task.Err(), boom) {
		t.Fatalf("Err = %v", task.Err())
	}
	reason, err := task.Stop(context.Background())
	if reason != lifecycle.Failed || !errors.Is(err, boom) {
		t.Fatalf("stop = %s, %v; want failed, boom", reason, err)
	}
	if reason, _ := task.Stop(context.Background()); reason != lifecycle.NotRunning {
		t.Fatalf("second stop = %s", reason)
	}
}

func TestFinishedOnItsOwn(t *testing.T) {
	task := newTask(t, lifecycle.Config{}, func(context.Context, func()) error { return nil })
	if err := task.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-task.Done()
	if reason, err := task.Stop(context.Background()); reason != lifecycle.Finished || err != nil {
		t.Fatalf("stop = %s, %v; want finished, nil", reason, err)
	}
}

// A run that signals ready and then returns nil at once: Start returns nil
// whichever it saw first, so the Stop after it says the run finished (it
// said NotRunning when Start had seen the end, about two runs in three).
func TestFinishedRightAfterReady(t *testing.T) {
	for i := range 200 {
		task := newTask(t, lifecycle.Config{AwaitReady: true}, func(_ context.Context, ready func()) error { ready(); return nil })
		if err := task.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		<-task.Done()
		if reason, err := task.Stop(context.Background()); reason != lifecycle.Finished || err != nil {
			t.Fatalf("run %d: stop = %s, %v; want finished, nil", i, reason, err)
		}
	}
}

func TestPanicIsAFailure(t *testing.T) {
	task := newTask(t, lifecycle.Config{AwaitReady: true}, func(context.Context, func()) error { panic("kaboom") })
	if err := task.Start(context.Background()); err == nil {
		t.Fatal("start of a panicking task succeeded")
	}
}

func TestErrorWhileStopping(t *testing.T) {
	flushFailed := errors.New("could not flush")
	task := newTask(t, lifecycle.Config{}, func(ctx context.Context, ready func()) error {
		<-ctx.Done()
		return flushFailed
	})
	if err := task.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if reason, err := task.Stop(context.Background()); reason != lifecycle.Failed || !errors.Is(err, flushFailed) {
		t.Fatalf("stop = %s, %v", reason, err)
	}
}

func TestConcurrentStops(t *testing.T) {
	task := newTask(t, lifecycle.Config{}, untilCancelled)
	if err := task.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 8)
	for range 8 {
		go func() {
			_, err := task.Stop(context.Background())
			errs <- err
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if s := task.Status(); s != lifecycle.Stopped {
		t.Fatalf("status = %s", s)
	}
}

func TestFxHook(t *testing.T) {
	var task *lifecycle.Task
	app := fxtest.New(t,
		fx.NopLogger,
		fx.Provide(func() (*lifecycle.Task, error) {
			return lifecycle.New(lifecycle.Config{Name: "fx-task", AwaitReady: true, Logger: quiet}, untilCancelled)
		}),
		fx.Invoke(lifecycle.Hook),
		fx.Populate(&task),
	)
	app.RequireStart()
	if s := task.Status(); s != lifecycle.Running {
		t.Fatalf("after fx start: %s", s)
	}
	app.RequireStop()
	if s := task.Status(); s != lifecycle.Stopped {
		t.Fatalf("after fx stop: %s", s)
	}
}

// A task not ready by fx's start timeout says so in its log, naming
// itself: fx returns a bare context error as soon as its timeout passes,
// so OnStart's error, which names the task, never reached the caller.
func TestFxStartTimeoutIsLogged(t *testing.T) {
	logs := &lineWatch{want: `level=ERROR msg="task not ready before the start context ended; stopping it" task=slow-start`,
		seen: make(chan struct{})}
	app := fx.New(
		fx.NopLogger,
		fx.Invoke(func(lc fx.Lifecycle) error {
			task, err := lifecycle.New(lifecycle.Config{Name: "slow-start", AwaitReady: true,
				Logger: slog.New(slog.NewTextHandler(logs, nil))}, func(ctx context.Context, _ func()) error {
				<-ctx.Done() // never ready
				return nil
			})
			lifecycle.Hook(lc, task)
			return err
		}),
	)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond) // fx's start timeout
	defer cancel()
	if err := app.Start(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("app start = %v, want fx's start timeout", err)
	}
	select { // fx returned at its timeout; the hook logs before it stops the task
	case <-logs.seen:
	case <-time.After(time.Minute):
		t.Fatalf("no log record saying the task was not ready")
	}
}

// lineWatch closes seen when a write holds want.
type lineWatch struct {
	want string
	seen chan struct{}
	once sync.Once
}

func (l *lineWatch) Write(p []byte) (int, error) {
	if strings.Contains(string(p), l.want) {
		l.once.Do(func() { close(l.seen) })
	}
	return len(p), nil
}

func TestFxStartFailsWhenTaskFails(t *testing.T) {
	boom := errors.New("boom")
	app := fx.New(
		fx.NopLogger,
		fx.Invoke(func(lc fx.Lifecycle) error {
			task, err := lifecycle.New(lifecycle.Config{Name: "bad", AwaitReady: true, Logger: quiet},
				func(context.Context, func()) error { return boom })
			lifecycle.Hook(lc, task)
			return err
		}),
	)
	if err := app.Start(context.Background()); !errors.Is(err, boom) {
		t.Fatalf("app start = %v, want boom", err)
	}
}

func TestFxShutdownOnFailure(t *testing.T) {
	fail := make(chan struct{})
	app := fxtest.New(t,
		fx.NopLogger,
		fx.Invoke(func(lc fx.Lifecycle, sd fx.Shutdowner) error {
			task, err := lifecycle.New(lifecycle.Config{Name: "dies", AwaitReady: true, Logger: quiet},
				func(ctx context.Context, ready func()) error {
					ready()
					<-fail
					return errors.New("lost my connection for good")
				})
			lifecycle.HookWithShutdown(lc, sd, task)
			return err
		}),
	)
	app.RequireStart()
	close(fail)
	sig := <-app.Wait()
	if sig.ExitCode != 1 {
		t.Fatalf("shutdown exit code %d, want 1", sig.ExitCode)
	}
	// The task already ended; stopping the app reports how it ended.
	if err := app.Stop(context.Background()); err == nil {
		t.Fatal("app stop did not report the task's failure")
	}
}

func ExampleTask() {
	task, err := lifecycle.New(lifecycle.Config{Name: "ticker", AwaitReady: true, Logger: quiet},
		func(ctx context.Context, ready func()) error {
			ready()
			<-ctx.Done()
			return nil
		})
	if err != nil {
		panic(err)
	}
	if err := task.Start(context.Background()); err != nil {
		panic(err)
	}
	fmt.Println(task.Status())
	reason, err := task.Stop(context.Background())
	fmt.Println(reason, err, task.Status())
	// Output:
	// running
	// cancelled <nil> stopped
}
