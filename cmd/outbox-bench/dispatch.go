package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/modkit-go/modkit/internal/benchsql"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// rawClaimSQL is the claim statement of modkit/outbox's PostgreSQL driver
// before migration 0004 moved it into the modkit_outbox_claim function
// (which runs the same CTE and also records repaired leases in the
// ledger): the same order, lock clause, UPDATE, RETURNING list and
// parameters ($1 MaxAttempts, $2 topic keys "namespace:topic", $3 limit,
// $4 worker id, $5 lease), and the predicate of today's claim index
// (unsettled, unheld events since migration 0014; of these it takes the
// pending ones), so that the baseline gets the index the library's claim
// uses; it leaves out the repair of expired
// leases, which a drain never needs. It leaves out the
// asynchronous commit the library's statements carry: the baseline is what
// a hand-written loop would send.
func rawClaimSQL(table string) string {
	return `WITH due AS (
	SELECT id FROM ` + table + `
	WHERE settled_status IS NULL AND NOT held AND status = 'pending' AND next_attempt_at <= now()
	  AND attempts < $1
	  AND (namespace || ':' || topic) = ANY($2::text[])
	ORDER BY created_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED
)
UPDATE ` + table + ` AS e SET
	status = 'processing',
	attempts = e.attempts + 1,
	locked_by = $4,
	locked_until = now() + $5::interval,
	lease_token = gen_random_uuid(),
	updated_at = now()
FROM due WHERE e.id = due.id
RETURNING e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, e.payload, e.attempts,
	e.lease_token, e.locked_until, e.created_at`
}

// drainResult is one drain of a preloaded table.
type drainResult struct {
	delivered int
	elapsed   time.Duration
	queries   counts // the dispatcher's statements, zero for the baseline
}

func (r drainResult) rate() float64 { return float64(r.delivered) / r.elapsed.Seconds() }

// drainTimeout bounds a drain of n events: far beyond any plausible rate.
func drainTimeout(n int) time.Duration { return time.Minute + time.Duration(n)*time.Millisecond }

// drainDispatcher delivers the n preloaded events with the library's
// Dispatcher and a no-op publisher, timing from Start until OnOutcome has
// seen the n-th delivery. settings are session settings of the
// dispatcher's pool.
func (b *bench) drainDispatcher(ctx context.Context, n, batch, concurrency int, settings map[string]string) (drainResult, error) {
	return b.drainDispatcherWith(ctx, n, batch, concurrency, settings, nil)
}

// drainDispatcherWith is drainDispatcher with pub as the publisher (nil: a
// no-op one).
func (b *bench) drainDispatcherWith(ctx context.Context, n, batch, concurrency int, settings map[string]string, pub *outbox.Publisher) (drainResult, error) {
	qc := &queryCounter{}
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: b.opts.dispatcherConns, tracer: qc, warm: 1, settings: settings})
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	var delivered atomic.Int64
	var doneAfter atomic.Int64
	done := make(chan struct{})
	var start time.Time
	cfg := outbox.DispatcherConfig{
		BatchSize: batch, Concurrency: concurrency, Logger: b.dispatcherLog,
		OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
			if o.LeaseLost || o.Released || o.Status != outbox.StatusDelivered {
				return
			}
			if delivered.Add(1) == int64(n) {
				doneAfter.Store(int64(time.Since(start)))
				close(done)
			}
		},
	}
	var d *outbox.Dispatcher
	switch {
	case pub != nil:
		var client *outbox.Client
		if client, err = b.newClient(pool, outbox.Config{}); err == nil {
			d, err = client.NewDispatcher(cfg, *pub)
		}
	default:
		d, err = b.newDispatcher(pool, cfg, nil)
	}
	if err != nil {
		return drainResult{}, err
	}
	before := qc.snapshot()
	start = time.Now()
	if err := d.Start(ctx); err != nil {
		return drainResult{}, fmt.Errorf("start dispatcher: %w", err)
	}
	var waitErr error
	select {
	case <-done:
	case <-ctx.Done():
		waitErr = ctx.Err()
	case <-time.After(drainTimeout(n)):
		waitErr = fmt.Errorf("only %d of %d events delivered after %v", delivered.Load(), n, drainTimeout(n))
	}
	if err := d.Stop(context.WithoutCancel(ctx)); err != nil && waitErr == nil {
		waitErr = fmt.Errorf("stop dispatcher: %w", err)
	}
	if waitErr != nil {
		return drainResult{}, waitErr
	}
	res := drainResult{delivered: n, elapsed: time.Duration(doneAfter.Load()), queries: qc.snapshot().sub(before)}
	if pub != nil && pub.DeleteOnDelivery {
		return res, b.checkDeleted(ctx)
	}
	return res, b.checkDelivered(ctx, n)
}

