package outbox

import (
	"context"
	"errors"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// The notifier wakes the claimer on NOTIFY. A lost connection is re-opened
// with backoff; the first wake after a reconnect covers what was missed.
// Polling goes on meanwhile, so a dead listener only costs latency.
func (d *Dispatcher) notifier(ctx context.Context, wake chan<- struct{}) {
	signal := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	wanted := make(map[string]bool, len(d.reg.keys))
	for _, k := range d.reg.keys {
		wanted[k] = true
	}
	onNotify := func(topic string) {
		if wanted[topic] {
			d.metrics.observeWakeup(topic)
			signal()
		}
	}
	for delay := time.Duration(0); ; {
		if delay > 0 && !sleepCtx(ctx, delay) {
			return
		}
		// signal once listening: anything enqueued while we were not.
		err := d.c.store.Listen(ctx, signal, onNotify)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, driver.ErrListenUnsupported) {
			d.log.Info("the database has no notifications; polling only")
			return
		}
		delay = min(max(2*delay, 100*time.Millisecond), 5*time.Second)
		d.metrics.listenerReconnects.Add(ctx, 1)
		d.log.Warn("notification listener lost; polling continues, reconnecting", "error", err, "retry_in", delay)
	}
}
