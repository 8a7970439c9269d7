package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// rawClaimSQL is the claim statement of modkit/outbox (sql.go) with the
// same eligibility predicate, order, lock clause, UPDATE and RETURNING
// list, so that the baseline differs from the library only in what
// surrounds the statement.
func rawClaimSQL(table string) string {
	return `WITH due AS (
	SELECT id FROM ` + table + `
	WHERE status IN ('pending', 'processing')
	  AND ((status = 'pending' AND next_attempt_at <= now())
	    OR (status = 'processing' AND locked_until < now()))
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

// rawAckSQL marks claimed events delivered by id, clearing the lease as the
// table's lease constraint requires; unlike the library's outcome
// statement it checks no lease token.
func rawAckSQL(table string) string {
	return `UPDATE ` + table + ` SET status = 'delivered', locked_by = NULL, locked_until = NULL,
	lease_token = NULL, updated_at = now()
WHERE id = ANY($1)`
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

// noopPublishers registers a publisher for benchTopic that calls fn (if set)
// and succeeds.
func noopPublishers(fn func(m outbox.ClaimedMessage)) *outbox.Publishers {
	var pubs outbox.Publishers
	err := pubs.Register(outbox.Publisher{Topic: benchTopic, Name: "outbox-bench", Publish: func(_ context.Context, m outbox.ClaimedMessage) error {
		if fn != nil {
			fn(m)
		}
		return nil
	}})
	if err != nil {
		panic(err) // a fixed, valid registration
	}
	return &pubs
}

// drainDispatcher delivers the n preloaded events with the library's
// Dispatcher and a no-op publisher, timing from Start until OnSettled has
// seen the n-th delivery. settings are session settings of the
// dispatcher's pool.
func (b *bench) drainDispatcher(ctx context.Context, n, batch, concurrency int, settings map[string]string) (drainResult, error) {
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
		OnSettled: func(_ outbox.ClaimedMessage, st outbox.Settlement) {
			if st.LeaseLost || st.Status != outbox.StatusDelivered {
				return
			}
			if delivered.Add(1) == int64(n) {
				doneAfter.Store(int64(time.Since(start)))
				close(done)
			}
		},
	}
	d, err := outbox.NewDispatcher(pool, noopPublishers(nil), cfg)
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
	return res, b.checkDelivered(ctx, n)
}

// rawLoop is a raw-SQL claim+ack loop: the baseline, and the variants the
// experiments workload measures.
type rawLoop struct {
	workers, batch int
	claim          string // parameters as the library's claim
	ack            string
	// ackArgs gives the ack's arguments; nil means the id array alone.
	ackArgs  func(ids, tokens []pgtype.UUID) []any
	settings map[string]string // session settings
}

// baselineLoop is the baseline of the dispatch workload: rawClaimSQL and
// rawAckSQL on b.opts.rawWorkers connections.
func (b *bench) baselineLoop() rawLoop {
	table := b.t.table.Sanitize()
	return rawLoop{workers: b.opts.rawWorkers, batch: b.opts.batch, claim: rawClaimSQL(table), ack: rawAckSQL(table)}
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
	keys := []string{benchTopic.Namespace + ":" + benchTopic.Topic}
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
			worker := uuid.New()
			ids := make([]pgtype.UUID, 0, loop.batch)
			tokens := make([]pgtype.UUID, 0, loop.batch)
			var m outbox.ClaimedMessage
			var id, tenant, token pgtype.UUID
			for {
				ids, tokens = ids[:0], tokens[:0]
				rows, err := conn.Query(ctx, loop.claim, outbox.MaxAttemptsDefault, keys, loop.batch, worker, outbox.LeaseDurationDefault)
				if err != nil {
					errs[w] = err
					return
				}
				for rows.Next() {
					if err := rows.Scan(&id, &m.Namespace, &m.Topic, &tenant, &m.DedupeKey, &m.Payload, &m.Attempts,
						&token, &m.LeaseExpiresAt, &m.CreatedAt); err != nil {
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
					args = loop.ackArgs(ids, tokens)
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

// prepareDrain readies the table for one drain: empty it, add retained
// delivered rows and n pending events, vacuum and checkpoint, and explain
// the hot statements when asked to.
func (b *bench) prepareDrain(ctx context.Context, label string, retained, n int) error {
	if err := b.t.truncate(ctx); err != nil {
		return err
	}
	b.retainedNow = retained
	if retained > 0 {
		b.log.Info(label+": inserting delivered history", "rows", retained)
		if err := b.t.insertDelivered(ctx, b.src, retained); err != nil {
			return err
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

// drainBoth measures one preloaded table twice, first with the raw-SQL
// baseline, then with the library's dispatcher, preparing the table afresh
// for each.
func (b *bench) drainBoth(ctx context.Context, label string, retained, n int) (lib, raw drainResult, err error) {
	if err := b.prepareDrain(ctx, label, retained, n); err != nil {
		return lib, raw, err
	}
	b.log.Info(label+": raw SQL drain", "workers", b.opts.rawWorkers, "batch", b.opts.batch)
	if raw, err = b.drainRaw(ctx, n, b.baselineLoop()); err != nil {
		return lib, raw, err
	}
	b.log.Info(label+": raw SQL drained", "events_per_s", int(raw.rate()))
	lib, err = b.drainLibrary(ctx, label, retained, n, b.opts.batch)
	return lib, raw, err
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

// runDispatch is the dispatch workload: N preloaded events drained by the
// dispatcher against the raw-SQL claim+ack loop, -repeat times each
// (alternating), reporting the medians.
func (b *bench) runDispatch(ctx context.Context) error {
	n := b.opts.events
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	var libs, raws, defs []drainResult
	for range b.opts.repeat {
		lib, raw, err := b.drainBoth(ctx, "dispatch", 0, n)
		if err != nil {
			return err
		}
		libs, raws = append(libs, lib), append(raws, raw)
		if b.opts.batch != outbox.BatchSizeDefault {
			def, err := b.drainLibrary(ctx, "dispatch-default-batch", 0, n, outbox.BatchSizeDefault)
			if err != nil {
				return err
			}
			defs = append(defs, def)
		}
	}
	lib, raw := median(libs), median(raws)
	b.emptyRate = lib.rate()
	r := rateRow("dispatch", fmt.Sprintf("%s events, batch %d, concurrency %d", itoa(int64(n)), b.opts.batch, b.opts.concurrency),
		lib.rate(), raw.rate(), 0.9)
	r.Note = fmt.Sprintf("Baseline: %d goroutines on their own connections looping claim (the library's statement, batch %d) + UPDATE … WHERE id = ANY($1). "+
		"Dispatcher statements per 1,000 events: %s.%s", b.opts.rawWorkers, b.opts.batch, perThousand(lib.queries, n), medianNote(libs, raws))
	b.add(r)

	if len(defs) > 0 {
		def := median(defs)
		r := rateRow("dispatch", fmt.Sprintf("same, library default batch %d", outbox.BatchSizeDefault), def.rate(), raw.rate(), 0)
		r.Note = fmt.Sprintf("Library defaults (BatchSize %d, Concurrency %d); the claim takes whatever room the queue of BatchSize has, at least half of it. "+
			"Statements per 1,000 events: %s.%s", outbox.BatchSizeDefault, b.opts.concurrency, perThousand(def.queries, n), medianNote(defs, nil))
		b.add(r)
	}
	return nil
}

// median returns the run with the median rate (the lower middle one for an
// even count).
func median(runs []drainResult) drainResult {
	sorted := slices.Clone(runs)
	slices.SortFunc(sorted, func(a, b drainResult) int { return cmp.Compare(a.rate(), b.rate()) })
	return sorted[(len(sorted)-1)/2]
}

// spread describes repeated runs by their lowest and highest rate,
// "14,000–15,000/s"; empty for a single run.
func spread(runs []drainResult) string {
	if len(runs) < 2 {
		return ""
	}
	byRate := func(a, b drainResult) int { return cmp.Compare(a.rate(), b.rate()) }
	lo, hi := slices.MinFunc(runs, byRate), slices.MaxFunc(runs, byRate)
	return strings.TrimSuffix(fmtRate(lo.rate()), "/s") + "–" + fmtRate(hi.rate())
}

// medianNote says which medians a row shows, or nothing for single runs.
func medianNote(runs []drainResult, raws []drainResult) string {
	if len(runs) < 2 {
		return ""
	}
	s := fmt.Sprintf(" Median of %d runs; outbox %s", len(runs), spread(runs))
	if len(raws) > 1 {
		s += ", baseline " + spread(raws)
	}
	return s + "."
}

// runScale is the scale workload: the dispatch rate with many delivered
// rows retained, and with a large pending backlog, against the rate on an
// empty table.
func (b *bench) runScale(ctx context.Context) error {
	n := b.opts.events
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	if b.emptyRate == 0 {
		lib, err := b.drainLibrary(ctx, "scale-empty", 0, n, b.opts.batch)
		if err != nil {
			return err
		}
		b.emptyRate = lib.rate()
	}
	emptyLabel := func(r row) row {
		r.Baseline = fmtRate(r.Values["baseline_per_s"]) + " (empty table)"
		return r
	}

	retained := b.opts.retained
	var lib, raw drainResult
	var err error
	if b.opts.scaleRaw {
		lib, raw, err = b.drainBoth(ctx, "scale-retained", retained, n)
	} else {
		lib, err = b.drainLibrary(ctx, "scale-retained", retained, n, b.opts.batch)
	}
	if err != nil {
		return err
	}
	r := emptyLabel(rateRow("scale: delivered retained", fmt.Sprintf("%s events drained, %s delivered rows kept", itoa(int64(n)), itoa(int64(retained))),
		lib.rate(), b.emptyRate, 0.8))
	r.Note = "Ratio against the dispatch rate on an empty table in this run. Delivered rows are inserted directly (INSERT … SELECT generate_series), then VACUUM (ANALYZE)."
	if raw.delivered > 0 {
		r.Note += fmt.Sprintf(" The raw-SQL baseline on the same table moved %s (the outbox: %.2f× of it).", fmtRate(raw.rate()), lib.rate()/raw.rate())
	}
	b.add(r)

	backlog := b.opts.backlog
	lib, err = b.drainLibrary(ctx, "scale-backlog", 0, backlog, b.opts.batch)
	if err != nil {
		return err
	}
	r = emptyLabel(rateRow("scale: pending backlog", fmt.Sprintf("%s pending events drained", itoa(int64(backlog))), lib.rate(), b.emptyRate, 0))
	b.add(r)
	b.retainedNow = 0
	return nil
}

// perThousand renders statement counts per 1,000 events.
func perThousand(c counts, n int) string { return c.scaled(1000 / float64(n)) }
