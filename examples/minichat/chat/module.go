package chat

import (
	"context"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"go.uber.org/fx"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/lifecycle"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// Defaults of Config.
const (
	WatchdogIntervalDefault = time.Second
	OrphanAfterDefault      = 5 * time.Minute
	WatchdogBatchDefault    = 1000
)

// Config tunes the chat module. The zero value is valid.
type Config struct {
	// WatchdogInterval is how often the watchdog looks for orphaned turns.
	// Default WatchdogIntervalDefault.
	WatchdogInterval time.Duration
	// OrphanAfter is how long a turn may run before the watchdog finalises
	// it as orphaned. Default OrphanAfterDefault. It judges by age alone
	// (turns have no heartbeat): a turn still running past it loses to the
	// watchdog, and its runner's Finalise returns Won false.
	OrphanAfter time.Duration
	// WatchdogBatch is the most turns one watchdog pass finalises. Default
	// WatchdogBatchDefault.
	WatchdogBatch int
	// OnCommitted, if set, is called after each finalisation this service
	// won has committed, with the turn id and the local commit time (the
	// demo measures commit-to-publish latency with it). Keep it fast.
	OnCommitted func(turnID uuid.UUID, committedAt time.Time)
}

func (c Config) withDefaults() Config {
	if c.WatchdogInterval <= 0 {
		c.WatchdogInterval = WatchdogIntervalDefault
	}
	if c.OrphanAfter <= 0 {
		c.OrphanAfter = OrphanAfterDefault
	}
	if c.WatchdogBatch <= 0 {
		c.WatchdogBatch = WatchdogBatchDefault
	}
	return c
}

// ModuleParams is what Module takes from the graph.
type ModuleParams struct {
	fx.In
	DB     *db.Provider
	Outbox *outbox.Client
	Config Config       `optional:"true"`
	Logger *slog.Logger `optional:"true"`
}

// Module provides the chat *Service, on the bun handle of the
// *db.Provider and the *outbox.Client (from outbox.Module), and runs its
// watchdog as a lifecycle task that starts and stops with the app. It
// takes an optional Config and *slog.Logger.
var Module = fx.Module("minichat-chat",
	fx.Provide(func(p ModuleParams) *Service { return NewService(p.DB.Bun, p.Outbox, p.Config, p.Logger) }),
	fx.Invoke(func(lc fx.Lifecycle, sd fx.Shutdowner, svc *Service) error {
		task, err := NewWatchdog(svc)
		if err != nil {
			return err
		}
		lifecycle.HookWithShutdown(lc, sd, task)
		return nil
	}),
)

// NewWatchdog returns a lifecycle task that, every WatchdogInterval of the
// service's Config, finalises as orphaned the turns that have been running
// for longer than OrphanAfter. A failed pass is logged and retried at the
// next tick.
func NewWatchdog(svc *Service) (*lifecycle.Task, error) {
	cfg := svc.cfg
	return lifecycle.New(lifecycle.Config{Name: "minichat-watchdog", Logger: svc.log}, func(ctx context.Context, ready func()) error {
		ready()
		tick := time.NewTicker(cfg.WatchdogInterval)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-tick.C:
			}
			n, err := svc.FinaliseOrphans(ctx, cfg.OrphanAfter, cfg.WatchdogBatch)
			if err != nil && ctx.Err() == nil {
				svc.log.Warn("watchdog pass failed; retrying at the next tick", "error", err)
			}
			if n > 0 {
				svc.log.Debug("watchdog finalised orphaned turns", "count", n)
			}
		}
	})
}
