// Package lifecycle runs long-lived background work under a start/stop
// contract: the Go form of a ModKit stateful task.
//
// A Task wraps a RunFunc. Its status moves Stopped → Starting → Running →
// Stopping → Stopped:
//
//   - Start returns at once and runs the task on a context that keeps the
//     start context's values but not its deadline, so the task outlives fx's
//     start timeout. With Config.AwaitReady the task is Running only after
//     it calls ready, and Start waits for that (or for the task's failure,
//     or for the start context to end). Starting a started task returns
//     ErrAlreadyStarted.
//   - Stop cancels the task's context and waits up to Config.StopTimeout
//     (default 30s) for it to return, then reports why it ended: Finished,
//     Cancelled, TimedOut or Failed. Stop on a never-started task, or a
//     second Stop after one that saw the run end, is safe and returns
//     NotRunning. A Stop after one that timed out waits again for the
//     run, which is still going (TimedOut again if it does not end).
//   - A task that fails on its own after it started is logged, and
//     Config.OnFailure (or HookWithShutdown's app shutdown) is called.
//
// Hook and HookWithShutdown register a task with an fx.Lifecycle:
//
//	task, err := lifecycle.New(lifecycle.Config{Name: "indexer", AwaitReady: true},
//		func(ctx context.Context, ready func()) error {
//			ready()
//			<-ctx.Done()
//			return nil
//		})
//	...
//	fx.Invoke(func(lc fx.Lifecycle, sd fx.Shutdowner) { lifecycle.HookWithShutdown(lc, sd, task) })
package lifecycle
