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

	"github.com/modkit-go/modkit/modkit/outbox"
)

var rawColumns = []string{"id", "namespace", "topic", "tenant_id", "dedupe_key", "payload", "status", "attempts"}

// rawRow is m as the outbox table's columns, with a fresh time-ordered id.
func rawRow(m outbox.Message) ([]any, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return nil, err
	}
	return []any{pgtype.UUID{Bytes: id, Valid: true}, m.Namespace, m.Topic, pgtype.UUID{Bytes: *m.TenantID, Valid: true},
		*m.DedupeKey, string(m.Payload), "pending", 0}, nil
}

// enqueueLoop runs producers goroutines committing one transaction after
// another for dur, each calling write once, and returns transactions per
// second.
func (b *bench) enqueueLoop(ctx context.Context, producers int, dur time.Duration, write func(ctx context.Context, tx pgx.Tx, seq int64) error) (float64, error) {
	if err := b.env.reset(ctx); err != nil {
		return 0, err
	}
	pool, err := b.env.newPool(ctx, int32(producers), producers, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	var seq, committed atomic.Int64
	errs := make([]error, producers)
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(dur)
	for p := range producers {
		wg.Go(func() {
			for ctx.Err() == nil && time.Now().Before(deadline) {
				s := seq.Add(1)
				if errs[p] = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return write(ctx, tx, s) }); errs[p] != nil {
					return
				}
				committed.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := errors.Join(append(errs, ctx.Err())...); err != nil {
		return 0, err
	}
	return float64(committed.Load()) / elapsed.Seconds(), nil
}

// runEnqueue: one event per transaction from concurrent producers.
func (b *bench) runEnqueue(ctx context.Context) error {
	lib, err := b.newOutbox(b.env.admin, outbox.Config{NotifyInterval: b.opts.notifyInterval})
	if err != nil {
		return err
	}
	riv, err := b.newRiver(b.env.admin, nil)
	if err != nil {
		return err
	}
	insert := `INSERT INTO ` + b.env.outboxTable.Sanitize() + ` (id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8)`
	loop := func(write func(ctx context.Context, tx pgx.Tx, seq int64) error) func(context.Context) (float64, error) {
		return func(ctx context.Context) (float64, error) {
			return b.enqueueLoop(ctx, b.opts.producers, b.opts.duration, write)
		}
	}
	sides := []side[float64]{
		{"outbox Client.Enqueue", loop(func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := lib.Enqueue(ctx, tx, b.src.message("enqueue", seq))
			return err
		})},
		{"River InsertTx", loop(func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := riv.InsertTx(ctx, tx, b.src.job(seq), nil)
			return err
		})},
		{"plain INSERT", loop(func(ctx context.Context, tx pgx.Tx, seq int64) error {
			v, err := rawRow(b.src.message("enqueue-raw", seq))
			if err == nil {
				_, err = tx.Exec(ctx, insert, v...)
			}
			return err
		})},
		{"outbox Client.Enqueue without a dedupe key", loop(func(ctx context.Context, tx pgx.Tx, seq int64) error {
			m := b.src.message("enqueue-keyless", seq)
			m.DedupeKey = nil
			_, err := lib.Enqueue(ctx, tx, m)
			return err
		})},
		{"plain INSERT without a dedupe key", loop(func(ctx context.Context, tx pgx.Tx, seq int64) error {
			v, err := rawRow(b.src.message("enqueue-raw-keyless", seq))
			if err == nil {
				v[4] = nil // dedupe_key
				_, err = tx.Exec(ctx, insert, v...)
			}
			return err
		})},
		{"River InsertTx with unique options", loop(func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := riv.InsertTx(ctx, tx, b.src.job(seq), &uniqueByArgs)
			return err
		})},
	}
	runs, err := alternate(ctx, b, "enqueue", sides)
	if err != nil {
		return err
	}
	b.add(rateRow("enqueue", fmt.Sprintf("1 event/tx, %d producers, %v per round", b.opts.producers, b.opts.duration),
		runs[0], runs[1], runs[2], "≥ 1.2× River",
		"Outbox: Client.Enqueue with a tenant and dedupe key (a plain INSERT of the message columns, the enqueue function only for a duplicate; "+b.notifyNote()+"); "+
			"River: InsertTx of the same payload, no unique options; raw: a plain INSERT of the outbox row. Each in BEGIN; …; COMMIT."))
	b.add(rateRow("enqueue", "same, outbox messages without a dedupe key", runs[3], runs[1], runs[4], "",
		"Like for like with River's InsertTx without unique options: the outbox message has no dedupe key (the library inserts it without ON CONFLICT), "+
			"and raw is a plain INSERT of the outbox row without one."))
	b.add(rateRow("enqueue", "same, both deduplicating", runs[0], runs[5], runs[2], "",
		"Like for like with a dedupe key: the outbox message has its tenant and dedupe key (as in the first row), "+
			"River's InsertTx has UniqueOpts{ByArgs: true} (a unique key from the job's kind and args, ON CONFLICT on River's unique index); "+
			"raw is the plain INSERT of the first row."))
	return nil
}