// rawLoop is a raw-SQL claim+ack loop: the baseline, and the variants the
// experiments workload measures.
type rawLoop struct {
	workers, batch int
	claim          string // parameters as the library's claim
	ack            string
	// ackArgs gives the ack's arguments from the claiming worker and the
	// claimed ids and lease tokens; nil means the id array alone.
	ackArgs  func(worker pgtype.UUID, ids, tokens []pgtype.UUID) []any
	settings map[string]string // session settings
}

// baselineLoop is the baseline of the dispatch workload: rawClaimSQL and
// benchsql.RawAck on b.opts.rawWorkers connections.
func (b *bench) baselineLoop() rawLoop {
	table := b.t.table.Sanitize()
	return rawLoop{workers: b.opts.rawWorkers, batch: b.opts.batch, claim: rawClaimSQL(table), ack: benchsql.RawAck(table)}
}

// drainRaw delivers the n preloaded events with a raw loop: loop.workers
// goroutines, each on its own connection, run one claim statement and one
// ack statement after another until a claim finds nothing.
func (b *bench) drainRaw(ctx context.Context, n int, loop rawLoop) (drainResult, error) {
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: int32(loop.workers), warm: loop.workers, settings: loop.settings})
	if err != nil {
		return drainResult{}, err
	}
	defer pool.Close()
	ctx, cancel := context.WithTimeout(ctx, drainTimeout(n))
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, loop.workers)
	start := time.Now()
	for w := range loop.workers {
		wg.Go(func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				errs[w] = err
				return
			}
			defer conn.Release()
			worker := pgtype.UUID{Bytes: uuid.New(), Valid: true}
			args := b.claimParams(loop.batch, worker)
			ids := make([]pgtype.UUID, 0, loop.batch)
			tokens := make([]pgtype.UUID, 0, loop.batch)
			// The rows are decoded into the types the driver's Claim uses.
			var c driver.Claimed
			var id, tenant, token pgtype.UUID
			for {
				ids, tokens = ids[:0], tokens[:0]
				rows, err := conn.Query(ctx, loop.claim, args...)
				if err != nil {
					errs[w] = err
					return
				}
				for rows.Next() {
					if err := rows.Scan(&id, &c.Namespace, &c.Topic, &tenant, &c.DedupeKey, &c.Payload, &c.Attempts,
						&token, &c.LockedTill, &c.CreatedAt); err != nil {
						rows.Close()
						errs[w] = err
						return
					}
					ids, tokens = append(ids, id), append(tokens, token)
				}
				if errs[w] = rows.Err(); errs[w] != nil || len(ids) == 0 {
					return
				}
				args := []any{ids}
				if loop.ackArgs != nil {
					args = loop.ackArgs(worker, ids, tokens)
				}
				if _, errs[w] = conn.Exec(ctx, loop.ack, args...); errs[w] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return drainResult{}, fmt.Errorf("raw drain: %w", err)
	}
	return drainResult{delivered: n, elapsed: elapsed}, b.checkDelivered(ctx, n)
}

// checkDelivered verifies that a drain delivered exactly the n preloaded
// events: nothing left behind, nothing extra.
func (b *bench) checkDelivered(ctx context.Context, n int) error {
	got, err := b.t.countStatus(ctx, outbox.StatusDelivered)
	if err != nil {
		return err
	}
	retained := b.retainedNow
	if got != n+retained {
		return fmt.Errorf("drain check: %d delivered rows, want %d", got, n+retained)
	}
	return nil
}

