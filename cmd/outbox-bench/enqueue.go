package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// rawInsertSQL inserts one event with the columns the library's enqueue
// writes, without ON CONFLICT, duplicate lookup or NOTIFY.
func rawInsertSQL(table string) string {
	return `INSERT INTO ` + table + ` (` + strings.Join(insertColumns, ", ") + `)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8)`
}

// enqueueLoop runs producers goroutines, each committing one transaction
// after another until dur has passed, and returns the committed
// transactions per second. write adds the event seq to tx.
func (b *bench) enqueueLoop(ctx context.Context, producers int, dur time.Duration,
	write func(ctx context.Context, tx pgx.Tx, seq int64) error) (float64, error) {
	if err := b.t.truncate(ctx); err != nil {
		return 0, err
	}
	if err := b.t.settle(ctx); err != nil {
		return 0, err
	}
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: int32(producers), warm: producers})
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

// enqueueVariant is one way of writing an event in a producer's
// transaction.
type enqueueVariant struct {
	name  string
	write func(ctx context.Context, tx pgx.Tx, seq int64) error
}

// enqueueVariants measures each variant in -rounds rounds, running all of
// them in the order given in each round, and returns each one's rate per
// round.
func (b *bench) enqueueVariants(ctx context.Context, producers int, dur time.Duration, variants []enqueueVariant) ([]series, error) {
	sides := make([]side[float64], len(variants))
	for i, v := range variants {
		sides[i] = side[float64]{v.name, func(ctx context.Context, _ int) (float64, error) {
			rate, err := b.enqueueLoop(ctx, producers, dur, v.write)
			if err == nil {
				b.log.Info("enqueue: "+v.name+" done", "producers", producers, "events_per_s", int(rate))
			}
			return rate, err
		}}
	}
	runs, err := alternate(ctx, b, "enqueue", b.opts.rounds, sides)
	if err != nil {
		return nil, err
	}
	return toSeries(runs), nil
}

// toSeries turns alternate's results of plain figures into series.
func toSeries(runs [][]float64) []series {
	out := make([]series, len(runs))
	for i, r := range runs {
		out[i] = r
	}
	return out
}

// runEnqueue is the enqueue workload: one event per transaction from
// concurrent producers, the library's Client.Enqueue against a plain INSERT
// of the same row in the same transaction shape (BEGIN; INSERT; COMMIT),
// and Enqueue with Config.DisableNotify, round after round.
func (b *bench) runEnqueue(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	producers, dur := b.opts.producers, b.opts.duration
	insert := rawInsertSQL(b.t.table.Sanitize())
	// The clients' pool only matters for enqueues through a pool; these
	// run in the producers' transactions.
	lib, err := b.newClient(b.t.admin, outbox.Config{})
	if err != nil {
		return err
	}
	quiet, err := b.newClient(b.t.admin, outbox.Config{DisableNotify: true})
	if err != nil {
		return err
	}
	variants := []enqueueVariant{
		{"Client.Enqueue", func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := lib.Enqueue(ctx, tx, b.src.message("enqueue", seq))
			return err
		}},
		{"plain INSERT", func(ctx context.Context, tx pgx.Tx, seq int64) error {
			v, err := rawValues(b.src.message("enqueue-raw", seq))
			if err == nil {
				_, err = tx.Exec(ctx, insert, v...)
			}
			return err
		}},
		{"Enqueue without NOTIFY", func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := quiet.Enqueue(ctx, tx, b.src.message("enqueue-quiet", seq))
			return err
		}},
		{"Client.Enqueue without a dedupe key", func(ctx context.Context, tx pgx.Tx, seq int64) error {
			m := b.src.message("enqueue-keyless", seq)
			m.DedupeKey = nil
			_, err := lib.Enqueue(ctx, tx, m)
			return err
		}},
		{"plain INSERT without a dedupe key", func(ctx context.Context, tx pgx.Tx, seq int64) error {
			v, err := rawValues(b.src.message("enqueue-raw-keyless", seq))
			if err == nil {
				v[4] = nil // dedupe_key
				_, err = tx.Exec(ctx, insert, v...)
			}
			return err
		}},
	}
	rates, err := b.enqueueVariants(ctx, producers, dur, variants)
	if err != nil {
		return err
	}
	measure := fmt.Sprintf("1 event/tx, %d producers, %v per round", producers, dur)
	r := roundsRow("enqueue", measure, rates[0], rates[1], 0.9)
	r.Note = "Baseline: the same row (same columns, dedupe key and tenant) by a plain INSERT in the same BEGIN; INSERT; COMMIT. " +
		"The library sends NOTIFY at most once per Config.NotifyInterval (default " + notifyIntervalDefault + ") per client, inside the enqueue statement." +
		roundsNote(rates[0], rates[1])
	b.add(r)
	b.add(roundsRow("enqueue", "same, Config.DisableNotify", rates[2], rates[1], 0))
	r = roundsRow("enqueue", "same, messages without a dedupe key", rates[3], rates[4], 0)
	r.Note = "Baseline: the same row without a dedupe key by a plain INSERT. The library inserts such an event without ON CONFLICT (only its fresh id is unique)." +
		roundsNote(rates[3], rates[4])
	b.add(r)
	return nil
}

