package db

import (
	"context"
	"fmt"

	"go.uber.org/fx"
)

// Module provides the process's *Provider, built from the Config in the
// graph. The connection is checked in the app's start hook (bounded by fx's
// start timeout) and closed in its stop hook. It is the only module that
// provides the pool: other modules take a *Provider.
var Module = fx.Module("modkit-db",
	fx.Provide(newFx),
)

// FxParams is what Module needs from the graph.
type FxParams struct {
	fx.In
	Config    Config
	Lifecycle fx.Lifecycle
}

func newFx(p FxParams) (*Provider, error) {
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
			if err := prov.Ping(ctx); err != nil {
				prov.Close()
				return err
			}
			return nil
		},
		// pgxpool's Close waits for every connection to come back. A
		// connection still out at the stop is held by a component that
		// outlived its own stop (fx stops this module last): waiting for
		// it would hold the app's stop to its deadline, and fx would
		// then report the deadline alone, dropping the other hooks'
		// errors (a task's ErrStopTimeout). So the stop says so at once,
		// and the pool closes in the background when it comes back.
		OnStop: func(ctx context.Context) error {
			sqlClosed, closed := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(closed)
				// database/sql keeps idle connections acquired from the
				// pool: closing it first leaves only what others hold.
				_ = prov.Bun.Close()
				close(sqlClosed)
				prov.Close()
			}()
			select {
			case <-sqlClosed:
			case <-ctx.Done():
				return fmt.Errorf("modkit/db: closing the database/sql handle: %w", ctx.Err())
			}
			if n := prov.Pool.Stat().AcquiredConns(); n > 0 {
				return fmt.Errorf("modkit/db: %d connection(s) still in use when the app stopped: a component outlived its "+
					"own stop; the pool closes when they are returned", n)
			}
			select {
			case <-closed:
				return nil
			case <-ctx.Done():
				return fmt.Errorf("modkit/db: closing the pool: %w", ctx.Err())
			}
		},
	})
	return prov, nil
}
