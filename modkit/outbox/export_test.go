package outbox

import (
	"sync/atomic"
	"time"
)

// OnMaintenance sets a hook called after each maintenance pass of d with
// the roles d held; set it before Start.
func OnMaintenance(d *Dispatcher, fn func(held []string)) { d.onMaintenance = fn }

// OnGaugeRefresh sets a hook called after each read of the depth gauges by
// d's refresher (between maintenance passes); set it before Start.
func OnGaugeRefresh(d *Dispatcher, fn func()) { d.metrics.onRefresh = fn }

// AtomicTime is a time.Time safe for concurrent use, for test clocks.
type AtomicTime struct{ v atomic.Pointer[time.Time] }

// Store sets the time.
func (a *AtomicTime) Store(t time.Time) { a.v.Store(&t) }

// Load returns the time.
func (a *AtomicTime) Load() time.Time { return *a.v.Load() }

// PurgeMargin is how far below a topic's purge watermark d's next purge
// starts.
func PurgeMargin(d *Dispatcher) time.Duration { return d.purgeMargin() }
