package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/riverqueue/river"

	"github.com/modkit-go/modkit/internal/benchsql"
	"github.com/modkit-go/modkit/modkit/outbox"
)

const preloadChunk = 20000

// preloadOutbox writes n pending, due outbox events by COPY, created a
// microsecond apart like a steady stream of enqueues, with time-ordered ids
// as the library gives them.
func (b *bench) preloadOutbox(ctx context.Context, run string, n int) error {
	cols := []string{"id", "namespace", "topic", "tenant_id", "dedupe_key", "payload", "status", "attempts", "created_at", "next_attempt_at"}
	at := time.Now().Add(-time.Minute)
	for start := 0; start < n; start += preloadChunk {
		rows := make([][]any, 0, preloadChunk)
		for i := start; i < min(n, start+preloadChunk); i++ {
			m := b.src.message(run, int64(i))
			id, err := uuid.NewV7()
			if err != nil {
				return err
			}
			ts := at.Add(time.Duration(i) * time.Microsecond)
			rows = append(rows, []any{pgtype.UUID{Bytes: id, Valid: true}, m.Namespace, m.Topic, pgtype.UUID{Bytes: b.src.tenant, Valid: true},
				*m.DedupeKey, string(m.Payload), "pending", 0, ts, ts})
		}
		if _, err := b.env.admin.CopyFrom(ctx, b.env.outboxTable, cols, pgx.CopyFromRows(rows)); err != nil {
			return fmt.Errorf("preload outbox: %w", err)
		}
	}
	return nil
}

// preloadRiver inserts n available River jobs with River's own bulk insert
// (InsertManyFastTx, COPY).
func (b *bench) preloadRiver(ctx context.Context, n int) error {
	client, err := b.newRiver(b.env.admin, nil)
	if err != nil {
		return err
	}
	for start := 0; start < n; start += preloadChunk {
		params := make([]river.InsertManyParams, 0, preloadChunk)
		for i := start; i < min(n, start+preloadChunk); i++ {
			params = append(params, river.InsertManyParams{Args: b.src.job(int64(i))})
		}
		if err := pgx.BeginFunc(ctx, b.env.admin, func(tx pgx.Tx) error {
			_, err := client.InsertManyFastTx(ctx, tx, params)
			return err
		}); err != nil {
			return fmt.Errorf("preload River: %w", err)
		}
	}
	return nil
}

func drainTimeout(n int) time.Duration { return time.Minute + time.Duration(n)*time.Millisecond }

// drainOutbox resets the tables, preloads n events and times the
// dispatcher (library defaults but for clientCfg) from Start until the n-th
// delivery is recorded.
func (b *bench) drainOutbox(ctx context.Context, n int, clientCfg outbox.Config, deleteOnDelivery bool) (float64, error) {
	if err := b.env.reset(ctx); err != nil {
		return 0, err
	}
	if err := b.preloadOutbox(ctx, "dispatch", n); err != nil {
		return 0, err
	}
	if err := b.env.settle(ctx); err != nil {
		return 0, err
	}
	pool, err := b.env.newPool(ctx, 0, 1, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	var delivered, took atomic.Int64
	done := make(chan struct{})
	var start time.Time
	cfg := outbox.DispatcherConfig{OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
		if o.LeaseLost || o.Released || o.Status != outbox.StatusDelivered {
			return
		}
		if delivered.Add(1) == int64(n) {
			took.Store(int64(time.Since(start)))
			close(done)
		}
	}}
	d, err := b.newDispatcher(pool, clientCfg, deleteOnDelivery, cfg, nil)
	if err != nil {
		return 0, err
	}
	start = time.Now()
	if err := d.Start(ctx); err != nil {
		return 0, err
	}
	err = waitDone(ctx, done, n, &delivered)
	if stopErr := d.Stop(context.WithoutCancel(ctx)); err == nil && stopErr != nil {
		err = fmt.Errorf("stop dispatcher: %w", stopErr)
	}
	if err != nil {
		return 0, err
	}
	check := "SELECT count(*) FROM " + b.env.outboxTable.Sanitize() + " WHERE status = 'delivered'"
	if deleteOnDelivery {
		check = "SELECT count(*) FROM " + pgx.Identifier{outboxSchema, "modkit_outbox_attempts"}.Sanitize() + " WHERE outcome = 'delivered'"
	}
	got, err := b.env.count(ctx, check)
	if err == nil && got != n {
		err = fmt.Errorf("drain check: %d deliveries recorded, want %d", got, n)
	}
	if err == nil && deleteOnDelivery {
		if left, cerr := b.env.count(ctx, "SELECT count(*) FROM "+b.env.outboxTable.Sanitize()); cerr != nil || left != 0 {
			err = errors.Join(cerr, fmt.Errorf("drain check: %d events left with DeleteOnDelivery, want 0", left))
		}
	}
	return float64(n) / time.Duration(took.Load()).Seconds(), err
}

