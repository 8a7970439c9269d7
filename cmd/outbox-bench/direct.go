package main

import (
	"context"
	"errors"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// directDriver is the library's write path as it was before migration 0004
// (the "direct path"): the single enqueue, the claim and the outcome as
// plain statements on the events table, without the SECURITY DEFINER
// functions and without the attempts ledger. It exists only here, so that
// the dispatch and enqueue workloads can alternate the function path with
// it in one run (issue 11 asks for at least 0.85x). Everything else (batch
// enqueue by COPY, sweeps, elections, reads) is the real driver's.
type directDriver struct{ pool *pgxpool.Pool }

// Open implements driver.Driver.
func (d directDriver) Open(opts driver.Options) (driver.Store, error) {
	inner, err := outboxpg.New(d.pool).Open(opts)
	if err != nil {
		return nil, err
	}
	table := pgx.Identifier{opts.Schema, outboxpg.TableName}.Sanitize()
	return &directStore{Store: inner, pool: d.pool,
		insertOne: `WITH ins AS (INSERT INTO ` + table + ` (id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts)
	VALUES ($1, $2, $3, $4, $5, $6::jsonb, 'pending', 0)
	ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
	RETURNING id),
n AS (SELECT pg_notify('` + outboxpg.NotifyChannel + `', $2 || ':' || $3) WHERE $7)
SELECT ins.id FROM ins LEFT JOIN n ON true`,
		lookup: `SELECT id FROM ` + table + ` WHERE namespace = $1 AND topic = $2 AND dedupe_key = $3`,
		claim:  strings.Replace(rawClaimSQL(table), "FROM due WHERE", "FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit, due WHERE", 1),
		complete: `UPDATE ` + table + ` AS e SET
	status = CASE a.outcome WHEN 'released' THEN 'pending' ELSE a.outcome END,
	attempts = CASE a.outcome WHEN 'released' THEN e.attempts - 1 ELSE e.attempts END,
	next_attempt_at = CASE a.outcome
		WHEN 'pending' THEN statement_timestamp() + a.delay_ms * interval '1 millisecond'
		WHEN 'released' THEN statement_timestamp()
		ELSE e.next_attempt_at END,
	last_error = CASE WHEN a.outcome IN ('pending', 'dead') THEN a.err ELSE e.last_error END,
	locked_by = NULL, locked_until = NULL, lease_token = NULL,
	updated_at = statement_timestamp()
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit,
	unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::bigint[]) AS a(id, token, outcome, err, delay_ms)
WHERE e.id = a.id AND e.lease_token = a.token AND e.locked_by = $6 AND e.status = 'processing'
  AND e.locked_until > statement_timestamp()
RETURNING e.id`,
	}, nil
}

type directStore struct {
	driver.Store
	pool                               *pgxpool.Pool
	insertOne, lookup, claim, complete string
}

// Insert implements driver.Store: one event by the direct INSERT; batches
// by the real driver (its COPY fast path did not change).
func (s *directStore) Insert(ctx context.Context, tx any, rows []driver.InsertRow, notify []string) ([]driver.Inserted, error) {
	if len(rows) != 1 {
		return s.Store.Insert(ctx, tx, rows, notify)
	}
	q, err := db.AsQuerier(tx)
	if err != nil {
		return nil, err
	}
	r := rows[0]
	out := []driver.Inserted{{}}
	var tenant pgtype.UUID
	if r.TenantID != nil {
		tenant = pgtype.UUID{Bytes: *r.TenantID, Valid: true}
	}
	err = q.QueryRow(ctx, s.insertOne, pgUUID(r.ID), r.Namespace, r.Topic, tenant, r.DedupeKey, string(r.Payload), len(notify) > 0).Scan(&out[0].ID)
	if errors.Is(err, db.ErrNoRows) {
		out[0].Duplicate = true
		err = q.QueryRow(ctx, s.lookup, r.Namespace, r.Topic, *r.DedupeKey).Scan(&out[0].ID)
	}
	return out, err
}

// Claim implements driver.Store with the direct claim.
func (s *directStore) Claim(ctx context.Context, p driver.ClaimParams) ([]driver.Claimed, error) {
	rows, err := s.pool.Query(ctx, s.claim, pgx.QueryExecModeExec, p.MaxAttempts, p.Topics, p.Limit, pgUUID(p.Worker), p.Lease)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.Claimed, error) {
		var c driver.Claimed
		var tenant pgtype.UUID
		err := r.Scan(&c.ID, &c.Namespace, &c.Topic, &tenant, &c.DedupeKey, &c.Payload, &c.Attempts, &c.LeaseToken, &c.LockedTill, &c.CreatedAt)
		if tenant.Valid {
			id := uuid.UUID(tenant.Bytes)
			c.TenantID = &id
		}
		return c, err
	})
}

var directOutcomes = [...]string{driver.Delivered: "delivered", driver.Retry: "pending", driver.Dead: "dead", driver.Release: "released"}

// Complete implements driver.Store with the direct outcome statement (the
// bench's publishers never use a caller's transaction).
func (s *directStore) Complete(ctx context.Context, tx any, worker uuid.UUID, outcomes []driver.Outcome) ([]bool, error) {
	if tx != nil {
		return s.Store.Complete(ctx, tx, worker, outcomes)
	}
	n := len(outcomes)
	ids, tokens, kinds, errs, delays := make([]pgtype.UUID, n), make([]pgtype.UUID, n), make([]string, n), make([]*string, n), make([]int64, n)
	for i, o := range outcomes {
		ids[i], tokens[i], kinds[i], delays[i] = pgUUID(o.ID), pgUUID(o.LeaseToken), directOutcomes[o.Kind], o.Delay.Milliseconds()
		if o.Error != "" {
			errs[i] = &o.Error
		}
	}
	rows, err := s.pool.Query(ctx, s.complete, pgx.QueryExecModeExec, ids, tokens, kinds, errs, delays, pgUUID(worker))
	if err != nil {
		return nil, err
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, err
	}
	recorded := make(map[uuid.UUID]bool, len(done))
	for _, id := range done {
		recorded[id] = true
	}
	settled := make([]bool, n)
	for i, o := range outcomes {
		settled[i] = recorded[o.ID]
	}
	return settled, nil
}

// newDirectClient is newClient on the direct path.
func (b *bench) newDirectClient(pool *pgxpool.Pool, cfg outbox.Config) (*outbox.Client, error) {
	cfg.Schema = b.t.schema
	if cfg.Logger == nil {
		cfg.Logger = b.dispatcherLog
	}
	return outbox.New(directDriver{pool: pool}, cfg)
}

func pgUUID(id uuid.UUID) pgtype.UUID { return pgtype.UUID{Bytes: id, Valid: true} }
