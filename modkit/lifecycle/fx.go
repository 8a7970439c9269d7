package lifecycle

import (
	"context"

	"go.uber.org/fx"
)

// Hook registers t with an fx lifecycle: OnStart starts it (waiting for
// ready if the task awaits it, until fx's start timeout; a task not ready
// by then is stopped before OnStart returns, which may take up to its stop
// timeout more) and OnStop stops it (bounded by the task's stop timeout
// and fx's stop timeout, whichever ends first; see StopDeadline). A stop
// that times out fails the app's Stop with ErrStopTimeout. fx reports its
// start timeout as a bare context error as soon as it passes, without
// waiting for OnStart's error, so a task not ready in time also logs, at
// error level on its Config.Logger, that it was not ready and how its stop
// went (a stop that timed out leaves the run going: fx runs no OnStop for
// a failed start). Under fx's App.Run that record is usually lost: Run
// exits the process as soon as fx reports the timeout, and what is left is
// fx's own log ("Failed to start: context deadline exceeded", after the
// "HOOK OnStart … (*Task).Start-fm() executing" line of the hook that did
// not return). App.Start returns the error and leaves time for it.
func Hook(lc fx.Lifecycle, t *Task) {
	lc.Append(fx.Hook{
		OnStart: t.Start,
		OnStop: func(ctx context.Context) error {
			_, err := t.Stop(ctx)
			return err
		},
	})
}

// HookWithShutdown is Hook, and also asks the app to shut down (exit code
// 1) when the task fails on its own after it started, so that a service
// whose essential worker died does not run on silently.
func HookWithShutdown(lc fx.Lifecycle, sd fx.Shutdowner, t *Task) {
	t.addFailureHook(func(string, error) {
		_ = sd.Shutdown(fx.ExitCode(1))
	})
	Hook(lc, t)
}
