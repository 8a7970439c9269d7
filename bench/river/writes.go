package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// The writes workload sizes the "fewer writes per event" options of issue
// 16 without touching the library's migrations: every option is a table
// design built in a scratch schema, loaded with the same events, drained
// by a raw claim+ack loop (claim 500, 2 connections, each delivery also
// appending an attempts-ledger row, as the library's function path does),
// then cleaned up the way that design would (retention purge, VACUUM, or
// TRUNCATE). For each phase it reports the WAL written (pg_current_wal_lsn
// delta) and the transactions committed (pg_stat_database.xact_commit
// delta) per event, next to today's library on its own tables. One
// CHECKPOINT precedes each variant's insert phase, so full-page images are
// (almost) absent: these are the lower bounds a design can reach between
// checkpoints; a real server adds a full-page image for the first change
// of each page after every checkpoint.

const scratch = "scratch"

// writeVariant is one table design.
type writeVariant struct {
	name  string
	ddl   []string // run in a fresh scratch schema; {{t}} is the events table
	table string   // the events table ("scratch.events")
	// claim takes ($1 namespace, $2 topic, $3 limit, $4 worker[, $5
	// created_at, $6 id keyset hint]) and returns id, created_at.
	claim  string
	keyset bool
	ack    string // ($1 ids, $2 worker); appends the ledger rows too
	clean  []string
	// repeatClean statements run until they affect no row.
	repeatClean string
	library     bool // today's library on its own tables instead
	// deleteOnDelivery: the library with Publisher.DeleteOnDelivery.
	deleteOnDelivery bool
}

// phase is what one phase of a variant cost.
type phase struct {
	wal, commits int64
	took         time.Duration
}

type writeRun struct {
	insert, deliver, clean phase
	hotShare               float64 // of the events table's updates, HOT
}

const ledgerDDL = `CREATE TABLE scratch.ledger (
	event_id uuid NOT NULL, attempt_no int NOT NULL, namespace text NOT NULL, topic text NOT NULL,
	outcome text NOT NULL, attempt int NULL, worker uuid NULL, lease_token uuid NULL,
	claimed_at timestamptz NULL, finished_at timestamptz NOT NULL, detail text NULL, actor text NULL,
	PRIMARY KEY (event_id, attempt_no)) WITH (fillfactor = 100)`

const eventsLike = `(LIKE outbox.modkit_outbox_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`
const eventsOpts = `WITH (fillfactor = 85, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05)`

func writeClaim(table string, keyset bool) string {
	return writeClaimWhere(table, "status IN ('pending', 'processing')", keyset)
}

// writeClaimWhere is writeClaim whose rows are those matching live, the
// predicate of the design's claim index.
func writeClaimWhere(table, live string, keyset bool) string {
	hint := ""
	if keyset {
		hint = "\n\t  AND (created_at, id) > ($5::timestamptz, $6::uuid)"
	}
	return `WITH due AS (
	SELECT id FROM ` + table + `
	WHERE ` + live + `
	  AND ((status = 'pending' AND next_attempt_at <= now()) OR (status = 'processing' AND locked_until < now()))
	  AND attempts < 25 AND namespace = $1 AND topic = $2` + hint + `
	ORDER BY created_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED)
UPDATE ` + table + ` AS e SET status = 'processing', attempts = e.attempts + 1, locked_by = $4,
	locked_until = now() + interval '30 seconds', lease_token = gen_random_uuid(), claimed_at = now(), updated_at = now()
FROM due WHERE e.id = due.id
RETURNING e.id, e.created_at`
}

// ledgerInsert appends a delivered row per row of CTE d.
const ledgerInsert = `INSERT INTO scratch.ledger (event_id, attempt_no, namespace, topic, outcome, attempt, worker, claimed_at, finished_at)
SELECT id, ledger_seq, namespace, topic, 'delivered', attempts, $2::uuid, claimed_at, now() FROM d`

