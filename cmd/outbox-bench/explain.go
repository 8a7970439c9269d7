package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/internal/benchsql"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// sqlCapture is a pgx.QueryTracer that keeps the text of every distinct
// statement it sees, so that -explain and the experiments run the
// library's own SQL rather than a copy of it.
type sqlCapture struct {
	mu   sync.Mutex
	seen []string
}

// TraceQueryStart records the statement's text.
func (c *sqlCapture) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !slices.Contains(c.seen, data.SQL) {
		c.seen = append(c.seen, data.SQL)
	}
	return ctx
}

// TraceQueryEnd does nothing.
func (c *sqlCapture) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// find returns the first statement seen that contains marker.
func (c *sqlCapture) find(marker string) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.seen {
		if strings.Contains(s, marker) {
			return s, nil
		}
	}
	return "", fmt.Errorf("the library sent no statement containing %q", marker)
}

// Markers that pick the library's statements out of a sqlCapture.
const (
	claimMarker        = "modkit_outbox_claim_chained("
	completeMarker     = "modkit_outbox_complete("
	enqueueBatchMarker = "modkit_outbox_enqueue_many("
)

// librarySQL learns the library's claim and outcome statements by claiming
// one due event and releasing it again (the table must hold one). It calls
// the PostgreSQL driver's Claim and Complete directly, opened with the
// options a Client with a zero Config (but for the schema) gives it, which
// is the one way to run a single claim without a dispatcher publishing
// what it claims: the statements are those a dispatcher sends.
func (b *bench) librarySQL(ctx context.Context) (claim, complete string, err error) {
	capture := &sqlCapture{}
	pool, err := b.t.newPool(ctx, poolSpec{maxConns: 1, tracer: capture})
	if err != nil {
		return "", "", err
	}
	defer pool.Close()
	store, err := outboxpg.New(pool).Open(driver.Options{Schema: b.t.schema})
	if err != nil {
		return "", "", err
	}
	worker := uuid.New()
	got, err := store.Claim(ctx, driver.ClaimParams{Topics: []string{benchTopic.Namespace + ":" + benchTopic.Topic}, Limit: 1,
		MaxAttempts: b.defaults.MaxAttempts, Worker: worker, Lease: b.defaults.LeaseDuration})
	if err != nil {
		return "", "", err
	}
	if len(got) == 0 {
		return "", "", errors.New("learn the library's SQL: no due event to claim")
	}
	release := make([]driver.Outcome, len(got))
	for i, c := range got {
		release[i] = driver.Outcome{ID: c.ID, LeaseToken: c.LeaseToken, Kind: driver.Release}
	}
	if _, err := store.Complete(ctx, nil, worker, release); err != nil {
		return "", "", err
	}
	if claim, err = capture.find(claimMarker); err != nil {
		return "", "", err
	}
	complete, err = capture.find(completeMarker)
	return claim, complete, err
}

// libraryClaimArgs are the arguments of the library's claim function
// (modkit_outbox_claim_chained): worker, topics, limit, max attempts,
// lease, topics that skip dead heads (none) and chain lengths (none).
func (b *bench) libraryClaimArgs(limit int, worker uuid.UUID) []any {
	return []any{worker, []string{benchTopic.Namespace + ":" + benchTopic.Topic}, limit, b.defaults.MaxAttempts,
		b.defaults.LeaseDuration, []string(nil), []int32(nil)}
}

// explainHotPath prints EXPLAIN (ANALYZE, BUFFERS) of the library's claim
// and outcome statements and of the baseline's ack, on the table as the
// next drain will find it, to stderr. The statements run in a transaction
// that is rolled back, so the table is left as it was (but for one event
// claimed and released to learn the library's SQL).
func (b *bench) explainHotPath(ctx context.Context, label string) {
	if err := b.explain(ctx, label); err != nil {
		b.log.Warn("explain failed", "phase", label, "error", err)
	}
}

