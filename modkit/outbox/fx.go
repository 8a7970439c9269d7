package outbox

import (
	"log/slog"

	"go.uber.org/fx"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/lifecycle"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// Module wires the outbox into an fx app. It takes the *db.Provider (from
// db.Module), every Publisher provided with AsPublisher, and optionally a
// Config, a DispatcherConfig and a *slog.Logger from the graph. It provides
// the *Client (for enqueues and Admin) and a *Dispatcher for the
// publishers, which starts with the app (the start waits until it is ready)
// and stops with it; if it fails on its own, it asks the app to shut down.
// With no publisher registered the *Dispatcher is nil and nothing runs: a
// service that only enqueues includes Module all the same.
//
// A module contributes a publisher like this:
//
//	fx.Provide(outbox.AsPublisher(func(deps Deps) outbox.Publisher {
//		return outbox.Publisher{Topic: outbox.Topic{Namespace: "mini-chat", Topic: "usage_snapshot"}, Publish: deps.Send}
//	}))
var Module = fx.Module("modkit-outbox",
	fx.Provide(newFxClient, newFxDispatcher),
	fx.Invoke(func(lc fx.Lifecycle, sd fx.Shutdowner, d *Dispatcher) {
		if d != nil {
			lifecycle.HookWithShutdown(lc, sd, d.Task())
		}
	}),
)

const publisherGroup = "outbox_publishers"

// AsPublisher annotates a constructor returning a Publisher so that Module
// collects it.
func AsPublisher(constructor any) any {
	return fx.Annotate(constructor, fx.ResultTags(`group:"`+publisherGroup+`"`))
}

type fxClientParams struct {
	fx.In
	DB     *db.Provider
	Config Config       `optional:"true"`
	Logger *slog.Logger `optional:"true"`
}

func newFxClient(p fxClientParams) (*Client, error) {
	cfg := p.Config
	if cfg.Logger == nil {
		cfg.Logger = p.Logger
	}
	return New(outboxpg.New(p.DB.Pool), cfg)
}

type fxDispatcherParams struct {
	fx.In
	Client     *Client
	Publishers []Publisher      `group:"outbox_publishers"`
	Config     DispatcherConfig `optional:"true"`
}

func newFxDispatcher(p fxDispatcherParams) (*Dispatcher, error) {
	if len(p.Publishers) == 0 {
		return nil, nil
	}
	return p.Client.NewDispatcher(p.Config, p.Publishers...)
}