func ackInPlace(table string) string {
	return `WITH d AS (UPDATE ` + table + ` SET status = 'delivered', locked_by = NULL, locked_until = NULL, lease_token = NULL,
	ledger_seq = ledger_seq + 1, updated_at = now()
	WHERE id = ANY($1) RETURNING id, ledger_seq, namespace, topic, attempts, claimed_at)
` + ledgerInsert
}

// liveDDL is design H's table: the claim index's predicate reads a stored
// generated column that a claim (pending -> processing) leaves unchanged,
// so that no index refers to a column a claim changes and the claim's
// update can be HOT; the outcome (live -> not live) cannot be.
func liveDDL(opts string) []string {
	return []string{
		`CREATE TABLE scratch.events ` + eventsLike + ` ` + opts,
		`ALTER TABLE scratch.events ADD COLUMN live boolean GENERATED ALWAYS AS (status IN ('pending', 'processing')) STORED`,
		`ALTER TABLE scratch.events ADD PRIMARY KEY (id)`,
		`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
		`CREATE INDEX ON scratch.events (created_at, id) WHERE live`,
	}
}

func (b *bench) writeVariants() []writeVariant {
	const t = "scratch.events"
	// The index set of the outbox's tables before migration 0007, which
	// dropped (status, next_attempt_at) and locked_until (and 0014 the
	// status-partial claim index): the starting point the variants below
	// are measured from, not today's tables (the first two rows are).
	before0007 := []string{
		`CREATE TABLE scratch.events ` + eventsLike + ` ` + eventsOpts,
		`ALTER TABLE scratch.events ADD PRIMARY KEY (id)`,
		`CREATE INDEX ON scratch.events (status, next_attempt_at)`,
		`CREATE INDEX ON scratch.events (locked_until) WHERE locked_until IS NOT NULL`,
		`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
		`CREATE INDEX ON scratch.events (created_at, id) WHERE status IN ('pending', 'processing')`,
	}
	lean := []string{
		`CREATE TABLE scratch.events ` + eventsLike + ` ` + eventsOpts,
		`ALTER TABLE scratch.events ADD PRIMARY KEY (id)`,
		`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
		`CREATE INDEX ON scratch.events (created_at, id) WHERE status IN ('pending', 'processing')`,
		// Dead rows still need a listing for operators: a partial index that
		// holds only them stays empty on the hot path.
		`CREATE INDEX ON scratch.events (updated_at) WHERE status = 'dead'`,
	}
	purge := `DELETE FROM scratch.events WHERE id IN (SELECT id FROM scratch.events WHERE status = 'delivered' LIMIT 10000)`
	vacuum := []string{"VACUUM scratch.events", "VACUUM scratch.ledger"}
	// The library's own clean-up: its maintenance purge, then VACUUM.
	libraryPurge := `SELECT ` + pgx.Identifier{outboxSchema}.Sanitize() + `.modkit_outbox_purge(ARRAY['bench:events'], interval '0', 10000)`
	libraryVacuum := []string{"VACUUM outbox.modkit_outbox_events", "VACUUM outbox.modkit_outbox_attempts"}
	return []writeVariant{
		{name: "today's library: function path, attempts ledger, its migrations' indexes (outbox tables)", library: true,
			repeatClean: libraryPurge, clean: libraryVacuum},
		{name: "L. today's library with Publisher.DeleteOnDelivery: the delivery deletes the event (outbox tables)", library: true,
			deleteOnDelivery: true, repeatClean: libraryPurge, clean: libraryVacuum},
		{name: "A. the 5 indexes before migration 0007, raw claim+ack, ledger row, purge by DELETE + VACUUM", ddl: before0007, table: t,
			claim: writeClaim(t, false), ack: ackInPlace(t), repeatClean: purge, clean: vacuum},
		{name: "B. index set: pk, dedupe, claim (+ empty dead-rows partial); drop (status, next_attempt_at) and locked_until", ddl: lean, table: t,
			claim: writeClaim(t, false), ack: ackInPlace(t), repeatClean: purge, clean: vacuum},
		{name: "C. HOT-friendly: pk, dedupe, claim index (created_at, id) without a status predicate + keyset hint", table: t,
			ddl: []string{
				`CREATE TABLE scratch.events ` + eventsLike + ` ` + eventsOpts,
				`ALTER TABLE scratch.events ADD PRIMARY KEY (id)`,
				`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
				`CREATE INDEX ON scratch.events (created_at, id)`,
			},
			claim: writeClaim(t, true), keyset: true, ack: ackInPlace(t), repeatClean: purge, clean: vacuum},
		{name: "C2. C with fillfactor 40 (room on the page for a whole claimed batch's new versions)", table: t,
			ddl: []string{
				`CREATE TABLE scratch.events ` + eventsLike + ` ` + strings.Replace(eventsOpts, "fillfactor = 85", "fillfactor = 40", 1),
				`ALTER TABLE scratch.events ADD PRIMARY KEY (id)`,
				`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
				`CREATE INDEX ON scratch.events (created_at, id)`,
			},
			claim: writeClaim(t, true), keyset: true, ack: ackInPlace(t), repeatClean: purge, clean: vacuum},
		{name: "H. claim index over a stored generated column (live = not delivered or dead): the claim can be HOT, the outcome is not; pk, dedupe, claim", table: t,
			ddl:   liveDDL(eventsOpts),
			claim: writeClaimWhere(t, "live", false), ack: ackInPlace(t), repeatClean: purge, clean: vacuum},
		{name: "H2. H with fillfactor 50", table: t,
			ddl:   liveDDL(strings.Replace(eventsOpts, "fillfactor = 85", "fillfactor = 50", 1)),
			claim: writeClaimWhere(t, "live", false), ack: ackInPlace(t), repeatClean: purge, clean: vacuum},
		{name: "D. delete on deliver, history in the attempts ledger (B's indexes)", ddl: lean, table: t,
			claim: writeClaim(t, false),
			ack: `WITH d AS (DELETE FROM ` + t + ` WHERE id = ANY($1) RETURNING id, ledger_seq + 1 AS ledger_seq, namespace, topic, attempts, claimed_at)
` + ledgerInsert,
			clean: vacuum},
		{name: "G. D's delete on deliver with C2's claim index (no status predicate) and fillfactor 40: HOT claim, delete on deliver", table: t,
			ddl: []string{
				`CREATE TABLE scratch.events ` + eventsLike + ` ` + strings.Replace(eventsOpts, "fillfactor = 85", "fillfactor = 40", 1),
				`ALTER TABLE scratch.events ADD PRIMARY KEY (id)`,
				`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
				`CREATE INDEX ON scratch.events (created_at, id)`,
			},
			claim: writeClaim(t, false),
			ack: `WITH d AS (DELETE FROM ` + t + ` WHERE id = ANY($1) RETURNING id, ledger_seq + 1 AS ledger_seq, namespace, topic, attempts, claimed_at)
` + ledgerInsert,
			clean: vacuum},
		{name: "E. hot pending table (pk, dedupe, claim without predicate) + archive (pk, dedupe); deliver moves the row", table: t,
			ddl: []string{
				`CREATE TABLE scratch.events ` + eventsLike + ` ` + eventsOpts,
				`ALTER TABLE scratch.events ADD PRIMARY KEY (id)`,
				`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
				`CREATE INDEX ON scratch.events (created_at, id)`,
				`CREATE TABLE scratch.archive ` + eventsLike + ` WITH (fillfactor = 100)`,
				`ALTER TABLE scratch.archive ADD PRIMARY KEY (id)`,
				`CREATE UNIQUE INDEX ON scratch.archive (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL`,
			},
			claim: writeClaim(t, false),
			ack: `WITH d AS (DELETE FROM ` + t + ` WHERE id = ANY($1) RETURNING *),
a AS (INSERT INTO scratch.archive (id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts, next_attempt_at,
	locked_by, locked_until, last_error, created_at, updated_at, lease_token, ledger_seq, claimed_at)
	SELECT id, namespace, topic, tenant_id, dedupe_key, payload, 'delivered', attempts, next_attempt_at,
	NULL, NULL, last_error, created_at, now(), NULL, ledger_seq + 1, claimed_at FROM d)
INSERT INTO scratch.ledger (event_id, attempt_no, namespace, topic, outcome, attempt, worker, claimed_at, finished_at)
SELECT id, ledger_seq + 1, namespace, topic, 'delivered', attempts, $2::uuid, claimed_at, now() FROM d`,
			repeatClean: `DELETE FROM scratch.archive WHERE id IN (SELECT id FROM scratch.archive LIMIT 10000)`,
			clean:       []string{"VACUUM scratch.events", "VACUUM scratch.archive", "VACUUM scratch.ledger"}},
		{name: "F. partitioned by generation (B's indexes per partition), retention by TRUNCATE of the drained partition", table: t,
			ddl: []string{
				`CREATE TABLE scratch.events (LIKE outbox.modkit_outbox_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS, gen int NOT NULL DEFAULT 0) PARTITION BY LIST (gen)`,
				`CREATE TABLE scratch.events_g0 PARTITION OF scratch.events FOR VALUES IN (0) ` + eventsOpts,
				`CREATE TABLE scratch.events_g1 PARTITION OF scratch.events FOR VALUES IN (1) ` + eventsOpts,
				`ALTER TABLE scratch.events ADD PRIMARY KEY (id, gen)`,
				`CREATE UNIQUE INDEX ON scratch.events (namespace, topic, dedupe_key, gen) WHERE dedupe_key IS NOT NULL`,
				`CREATE INDEX ON scratch.events (created_at, id) WHERE status IN ('pending', 'processing')`,
				`CREATE INDEX ON scratch.events (updated_at) WHERE status = 'dead'`,
			},
			claim: writeClaim(t, false), ack: ackInPlace(t),
			clean: []string{"TRUNCATE scratch.events_g0", "VACUUM scratch.ledger"}},
	}
}

// walAndCommits reads the WAL position and this database's committed
// transactions (after the stats of closed sessions are in).
func (b *bench) walAndCommits(ctx context.Context) (lsn pgtype.Text, commits int64, err error) {
	time.Sleep(300 * time.Millisecond) // exiting backends flush their statistics
	if _, err = b.env.admin.Exec(ctx, "SELECT pg_stat_clear_snapshot()"); err != nil {
		return lsn, 0, err
	}
	err = b.env.admin.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text, xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&lsn, &commits)
	return lsn, commits, err
}

// measurePhase runs fn and returns the WAL bytes and commits it caused.
// fn must close every connection it opened.
func (b *bench) measurePhase(ctx context.Context, fn func(ctx context.Context) error) (phase, error) {
	lsn0, c0, err := b.walAndCommits(ctx)
	if err != nil {
		return phase{}, err
	}
	start := time.Now()
	if err := fn(ctx); err != nil {
		return phase{}, err
	}
	took := time.Since(start)
	lsn1, c1, err := b.walAndCommits(ctx)
	if err != nil {
		return phase{}, err
	}
	var wal int64
	if err := b.env.admin.QueryRow(ctx, "SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint", lsn1.String, lsn0.String).Scan(&wal); err != nil {
		return phase{}, err
	}
	// The two reads above commit two transactions of their own.
	return phase{wal: wal, commits: c1 - c0 - 2, took: took}, nil
}

// withPool runs fn on a pool of its own, closed before it returns.
func (b *bench) withPool(ctx context.Context, conns int, fn func(pool *pgxpool.Pool) error) error {
	pool, err := b.env.newPool(ctx, int32(conns), 0, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	return fn(pool)
}

func (b *bench) runWriteVariant(ctx context.Context, v writeVariant) (writeRun, error) {
	n := b.opts.writeEvents
	if err := b.env.reset(ctx); err != nil {
		return writeRun{}, err
	}
	if _, err := b.env.admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+scratch+" CASCADE"); err != nil {
		return writeRun{}, err
	}
	if !v.library {
		ddl := append([]string{"CREATE SCHEMA " + scratch, ledgerDDL}, v.ddl...)
		for _, s := range ddl {
			if _, err := b.env.admin.Exec(ctx, s); err != nil {
				return writeRun{}, fmt.Errorf("%s: %w", s, err)
			}
		}
	}
	events := v.table
	if v.library {
		events = b.env.outboxTable.Sanitize()
	}
	if err := b.env.settle(ctx); err != nil {
		return writeRun{}, err
	}
	var r writeRun
	var err error
	run := fmt.Sprintf("writes-%d", time.Now().UnixNano())
	// Insert: batches of 1,000 per transaction (EnqueueBatch for the
	// library, COPY for the designs).
	r.insert, err = b.measurePhase(ctx, func(ctx context.Context) error {
		return b.withPool(ctx, 1, func(pool *pgxpool.Pool) error {
			client, err := b.newOutbox(pool, outbox.Config{DisableNotify: true})
			if err != nil {
				return err
			}
			for first := 0; first < n; first += 1000 {
				msgs := make([]outbox.Message, min(1000, n-first))
				for i := range msgs {
					msgs[i] = b.src.message(run, int64(first+i))
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if v.library {
						_, err := client.EnqueueBatch(ctx, tx, msgs)
						return err
					}
					rows := make([][]any, len(msgs))
					for i, m := range msgs {
						if rows[i], err = rawRow(m); err != nil {
							return err
						}
					}
					_, err := tx.CopyFrom(ctx, pgx.Identifier{scratch, "events"}, rawColumns, pgx.CopyFromRows(rows))
					return err
				})
				if err != nil {
					return err
				}
			}
			return nil
		})
	})
	if err != nil {
		return r, fmt.Errorf("insert: %w", err)
	}
	if _, err := b.env.admin.Exec(ctx, "ANALYZE "+events); err != nil {
		return r, err
	}
	updates0, hot0, err := b.updateCounts(ctx, v)
	if err != nil {
		return r, err
	}
	r.deliver, err = b.measurePhase(ctx, func(ctx context.Context) error {
		if v.library {
			_, err := b.drainOutboxLoaded(ctx, n, v.deleteOnDelivery)
			return err
		}
		return b.writeLoop(ctx, v)
	})
	if err != nil {
		return r, fmt.Errorf("deliver: %w", err)
	}
	updates1, hot1, err := b.updateCounts(ctx, v)
	if err != nil {
		return r, err
	}
	if updates1 > updates0 {
		r.hotShare = float64(hot1-hot0) / float64(updates1-updates0)
	}
	left, err := b.env.count(ctx, "SELECT count(*) FROM "+events+" WHERE status IN ('pending', 'processing')")
	if err == nil && left != 0 {
		err = fmt.Errorf("%d events left undelivered", left)
	}
	if err != nil {
		return r, err
	}
	r.clean, err = b.measurePhase(ctx, func(ctx context.Context) error {
		return b.withPool(ctx, 1, func(pool *pgxpool.Pool) error {
			for v.repeatClean != "" {
				var affected int64
				if v.library {
					if err := pool.QueryRow(ctx, v.repeatClean).Scan(&affected); err != nil {
						return err
					}
				} else {
					tag, err := pool.Exec(ctx, v.repeatClean)
					if err != nil {
						return err
					}
					affected = tag.RowsAffected()
				}
				if affected == 0 {
					break
				}
			}
			for _, s := range v.clean {
				if _, err := pool.Exec(ctx, s); err != nil {
					return fmt.Errorf("%s: %w", s, err)
				}
			}
			return nil
		})
	})
	if err != nil {
		return r, fmt.Errorf("clean: %w", err)
	}
	return r, nil
}

// updateCounts reads the updates and HOT updates of the variant's events
// table (its partitions for a partitioned one).
func (b *bench) updateCounts(ctx context.Context, v writeVariant) (int64, int64, error) {
	time.Sleep(300 * time.Millisecond)
	schema, name := scratch, "events%"
	if v.library {
		schema, name = outboxSchema, "modkit_outbox_events"
	}
	if _, err := b.env.admin.Exec(ctx, "SELECT pg_stat_clear_snapshot()"); err != nil {
		return 0, 0, err
	}
	var upd, hot int64
	err := b.env.admin.QueryRow(ctx, `SELECT coalesce(sum(n_tup_upd), 0)::bigint, coalesce(sum(n_tup_hot_upd), 0)::bigint
FROM pg_stat_user_tables WHERE schemaname = $1 AND relname LIKE $2`, schema, name).Scan(&upd, &hot)
	return upd, hot, err
}

// drainOutboxLoaded runs the library's dispatcher (defaults, with
// Publisher.DeleteOnDelivery when asked) over the n events already in the
// outbox table.
func (b *bench) drainOutboxLoaded(ctx context.Context, n int, deleteOnDelivery bool) (time.Duration, error) {
	pool, err := b.env.newPool(ctx, 0, 1, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	var delivered atomic.Int64
	done := make(chan struct{})
	d, err := b.newDispatcher(pool, outbox.Config{}, deleteOnDelivery, outbox.DispatcherConfig{OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
		if !o.LeaseLost && !o.Released && o.Status == outbox.StatusDelivered && delivered.Add(1) == int64(n) {
			close(done)
		}
	}}, nil)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := d.Start(ctx); err != nil {
		return 0, err
	}
	err = waitDone(ctx, done, n, &delivered)
	took := time.Since(start)
	if stopErr := d.Stop(context.WithoutCancel(ctx)); err == nil {
		err = stopErr
	}
	return took, err
}

// writeLoop drains the variant's table with 2 connections, claim 500 and
// the variant's ack.
func (b *bench) writeLoop(ctx context.Context, v writeVariant) error {
	const workers, batch = 2, 500
	pool, err := b.env.newPool(ctx, workers, workers, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	var mu sync.Mutex
	hintAt, hintID := time.Time{}, pgtype.UUID{Bytes: uuid.UUID{}, Valid: true}
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			worker := pgtype.UUID{Bytes: uuid.New(), Valid: true}
			ids := make([]pgtype.UUID, 0, batch)
			for {
				args := []any{benchTopic.Namespace, benchTopic.Topic, batch, worker}
				if v.keyset {
					mu.Lock()
					args = append(args, hintAt, hintID)
					mu.Unlock()
				}
				ids = ids[:0]
				rows, err := pool.Query(ctx, v.claim, args...)
				if err != nil {
					errs[w] = err
					return
				}
				var id pgtype.UUID
				var at time.Time
				lastAt, lastID := time.Time{}, pgtype.UUID{}
				for rows.Next() {
					if err := rows.Scan(&id, &at); err != nil {
						errs[w] = err
						break
					}
					ids = append(ids, id)
					if at.After(lastAt) || (at.Equal(lastAt) && slices.Compare(id.Bytes[:], lastID.Bytes[:]) > 0) {
						lastAt, lastID = at, id
					}
				}
				rows.Close()
				if errs[w] = errors.Join(errs[w], rows.Err()); errs[w] != nil || len(ids) == 0 {
					return
				}
				if v.keyset {
					mu.Lock()
					if lastAt.After(hintAt) || (lastAt.Equal(hintAt) && slices.Compare(lastID.Bytes[:], hintID.Bytes[:]) > 0) {
						hintAt, hintID = lastAt, lastID
					}
					mu.Unlock()
				}
				if _, errs[w] = pool.Exec(ctx, v.ack, ids, worker); errs[w] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// selectedWriteVariants is today's library and the designs -write-designs
// names by their letters (all when it names none).
func (b *bench) selectedWriteVariants() ([]writeVariant, error) {
	all := b.writeVariants()
	if len(b.opts.writeDesigns) == 0 {
		return all, nil
	}
	picked := all[:1]
	for _, d := range b.opts.writeDesigns {
		i := slices.IndexFunc(all, func(v writeVariant) bool { return strings.HasPrefix(v.name, d+". ") })
		if i < 0 {
			return nil, fmt.Errorf("-write-designs: no design %q (the designs are A to H2 and L, as BENCHMARKS.md names them)", d)
		}
		picked = append(picked, all[i])
	}
	return picked, nil
}

// runWrites measures every variant once per round, in turn.
func (b *bench) runWrites(ctx context.Context) error {
	variants, err := b.selectedWriteVariants()
	if err != nil {
		return err
	}
	sides := make([]side[writeRun], len(variants))
	for i, v := range variants {
		sides[i] = side[writeRun]{v.name, func(ctx context.Context) (writeRun, error) {
			r, err := b.runWriteVariant(ctx, v)
			if err == nil {
				n := float64(b.opts.writeEvents)
				b.log.Info("writes: "+v.name, "insert_B_per_event", float64(r.insert.wal)/n, "deliver_B_per_event", float64(r.deliver.wal)/n,
					"clean_B_per_event", float64(r.clean.wal)/n, "deliver_per_s", int(n/r.deliver.took.Seconds()), "hot", r.hotShare)
			}
			return r, err
		}}
	}
	runs, err := alternate(ctx, b, "writes", sides)
	if _, dropErr := b.env.admin.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+scratch+" CASCADE"); err == nil {
		err = dropErr
	}
	if err != nil {
		return err
	}
	b.report.writes = &writesTable{events: b.opts.writeEvents, names: make([]string, len(variants)), runs: runs}
	for i, v := range variants {
		b.report.writes.names[i] = v.name
	}
	return nil
}

// writesTable is the writes workload's own table.
type writesTable struct {
	events int
	names  []string
	runs   [][]writeRun
}

func (w *writesTable) print(out io.Writer) {
	n := float64(w.events)
	perEvent := func(runs []writeRun, f func(writeRun) float64) series {
		s := make(series, len(runs))
		for i, r := range runs {
			s[i] = f(r)
		}
		return s
	}
	one := func(v float64) string { return fmt.Sprintf("%.0f", v) }
	three := func(v float64) string { return fmt.Sprintf("%.3f", v) }
	total := func(r writeRun) float64 { return float64(r.insert.wal+r.deliver.wal+r.clean.wal) / n }
	minimum := perEvent(w.runs[0], func(r writeRun) float64 { return float64(r.insert.wal) / n }).median()
	base := perEvent(w.runs[0], total).median()
	fmt.Fprintf(out, "\nWrites per event (%s events per phase; WAL bytes from pg_current_wal_lsn, commits from pg_stat_database; medians of %d rounds, min–max)\n",
		itoa(int64(w.events)), len(w.runs[0]))
	fmt.Fprintf(out, "theoretical minimum: one insert per event = the library's insert phase, %.0f B/event\n\n", minimum)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "DESIGN\tINSERT B\tDELIVER B\tCLEAN-UP B\tTOTAL B\t×MINIMUM\tvs TODAY\tCOMMITS/EVENT (ins+del+clean)\tHOT\tDRAIN/s")
	for i, name := range w.names {
		runs := w.runs[i]
		ins := perEvent(runs, func(r writeRun) float64 { return float64(r.insert.wal) / n })
		del := perEvent(runs, func(r writeRun) float64 { return float64(r.deliver.wal) / n })
		cl := perEvent(runs, func(r writeRun) float64 { return float64(r.clean.wal) / n })
		tot := perEvent(runs, total)
		commits := perEvent(runs, func(r writeRun) float64 { return float64(r.insert.commits+r.deliver.commits+r.clean.commits) / n })
		hot := perEvent(runs, func(r writeRun) float64 { return 100 * r.hotShare })
		rate := perEvent(runs, func(r writeRun) float64 { return n / r.deliver.took.Seconds() })
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%.2f×\t%.2f×\t%s\t%s%%\t%s\n", name, ins.text(one), del.text(one), cl.text(one), tot.text(one),
			tot.median()/minimum, tot.median()/base, commits.text(three), hot.text(one), rate.text(fmtCount))
	}
	_ = tw.Flush()
	fmt.Fprintln(out, "\nCLEAN-UP is what each design needs to keep the table small once events are delivered: the purge of delivered rows "+
		"(DELETE in batches of 10,000, or the library's modkit_outbox_purge) and VACUUM, or a TRUNCATE of the drained partition. "+
		"DRAIN/s is the deliver phase: the library's dispatcher (defaults) for the first row, a raw claim 500 + ack loop on 2 connections for the designs; "+
		"every design's ack appends one ledger row per event.")
}
