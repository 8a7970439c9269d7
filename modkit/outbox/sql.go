package outbox

import (
	"fmt"

	"github.com/jackc/pgx/v5"
)

// NotifyChannel is the PostgreSQL channel on which enqueues announce
// themselves (payload "namespace:topic"), so idle dispatchers wake at once.
const NotifyChannel = "modkit_outbox"

// TableName is the outbox table's name.
const TableName = "modkit_outbox_events"

// statements holds the SQL of one Store, with its table name filled in.
type statements struct {
	enqueue, enqueueNotify, lookupDuplicate string
	enqueueBatch, notifyMany                string
	lookupDuplicates                        string
	claim, complete, completeAsync          string
	sweepExhausted, purgeDelivered          string
	stats, listDead, replayDead             string
	get, depth                              string
}

const eventColumns = `id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts,
	next_attempt_at, locked_by, locked_until, last_error, created_at, updated_at`

// asyncCommit, joined into a statement's FROM list, makes the implicit
// transaction of that one statement commit without waiting for its WAL
// flush (synchronous_commit = off, transaction-local).
const asyncCommit = `(SELECT set_config('synchronous_commit', 'off', true)) AS async_commit, `

func newStatements(schema string, syncCommit bool) statements {
	t := pgx.Identifier{TableName}.Sanitize()
	if schema != "" {
		t = pgx.Identifier{schema, TableName}.Sanitize()
	}
	f := func(format string) string { return fmt.Sprintf(format, t) }

	// A duplicate inserts nothing and returns no row; Enqueue then finds
	// the original with lookupDuplicate in a new statement (which also sees
	// a row a racing transaction committed after the insert's snapshot).
	insertOne := `INSERT INTO %[1]s (id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts)
	VALUES ($1, $2, $3, $4, $5, $6::jsonb, 'pending', 0)
	ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
	RETURNING id`

	batchInput := `WITH input AS (
	SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::uuid[], $5::text[], $6::jsonb[])
		WITH ORDINALITY AS i(id, namespace, topic, tenant_id, dedupe_key, payload, ord)
), ins AS (
	INSERT INTO %[1]s (id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts)
	SELECT id, namespace, topic, tenant_id, dedupe_key, payload, 'pending', 0 FROM input ORDER BY ord
	ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
	RETURNING id
)`

	async := asyncCommit
	if syncCommit {
		async = ""
	}
	fa := func(format string) string { return fmt.Sprintf(format, t, async) }
	// complete fences on statement_timestamp(), not now(): inside a caller's
	// transaction (CompleteTx, HandleTx) now() is frozen at BEGIN, so a lease
	// that expired while the handler ran would still look valid.
	complete := `UPDATE %[1]s AS e SET
	status = CASE a.outcome WHEN 'released' THEN 'pending' ELSE a.outcome END,
	attempts = CASE a.outcome WHEN 'released' THEN e.attempts - 1 ELSE e.attempts END,
	next_attempt_at = CASE a.outcome
		WHEN 'pending' THEN statement_timestamp() + a.delay_ms * interval '1 millisecond'
		WHEN 'released' THEN statement_timestamp()
		ELSE e.next_attempt_at END,
	last_error = CASE WHEN a.outcome IN ('pending', 'dead') THEN a.err ELSE e.last_error END,
	locked_by = NULL, locked_until = NULL, lease_token = NULL,
	updated_at = statement_timestamp()
FROM %[2]sunnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::bigint[]) AS a(id, token, outcome, err, delay_ms)
WHERE e.id = a.id AND e.lease_token = a.token AND e.status = 'processing' AND e.locked_until > statement_timestamp()
RETURNING e.id`

	return statements{
		// The insert stands alone: a duplicate returns no row and Enqueue
		// looks the original up in a second statement, so the common case
		// pays for nothing but the insert (and, at most once per
		// NotifyInterval, the NOTIFY).
		enqueue: f(insertOne + `, false`),
		// pg_notify is evaluated only when the insert produced a row.
		enqueueNotify: f(`WITH ins AS (` + insertOne + `),
n AS (SELECT pg_notify('` + NotifyChannel + `', $2 || ':' || $3))
SELECT ins.id, false FROM ins CROSS JOIN n`),
		lookupDuplicate: f(`SELECT id FROM %[1]s WHERE namespace = $1 AND topic = $2 AND dedupe_key = $3`),

		enqueueBatch: f(batchInput + `
SELECT id FROM ins`),
		notifyMany: `SELECT pg_notify('` + NotifyChannel + `', p) FROM unnest($1::text[]) AS p`,
		lookupDuplicates: f(`SELECT e.id, e.namespace, e.topic, e.dedupe_key
FROM %[1]s e JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(namespace, topic, dedupe_key)
  ON e.namespace = k.namespace AND e.topic = k.topic AND e.dedupe_key = k.dedupe_key`),

		// Seed 004 §3: one statement, FOR UPDATE SKIP LOCKED, eligible =
		// pending and due, or processing with an expired lease; attempts
		// below the maximum; deterministic order. The subquery walks the
		// partial claim index (created_at, id) WHERE status IN
		// ('pending','processing'), so delivered and dead rows are never
		// visited. Each claim issues a fresh lease token.
		claim: fa(`WITH due AS (
	SELECT id FROM %[1]s
	WHERE status IN ('pending', 'processing')
	  AND ((status = 'pending' AND next_attempt_at <= now())
	    OR (status = 'processing' AND locked_until < now()))
	  AND attempts < $1
	  AND (namespace || ':' || topic) = ANY($2::text[])
	ORDER BY created_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED
)
UPDATE %[1]s AS e SET
	status = 'processing',
	attempts = e.attempts + 1,
	locked_by = $4,
	locked_until = now() + $5::interval,
	lease_token = gen_random_uuid(),
	updated_at = now()
FROM %[2]sdue WHERE e.id = due.id
RETURNING e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, e.payload, e.attempts,
	e.lease_token, e.locked_until, e.created_at`),

		// One statement records any mix of outcomes. Each row must present
		// the lease token of its claim, and the lease must not have expired:
		// a stale worker matches nothing. Outcome kinds:
		//   delivered: terminal success;
		//   pending:   retry after delay_ms, lease cleared;
		//   dead:      terminal failure;
		//   released:  back to pending at once, the claim's attempt undone.
		// Through the caller's transaction (CompleteTx) the statement must
		// not change that transaction's commit mode; on the dispatcher's own
		// connections it commits asynchronously unless Config.SynchronousCommit.
		complete:      fmt.Sprintf(complete, t, ""),
		completeAsync: fa(complete),

		// Rows that can never be claimed again because their attempts are
		// used up: a worker crashed (or overran its lease) on the last
		// allowed attempt, or max_attempts was lowered.
		sweepExhausted: f(`UPDATE %[1]s AS e SET
	status = 'dead',
	last_error = CASE WHEN e.status = 'processing'
		THEN format('lease of worker %%s expired on the final attempt (%%s of %%s): the worker crashed or its publish outlived the lease', e.locked_by, e.attempts, $1::int)
		ELSE format('attempts (%%s) reached max_attempts (%%s)', e.attempts, $1::int) END
		|| coalesce('; last publish error: ' || e.last_error, ''),
	locked_by = NULL, locked_until = NULL, lease_token = NULL,
	updated_at = now()
WHERE e.id IN (
	SELECT id FROM %[1]s
	WHERE status IN ('pending', 'processing') AND attempts >= $1
	  AND (status = 'pending' OR locked_until < now())
	  AND (namespace || ':' || topic) = ANY($2::text[])
	ORDER BY created_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED)
RETURNING e.id`),

		purgeDelivered: f(`DELETE FROM %[1]s WHERE id IN (
	SELECT id FROM %[1]s
	WHERE status = 'delivered' AND updated_at < now() - $1::interval
	LIMIT $2
	FOR UPDATE SKIP LOCKED)`),

		stats: f(`SELECT namespace, topic, status, count(*),
	min(next_attempt_at) FILTER (WHERE status = 'pending' AND next_attempt_at <= now()),
	now()
FROM %[1]s GROUP BY namespace, topic, status ORDER BY namespace, topic, status`),

		listDead: f(`SELECT ` + eventColumns + ` FROM %[1]s
WHERE status = 'dead'
  AND ($1::text IS NULL OR namespace = $1)
  AND ($2::text IS NULL OR topic = $2)
  AND ($3::uuid IS NULL OR tenant_id = $3)
  AND ($4::timestamptz IS NULL OR (created_at, id) > ($4, $5::uuid))
ORDER BY created_at, id
LIMIT $6`),

		replayDead: f(`UPDATE %[1]s SET
	status = 'pending', attempts = 0, next_attempt_at = now(),
	last_error = format('replayed by %%s at %%s', $2::text, to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'))
		|| coalesce('; error before replay: ' || last_error, ''),
	updated_at = now()
WHERE id = ANY($1::uuid[]) AND status = 'dead'
RETURNING id`),

		get: f(`SELECT ` + eventColumns + ` FROM %[1]s WHERE id = $1`),

		depth: f(`SELECT count(*) FILTER (WHERE status = 'pending'),
	count(*) FILTER (WHERE status = 'processing'),
	count(*) FILTER (WHERE status = 'dead'),
	coalesce(extract(epoch FROM now() - min(next_attempt_at) FILTER (WHERE status = 'pending' AND next_attempt_at <= now())), 0)::float8
FROM %[1]s
WHERE status IN ('pending', 'processing', 'dead') AND (namespace || ':' || topic) = ANY($1::text[])`),
	}
}