// uniqueByArgs makes River refuse a second job of the same kind and args
// (in any state but cancelled and discarded, River's default), as a dedupe
// key makes the outbox refuse a second event.
var uniqueByArgs = river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}

// bulkLoad writes total events in batches of batch, one transaction per
// batch, from one producer, and returns events per second; write builds
// each batch inside the timed loop, for every side alike (unlike
// cmd/outbox-bench, which builds its messages before timing).
func (b *bench) bulkLoad(ctx context.Context, total, batch int, write func(ctx context.Context, tx pgx.Tx, first, n int) error) (float64, error) {
	if err := b.env.reset(ctx); err != nil {
		return 0, err
	}
	start := time.Now()
	for first := 0; first < total; first += batch {
		n := min(batch, total-first)
		if err := pgx.BeginFunc(ctx, b.env.admin, func(tx pgx.Tx) error { return write(ctx, tx, first, n) }); err != nil {
			return 0, err
		}
	}
	return float64(total) / time.Since(start).Seconds(), nil
}

// runBulk: batches of -bulk-batch from one producer.
func (b *bench) runBulk(ctx context.Context) error {
	lib, err := b.newOutbox(b.env.admin, outbox.Config{})
	if err != nil {
		return err
	}
	riv, err := b.newRiver(b.env.admin, nil)
	if err != nil {
		return err
	}
	total, batch := b.opts.bulkEvents, b.opts.bulkBatch
	var round atomic.Int64
	// Inputs are built per batch inside the timed loop for all three sides
	// alike: River's params, the outbox's messages, COPY's rows.
	sides := []side[float64]{
		{"outbox EnqueueBatch", func(ctx context.Context) (float64, error) {
			run := fmt.Sprintf("bulk-%d", round.Add(1))
			return b.bulkLoad(ctx, total, batch, func(ctx context.Context, tx pgx.Tx, first, n int) error {
				msgs := make([]outbox.Message, n)
				for i := range msgs {
					msgs[i] = b.src.message(run, int64(first+i))
				}
				res, err := lib.EnqueueBatch(ctx, tx, msgs)
				if err == nil && len(res) != n {
					err = fmt.Errorf("EnqueueBatch returned %d results for %d", len(res), n)
				}
				return err
			})
		}},
		{"River InsertManyFastTx", func(ctx context.Context) (float64, error) {
			return b.bulkLoad(ctx, total, batch, func(ctx context.Context, tx pgx.Tx, first, n int) error {
				params := make([]river.InsertManyParams, n)
				for i := range params {
					params[i] = river.InsertManyParams{Args: b.src.job(int64(first + i))}
				}
				_, err := riv.InsertManyFastTx(ctx, tx, params)
				return err
			})
		}},
		{"COPY", func(ctx context.Context) (float64, error) {
			run := fmt.Sprintf("copy-%d", round.Add(1))
			return b.bulkLoad(ctx, total, batch, func(ctx context.Context, tx pgx.Tx, first, n int) error {
				rows := make([][]any, n)
				for i := range rows {
					v, err := rawRow(b.src.message(run, int64(first+i)))
					if err != nil {
						return err
					}
					rows[i] = v
				}
				_, err := tx.CopyFrom(ctx, b.env.outboxTable, rawColumns, pgx.CopyFromRows(rows))
				return err
			})
		}},
	}
	runs, err := alternate(ctx, b, "bulk", sides)
	if err != nil {
		return err
	}
	b.add(rateRow("bulk enqueue", fmt.Sprintf("batches of %d, 1 producer, %s events", batch, itoa(int64(total))),
		runs[0], runs[1], runs[2], "≥ 1.0× COPY",
		"Outbox: EnqueueBatch with tenant and dedupe keys; River: InsertManyFastTx (COPY), no unique options; raw: pgx CopyFrom of the outbox rows. One transaction per batch."))
	return nil
}
