package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// The completer records outcomes in batches: it waits for one result, takes
// whatever else is ready, waits a little for more when that is only a few
// (see completeLinger), and settles them all in one statement, retrying
// while the leases can still be honoured.

// completeLinger is how long the completer waits for more results when it
// has fewer than completeLingerBelow and none of them is of an ordering key.
// Each write costs the server a fixed part (the call, a round trip, its
// statements) besides a part per outcome, and at a steady rate each claim's
// few results reach the completer together: without the wait it wrote once
// per claim (BENCHMARKS.md, "Outcome writes wait 2 ms"). Results are
// handed over as before, so publish slots, and with them claims, do not
// wait for it; a result of an ordering key is written at once, since the
// next event of its key cannot be claimed before it.
const (
	completeLinger      = 2 * time.Millisecond
	completeLingerBelow = 64
)

// Outcome is what the dispatcher recorded for one publish, as reported to
// DispatcherConfig.OnOutcome.
type Outcome struct {
	// Status the event was moved to: delivered, pending (a retry, or given
	// back unpublished when Released) or dead. Empty when LeaseLost.
	Status Status
	// Released: the event went back unpublished, its attempt not counted
	// (the dispatcher stopped, its deadline passed while queued, or its
	// publish had not returned when a stop ran out of time).
	Released bool
	// Abandoned: the publish was given up on while it still ran. At its
	// deadline, the attempt counts as failed (Status pending with RetryIn,
	// or dead after the last attempt, as for a publish that returned an
	// error); when a stop ran out of time, the event is Released.
	Abandoned bool
	// LeaseLost: the lease had expired before the outcome could be
	// recorded; nothing was changed and the event will be delivered again.
	LeaseLost bool
	// RetryIn is the backoff chosen for a retry.
	RetryIn time.Duration
	// Error is what was stored in last_error (redacted, truncated).
	Error string
}

// completeWriters is how many outcome writes a dispatcher runs at once. A
// drain is bound by its outcome writes (each settles up to completeMaxBatch
// events in one statement, most of its time the server's writes), and one
// writer left a core idle while the other wrote (BENCHMARKS.md, "Two
// outcome writers").
const completeWriters = 2

func (d *Dispatcher) completer(ctx context.Context, results <-chan result, due *dueTimes) {
	writeOutcomes(results, func(batch []result) { d.settle(ctx, batch, due) })
}

// writeOutcomes gathers results into batches and has write record each,
// up to completeWriters at once, until results is closed and every write
// has returned. A batch holding a result of an ordering key is written
// alone, after every write before it and before any after it, as with one
// writer: whether a released event is held again, and which successor a
// delivery lets into the claim, depend on the outcomes of its key that
// earlier writes recorded. write may keep batch only until it returns.
func writeOutcomes(results <-chan result, write func(batch []result)) {
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	// A batch's buffer goes back to free when its write is done; a token
	// in writing is a writer at work.
	free := make(chan []result, completeWriters)
	for range completeWriters {
		free <- make([]result, 0, completeMaxBatch)
	}
	writing := make(chan struct{}, completeWriters)
	var writers sync.WaitGroup
	defer writers.Wait()
	for first := range results {
		batch := gather(append((<-free)[:0], first), results, linger, completeLinger)
		if slices.ContainsFunc(batch, ordered) {
			for range completeWriters {
				writing <- struct{}{}
			}
			write(batch)
			for range completeWriters {
				<-writing
			}
			free <- batch
			continue
		}
		writing <- struct{}{}
		writers.Go(func() {
			write(batch)
			free <- batch
			<-writing
		})
	}
}

// gather adds to batch the results that are ready, then, while batch has
// fewer than completeLingerBelow and none of an ordering key, those that
// come within wait (timed by linger, a stopped timer).
func gather(batch []result, results <-chan result, linger *time.Timer, wait time.Duration) []result {
	for len(batch) < completeMaxBatch {
		select {
		case r, ok := <-results:
			if !ok {
				return batch
			}
			batch = append(batch, r)
			continue
		default:
		}
		break
	}
	if len(batch) >= completeLingerBelow || slices.ContainsFunc(batch, ordered) {
		return batch
	}
	resetTimer(linger, wait)
	defer linger.Stop()
	for len(batch) < completeLingerBelow {
		select {
		case r, ok := <-results:
			if !ok {
				return batch
			}
			batch = append(batch, r)
			if ordered(r) {
				return batch
			}
		case <-linger.C:
			return batch
		}
	}
	return batch
}

// ordered reports whether a result is of an event with an ordering key.
func ordered(r result) bool { return r.c.d.OrderingKey != "" }

