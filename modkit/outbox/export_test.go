package outbox

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// OnMaintenance sets a hook called after each maintenance pass of d with
// the roles d held; set it before Start.
func OnMaintenance(d *Dispatcher, fn func(held []string)) {
	d.onMaintenance = func(held []string, _ bool) { fn(held) }
}

// OnMaintenancePass is OnMaintenance with whether the pass finished before
// its deadline (two thirds of its lease): a pass cut short by it (a slow
// machine) may have left its sweep or purge undone.
func OnMaintenancePass(d *Dispatcher, fn func(held []string, finished bool)) { d.onMaintenance = fn }

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

// SettleItem is one result for SettleInOneBatch: a give-back of Claim, or
// its delivery.
type SettleItem struct {
	Claim   driver.Claimed
	Deliver bool
}

// SettleInOneBatch has d's completer record items as one batch, in the
// order given, as it records the results that reach it together (the
// claims must be of d's WorkerID).
func SettleInOneBatch(ctx context.Context, d *Dispatcher, items ...SettleItem) {
	batch := make([]result, len(items))
	for i, it := range items {
		batch[i] = result{c: claimed{d: d.delivery(it.Claim), deadline: time.Now().Add(time.Minute)}, kind: released, why: "test"}
		if it.Deliver {
			batch[i].kind = published
		}
	}
	d.settle(ctx, batch, newDueTimes())
}

// SetBatchMaxBytes lowers what one EnqueueBatch of c may send.
func SetBatchMaxBytes(c *Client, n int) { c.batchMaxBytes = n }

// OnClaimRound sets a hook called after each round of claims of d that
// worked, with the topics that claimed ("namespace:topic"); set it before
// Start.
func OnClaimRound(d *Dispatcher, fn func(topics []string)) { d.onClaimRound = fn }

// OnDueWake sets a hook called when d's claimer wakes for a retry that
// fell due; set it before Start.
func OnDueWake(d *Dispatcher, fn func()) { d.onDueWake = fn }

// LaneLimit is how many publishes of topic d runs at once at most.
func LaneLimit(d *Dispatcher, topic Topic) int { return d.laneLimit(d.reg.byKey[topic.key()]) }

// AgeTopicFailures moves the times of the failed publishes that d's Health
// counts back by by, as if they had failed that much earlier.
func AgeTopicFailures(d *Dispatcher, by time.Duration) {
	d.mu.Lock()
	pool := d.pool
	d.mu.Unlock()
	pool.mu.Lock()
	defer pool.mu.Unlock()
	for _, l := range pool.lanes {
		l.failedFirst, l.failedLast = l.failedFirst.Add(-by), l.failedLast.Add(-by)
	}
}
