package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// The experiments workload (-only=experiments, not part of the default
// run) measures changes one might make to the library, as raw-SQL variants
// of the baseline and as the real dispatcher under other session settings,
// each against the unchanged form in the same run. Use a smaller -events
// (50000 drains in seconds even with the slow variants).

// topicPredicate is the claim's topic filter in modkit/outbox's SQL.
const topicPredicate = `AND (namespace || ':' || topic) = ANY($2::text[])`

// claimVariant rewrites the topic filter of the baseline claim.
func claimVariant(table, predicate string) (string, error) {
	sql := rawClaimSQL(table)
	if !strings.Contains(sql, topicPredicate) {
		return "", fmt.Errorf("claim statement has no %q", topicPredicate)
	}
	return strings.Replace(sql, topicPredicate, predicate, 1), nil
}

// rawExperiment is one variant of the raw claim+ack loop.
type rawExperiment struct {
	name     string
	before   string // DDL run before the table is prepared
	after    string // DDL run after the drain
	loop     rawLoop
	explain  bool // print the custom plan of the claim
	settings map[string]string
}

func (b *bench) runExperiments(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	n, table := b.opts.events, b.t.table.Sanitize()
	if err := b.prepareDrain(ctx, "experiments", 0, n); err != nil {
		return err
	}
	_, completeSQL, err := b.librarySQL(ctx)
	if err != nil {
		return err
	}
	custom := map[string]string{"plan_cache_mode": "force_custom_plan"}
	asyncCommit := map[string]string{"synchronous_commit": "off"}
	base := b.baselineLoop()
	with := func(f func(l *rawLoop)) rawLoop {
		l := base
		f(&l)
		return l
	}
	splitPart, err := claimVariant(table, `AND (namespace, topic) IN (SELECT split_part(k, ':', 1), split_part(k, ':', 2) FROM unnest($2::text[]) AS k)`)
	if err != nil {
		return err
	}
	// A statement can make its own implicit transaction commit
	// asynchronously: set_config(…, true) lasts until that commit.
	asyncClaim := strings.Replace(base.claim, "FROM due WHERE e.id = due.id",
		"FROM due, (SELECT set_config('synchronous_commit', 'off', true)) AS async WHERE e.id = due.id", 1)
	asyncAck := strings.Replace(base.ack, "WHERE id = ANY($1)",
		"FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async WHERE id = ANY($1)", 1)
	if asyncClaim == base.claim || asyncAck == base.ack {
		return fmt.Errorf("experiments: cannot rewrite the claim or ack for asynchronous commit")
	}
	stats := pgx.Identifier{b.t.schema, "outbox_bench_topic_stats"}.Sanitize()
	experiments := []rawExperiment{
		{name: "baseline: library claim, ack by id", loop: base, explain: true},
		{name: "plan_cache_mode=force_custom_plan (a custom plan per claim, as with QueryExecModeExec or PgBouncer)",
			loop: with(func(l *rawLoop) { l.settings = custom }), explain: true, settings: custom},
		{name: "same + CREATE STATISTICS on (namespace || ':' || topic)",
			before: "CREATE STATISTICS " + stats + " ON ((namespace || ':' || topic)) FROM " + table, after: "DROP STATISTICS " + stats,
			loop: with(func(l *rawLoop) { l.settings = custom }), explain: true, settings: custom},
		{name: "same, topic filter as (namespace, topic) IN (… unnest($2) …), no statistics",
			loop: with(func(l *rawLoop) { l.settings, l.claim = custom, splitPart }), explain: true, settings: custom},
		{name: "synchronous_commit=off on the loop's connections", loop: with(func(l *rawLoop) { l.settings = asyncCommit })},
		{name: "claim and ack commit asynchronously by set_config('synchronous_commit', 'off', true) inside the statement",
			loop: with(func(l *rawLoop) { l.claim, l.ack = asyncClaim, asyncAck })},
		{name: "ack with the library's fenced outcome statement", loop: with(func(l *rawLoop) {
			l.ack = completeSQL
			l.ackArgs = func(worker pgtype.UUID, ids, tokens []pgtype.UUID) []any {
				outcomes, errs, delays := make([]string, len(ids)), make([]*string, len(ids)), make([]int64, len(ids))
				for i := range outcomes {
					outcomes[i] = string(outbox.StatusDelivered)
				}
				return []any{worker, ids, tokens, outcomes, errs, delays}
			}
		})},
		{name: "batch 100", loop: with(func(l *rawLoop) { l.batch = 100 })},
		{name: "batch 1000", loop: with(func(l *rawLoop) { l.batch = 1000 })},
		{name: "1 worker", loop: with(func(l *rawLoop) { l.workers = 1 })},
		{name: "4 workers", loop: with(func(l *rawLoop) { l.workers = 4 })},
	}
	// Rounds go through all variants in turn, so that drift (autovacuum,
	// checkpoints, a noisy neighbour) spreads over all of them.
	sides := make([]side[drainResult], len(experiments))
	for i, e := range experiments {
		sides[i] = side[drainResult]{e.name, func(ctx context.Context, round int) (drainResult, error) {
			return b.rawExperiment(ctx, e, n, round == 0)
		}}
	}
	results, err := alternate(ctx, b, "experiments", b.opts.rounds, sides)
	if err != nil {
		return err
	}
	baseline := mapSeries(results[0], drainRate)
	for i, e := range experiments {
		rates := mapSeries(results[i], drainRate)
		r := roundsRow("experiment: raw drain", e.name, rates, baseline, 0)
		r.Note = strings.TrimSpace(roundsNote(rates, baseline))
		b.add(r)
	}
	if err := b.dispatcherExperiments(ctx, n); err != nil {
		return err
	}
	if err := b.enqueueExperiments(ctx); err != nil {
		return err
	}
	return b.bulkExperiments(ctx)
}