// decide turns a publish result into the outcome to record.
func (d *Dispatcher) decide(r result) (driver.Outcome, Outcome) {
	m := r.c.d
	o := driver.Outcome{ID: m.ID, LeaseToken: m.leaseToken}
	var out Outcome
	fail := func(format string, err error) string {
		return sanitizeError(fmt.Sprintf(format, m.Attempt, m.MaxAttempts, err), d.c.cfg.ErrorMaxLen)
	}
	if r.kind == abandoned && r.why == whyAbandoned {
		// A publish abandoned at its deadline used its attempt, as one
		// that returned its context's error at the deadline does: an event
		// whose every publish hangs is dead-lettered after MaxAttempts,
		// where it was claimed again for ever. (One abandoned because a
		// stop ran out of time is given back below.)
		r.kind, r.err = published, errPublishAbandoned
		out.Abandoned = true
	}
	switch {
	case r.kind != published:
		o.Kind, out.Status, out.Released, out.Abandoned = driver.Release, StatusPending, true, r.kind == abandoned
		o.Error = r.why
	case r.err == nil:
		o.Kind, out.Status = deliveredKind(r.pub), StatusDelivered
	case IsPermanent(r.err):
		err := r.err
		if p, ok := err.(*permanentError); ok {
			err = p.err // "failed permanently" says what its "permanent: " prefix would
		}
		o.Kind, out.Status, o.Error = driver.Dead, StatusDead, fail("attempt %d of %d failed permanently: %v", err)
	case m.Attempt >= m.MaxAttempts:
		o.Kind, out.Status, o.Error = driver.Dead, StatusDead, fail("attempt %d of %d failed, no attempts left: %v", r.err)
	default:
		o.Kind, out.Status, o.Error = driver.Retry, StatusPending, fail("attempt %d of %d failed: %v", r.err)
		o.Delay = max(d.cfg.Retry.Backoff(m.Attempt), retryAfter(r.err))
		out.RetryIn = o.Delay
	}
	if o.Kind != driver.Release {
		out.Error = o.Error
	}
	return o, out
}

// deliveredKind is how a delivery of p's topic is recorded: kept as
// delivered, or deleted (Publisher.DeleteOnDelivery). p is nil for an event
// that was not published.
func deliveredKind(p *Publisher) driver.OutcomeKind {
	if p != nil && p.DeleteOnDelivery {
		return driver.DeliveredDeleted
	}
	return driver.Delivered
}

// retryAfterMax bounds the delay a publish error may ask for.
const retryAfterMax = 24 * time.Hour

// retryAfter is the delay a publish error asks for through a
// RetryAfter() time.Duration method (an HTTP 429 or 503 with Retry-After,
// a broker's back-off), at most retryAfterMax; 0 when it asks for none.
func retryAfter(err error) time.Duration {
	var ra interface{ RetryAfter() time.Duration }
	if !errors.As(err, &ra) {
		return 0
	}
	return min(max(ra.RetryAfter(), 0), retryAfterMax)
}

// settle records a batch of results. A batch may hold two results of one
// event: one of an earlier claim that reached the completer late (a
// give-back sent as its lease ended, while the writes lagged) and one of
// the event's next claim. One write records one outcome an event, so each
// repeat goes in a later write, in the order the results came: the stale
// one then fails its lease check and the other is recorded, where in one
// write the first would have been tried and the other dropped.
func (d *Dispatcher) settle(ctx context.Context, batch []result, due *dueTimes) {
	for len(batch) > 0 {
		var later []result
		batch, later = splitRepeats(batch)
		d.settleOnce(ctx, batch, due)
		batch = later
	}
}

// splitRepeats returns batch's results of events not seen earlier in it,
// and the rest (nil when every event is there once, the usual case, when
// first is batch itself), each in batch's order.
func splitRepeats(batch []result) (first, later []result) {
	if len(batch) < 2 {
		return batch, nil
	}
	seen := make(map[uuid.UUID]struct{}, len(batch))
	for i, r := range batch {
		if _, ok := seen[r.c.d.ID]; !ok {
			seen[r.c.d.ID] = struct{}{}
			continue
		}
		first = append(make([]result, 0, len(batch)), batch[:i]...)
		for _, r := range batch[i:] {
			if _, ok := seen[r.c.d.ID]; ok {
				later = append(later, r)
			} else {
				seen[r.c.d.ID] = struct{}{}
				first = append(first, r)
			}
		}
		return first, later
	}
	return batch, nil
}