// bulkLoad writes total events in batches of batch, each batch in its own
// transaction, from producers goroutines, and returns events per second.
// The messages are built before the clock starts.
func (b *bench) bulkLoad(ctx context.Context, run string, producers, total, batch int,
	write func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error) (float64, error) {
	if err := b.t.truncate(ctx); err != nil {
		return 0, err
	}
	if err := b.t.settle(ctx); err != nil {
		return 0, err
	}
	batches := make(chan []outbox.Message, total/batch+1)
	for start := 0; start < total; start += batch {
		msgs := make([]outbox.Message, 0, batch)
		for i := start; i < min(total, start+batch); i++ {
			msgs = append(msgs, b.src.message(run, int64(i)))
		}
		batches <- msgs
	}
	close(batches)
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: int32(producers), warm: producers})
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	errs := make([]error, producers)
	var wg sync.WaitGroup
	start := time.Now()
	for p := range producers {
		wg.Go(func() {
			for msgs := range batches {
				if errs[p] = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return write(ctx, tx, msgs) }); errs[p] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	return float64(total) / elapsed.Seconds(), nil
}

// bulkVariant is one way of writing a batch of events.
type bulkVariant struct {
	name  string
	write func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error
}

// bulkVariants loads -bulk-events events with each variant in -rounds
// rounds, running all of them in the order given in each round, and
// returns each one's rate per round.
func (b *bench) bulkVariants(ctx context.Context, producers int, variants []bulkVariant) ([]series, error) {
	total, batch := b.opts.bulkEvents, b.opts.bulkBatch
	sides := make([]side[float64], len(variants))
	for i, v := range variants {
		sides[i] = side[float64]{fmt.Sprintf("%s, %d producer(s), %s events in batches of %d", v.name, producers, itoa(int64(total)), batch),
			func(ctx context.Context, round int) (float64, error) {
				rate, err := b.bulkLoad(ctx, fmt.Sprintf("bulk-%d-%d-%d", producers, i, round), producers, total, batch, v.write)
				if err == nil {
					b.log.Info("bulk: "+v.name+" done", "producers", producers, "events_per_s", int(rate))
				}
				return rate, err
			}}
	}
	runs, err := alternate(ctx, b, "bulk", b.opts.rounds, sides)
	if err != nil {
		return nil, err
	}
	return toSeries(runs), nil
}

// copyBaseline is the bulk baseline: the same rows as EnqueueBatch would
// write, loaded with pgx CopyFrom in tx.
func (b *bench) copyBaseline(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
	rows := make([][]any, len(msgs))
	for i, m := range msgs {
		v, err := rawValues(m)
		if err != nil {
			return err
		}
		rows[i] = v
	}
	_, err := tx.CopyFrom(ctx, b.t.table, insertColumns, pgx.CopyFromRows(rows))
	return err
}

// runBulk is the bulk enqueue workload: Client.EnqueueBatch of batches
// with dedupe keys against COPY of the same rows, with one and with two
// producers, round after round.
func (b *bench) runBulk(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	total, batch := b.opts.bulkEvents, b.opts.bulkBatch
	client, err := b.newClient(b.t.admin, outbox.Config{})
	if err != nil {
		return err
	}
	lib := func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
		res, err := client.EnqueueBatch(ctx, tx, msgs)
		if err == nil && len(res) != len(msgs) {
			err = fmt.Errorf("EnqueueBatch returned %d results for %d messages", len(res), len(msgs))
		}
		return err
	}
	// The other fast path a producer role may use: the enqueue_many
	// function with arrays (what EnqueueBatch sends for batches under 64
	// rows, or when COPY meets an existing dedupe key).
	fnSQL := "SELECT count(*) FROM " + pgx.Identifier{b.t.schema}.Sanitize() +
		".modkit_outbox_enqueue_many($1::uuid[], $2::text[], $3::text[], $4::uuid[], $5::text[], $6::jsonb[], NULL, NULL, NULL)"
	fn := func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
		n := len(msgs)
		ids, tenants := make([]pgtype.UUID, n), make([]pgtype.UUID, n)
		ns, tp, keys, payloads := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		for i, m := range msgs {
			id, err := uuid.NewV7()
			if err != nil {
				return err
			}
			ids[i], tenants[i] = pgtype.UUID{Bytes: id, Valid: true}, pgtype.UUID{Bytes: *m.TenantID, Valid: true}
			ns[i], tp[i], keys[i], payloads[i] = m.Namespace, m.Topic, *m.DedupeKey, string(m.Payload)
		}
		_, err := tx.Exec(ctx, fnSQL, ids, ns, tp, tenants, keys, payloads)
		return err
	}
	// What EnqueueBatch adds around its COPY, measured apart: the savepoint
	// that lets it fall back when a dedupe key exists (two round trips and
	// a subtransaction) and the NOTIFY (one round trip, and the notification
	// queue at commit).
	copyIn := func(notify bool) func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
		return func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if err := b.copyBaseline(ctx, sp, msgs); err != nil {
				_ = sp.Rollback(ctx)
				return err
			}
			if err := sp.Commit(ctx); err != nil {
				return err
			}
			if notify {
				_, err = tx.Exec(ctx, "SELECT pg_notify($1, $2)", outboxpg.NotifyChannel(b.t.schema), benchTopic.Namespace+":"+benchTopic.Topic)
			}
			return err
		}
	}
	for _, producers := range []int{1, 2} {
		variants := []bulkVariant{{"EnqueueBatch", lib}, {"COPY", b.copyBaseline}}
		if producers == 1 {
			variants = append(variants, bulkVariant{"enqueue_many function", fn},
				bulkVariant{"COPY in a savepoint", copyIn(false)}, bulkVariant{"COPY in a savepoint, then NOTIFY", copyIn(true)})
		}
		rates, err := b.bulkVariants(ctx, producers, variants)
		if err != nil {
			return err
		}
		minRatio := 0.0
		if producers == 1 {
			minRatio = 1 // the performance issue's target: at least COPY's rate
		}
		r := roundsRow("bulk enqueue", fmt.Sprintf("batches of %d with dedupe keys, %d producer(s), %s events", batch, producers, itoa(int64(total))),
			rates[0], rates[1], minRatio)
		if producers == 1 {
			r.Note = "Baseline: pgx CopyFrom of the same rows (same columns, ids generated the same way) into the same table, one transaction per batch." +
				roundsNote(rates[0], rates[1])
		}
		b.add(r)
		if producers == 1 {
			r := roundsRow("bulk enqueue", "same, the enqueue_many function instead of COPY", rates[2], rates[1], 0)
			r.Note = "The two bulk paths a producer role may use: COPY (it may INSERT the message columns only, and the table's checks hold) " +
				"and the SECURITY DEFINER function with arrays, which also finds duplicates without letting the producer read the table." +
				roundsNote(rates[2], rates[1])
			b.add(r)
			for i, what := range []string{"COPY in a savepoint (EnqueueBatch's, for its fallback)", "COPY in a savepoint, then NOTIFY (what EnqueueBatch sends)"} {
				r := roundsRow("bulk enqueue", "same, "+what+", against COPY", rates[3+i], rates[1], 0)
				r.Note = "Attributes EnqueueBatch's distance from COPY: the rest is its own work (validation, ids, encoding)." +
					roundsNote(rates[3+i], rates[1])
				b.add(r)
			}
		}
	}
	return nil
}