// rawExperiment prepares the table for e, drains it with e's loop and
// undoes e's DDL.
func (b *bench) rawExperiment(ctx context.Context, e rawExperiment, n int, explain bool) (drainResult, error) {
	if e.before != "" {
		if _, err := b.t.admin.Exec(ctx, e.before); err != nil {
			return drainResult{}, err
		}
	}
	if err := b.prepareDrain(ctx, "experiments", 0, n); err != nil {
		return drainResult{}, err
	}
	if e.explain && explain {
		if err := b.explainCustomClaim(ctx, e.name, e.loop.claim, e.settings); err != nil {
			return drainResult{}, err
		}
	}
	b.log.Info("experiment: "+e.name, "events", n)
	res, err := b.drainRaw(ctx, n, e.loop)
	if err != nil {
		return drainResult{}, err
	}
	if e.after != "" {
		if _, err := b.t.admin.Exec(ctx, e.after); err != nil {
			return drainResult{}, err
		}
	}
	b.log.Info("experiment: "+e.name+" done", "events_per_s", int(res.rate()))
	return res, nil
}

// explainCustomClaim prints the plan a session with settings gets for
// claim, and its generic plan unless settings fix the plan cache mode, in
// a transaction that is rolled back.
func (b *bench) explainCustomClaim(ctx context.Context, name, claim string, settings map[string]string) error {
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: 1, settings: settings})
	if err != nil {
		return err
	}
	defer pool.Close()
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	title := fmt.Sprintf("experiment %q: claim, batch %d, custom plan", name, b.opts.batch)
	if err := printExplain(ctx, tx, title, claim, b.claimParams(b.opts.batch, uuid.New())...); err != nil {
		return err
	}
	if settings["plan_cache_mode"] == "" {
		return b.explainGenericClaim(ctx, tx, fmt.Sprintf("experiment %q", name), claim, false)
	}
	return nil
}