// checkDeleted verifies that a drain with Publisher.DeleteOnDelivery left
// only the retained history in the table (the n deliveries themselves were
// counted by OnOutcome).
func (b *bench) checkDeleted(ctx context.Context) error {
	var left int
	if err := b.t.admin.QueryRow(ctx, "SELECT count(*) FROM "+b.t.table.Sanitize()).Scan(&left); err != nil {
		return err
	}
	if left != b.retainedNow {
		return fmt.Errorf("drain check: %d rows left after deleting on delivery, want %d", left, b.retainedNow)
	}
	return nil
}

// prepareDrain readies the table for one drain: empty it, add retained
// delivered rows and n pending events, vacuum and checkpoint, and explain
// the hot statements when asked to. A table that already holds that much
// delivered history keeps it, and only loses the rows of earlier phases.
func (b *bench) prepareDrain(ctx context.Context, label string, retained, n int) error {
	b.retainedNow = retained
	if retained > 0 && b.t.history == retained {
		b.log.Info(label+": keeping the delivered history, deleting the rest", "rows", retained)
		if err := b.t.deleteAllButHistory(ctx, b.src); err != nil {
			return err
		}
	} else {
		if err := b.t.truncate(ctx); err != nil {
			return err
		}
		if retained > 0 {
			b.log.Info(label+": inserting delivered history", "rows", retained)
			if err := b.t.insertDelivered(ctx, b.src, retained); err != nil {
				return err
			}
			b.t.history = retained
		}
	}
	b.log.Info(label+": preloading pending events", "events", n)
	if err := b.t.preloadPending(ctx, b.src, label, n); err != nil {
		return err
	}
	if err := b.t.settle(ctx); err != nil {
		return err
	}
	if b.opts.explain {
		b.explainHotPath(ctx, label)
	}
	return nil
}

// drainBaseline prepares the table and drains it with the raw-SQL
// baseline loop.
func (b *bench) drainBaseline(ctx context.Context, label string, retained, n int) (drainResult, error) {
	if err := b.prepareDrain(ctx, label, retained, n); err != nil {
		return drainResult{}, err
	}
	b.log.Info(label+": raw SQL drain", "workers", b.opts.rawWorkers, "batch", b.opts.batch)
	res, err := b.drainRaw(ctx, n, b.baselineLoop())
	if err == nil {
		b.log.Info(label+": raw SQL drained", "events_per_s", int(res.rate()))
	}
	return res, err
}

// drainLibrary prepares the table and drains it with the dispatcher.
func (b *bench) drainLibrary(ctx context.Context, label string, retained, n, batch int) (drainResult, error) {
	if err := b.prepareDrain(ctx, label, retained, n); err != nil {
		return drainResult{}, err
	}
	b.log.Info(label+": dispatcher drain", "batch", batch, "concurrency", b.opts.concurrency)
	res, err := b.drainDispatcher(ctx, n, batch, b.opts.concurrency, b.opts.dispatcherSettings)
	if err == nil {
		b.log.Info(label+": dispatcher drained", "events_per_s", int(res.rate()), "statements", res.queries.breakdown())
	}
	return res, err
}

// drainRate is a drain's figure: events per second.
func drainRate(r drainResult) float64 { return r.rate() }

