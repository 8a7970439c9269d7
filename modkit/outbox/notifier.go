package outbox

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// The notifier wakes the claimer on NOTIFY. A lost connection is re-opened
// with backoff; the first wake after a reconnect covers what was missed.
// The driver's Listen also gives up on a connection that stays silent
// (outboxpg checks it after 30s without a notification, with one sent from
// the pool), and Health reports a listener that hears no one until it
// hears a notification again. Polling goes on meanwhile, so a dead or deaf
// listener only costs latency.
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
	onNotify := func(topic string) { // the empty topic: the driver's check came back
		if d.listenerDeafSince.Load() != 0 {
			d.listenerDeafSince.Store(0)
		}
		if wanted[topic] {
			d.metrics.observeWakeup(topic)
			signal()
		}
	}
	lostAt := time.Now() // when the listener last stopped listening (or first tried)
	defer d.listenerDownSince.Store(0)
	defer d.listenerDeafSince.Store(0)
	for delay := time.Duration(0); ; {
		if delay > 0 && !sleepCtx(ctx, delay) {
			return
		}
		// signal once listening: anything enqueued while we were not.
		var listening atomic.Bool
		err := d.c.store.Listen(ctx, func() {
			listening.Store(true)
			d.listenerDownSince.Store(0)
			signal()
		}, onNotify)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, driver.ErrListenUnsupported) {
			d.log.Info("the database has no notifications; polling only")
			return
		}
		if errors.Is(err, driver.ErrListenDeaf) {
			d.listenerDeafSince.CompareAndSwap(0, time.Now().UnixNano())
		}
		delay = reconnectDelay(delay, listening.Load())
		if listening.Load() { // a connection lost, not a failed attempt to open one
			d.metrics.listenerReconnects.Add(ctx, 1)
			lostAt = time.Now()
		} else {
			// An attempt to listen failed: Health reports the listener
			// down from when it was lost (or first tried).
			d.listenerDownSince.CompareAndSwap(0, lostAt.UnixNano())
		}
		d.log.Warn("notification listener lost; polling continues, reconnecting", "error", err, "retry_in", delay)
	}
}

// reconnectDelay is the wait before the listener's next reconnect, after
// one that waited prev and then listened (or failed to): it doubles from
// 100 ms up to 5 s while reconnects fail, and a listen that worked ends the
// run of failures, so the next reconnect starts from the shortest delay
// again rather than from where the failures of an hour ago left it.
func reconnectDelay(prev time.Duration, listened bool) time.Duration {
	if listened {
		prev = 0
	}
	return min(max(2*prev, 100*time.Millisecond), 5*time.Second)
}
