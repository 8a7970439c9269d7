package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// orderedKeys is the number of ordering keys of the ordered dispatch.
const orderedKeys = 1000

// preloadOrdered writes n pending, due events spread round-robin over keys
// ordering keys (key i%keys, sequence i/keys+1), as enqueues of interleaved
// keys would leave them.
func (t *target) preloadOrdered(ctx context.Context, src *eventSource, run string, n, keys int) error {
	// The keys' sequences first, as the enqueues would have left them: each
	// event refers to its key's stream id (migration 0008).
	seqs := pgx.Identifier{t.schema, "modkit_outbox_sequences"}.Sanitize()
	if _, err := t.admin.Exec(ctx, "TRUNCATE "+t.table.Sanitize()+", "+seqs); err != nil {
		return fmt.Errorf("preload ordered: %w", err)
	}
	names := make([]string, keys)
	last := make([]int64, keys)
	for k := range keys {
		names[k] = fmt.Sprintf("key-%05d", k)
		last[k] = int64(n / keys)
		if k < n%keys {
			last[k]++
		}
	}
	index := make(map[string]int, keys)
	for k, name := range names {
		index[name] = k
	}
	streams := make([]int64, keys)
	rows, err := t.admin.Query(ctx, "INSERT INTO "+seqs+" (namespace, topic, ordering_key, last_seq) "+
		"SELECT $1, $2, k.key, k.last FROM unnest($3::text[], $4::bigint[]) AS k(key, last) "+
		"RETURNING ordering_key, stream_id", benchTopic.Namespace, benchTopic.Topic, names, last)
	if err != nil {
		return fmt.Errorf("preload ordered: %w", err)
	}
	got := 0
	for rows.Next() {
		var name string
		var stream int64
		if err := rows.Scan(&name, &stream); err != nil {
			rows.Close()
			return fmt.Errorf("preload ordered: %w", err)
		}
		if k, ok := index[name]; ok {
			streams[k] = stream
			got++
		}
	}
	if rows.Close(); rows.Err() != nil || got != keys {
		return fmt.Errorf("preload ordered: %d stream ids for %d keys: %v", got, keys, rows.Err())
	}

	const chunk = 20000
	cols := append(insertColumns[:len(insertColumns):len(insertColumns)], "created_at", "next_attempt_at", "ordering_key", "ordering_seq", "ordering_stream", "held")
	base := time.Now().Add(-time.Minute)
	batch := make([][]any, 0, chunk)
	for start := 0; start < n; start += chunk {
		batch = batch[:0]
		for i := start; i < min(n, start+chunk); i++ {
			v, err := rawValues(src.message(run, int64(i)))
			if err != nil {
				return err
			}
			at := base.Add(time.Duration(i) * time.Microsecond)
			// As enqueues leave them: every event after a key's first is
			// held behind its predecessor.
			k := i % keys
			batch = append(batch, append(v, at, at, names[k], int64(i/keys+1), streams[k], i >= keys))
		}
		if _, err := t.admin.CopyFrom(ctx, t.table, cols, pgx.CopyFromRows(batch)); err != nil {
			return fmt.Errorf("preload ordered: %w", err)
		}
	}
	return nil
}

// drainOrdered drains n events over keys ordering keys with the dispatcher.
func (b *bench) drainOrdered(ctx context.Context, label string, n, keys int) (drainResult, error) {
	if err := b.t.truncate(ctx); err != nil {
		return drainResult{}, err
	}
	b.log.Info(label+": preloading ordered events", "events", n, "keys", keys)
	if err := b.t.preloadOrdered(ctx, b.src, label, n, keys); err != nil {
		return drainResult{}, err
	}
	if err := b.t.settle(ctx); err != nil {
		return drainResult{}, err
	}
	res, err := b.drainDispatcher(ctx, n, b.opts.batch, b.opts.concurrency, b.opts.dispatcherSettings)
	if err == nil {
		b.log.Info(label+": dispatcher drained", "events_per_s", int(res.rate()), "keys", keys, "statements", res.queries.breakdown())
	}
	return res, err
}

// runOrdering is the ordering workload (issue 12): ordered dispatch over
// 1,000 keys against unordered dispatch of as many events; one hot key
// against its bound, one claim plus one outcome write per event (a raw
// claim+ack loop of batch 1 on one connection, measured alternately); and
// Client.Enqueue with ordering keys against Client.Enqueue without.
func (b *bench) runOrdering(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	n := b.opts.events
	runs, err := alternate(ctx, b, "ordering", b.opts.rounds, []side[drainResult]{
		{fmt.Sprintf("ordered dispatch, %d keys", orderedKeys), func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainOrdered(ctx, "ordering", n, orderedKeys)
		}},
		{"unordered dispatch", func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainLibrary(ctx, "ordering-unordered", 0, n, b.opts.batch)
		}},
	})
	if err != nil {
		return err
	}
	ordered, unordered := mapSeries(runs[0], drainRate), mapSeries(runs[1], drainRate)
	r := roundsRow("ordering", fmt.Sprintf("%s events over %d ordering keys vs none, batch %d", itoa(int64(n)), orderedKeys, b.opts.batch), ordered, unordered, 0.8)
	r.Note = "Baseline: the same dispatcher draining as many events without ordering keys." + roundsNote(ordered, unordered)
	b.add(r)

	hot := min(n, 2000)
	bound := b.baselineLoop()
	bound.workers, bound.batch = 1, 1
	runs, err = alternate(ctx, b, "ordering-hot-key", b.opts.rounds, []side[drainResult]{
		{"one hot key", func(ctx context.Context, _ int) (drainResult, error) {
			return b.drainOrdered(ctx, "ordering-hot-key", hot, 1)
		}},
		{"bound: claim + outcome of one event at a time", func(ctx context.Context, _ int) (drainResult, error) {
			if err := b.prepareDrain(ctx, "ordering-bound", 0, hot); err != nil {
				return drainResult{}, err
			}
			return b.drainRaw(ctx, hot, bound)
		}},
	})
	if err != nil {
		return err
	}
	one, limit := mapSeries(runs[0], drainRate), mapSeries(runs[1], drainRate)
	r = roundsRow("ordering", fmt.Sprintf("one hot key, %s events", itoa(int64(hot))), one, limit, 0)
	r.Note = "Baseline: the key's bound, one claim plus one outcome write per event in sequence (a raw claim+ack loop of batch 1 on one connection); " +
		"the publish itself is a no-op here." + roundsNote(one, limit)
	b.add(r)

	client, err := b.newClient(b.t.admin, outbox.Config{})
	if err != nil {
		return err
	}
	keyed := func(run string, seq int64) outbox.Message {
		m := b.src.message(run, seq)
		m.OrderingKey = fmt.Sprintf("key-%05d", seq%orderedKeys)
		return m
	}
	rates, err := b.enqueueVariants(ctx, b.opts.producers, b.opts.duration, []enqueueVariant{
		{"Client.Enqueue with ordering keys", func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := client.Enqueue(ctx, tx, keyed("ordering-enqueue", seq))
			return err
		}},
		{"Client.Enqueue without", func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := client.Enqueue(ctx, tx, b.src.message("ordering-plain", seq))
			return err
		}},
	})
	if err != nil {
		return err
	}
	r = roundsRow("ordering", fmt.Sprintf("enqueue 1 event/tx over %d keys, %d producers", orderedKeys, b.opts.producers), rates[0], rates[1], 0.85)
	r.Note = "Baseline: the same enqueues without an ordering key (no sequence row to update)." + roundsNote(rates[0], rates[1])
	b.add(r)
	return nil
}