// settleOnce records results of distinct events in one write.
func (d *Dispatcher) settleOnce(ctx context.Context, batch []result, due *dueTimes) {
	outcomes := make([]driver.Outcome, 0, len(batch))
	reports := make([]Outcome, 0, len(batch))
	kept := make([]*result, 0, len(batch)) // the results outcomes[i] records
	var latest time.Time
	for i := range batch {
		r := &batch[i]
		switch r.kind {
		case ackedInTx:
			if r.c.d.OrderingKey != "" {
				// The handler's commit freed the next event of the key.
				due.add(time.Now())
			}
			d.record(*r, Outcome{Status: StatusDelivered})
			continue
		case lostInTx:
			d.record(*r, Outcome{LeaseLost: true})
			continue
		}
		o, rep := d.decide(*r)
		outcomes, reports, kept = append(outcomes, o), append(reports, rep), append(kept, r)
		if r.c.deadline.After(latest) {
			latest = r.c.deadline
		}
	}
	if len(outcomes) == 0 {
		return
	}
	// Keep trying while the leases can still be honoured; after that the
	// events will simply be claimed and delivered again. A stop that runs
	// out of time (flush, the completer's context, ends) gives up sooner.
	flush := ctx
	ctx, cancel := context.WithDeadline(ctx, latest.Add(d.cfg.LeaseHeadroom))
	defer cancel()
	giveUp := func(err error) {
		for _, r := range kept {
			d.metrics.unrecorded.Add(context.Background(), 1, d.metrics.topicAttrs(r.c.d.Namespace, r.c.d.Topic))
		}
		if context.Cause(flush) == errStopRanOut {
			d.unrecordedAtStop.Add(int64(len(outcomes)))
			d.log.Warn("could not record outcomes before the stop's time ran out; the events will be delivered again when their leases end",
				"count", len(outcomes), "error", err)
			return
		}
		d.log.Warn("could not record outcomes before the leases ended; the events will be delivered again",
			"count", len(outcomes), "error", err)
	}
	failedBefore := false
	for delay := 20 * time.Millisecond; ; delay = min(2*delay, time.Second) {
		settled, err := d.c.store.Complete(ctx, nil, d.cfg.WorkerID, outcomes)
		d.setOutcomeFailing(err != nil)
		if err == nil {
			if failedBefore {
				d.findRecorded(ctx, outcomes, settled)
			}
			// The database set each retry's next_attempt_at from its clock
			// during Complete, so now+delay is never before it: the wake-up
			// comes at most the statement's duration late. (A wake-up timed
			// from before the call could come early by more than the wake
			// window when the statement was slow to start, and the retry
			// then waited for the poll.)
			end := time.Now()
			deadHead := false
			for i, ok := range settled {
				if !ok {
					reports[i] = Outcome{LeaseLost: true, Abandoned: reports[i].Abandoned}
				} else if outcomes[i].Kind == driver.Retry {
					due.add(end.Add(outcomes[i].Delay))
				} else if dl := kept[i].c.d; dl.OrderingKey != "" {
					// The next event of the key may be claimed now.
					due.add(end)
					if outcomes[i].Kind == driver.Dead {
						p := d.reg.byKey[Topic{dl.Namespace, dl.Topic}.key()]
						deadHead = deadHead || p != nil && p.SkipDeadHeads
					}
				}
				d.record(*kept[i], reports[i])
			}
			// A dead event of a SkipDeadHeads topic does not free its
			// successor in the outcome's statement (a delivery does): the
			// release of held events does, now rather than at its next
			// turn, a PollInterval away.
			if deadHead && d.releaseHeld(ctx) > 0 {
				due.add(time.Now())
			}
			return
		}
		if ctx.Err() != nil {
			giveUp(err)
			return
		}
		failedBefore = true
		d.log.Warn("recording outcomes failed; retrying", "count", len(outcomes), "error", err, "retry_in", delay)
		if !sleepCtx(ctx, delay) {
			giveUp(err)
			return
		}
	}
}

// findRecorded marks as settled the outcomes of a write that an earlier,
// failed write of the same outcomes recorded: its commit went through and
// its answer was lost with the connection, so the write that followed found
// those leases ended and recorded nothing. They were reported as leases
// lost (a warning that the events would be delivered again, which they
// will not be). A store that cannot tell (no driver.OutcomeFinder, a schema
// before migration 0035) leaves them so.
func (d *Dispatcher) findRecorded(ctx context.Context, outcomes []driver.Outcome, settled []bool) {
	finder, ok := d.c.store.(driver.OutcomeFinder)
	if !ok {
		return
	}
	var unsettled []driver.Outcome
	var at []int
	for i, ok := range settled {
		if !ok {
			unsettled, at = append(unsettled, outcomes[i]), append(at, i)
		}
	}
	if len(unsettled) == 0 {
		return
	}
	recorded, err := finder.RecordedOutcomes(ctx, d.cfg.WorkerID, unsettled)
	if err != nil {
		d.log.Debug("could not tell whether a failed outcome write was recorded; its outcomes are reported as leases lost", "error", err)
		return
	}
	for j, ok := range recorded {
		settled[at[j]] = settled[at[j]] || ok
	}
}