func waitDone(ctx context.Context, done <-chan struct{}, n int, progress *atomic.Int64) error {
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(drainTimeout(n)):
		return fmt.Errorf("only %d of %d done after %v", progress.Load(), n, drainTimeout(n))
	}
}

// drainRiver resets the tables, preloads n jobs and times a tuned River
// client from Start until it reports the n-th job completed (River emits
// the event once the completion is committed).
func (b *bench) drainRiver(ctx context.Context, n int) (float64, error) {
	if err := b.env.reset(ctx); err != nil {
		return 0, err
	}
	if err := b.preloadRiver(ctx, n); err != nil {
		return 0, err
	}
	if err := b.env.settle(ctx); err != nil {
		return 0, err
	}
	pool, err := b.env.newPool(ctx, int32(b.opts.riverConns), 1, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	client, err := b.newRiver(pool, nil)
	if err != nil {
		return 0, err
	}
	events, cancel := client.SubscribeConfig(&river.SubscribeConfig{ChanSize: n + 1000, Kinds: []river.EventKind{river.EventKindJobCompleted}})
	defer cancel()
	var completed atomic.Int64
	done := make(chan struct{})
	var took time.Duration
	start := time.Now()
	if err := client.Start(ctx); err != nil {
		return 0, err
	}
	go func() {
		for range events {
			if completed.Add(1) == int64(n) {
				took = time.Since(start)
				close(done)
				return
			}
		}
	}()
	err = waitDone(ctx, done, n, &completed)
	stopCtx, stopCancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer stopCancel()
	if stopErr := client.Stop(stopCtx); err == nil && stopErr != nil {
		err = fmt.Errorf("stop River: %w", stopErr)
	}
	if err != nil {
		return 0, err
	}
	got, err := b.env.count(ctx, "SELECT count(*) FROM "+b.env.riverJob.Sanitize()+" WHERE state = 'completed'")
	if err == nil && got != n {
		err = fmt.Errorf("drain check: %d completed jobs, want %d", got, n)
	}
	return float64(n) / took.Seconds(), err
}

// rawClaim and benchsql.RawAck are a hand-written claim+ack loop on the outbox
// table: the predicate of the library's claim index (unsettled, unheld
// events since migration 0014, of which it takes the pending ones; the
// loop never needs the repair of expired leases) and its
// order, a batch claim under FOR UPDATE SKIP LOCKED that takes a lease,
// and a mark-delivered by id array, each statement its own (synchronously
// committed) transaction.
func rawClaim(table string) string {
	return `WITH due AS (
	SELECT id FROM ` + table + `
	WHERE settled_status IS NULL AND NOT held AND status = 'pending' AND next_attempt_at <= now()
	  AND attempts < 25 AND namespace = $1 AND topic = $2
	ORDER BY created_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED)
UPDATE ` + table + ` AS e SET status = 'processing', attempts = e.attempts + 1, locked_by = $4,
	locked_until = now() + interval '30 seconds', lease_token = gen_random_uuid(), updated_at = now()
FROM due WHERE e.id = due.id
RETURNING e.id, e.payload, e.lease_token`
}

// rawLoop drains table with workers goroutines on their own connections,
// each running claim (batch rows) then ack until a claim finds nothing,
// and returns the elapsed time. ack takes the claimed ids, and with
// withLedger also the worker and the claim's first lease token.
func (b *bench) rawLoop(ctx context.Context, workers, batch int, claim, ack string, withLedger bool) (time.Duration, error) {
	pool, err := b.env.newPool(ctx, int32(workers), workers, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	errs := make([]error, workers)
	var wg sync.WaitGroup
	start := time.Now()
	for w := range workers {
		wg.Go(func() {
			worker := pgtype.UUID{Bytes: uuid.New(), Valid: true}
			ids := make([]pgtype.UUID, 0, batch)
			for {
				ids = ids[:0]
				rows, err := pool.Query(ctx, claim, benchTopic.Namespace, benchTopic.Topic, batch, worker)
				if err != nil {
					errs[w] = err
					return
				}
				var id, token, first pgtype.UUID
				var payload []byte
				for rows.Next() {
					if err := rows.Scan(&id, &payload, &token); err != nil {
						errs[w] = err
						break
					}
					if len(ids) == 0 {
						first = token
					}
					ids = append(ids, id)
				}
				rows.Close()
				if errs[w] = errors.Join(errs[w], rows.Err()); errs[w] != nil || len(ids) == 0 {
					return
				}
				args := []any{ids}
				if withLedger {
					args = append(args, worker, first)
				}
				if _, errs[w] = pool.Exec(ctx, ack, args...); errs[w] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start), errors.Join(errs...)
}

// drainRaw resets the tables, preloads n outbox events and drains them with
// the raw loop; withLedger appends each delivery's ledger row as the
// library does.
func (b *bench) drainRaw(ctx context.Context, n int, withLedger bool) (float64, error) {
	if err := b.env.reset(ctx); err != nil {
		return 0, err
	}
	if err := b.preloadOutbox(ctx, "dispatch", n); err != nil {
		return 0, err
	}
	if err := b.env.settle(ctx); err != nil {
		return 0, err
	}
	table := b.env.outboxTable.Sanitize()
	ack := benchsql.RawAck(table)
	if withLedger {
		ack = benchsql.RawAckLedger(table, b.env.outboxAttempts.Sanitize())
	}
	took, err := b.rawLoop(ctx, b.opts.rawWorkers, b.opts.rawBatch, rawClaim(table), ack, withLedger)
	if err != nil {
		return 0, err
	}
	got, err := b.env.count(ctx, "SELECT count(*) FROM "+table+" WHERE status = 'delivered'")
	if err == nil && got != n {
		err = fmt.Errorf("raw drain check: %d delivered rows, want %d", got, n)
	}
	if withLedger && err == nil {
		if got, err = b.env.count(ctx, "SELECT count(*) FROM "+b.env.outboxAttempts.Sanitize()+" WHERE outcome = 'delivered'"); err == nil && got != n {
			err = fmt.Errorf("raw drain check: %d ledger rows, want %d", got, n)
		}
	}
	return float64(n) / took.Seconds(), err
}

// runDispatch alternates the six drains round by round.
func (b *bench) runDispatch(ctx context.Context) error {
	n := b.opts.events
	sides := []side[float64]{
		{"outbox, library defaults", func(ctx context.Context) (float64, error) { return b.drainOutbox(ctx, n, outbox.Config{}, false) }},
		{"River tuned", func(ctx context.Context) (float64, error) { return b.drainRiver(ctx, n) }},
		{"raw claim+ack loop", func(ctx context.Context) (float64, error) { return b.drainRaw(ctx, n, false) }},
		{"outbox, SynchronousCommit", func(ctx context.Context) (float64, error) {
			return b.drainOutbox(ctx, n, outbox.Config{SynchronousCommit: true}, false)
		}},
		{"outbox, DeleteOnDelivery", func(ctx context.Context) (float64, error) { return b.drainOutbox(ctx, n, outbox.Config{}, true) }},
		{"outbox, DeleteOnDelivery + SynchronousCommit", func(ctx context.Context) (float64, error) {
			return b.drainOutbox(ctx, n, outbox.Config{SynchronousCommit: true}, true)
		}},
		{"raw claim+ack loop with the ledger row", func(ctx context.Context) (float64, error) { return b.drainRaw(ctx, n, true) }},
	}
	runs, err := alternate(ctx, b, "dispatch", sides)
	if err != nil {
		return err
	}
	lib, riv, raw, sync := series(runs[0]), series(runs[1]), series(runs[2]), series(runs[3])
	del, delSync, rawLedger := series(runs[4]), series(runs[5]), series(runs[6])
	measure := fmt.Sprintf("drain %s preloaded no-op events", itoa(int64(n)))
	b.add(rateRow("dispatch", measure+", outbox library defaults", lib, riv, raw, "≥ 2× River, ≥ 1.0× raw",
		fmt.Sprintf("River tuned: FetchCooldown %v, MaxWorkers %d, a pool of %d connections; the outbox: zero DispatcherConfig, pgx's default pool; "+
			"raw: claim %d + ack by id array on %d connections, synchronous commits. Each drain starts from emptied tables, a COPY preload, VACUUM (ANALYZE) and CHECKPOINT.",
			b.opts.riverCooldown, b.opts.riverWorkers, b.opts.riverConns, b.opts.rawBatch, b.opts.rawWorkers)))
	b.add(rateRow("dispatch", measure+", outbox Config.SynchronousCommit", sync, riv, raw, "≥ 1.5× River", ""))
	b.add(rateRow("dispatch", measure+", outbox Publisher.DeleteOnDelivery", del, riv, raw, "≥ 2× River, ≥ 1.0× raw",
		"DeleteOnDelivery (opt-in, not the default): each event is deleted in the write that records its delivery; its ledger row stays."))
	b.add(rateRow("dispatch", measure+", outbox DeleteOnDelivery + SynchronousCommit", delSync, riv, raw, "≥ 1.5× River", ""))
	b.add(rateRow("dispatch", measure+", outbox library defaults against the raw loop with the ledger row", lib, riv, rawLedger, "-",
		"The raw loop's ack also appends the attempts-ledger row the library appends for each delivery (same columns, in the same statement): the two write the same rows, so this ratio is the library's machinery (commit modes aside: the raw loop commits synchronously, the library's claims and outcome writes asynchronously by default), and the one above with the bare raw loop includes the ledger's cost."))
	return nil
}
