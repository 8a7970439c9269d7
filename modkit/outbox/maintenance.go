package outbox

import (
	"context"
	"fmt"
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
//
// An election that fails (the database is unreachable) is tried again
// sooner than the next SweepInterval, with the backoff of failing claims
// (electRetryDelay): from 50ms, doubling up to 5s (or PollInterval, if
// longer), never later than the SweepInterval. So once the database
// answers again, the pass follows within seconds, and the failing
// maintenance that Health reports ends with it, rather than up to a
// SweepInterval later. A step of a pass that fails (a sweep, a purge, the
// gauges' read) waits for the next SweepInterval: the database answered
// the election, and retrying the step sooner would load it again.

// Purging from a watermark. Delivered events are found for the purge in the
// settled index (settled_status, settled_at), which holds every topic's: no
// index is led by topic, as each delivery would have to write it. Walked
// from its oldest entry, a purge also reads every delivered event that
// other topics keep past its cutoff (a longer retention, a topic kept
// forever, another service's topics in the table): 575 ms a pass with
// 860,000 of them, every SweepInterval, and growing for ever with a topic
// that keeps its events. So each pass starts where the last one ended:
//
//   - A purge that completed (its last statement deleted fewer than its
//     limit) returns its cutoff, clock - retention, in the database's clock
//     (or the test clock): every delivered event of its topics settled
//     before it that the purge could see and lock is gone. The dispatcher
//     keeps it per topic, as the topic's watermark.
//   - The next purge of a retention's topics walks from the lowest of their
//     watermarks minus purgeMargin (PurgeParams.From). What settles below
//     a watermark after its purge is an event whose settled_at was stamped
//     before its transaction committed: the outcome write takes the clock
//     when its statement starts, and a transactional handler's
//     (Publisher.HandleTx) commits with the handler's transaction, inside
//     the claim's lease; or an event written under a test clock
//     (Config.Now) moved back; or one another transaction held locked
//     (the purge skips locked rows). The margin covers the first, with
//     room for commits that wait; an event delivered again after a replay
//     is stamped anew, above the watermark.
//   - A topic without a watermark (the dispatcher's first pass, or leading
//     it again after another dispatcher did), or whose last walk from the
//     oldest event is purgeFullWalkEvery old, is purged from the oldest
//     event: that full walk catches whatever the margin missed.
//   - A purge that failed or was cut short (the pass's deadline after
//     statements that deleted their whole limit) leaves the watermarks as
//     they were; so does a schema without migration 0025, where purges
//     return no cutoff and every pass walks from the oldest event.
const (
	purgeMarginMin     = 10 * time.Minute
	purgeFullWalkEvery = time.Hour
)

// purgeMark is what the dispatcher knows of a topic's purge.
type purgeMark struct {
	cutoff   time.Time // of its last complete purge, in the database's (or test) clock
	fullWalk time.Time // when its last complete purge from the oldest event began (time.Now)
}

// purgeMargin is how far below a watermark the next purge starts: four
// leases of this dispatcher (an outcome commits within its claim's lease,
// also for replicas whose lease is up to four times longer), and at least
// purgeMarginMin, for commits that wait on a slow disk or a synchronous
// standby. The walk it adds reads the deliveries of that span only.
func (d *Dispatcher) purgeMargin() time.Duration {
	return max(purgeMarginMin, 4*min(d.cfg.LeaseDuration, math.MaxInt64/4))
}

// purgeFrom is where the purge of topics starts: zero (from the oldest
// event) unless each has a watermark and a full walk within
// purgeFullWalkEvery of now.
func (d *Dispatcher) purgeFrom(topics []string, now time.Time) time.Time {
	var low time.Time
	for _, t := range topics {
		m, ok := d.purgeMarks[t]
		if !ok || now.Sub(m.fullWalk) >= purgeFullWalkEvery {
			return time.Time{}
		}
		if low.IsZero() || m.cutoff.Before(low) {
			low = m.cutoff
		}
	}
	return low.Add(-d.purgeMargin())
}

// keepPurgeMarks forgets the watermarks of the topics not led now: when
// this dispatcher leads one again, its first purge walks from the oldest.
func (d *Dispatcher) keepPurgeMarks(topics []string) {
	for t := range d.purgeMarks {
		if !slices.Contains(topics, t) {
			delete(d.purgeMarks, t)
		}
	}
}

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

// leadership is what the maintenance goroutine knows of the leases it
// holds.
type leadership struct {
	// ends is when the leadership last won ends; zero when none is held.
	ends time.Time
	// mayHold: a lease may be held, so the stop resigns. Set by an
	// election that won a role, or by one that ran out of its time (its
	// answer, not its commit, may have been late); cleared by an election
	// that answered with no role. An election that failed otherwise (a
	// database that refuses connections) leaves it as it was: a
	// dispatcher whose database was down since its start holds nothing,
	// and does not try (and fail) to resign.
	mayHold bool
}

// electRetryDelay is the wait before an election is tried again after one
// failed, the last such wait having been prev: the claims' backoff
// (nextErrDelay), and at most the SweepInterval.
func (d *Dispatcher) electRetryDelay(prev time.Duration) time.Duration {
	return min(nextErrDelay(prev, d.cfg.PollInterval), d.cfg.SweepInterval)
}

func (d *Dispatcher) maintenance(ctx context.Context) {
	d.maintErrAt.Store(0) // a run starts with no news
	roles := d.maintenanceRoles()
	t := time.NewTimer(d.cfg.SweepInterval)
	defer t.Stop()
	var lead leadership
	defer func() {
		if !lead.mayHold {
			return
		}
		// Let another dispatcher take over at once. Every role, not only
		// those last known held: an election cut short by the stop may
		// still have committed. Resign deletes only this holder's rows.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.stopBound(ctx, d.cfg.LeaseHeadroom))
		defer cancel()
		if err := d.c.store.Resign(rctx, d.cfg.WorkerID, roles); err != nil {
			d.log.Warn("could not resign maintenance leadership; another dispatcher takes over when the lease expires", d.errorAttrs(err)...)
		}
	}()
	d.warnMissingMigrations(ctx)
	d.warnNoAutovacuum(ctx)
	var retryIn time.Duration // the last wait after a failed election; 0 after one that worked
	for {
		// Passes start a SweepInterval apart (at once after one that
		// took longer), as the lease's term assumes.
		began := time.Now()
		err := d.maintainOnce(ctx, roles, &lead)
		wait := time.Until(began.Add(d.cfg.SweepInterval))
		if err != nil {
			attrs := d.errorAttrs(err)
			if ctx.Err() == nil {
				retryIn = d.electRetryDelay(retryIn)
				wait = retryIn
				attrs = append(attrs, "retry_in", retryIn)
			}
			d.log.Warn("maintenance election failed; retrying", attrs...)
		} else {
			retryIn = 0
		}
		resetTimer(t, wait)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// warnMissingMigrations logs a warning when the schema lacks some of the
// migrations of this build (a library upgraded, its migrations not run):
// the database then runs the functions of the migrations it has, so fixes
// and features of the missing ones are absent. Once a start, before the
// first election; a check that fails is logged at debug level only.
func (d *Dispatcher) warnMissingMigrations(ctx context.Context) {
	mc, ok := d.c.store.(driver.MigrationChecker)
	if !ok {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, d.cfg.LeaseHeadroom)
	defer cancel()
	missing, err := mc.MissingMigrations(cctx)
	switch {
	case err != nil:
		d.log.Debug("could not tell whether the schema lacks migrations", "schema", d.c.cfg.Schema, "error", err)
	case len(missing) > 0:
		d.log.Warn("the outbox schema lacks migrations of this build: run them (Client.Migrate, outbox.Module's "+
			"migrations, or modkit-outbox migrate up); until then the database runs the functions of the migrations it has",
			"schema", d.c.cfg.Schema, "missing", missing)
	}
}

// warnNoAutovacuum logs a warning when automatic vacuum does not run on the
// events table: each claim and outcome leaves a dead row version, which
// only vacuum reclaims, and without it the table and its indexes grow and
// claims slow down (a trial without it: 105,000 dead rows against 92,000
// live ones within 6 minutes, and the table at 122 MB). Once a start; a
// check that fails is logged at debug level only.
func (d *Dispatcher) warnNoAutovacuum(ctx context.Context) {
	vc, ok := d.c.store.(driver.VacuumChecker)
	if !ok {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, d.cfg.LeaseHeadroom)
	defer cancel()
	why, err := vc.AutovacuumOff(cctx)
	switch {
	case err != nil:
		d.log.Debug("could not tell whether autovacuum runs on the outbox's tables", "schema", d.c.cfg.Schema, "error", err)
	case why != "":
		d.log.Warn("autovacuum does not run on the outbox's events ("+why+"): every claim and outcome leaves a dead row version "+
			"that only vacuum reclaims, so the table grows and claims slow down; turn autovacuum on, or VACUUM the table "+
			"often (every minute or so under load)", "schema", d.c.cfg.Schema)
	}
}

// errorAttrs are a log line's attributes for a database error: the error,
// and what to check when retrying cannot cure it (a dispatcher started on a
// schema not migrated logs its election's failure before the claimer's
// error says what is wrong).
func (d *Dispatcher) errorAttrs(err error) []any {
	if poolerConflict(err) {
		return []any{"error", err, "hint", poolerHint}
	}
	if d.c.store.Fatal(err) {
		return []any{"error", err, "hint", fatalHint(err, roleDispatcher)}
	}
	return []any{"error", err}
}

// maintainOnce elects and runs one pass for the topics led, updates lead,
// and returns the election's error, if it failed: after a failed election
// the gauges of the topics led stop being reported once the leadership held
// before ends, since another dispatcher may lead them by then.
func (d *Dispatcher) maintainOnce(ctx context.Context, roles []string, lead *leadership) error {
	electedAt := time.Now()
	// Like a claim, the election is not cancelled by a stop at once: it
	// finishes (or runs out of the stop's time, see outlastStop) before
	// the resign that follows the stop.
	ectx, cancel := d.outlastStop(ctx, d.cfg.LeaseHeadroom)
	held, err := d.c.store.Elect(ectx, driver.ElectParams{Roles: roles, Holder: d.cfg.WorkerID, TTL: d.maintenanceTTL()})
	outOfTime := ectx.Err() != nil
	cancel()
	if err != nil {
		lead.mayHold = lead.mayHold || outOfTime
		if ctx.Err() == nil {
			d.maintErrAt.CompareAndSwap(0, time.Now().UnixNano())
		}
		if !lead.ends.IsZero() && time.Now().After(lead.ends) {
			d.metrics.setLeading(nil)
			lead.ends = time.Time{}
		}
		return err
	}
	lead.mayHold = len(held) > 0
	if ctx.Err() != nil {
		return nil // stopping: the resign follows
	}
	d.keepPurgeMarks(topicsOf(held))
	finished := true
	if len(held) > 0 {
		d.metrics.setLeading(topicsOf(held))
		// Stay inside the lease, with a margin for clock drift.
		budget := d.maintenanceTTL() / 3 * 2
		pctx, cancel := context.WithDeadline(ctx, electedAt.Add(budget))
		cut, failed := d.maintain(pctx, held)
		cancel()
		finished = cut == ""
		switch {
		case ctx.Err() != nil: // stopping: no news
		case failed || !finished:
			d.maintErrAt.CompareAndSwap(0, time.Now().UnixNano())
		default:
			d.maintErrAt.Store(0)
		}
		if !finished && ctx.Err() == nil {
			d.log.Warn("maintenance pass ran out of time; what it left waits for the next pass, and a pass that never "+
				"finishes leaves these topics unmaintained (raise DispatcherConfig.SweepInterval, or find what slows the database)",
				"cut_short", cut, "budget", budget, "topics", topicsOf(held))
		}
	} else {
		d.metrics.setLeading(nil) // another dispatcher reports these topics now
		d.maintErrAt.Store(0)     // and maintains them
	}
	if d.onMaintenance != nil {
		d.onMaintenance(held, finished)
	}
	lead.ends = time.Time{}
	if len(held) > 0 {
		lead.ends = electedAt.Add(d.maintenanceTTL())
	}
	return nil
}

// topicsOf returns the topics ("namespace:topic") of maintenance roles.
func topicsOf(roles []string) []string {
	topics := make([]string, len(roles))
	for i, r := range roles {
		topics[i] = strings.TrimPrefix(r, maintenanceRolePrefix)
	}
	return topics
}

// maintainLogIDs bounds the event ids one maintenance log record lists.
const maintainLogIDs = 100

// maintain runs one maintenance pass for roles: the sweep, the release of
// held events, the purges, the depth gauges. It returns the step its
// context's end cut short, if any, and whether a step failed otherwise.
func (d *Dispatcher) maintain(ctx context.Context, roles []string) (cut string, failed bool) {
	topics := topicsOf(roles)
	swept, err := d.c.store.Sweep(ctx, driver.SweepParams{Topics: topics, MaxAttempts: d.cfg.MaxAttempts, Limit: purgeBatch})
	switch {
	case err != nil && ctx.Err() != nil:
		cut = "the sweep of exhausted events"
	case err != nil:
		d.log.Warn("sweep of exhausted events failed", "error", err)
		failed = true
	}
	// A sweep that failed part way returns what its committed batches
	// swept: those events are dead or repaired all the same.
	if len(swept) > 0 {
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
				"count", len(repaired), "event_ids", repaired[:min(len(repaired), maintainLogIDs)])
		}
		if len(dead) > 0 {
			d.log.Error("dead-lettered events whose attempts were used up (crashed or overran on the last attempt)",
				"count", len(dead), "event_ids", dead[:min(len(dead), maintainLogIDs)])
		}
	}
	if cut != "" {
		return cut, failed
	}
	// Events held behind a settled predecessor (see releaseHeld): the
	// claimer frees them once per PollInterval only after it has claimed
	// ordered events, which a dispatcher started while a key's head was
	// dead never does. What it frees is claimed at once: the completer's
	// own release after a dead head (which wakes the claimer) finds
	// nothing to free when this one came first.
	if n, err := d.c.store.ReleaseHeld(ctx, topics, d.reg.skipDead, releaseHeldMax); err != nil {
		if ctx.Err() != nil {
			return "the release of held events", failed
		}
		d.log.Warn("releasing ordered events held behind settled ones failed", "error", err)
		failed = true
	} else if q := d.due.Load(); n > 0 && q != nil {
		q.add(time.Now())
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
		group := byRetention[r]
		began := time.Now()
		from := d.purgeFrom(group, began)
		res, err := d.c.store.Purge(ctx, driver.PurgeParams{Topics: group, Retention: r, Limit: purgeBatch, From: from})
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Sprintf("the purge of events delivered more than %v ago", r), failed
			}
			d.log.Warn("purge of delivered events failed", "error", err, "topics", group)
			failed = true
			continue
		}
		if res.Purged > 0 {
			d.log.Info("purged delivered events", "count", res.Purged, "retention", r, "topics", group)
		}
		if res.Cutoff.IsZero() {
			continue // not from migration 0025's function: no watermark
		}
		if d.purgeMarks == nil {
			d.purgeMarks = map[string]purgeMark{}
		}
		for _, t := range group {
			m := d.purgeMarks[t]
			m.cutoff = res.Cutoff
			if from.IsZero() {
				m.fullWalk = began
			}
			d.purgeMarks[t] = m
		}
	}
	_, ok, readFailed := d.metrics.refreshDepth(ctx, d.c.store, false)
	if !ok && ctx.Err() != nil {
		return "reading the depth gauges", failed
	}
	// A pass that cannot read the gauges is a failed one: Health says so,
	// as the gauges no longer do.
	return "", failed || readFailed
}