// dispatcherExperiments drains with the real dispatcher under session
// settings a user could give its pool, and measures latency with them.
func (b *bench) dispatcherExperiments(ctx context.Context, n int) error {
	variants := []struct {
		name     string
		settings map[string]string
	}{
		{"dispatcher, default session settings", nil},
		{"dispatcher, synchronous_commit=off on its pool", map[string]string{"synchronous_commit": "off"}},
		{"dispatcher, plan_cache_mode=force_custom_plan on its pool", map[string]string{"plan_cache_mode": "force_custom_plan"}},
	}
	sides := make([]side[drainResult], len(variants))
	for i, v := range variants {
		sides[i] = side[drainResult]{v.name, func(ctx context.Context, _ int) (drainResult, error) {
			if err := b.prepareDrain(ctx, "experiments", 0, n); err != nil {
				return drainResult{}, err
			}
			res, err := b.drainDispatcher(ctx, n, b.opts.batch, b.opts.concurrency, v.settings)
			if err == nil {
				b.log.Info("experiment: "+v.name+" done", "events_per_s", int(res.rate()))
			}
			return res, err
		}}
	}
	results, err := alternate(ctx, b, "experiments", b.opts.rounds, sides)
	if err != nil {
		return err
	}
	baseline := mapSeries(results[0], drainRate)
	for i, v := range variants {
		rates := mapSeries(results[i], drainRate)
		r := roundsRow("experiment: dispatcher drain", v.name, rates, baseline, 0)
		r.Baseline += " (default settings)"
		r.Note = strings.TrimSpace(roundsNote(rates, baseline))
		b.add(r)
	}
	async := map[string]string{"synchronous_commit": "off"}
	latencyVariants := []struct {
		name  string
		setup latencySetup
	}{
		{"dispatcher, default session settings", latencySetup{}},
		{"dispatcher, synchronous_commit=off on its pool", latencySetup{settings: async}},
		{"dispatcher, synchronous_commit=off; producers NotifyInterval 10ms", latencySetup{settings: async, notifyInterval: 10 * time.Millisecond}},
	}
	latencySides := make([]side[latencyStats], len(latencyVariants))
	for i, v := range latencyVariants {
		latencySides[i] = side[latencyStats]{"latency at 500/s, " + v.name, func(ctx context.Context, _ int) (latencyStats, error) {
			st, err := b.measureLatency(ctx, 500, b.opts.duration, v.setup)
			if err == nil {
				b.log.Info("experiment: latency, "+v.name+" done", "stats", st.String())
			}
			return st, err
		}}
	}
	latencies, err := alternate(ctx, b, "experiments", b.opts.rounds, latencySides)
	if err != nil {
		return err
	}
	for i, v := range latencyVariants {
		runs := latencyRounds(latencies[i])
		values, perRound := runs.values()
		note := fmt.Sprintf("p90 %s. Dispatcher claim statements: %s.", runs.ms(p90).withSpread(fmtMsValue, " ms"), runs.claims())
		b.add(row{Workload: "experiment: latency 500/s, NOTIFY on", Measure: v.name, Outbox: runs.String(),
			Values: values, Runs: perRound, Note: note})
	}
	return nil
}

// enqueueExperiments measures how the NOTIFY of single-event enqueues
// weighs on producers, by the producers' NotifyInterval.
func (b *bench) enqueueExperiments(ctx context.Context) error {
	insert := rawInsertSQL(b.t.table.Sanitize())
	variants := []enqueueVariant{{"plain INSERT", func(ctx context.Context, tx pgx.Tx, seq int64) error {
		v, err := rawValues(b.src.message("exp-raw", seq))
		if err == nil {
			_, err = tx.Exec(ctx, insert, v...)
		}
		return err
	}}}
	for _, cfg := range []outbox.Config{
		{}, {NotifyInterval: 10 * time.Millisecond}, {NotifyInterval: 100 * time.Millisecond}, {DisableNotify: true},
	} {
		p, err := b.newClient(b.t.admin, cfg)
		if err != nil {
			return err
		}
		name := "Enqueue, NotifyInterval " + cfg.NotifyInterval.String()
		switch {
		case cfg.DisableNotify:
			name = "Enqueue, DisableNotify"
		case cfg.NotifyInterval == 0:
			name = "Enqueue, NotifyInterval default (" + notifyIntervalDefault + ")"
		}
		run := fmt.Sprintf("exp-%d", len(variants))
		variants = append(variants, enqueueVariant{name, func(ctx context.Context, tx pgx.Tx, seq int64) error {
			_, err := p.Enqueue(ctx, tx, b.src.message(run, seq))
			return err
		}})
	}
	rates, err := b.enqueueVariants(ctx, b.opts.producers, b.opts.duration, variants)
	if err != nil {
		return err
	}
	for i, v := range variants {
		r := roundsRow(fmt.Sprintf("experiment: enqueue, %d producers", b.opts.producers), v.name, rates[i], rates[0], 0)
		r.Baseline += " (plain INSERT)"
		b.add(r)
	}
	return nil
}