func (b *bench) explain(ctx context.Context, label string) error {
	claimSQL, completeSQL, err := b.librarySQL(ctx)
	if err != nil {
		return err
	}

	tx, err := b.t.admin.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	worker := uuid.New()
	claimArgs := b.libraryClaimArgs(b.opts.batch, worker)
	show := func(title, sql string, args ...any) error {
		return printExplain(ctx, tx, label+": "+title, sql, args...)
	}
	claim := func() (ids, tokens []uuid.UUID, err error) {
		rows, err := tx.Query(ctx, claimSQL, claimArgs...)
		if err != nil {
			return nil, nil, err
		}
		defer rows.Close()
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				return nil, nil, err
			}
			ids = append(ids, uuid.UUID(vals[0].([16]byte)))
			tokens = append(tokens, uuid.UUID(vals[7].([16]byte)))
		}
		return ids, tokens, rows.Err()
	}

	if err := show(fmt.Sprintf("claim, batch %d (library), custom plan", b.opts.batch), claimSQL, claimArgs...); err != nil {
		return err
	}
	if err := b.explainGenericClaim(ctx, tx, label, claimSQL, true); err != nil {
		return err
	}
	ids, tokens, err := claim()
	if err != nil {
		return err
	}
	outcomes, errs, delays := make([]string, len(ids)), make([]*string, len(ids)), make([]int64, len(ids))
	for i := range outcomes {
		outcomes[i] = string(outbox.StatusDelivered)
	}
	if err := show(fmt.Sprintf("outcome of %d deliveries (library)", len(ids)), completeSQL, worker, ids, tokens, outcomes, errs, delays); err != nil {
		return err
	}
	if ids, _, err = claim(); err != nil {
		return err
	}
	return show(fmt.Sprintf("ack of %d by id array (baseline)", len(ids)), benchsql.RawAck(b.t.table.Sanitize()), ids)
}

// printExplain prints EXPLAIN (ANALYZE, BUFFERS) of sql, run through q, to
// stderr, cutting very long lines (the id arrays of an ack).
func printExplain(ctx context.Context, q pgx.Tx, title, sql string, args ...any) error {
	rows, err := q.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+sql, args...)
	if err != nil {
		return fmt.Errorf("explain %s: %w", title, err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("explain %s: %w", title, err)
	}
	for i, l := range lines {
		if len(l) > 240 {
			lines[i] = l[:240] + "…"
		}
	}
	fmt.Fprintf(os.Stderr, "\n== %s: EXPLAIN (ANALYZE, BUFFERS) ==\n%s\n", title, strings.Join(lines, "\n"))
	return nil
}

// explainGenericClaim prints the generic plan of claim, batch -batch: the
// plan a prepared statement (pgx's default statement cache) switches to
// after five executions when the planner thinks it no worse than the
// custom ones. It runs in tx, which the caller rolls back. claim takes
// libraryClaimArgs when libraryCall is set (the library's claim function),
// else claimParams (the raw claims).
func (b *bench) explainGenericClaim(ctx context.Context, tx pgx.Tx, label, claim string, libraryCall bool) error {
	batch := b.opts.batch
	if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
		return err
	}
	name := "outbox_bench_claim_" + strings.ReplaceAll(uuid.NewString(), "-", "")
	types, exec := "(int, text[], bigint, uuid, interval)", fmt.Sprintf("EXECUTE %s(%d, '{%s:%s}', %d, gen_random_uuid(), '%s')",
		name, b.defaults.MaxAttempts, benchTopic.Namespace, benchTopic.Topic, batch, b.defaults.LeaseDuration)
	if libraryCall {
		types, exec = "(uuid, text[], int, int, interval, text[], int[])", fmt.Sprintf("EXECUTE %s(gen_random_uuid(), '{%s:%s}', %d, %d, '%s', NULL, NULL)",
			name, benchTopic.Namespace, benchTopic.Topic, batch, b.defaults.MaxAttempts, b.defaults.LeaseDuration)
	}
	if _, err := tx.Exec(ctx, "PREPARE "+name+" "+types+" AS "+claim); err != nil {
		return err
	}
	// PREPARE outlives the transaction.
	defer func() { _, _ = tx.Conn().Exec(context.WithoutCancel(ctx), "DEALLOCATE "+name) }()
	if err := printExplain(ctx, tx, fmt.Sprintf("%s: claim, batch %d (library), generic plan", label, batch), exec); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = auto")
	return err
}
