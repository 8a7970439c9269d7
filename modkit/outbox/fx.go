package outbox

import (
	"log/slog"

	"go.uber.org/fx"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/lifecycle"
)

// Module runs a Dispatcher in an fx app. It takes the *db.Provider (from
// db.Module), every Publisher in the PublisherGroup value group, and an
// optional DispatcherConfig and *slog.Logger from the graph. The dispatcher
// starts with the app (the start waits until it is ready) and stops with it;
// if it fails on its own, it asks the app to shut down. It provides the
// *Dispatcher, whose Store serves admin calls.
//
// A module contributes a publisher like this:
//
//	fx.Provide(outbox.AsPublisher(func(deps Deps) outbox.Publisher {
//		return outbox.Publisher{Topic: outbox.Topic{Namespace: "mini-chat", Topic: "usage_snapshot"}, Publish: deps.Send}
//	}))
var Module = fx.Module("modkit-outbox",
	fx.Provide(newFxDispatcher),
	fx.Invoke(func(lc fx.Lifecycle, sd fx.Shutdowner, d *Dispatcher) {
		lifecycle.HookWithShutdown(lc, sd, d.Task())
	}),
)

// AsPublisher annotates a constructor returning a Publisher so that fx adds
// its result to the PublisherGroup.
func AsPublisher(constructor any) any {
	return fx.Annotate(constructor, fx.ResultTags(`group:"`+PublisherGroup+`"`))
}

// FxParams is what Module takes from the graph.
type FxParams struct {
	fx.In
	DB         *db.Provider
	Publishers []Publisher      `group:"outbox_publishers"`
	Config     DispatcherConfig `optional:"true"`
	Logger     *slog.Logger     `optional:"true"`
}

func newFxDispatcher(p FxParams) (*Dispatcher, error) {
	var reg Publishers
	for _, pub := range p.Publishers {
		if err := reg.Register(pub); err != nil {
			return nil, err
		}
	}
	cfg := p.Config
	if cfg.Logger == nil {
		cfg.Logger = p.Logger
	}
	return NewDispatcher(p.DB.Pool, &reg, cfg)
}