func (d *Dispatcher) record(r result, o Outcome) {
	// One at a time, whichever writer recorded it: OnOutcome is called
	// serially.
	d.recordMu.Lock()
	defer d.recordMu.Unlock()
	d.metrics.observe(r, o)
	if d.cfg.OnOutcome != nil {
		defer d.cfg.OnOutcome(r.c.d, o)
	}
	if o.Released && stopReason(r.why) { // for the stop's summary
		d.givenBackAtStop.Add(1)
		if o.Abandoned {
			d.abandonedAtStop.Add(1)
		}
	}
	quiet := !o.LeaseLost && !o.Abandoned && (o.Released || o.Status == StatusDelivered)
	if quiet && !d.log.Enabled(context.Background(), slog.LevelDebug) {
		return // the hot path: nothing to log, no attributes to build
	}
	m := r.c.d
	attrs := []any{"namespace", m.Namespace, "topic", m.Topic, "event_id", m.ID, "attempt", m.Attempt}
	switch {
	case o.LeaseLost:
		if r.err != nil {
			attrs = append(attrs, "publish_error", SanitizeError(r.err, d.c.cfg.ErrorMaxLen))
		}
		d.log.Warn("lease lost before the outcome was recorded (it expired, and the event may already be reclaimed); outcome dropped", attrs...)
	case o.Abandoned && o.Released:
		d.log.Debug("abandoned event given back", attrs...)
	case o.Abandoned && o.Status == StatusPending: // warned of when it was abandoned
		d.log.Debug("abandoned publish's attempt recorded as failed; will retry", append(attrs, "retry_in", o.RetryIn)...)
	case o.Released:
		d.log.Debug("event released", attrs...)
	case o.Status == StatusDelivered:
		d.log.Debug("event delivered", attrs...)
	case o.Status == StatusDead:
		d.log.Error("event dead-lettered", append(attrs, "error", o.Error)...)
	default:
		d.log.Warn("publish failed; will retry", append(attrs, "error", o.Error, "retry_in", o.RetryIn)...)
	}
}

// stopReason reports whether why, an event's reason for going back
// unpublished, is a stop's.
func stopReason(why string) bool {
	return why == whyStopped || why == whyStopLate || why == whyCutByStop || why == whyClaimAfter
}

// errPublishAbandoned is the failed attempt of a publish abandoned at its
// deadline.
var errPublishAbandoned = errors.New("the publish outlived its deadline and was abandoned: the publisher ignores its " +
	"context (it must return when ctx ends)")

// errHandlerEndedTx is the failed attempt of a HandleTx that committed or
// rolled back its transaction itself.
var errHandlerEndedTx = errors.New("outbox: HandleTx committed or rolled back tx itself, so the event could not be marked " +
	"delivered in it: leave tx open and return; the dispatcher commits it with the delivered mark when HandleTx returns nil " +
	"(and rolls it back when it returns an error)")

// handleTx runs a transactional handler and the fenced delivered mark in
// one transaction. A lost lease rolls the handler's writes back. An outcome
// recorded this way (or refused for its lease) is an outcome write that
// worked: it ends a failing spell reported by Health as the completer's do,
// or a dispatcher whose deliveries all go through HandleTx stayed degraded
// after its outcome writes had recovered.
func (d *Dispatcher) handleTx(ctx context.Context, p *Publisher, m Delivery, exited func(error)) (resultKind, error) {
	kind := published
	err := d.callSafely(p, m, exited, func() error {
		var handlerErr error
		err := d.c.store.InTx(ctx, func(ctx context.Context, tx any) error {
			if handlerErr = p.HandleTx(ctx, tx.(pgx.Tx), m); handlerErr != nil {
				return handlerErr
			}
			// Fails with driver.ErrLeaseLost (and aborts the
			// transaction) when the lease is no longer ours.
			_, err := d.c.store.Complete(ctx, tx, d.cfg.WorkerID, []driver.Outcome{{ID: m.ID, LeaseToken: m.leaseToken, Kind: deliveredKind(p)}})
			return err
		})
		if errors.Is(err, pgx.ErrTxClosed) && !errors.Is(handlerErr, pgx.ErrTxClosed) {
			// The handler ended the transaction: say so in its terms (the
			// store's InTx blamed "the function" of an InTx it never
			// called).
			if handlerErr != nil {
				return fmt.Errorf("%w (and the handler committed or rolled back tx itself first: what it committed stays)", handlerErr)
			}
			return errHandlerEndedTx
		}
		return err
	})
	switch {
	case err == nil:
		kind = ackedInTx
		d.setOutcomeFailing(false)
	case errors.Is(err, driver.ErrLeaseLost):
		kind, err = lostInTx, nil
		d.setOutcomeFailing(false)
	}
	return kind, err
}