// bulkExperiments splits the cost of EnqueueBatch against COPY: the
// library's statement run raw (no validation in Go, no NOTIFY), a plain
// INSERT … SELECT unnest without ON CONFLICT and RETURNING, and
// EnqueueBatch without NOTIFY.
func (b *bench) bulkExperiments(ctx context.Context) error {
	if err := b.t.truncate(ctx); err != nil {
		return err
	}
	capture := &sqlCapture{}
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: 1, tracer: capture})
	if err != nil {
		return err
	}
	// Two messages: a single one takes the one-row INSERT, and batches of
	// 64 or more through a pool try COPY first.
	client, err := b.newClient(pool, outbox.Config{})
	if err == nil {
		_, err = client.EnqueueBatch(ctx, pool, []outbox.Message{b.src.message("capture", 0), b.src.message("capture", 1)})
	}
	pool.Close()
	if err != nil {
		return err
	}
	batchSQL, err := capture.find(enqueueBatchMarker)
	if err != nil {
		return err
	}
	table := b.t.table.Sanitize()
	plainSQL := `INSERT INTO ` + table + ` (` + strings.Join(insertColumns, ", ") + `)
SELECT id, namespace, topic, tenant_id, dedupe_key, payload, 'pending', 0
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::uuid[], $5::text[], $6::jsonb[]) AS i(id, namespace, topic, tenant_id, dedupe_key, payload)`
	noReturningSQL := plainSQL + `
ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING`
	arrays := func(msgs []outbox.Message) ([]any, error) {
		n := len(msgs)
		ids, tenants := make([]pgtype.UUID, n), make([]pgtype.UUID, n)
		ns, tp, keys, payloads := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		for i, m := range msgs {
			id, err := uuid.NewV7()
			if err != nil {
				return nil, err
			}
			ids[i], tenants[i] = pgtype.UUID{Bytes: id, Valid: true}, pgtype.UUID{Bytes: *m.TenantID, Valid: true}
			ns[i], tp[i], keys[i], payloads[i] = m.Namespace, m.Topic, *m.DedupeKey, string(m.Payload)
		}
		return []any{ids, ns, tp, tenants, keys, payloads}, nil
	}
	lib, err := b.newClient(b.t.admin, outbox.Config{})
	if err != nil {
		return err
	}
	quiet, err := b.newClient(b.t.admin, outbox.Config{DisableNotify: true})
	if err != nil {
		return err
	}
	variants := []bulkVariant{
		{"COPY (the baseline)", b.copyBaseline},
		{"EnqueueBatch", func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
			_, err := lib.EnqueueBatch(ctx, tx, msgs)
			return err
		}},
		{"EnqueueBatch, DisableNotify", func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
			_, err := quiet.EnqueueBatch(ctx, tx, msgs)
			return err
		}},
		{"the library's batch INSERT run raw (ON CONFLICT, RETURNING; no Go validation, no NOTIFY)", func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
			args, err := arrays(msgs)
			if err == nil {
				// The function's other arrays: the topics to announce (none),
				// headers and ordering keys (none, one NULL per row).
				_, err = tx.Exec(ctx, batchSQL, append(args, []string(nil), make([]*string, len(msgs)), make([]*string, len(msgs)))...)
			}
			return err
		}},
		{"the same INSERT with ON CONFLICT DO NOTHING but no RETURNING (duplicates known from the row count)", func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
			args, err := arrays(msgs)
			if err != nil {
				return err
			}
			tag, err := tx.Exec(ctx, noReturningSQL, args...)
			if err == nil && tag.RowsAffected() != int64(len(msgs)) {
				err = fmt.Errorf("%d of %d rows inserted", tag.RowsAffected(), len(msgs))
			}
			return err
		}},
		{"INSERT … SELECT unnest, no ON CONFLICT, no RETURNING", func(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) error {
			args, err := arrays(msgs)
			if err == nil {
				_, err = tx.Exec(ctx, plainSQL, args...)
			}
			return err
		}},
	}
	rates, err := b.bulkVariants(ctx, 1, variants)
	if err != nil {
		return err
	}
	for i, v := range variants {
		r := roundsRow("experiment: bulk, 1 producer", v.name, rates[i], rates[0], 0)
		r.Baseline += " (COPY)"
		b.add(r)
	}
	return nil
}