// runDispatch is the dispatch workload: N preloaded events drained by the
// dispatcher against the raw-SQL claim+ack loop, alternating round by
// round (and, when -batch is not the library's default, the dispatcher
// with its default batch too), each drain on a freshly loaded table.
func (b *bench) runDispatch(ctx context.Context) error {
	n := b.opts.events
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	sides := []side[drainResult]{
		{fmt.Sprintf("dispatcher, batch %d", b.opts.batch), func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainLibrary(ctx, "dispatch", 0, n, b.opts.batch)
		}},
		{"raw SQL claim+ack loop", func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainBaseline(ctx, "dispatch", 0, n)
		}},
	}
	sides = append(sides, side[drainResult]{"raw SQL claim+ack loop appending the ledger row", func(ctx context.Context, _ int) (drainResult, error) {
		if err := b.prepareDrain(ctx, "dispatch-raw-ledger", 0, n); err != nil {
			return drainResult{}, err
		}
		loop := b.baselineLoop()
		loop.ack = benchsql.RawAckLedger(b.t.table.Sanitize(), pgx.Identifier{b.t.schema, "modkit_outbox_attempts"}.Sanitize())
		loop.ackArgs = func(worker pgtype.UUID, ids, tokens []pgtype.UUID) []any { return []any{ids, worker, tokens[0]} }
		return b.drainRaw(ctx, n, loop)
	}})
	deleting := noopPublisher(nil)
	deleting.DeleteOnDelivery = true
	sides = append(sides, side[drainResult]{"dispatcher with library defaults, Publisher.DeleteOnDelivery", func(ctx context.Context, _ int) (drainResult, error) {
		if err := b.prepareDrain(ctx, "dispatch-delete", 0, n); err != nil {
			return drainResult{}, err
		}
		return b.drainDispatcherWith(ctx, n, b.defaults.BatchSize, 0, b.opts.dispatcherSettings, &deleting)
	}})
	defaultBatch := b.defaults.BatchSize
	if b.opts.batch != defaultBatch {
		sides = append(sides, side[drainResult]{fmt.Sprintf("dispatcher, default batch %d", defaultBatch), func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainLibrary(ctx, "dispatch-default-batch", 0, n, defaultBatch)
		}})
	}
	runs, err := alternate(ctx, b, "dispatch", b.opts.rounds, sides)
	if err != nil {
		return err
	}
	lib, raw := mapSeries(runs[0], drainRate), mapSeries(runs[1], drainRate)
	r := roundsRow("dispatch", fmt.Sprintf("%s events, batch %d, concurrency %d", itoa(int64(n)), b.opts.batch, b.opts.concurrency), lib, raw, 0.9)
	r.Note = fmt.Sprintf("Baseline: %d goroutines on their own connections looping claim (the claim statement of rawClaimSQL, batch %d) + UPDATE … WHERE id = ANY($1), "+
		"each committed synchronously (the dispatcher's claims and outcome writes commit asynchronously unless Config.SynchronousCommit). "+
		"Dispatcher statements per 1,000 events (median round): %s.%s", b.opts.rawWorkers, b.opts.batch, perThousand(median(runs[0]).queries, n),
		roundsNote(lib, raw))
	b.add(r)
	rawLedger := mapSeries(runs[2], drainRate)
	r = roundsRow("dispatch", fmt.Sprintf("same, against a raw loop that also appends the ledger row, batch %d", b.opts.batch), lib, rawLedger, 0)
	r.Note = "Baseline: the raw loop above whose ack also appends, in the same statement, the attempts-ledger row the dispatcher appends for each delivery " +
		"(same columns): both write the same rows, so this compares the machinery (commit modes aside: the raw loop commits synchronously), " +
		"and the ratio to the bare loop includes the ledger's cost." +
		roundsNote(lib, rawLedger)
	b.add(r)

	del := mapSeries(runs[3], drainRate)
	r = roundsRow("dispatch", "library defaults with Publisher.DeleteOnDelivery (opt-in)", del, raw, 0)
	r.Note = fmt.Sprintf("The dispatcher with its default BatchSize and Concurrency, its publisher deleting each event in the write that records its delivery "+
		"(the attempts ledger keeps the delivery), against the same raw loop, which keeps delivered rows. Statements per 1,000 events (median round): %s.%s",
		perThousand(median(runs[3]).queries, n), roundsNote(del, raw))
	b.add(r)

	if len(runs) > 4 {
		def := mapSeries(runs[4], drainRate)
		r := roundsRow("dispatch", fmt.Sprintf("same, library default batch %d", defaultBatch), def, raw, 0)
		r.Note = fmt.Sprintf("Library defaults (BatchSize %d, Concurrency %d); the claim takes whatever room the queue of BatchSize has, at least half of it. "+
			"Statements per 1,000 events (median round): %s.%s", defaultBatch, b.defaults.Concurrency, perThousand(median(runs[4]).queries, n), roundsNote(def, raw))
		b.add(r)
	}
	return nil
}

