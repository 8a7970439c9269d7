package outbox

import (
	"context"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Maintenance keeps the table healthy: it dead-letters events whose
// attempts are used up but which no claim will pick again (a worker died on
// the last attempt), purges delivered events past their topic's retention,
// and reads the depth gauges (which the gauge refresher, metrics.go, keeps
// fresh between passes). Each topic's maintenance runs on one
// dispatcher at a time: every SweepInterval each dispatcher asks the
// database for the lease of the role "maintenance:<namespace>:<topic>" of
// each of its topics; a live holder keeps renewing it, and another
// dispatcher takes it over only after it expired (its holder stopped, died
// or lost the database). A pass is bounded by the lease it runs under, so
// two dispatchers never sweep or purge one topic at once. A dispatcher only
// maintains its own topics, with its own MaxAttempts and retentions.

// maintenanceTTL is how long an elected lease lasts: long enough to survive
// a missed renewal, short enough for a quick takeover.
// (Capped so that no SweepInterval overflows it, or its two thirds below.)
func (d *Dispatcher) maintenanceTTL() time.Duration {
	return 3 * min(d.cfg.SweepInterval, math.MaxInt64/3)
}

func (d *Dispatcher) maintenanceRoles() []string {
	roles := make([]string, len(d.reg.keys))
	for i, k := range d.reg.keys {
		roles[i] = maintenanceRolePrefix + k
	}
	return roles
}

func (d *Dispatcher) maintenance(ctx context.Context) {
	roles := d.maintenanceRoles()
	t := time.NewTicker(d.cfg.SweepInterval)
	defer t.Stop()
	defer func() {
		// Let another dispatcher take over at once. Every role, not only
		// those last known held: an election cut short by the stop may
		// still have committed. Resign deletes only this holder's rows.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.LeaseHeadroom)
		defer cancel()
		if err := d.c.store.Resign(rctx, d.cfg.WorkerID, roles); err != nil {
			d.log.Warn("could not resign maintenance leadership; another dispatcher takes over when the lease expires", "error", err)
		}
	}()
	for {
		d.maintainOnce(ctx, roles)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// maintainOnce elects and runs one pass for the topics led.
func (d *Dispatcher) maintainOnce(ctx context.Context, roles []string) {
	electedAt := time.Now()
	// Like a claim, the election is not cut short by a stop: it finishes
	// (or times out) before the resign that follows the stop.
	ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.LeaseHeadroom)
	held, err := d.c.store.Elect(ectx, driver.ElectParams{Roles: roles, Holder: d.cfg.WorkerID, TTL: d.maintenanceTTL()})
	cancel()
	if err != nil {
		d.log.Warn("maintenance election failed; retrying at the next sweep interval", "error", err)
		return
	}
	if ctx.Err() != nil {
		return // stopping: the resign follows
	}
	if len(held) > 0 {
		d.metrics.setLeading(topicsOf(held))
		// Stay inside the lease, with a margin for clock drift.
		pctx, cancel := context.WithDeadline(ctx, electedAt.Add(d.maintenanceTTL()/3*2))
		d.maintain(pctx, held)
		cancel()
	} else {
		d.metrics.setLeading(nil) // another dispatcher reports these topics now
	}
	if d.onMaintenance != nil {
		d.onMaintenance(held)
	}
}

// topicsOf returns the topics ("namespace:topic") of maintenance roles.
func topicsOf(roles []string) []string {
	topics := make([]string, len(roles))
	for i, r := range roles {
		topics[i] = strings.TrimPrefix(r, maintenanceRolePrefix)
	}
	return topics
}

func (d *Dispatcher) maintain(ctx context.Context, roles []string) {
	topics := topicsOf(roles)
	swept, err := d.c.store.Sweep(ctx, driver.SweepParams{Topics: topics, MaxAttempts: d.cfg.MaxAttempts, Limit: purgeBatch})
	if err != nil {
		if ctx.Err() == nil {
			d.log.Warn("sweep of exhausted events failed", "error", err)
		}
	} else if len(swept) > 0 {
		var dead, repaired []string
		for _, e := range swept {
			ns, topic, _ := strings.Cut(e.Topic, ":")
			if e.Repaired {
				d.metrics.leaseRepairs.Add(ctx, 1, d.metrics.topicAttrs(ns, topic))
				repaired = append(repaired, e.ID.String())
				continue
			}
			d.metrics.dead.Add(ctx, 1, d.metrics.topicAttrs(ns, topic))
			dead = append(dead, e.ID.String())
		}
		if len(repaired) > 0 {
			d.log.Warn("repaired expired leases: their dispatcher crashed or overran; they are delivered again",
				"count", len(repaired), "event_ids", repaired)
		}
		if len(dead) > 0 {
			d.log.Error("dead-lettered events whose attempts were used up (crashed or overran on the last attempt)",
				"count", len(dead), "event_ids", dead)
		}
	}
	// One purge per distinct retention.
	byRetention := map[time.Duration][]string{}
	for _, t := range topics {
		if r := d.retention(d.reg.byKey[t]); r >= 0 {
			byRetention[r] = append(byRetention[r], t)
		}
	}
	retentions := make([]time.Duration, 0, len(byRetention))
	for r := range byRetention {
		retentions = append(retentions, r)
	}
	slices.Sort(retentions)
	for _, r := range retentions {
		n, err := d.c.store.Purge(ctx, driver.PurgeParams{Topics: byRetention[r], Retention: r, Limit: purgeBatch})
		if err != nil {
			if ctx.Err() == nil {
				d.log.Warn("purge of delivered events failed", "error", err, "topics", byRetention[r])
			}
		} else if n > 0 {
			d.log.Info("purged delivered events", "count", n, "retention", r, "topics", byRetention[r])
		}
	}
	d.metrics.refreshDepth(ctx, d.c.store, false)
}
