package db

import (
	"context"

	"go.uber.org/fx"
)

// Module provides the process's *Provider, built from the Config in the
// graph. The connection is checked in the app's start hook: a server that
// cannot be reached yet, or is starting up, is tried again until the start
// context ends (fx's start timeout, 15s by default, under App.Run), so
// that an app started beside its database waits for it; a server that
// answers with a refusal (no such database, login refused) fails the start
// at once. The pool is closed in the stop hook, which returns when fx's stop
// timeout is up even while a component still holds a connection (the pool
// then closes once it is returned). It is the only module that
// provides the pool: other modules take a *Provider. An app whose graph
// fails to build after the Provider was made (another constructor's error)
// runs no hook, so nothing closes the pool: it holds no connection (it
// connects lazily), but its background goroutines stay until the process
// exits, and a test that checks for leaked goroutines (goleak, as
// outboxtest.Main does) reports them besides the app's error.
var Module = fx.Module("modkit-db",
	fx.Provide(newFx),
)

// fxParams is what Module needs from the graph.
type fxParams struct {
	fx.In
	Config    Config
	Lifecycle fx.Lifecycle
}

func newFx(p fxParams) (*Provider, error) {
	// pgxpool connects lazily, so building it does no I/O; the ping runs in
	// OnStart where fx's start context bounds it.
	prov, err := open(context.Background(), p.Config)
	if err != nil {
		return nil, err
	}
	p.Lifecycle.Append(fx.Hook{
		OnStart: func(ctx context.Context) error {
			// fx runs the stop hooks of the start hooks that succeeded
			// only: a failed ping closes the pool itself, or its
			// background goroutines would outlive the app.
			if err := prov.pingUntilUp(ctx); err != nil {
				prov.Close()
				return err
			}
			return nil
		},
		OnStop: prov.closeWithin,
	})
	return prov, nil
}