// median returns the run with the median rate (the lower middle one for an
// even count), for the statement counts of a typical run.
func median(runs []drainResult) drainResult {
	sorted := slices.Clone(runs)
	slices.SortFunc(sorted, func(a, b drainResult) int { return cmp.Compare(a.rate(), b.rate()) })
	return sorted[(len(sorted)-1)/2]
}

// runScale is the scale workload: the dispatch rate with many delivered
// rows retained, and with a large pending backlog, each against the rate
// on an empty table measured in the same rounds (retained, empty, backlog,
// retained, empty, backlog, …). The retained rows live in a second outbox
// schema of the run, inserted once: each retained round deletes the
// previous round's events there and loads its own, while the empty and
// backlog rounds use the run's own schema.
func (b *bench) runScale(ctx context.Context) error {
	n, retained, backlog := b.opts.events, b.opts.retained, b.opts.backlog
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	kept, drop, err := b.t.addSchema(ctx, "retained")
	if err != nil {
		return err
	}
	defer drop()
	inKept := func(ctx context.Context, drain func(ctx context.Context) (drainResult, error)) (drainResult, error) {
		b.t.use(kept)
		defer b.t.use(b.t.main)
		return drain(ctx)
	}
	sides := []side[drainResult]{
		{"dispatcher, delivered rows retained", func(ctx context.Context, _ int) (drainResult, error) {
			return inKept(ctx, func(ctx context.Context) (drainResult, error) {
				return b.drainLibrary(ctx, "scale-retained", retained, n, b.opts.batch)
			})
		}},
		{"dispatcher, empty table", func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainLibrary(ctx, "scale-empty", 0, n, b.opts.batch)
		}},
		{"dispatcher, pending backlog", func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainLibrary(ctx, "scale-backlog", 0, backlog, b.opts.batch)
		}},
	}
	if b.opts.scaleRaw {
		sides = append(sides, side[drainResult]{"raw SQL loop, delivered rows retained", func(ctx context.Context, _ int) (drainResult, error) {
			return inKept(ctx, func(ctx context.Context) (drainResult, error) {
				return b.drainBaseline(ctx, "scale-retained-raw", retained, n)
			})
		}})
	}
	runs, err := alternate(ctx, b, "scale", b.opts.rounds, sides)
	b.retainedNow = 0
	if err != nil {
		return err
	}
	withHistory, empty, pending := mapSeries(runs[0], drainRate), mapSeries(runs[1], drainRate), mapSeries(runs[2], drainRate)
	emptyLabel := func(r row) row {
		r.Baseline += ", empty table"
		return r
	}
	r := emptyLabel(roundsRow("scale: delivered retained", fmt.Sprintf("%s events drained, %s delivered rows kept", itoa(int64(n)), itoa(int64(retained))),
		withHistory, empty, 0.9))
	r.Note = "Baseline: the dispatcher draining the same number of events from an empty table, in the same rounds. " +
		"Delivered rows are inserted directly (INSERT … SELECT generate_series) into a second schema of the run, once; each round deletes the previous round's events there, " +
		"loads its own, then VACUUM (ANALYZE)." + roundsNote(withHistory, empty)
	if retained < 10_000_000 {
		r.Note += fmt.Sprintf(" The performance issue's 0.9× is for 10,000,000 rows kept (-retained 10000000); this run kept %s.", itoa(int64(retained)))
	}
	if len(runs) > 3 {
		raw := mapSeries(runs[3], drainRate)
		r.Note += fmt.Sprintf(" The raw-SQL baseline on the same table moved %s (the outbox: %.2f× of it).", raw.withSpread(fmtCount, "/s"), withHistory.median()/raw.median())
	}
	b.add(r)

	r = emptyLabel(roundsRow("scale: pending backlog", fmt.Sprintf("%s pending events drained", itoa(int64(backlog))), pending, empty, 0))
	r.Note = "Baseline: the dispatcher draining " + itoa(int64(n)) + " events from an empty table, in the same rounds." + roundsNote(pending, empty)
	b.add(r)
	return nil
}

// perThousand renders statement counts per 1,000 events.
func perThousand(c counts, n int) string { return c.scaled(1000 / float64(n)) }
