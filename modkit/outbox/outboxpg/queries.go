package outboxpg

import (
	"strings"

	"github.com/jackc/pgx/v5"
)

// The statements of the PostgreSQL driver. {{events}} and {{leaders}} stand
// for the quoted, schema-qualified table names; {{async}}, joined into a
// statement's FROM list, makes that statement's implicit transaction commit
// without waiting for its WAL flush (empty with Options.SynchronousCommit).
// {{now}} is the clock: the database's, or the test clock passed as a
// parameter (see queries.bind).
const (
	// A duplicate inserts nothing and returns no row; Insert then finds the
	// original with qLookupDuplicate in a new statement (which also sees a
	// row a racing transaction committed after the insert's snapshot).
	qInsertOne = `INSERT INTO {{events}} (id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts)
	VALUES ($1, $2, $3, $4, $5, $6::jsonb, 'pending', 0)
	ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
	RETURNING id`

	// pg_notify is evaluated only when the insert produced a row.
	qInsertOneNotify = `WITH ins AS (` + qInsertOne + `),
n AS (SELECT pg_notify('` + NotifyChannel + `', $2 || ':' || $3))
SELECT ins.id FROM ins CROSS JOIN n`

	qLookupDuplicate = `SELECT id FROM {{events}} WHERE namespace = $1 AND topic = $2 AND dedupe_key = $3`

	qInsertMany = `WITH input AS (
	SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::uuid[], $5::text[], $6::jsonb[])
		WITH ORDINALITY AS i(id, namespace, topic, tenant_id, dedupe_key, payload, ord)
)
INSERT INTO {{events}} (id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts)
SELECT id, namespace, topic, tenant_id, dedupe_key, payload, 'pending', 0 FROM input ORDER BY ord
ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
RETURNING id`

	qNotifyMany = `SELECT pg_notify('` + NotifyChannel + `', p) FROM unnest($1::text[]) AS p`

	qLookupDuplicates = `SELECT e.id, e.namespace, e.topic, e.dedupe_key
FROM {{events}} e JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(namespace, topic, dedupe_key)
  ON e.namespace = k.namespace AND e.topic = k.topic AND e.dedupe_key = k.dedupe_key`

	// One statement, FOR UPDATE SKIP LOCKED; eligible = pending and due, or
	// processing with an expired lease; attempts below the maximum; oldest
	// first. The subquery walks the partial claim index (created_at, id)
	// WHERE status IN ('pending','processing'), so delivered and dead rows
	// are never visited. Each claim issues a fresh lease token.
	qClaim = `WITH due AS (
	SELECT id FROM {{events}}
	WHERE status IN ('pending', 'processing')
	  AND ((status = 'pending' AND next_attempt_at <= {{now}})
	    OR (status = 'processing' AND locked_until < {{now}}))
	  AND attempts < $1
	  AND (namespace || ':' || topic) = ANY($2::text[])
	ORDER BY created_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED
)
UPDATE {{events}} AS e SET
	status = 'processing',
	attempts = e.attempts + 1,
	locked_by = $4,
	locked_until = {{now}} + $5::interval,
	lease_token = gen_random_uuid(),
	updated_at = {{now}}
FROM {{async}}due WHERE e.id = due.id
RETURNING e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, e.payload, e.attempts,
	e.lease_token, e.locked_until, e.created_at`

	// One statement records any mix of outcomes. Each row must present the
	// lease token of its claim, and the lease must not have expired: a stale
	// worker matches nothing. (Adding "e.id = ANY($1)" to steer generic
	// plans to the primary key was measured and made the drain with a
	// million delivered rows 7x slower: leave the planner this join.) The
	// fence uses statement_timestamp(), not
	// now(): inside a caller's transaction now() is frozen at BEGIN, so a
	// lease that expired while a handler ran would still look valid.
	//   delivered: terminal success;
	//   pending:   retry after delay_ms, lease cleared;
	//   dead:      terminal failure;
	//   released:  back to pending at once, the claim's attempt undone.
	qComplete = `UPDATE {{events}} AS e SET
	status = CASE a.outcome WHEN 'released' THEN 'pending' ELSE a.outcome END,
	attempts = CASE a.outcome WHEN 'released' THEN e.attempts - 1 ELSE e.attempts END,
	next_attempt_at = CASE a.outcome
		WHEN 'pending' THEN {{stmt_now}} + a.delay_ms * interval '1 millisecond'
		WHEN 'released' THEN {{stmt_now}}
		ELSE e.next_attempt_at END,
	last_error = CASE WHEN a.outcome IN ('pending', 'dead') THEN a.err ELSE e.last_error END,
	locked_by = NULL, locked_until = NULL, lease_token = NULL,
	updated_at = {{stmt_now}}
FROM {{async}}unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::bigint[]) AS a(id, token, outcome, err, delay_ms)
WHERE e.id = a.id AND e.lease_token = a.token AND e.status = 'processing' AND e.locked_until > {{stmt_now}}
RETURNING e.id`

	// Rows that can never be claimed again because their attempts are used
	// up: a worker crashed (or overran its lease) on the last allowed
	// attempt, or max_attempts was lowered.
	qSweep = `UPDATE {{events}} AS e SET
	status = 'dead',
	last_error = CASE WHEN e.status = 'processing'
		THEN format('lease of worker %s expired on the final attempt (%s of %s): the worker crashed or its publish outlived the lease', e.locked_by, e.attempts, $1::int)
		ELSE format('attempts (%s) reached max_attempts (%s)', e.attempts, $1::int) END
		|| coalesce('; last publish error: ' || e.last_error, ''),
	locked_by = NULL, locked_until = NULL, lease_token = NULL,
	updated_at = {{now}}
WHERE e.id IN (
	SELECT id FROM {{events}}
	WHERE status IN ('pending', 'processing') AND attempts >= $1
	  AND (status = 'pending' OR locked_until < {{now}})
	  AND (namespace || ':' || topic) = ANY($2::text[])
	ORDER BY created_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED)
RETURNING e.id, e.namespace || ':' || e.topic`

	qPurge = `DELETE FROM {{events}} WHERE id IN (
	SELECT id FROM {{events}}
	WHERE status = 'delivered' AND updated_at < {{now}} - $1::interval
	  AND (namespace || ':' || topic) = ANY($2::text[])
	LIMIT $3
	FOR UPDATE SKIP LOCKED)`

	// Takes each role whose lease expired (or that the holder already
	// has) and renews it; roles held by another live holder are left
	// alone. Rows are locked in role order so that two electors never
	// deadlock.
	qElect = `INSERT INTO {{leaders}} AS l (role, holder, expires_at, updated_at)
SELECT r, $2, {{now}} + $3::interval, {{now}} FROM unnest($1::text[]) AS r ORDER BY r
ON CONFLICT (role) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at, updated_at = EXCLUDED.updated_at
WHERE l.holder = EXCLUDED.holder OR l.expires_at < {{now}}
RETURNING role`

	qResign = `DELETE FROM {{leaders}} WHERE holder = $1 AND role = ANY($2::text[])`

	qStats = `SELECT namespace, topic, status, count(*),
	coalesce(extract(epoch FROM {{now}} - min(next_attempt_at) FILTER (WHERE status = 'pending' AND next_attempt_at <= {{now}})), 0)::float8
FROM {{events}} GROUP BY namespace, topic, status ORDER BY namespace, topic, status`

	qDepth = `SELECT namespace || ':' || topic,
	count(*) FILTER (WHERE status = 'pending'),
	count(*) FILTER (WHERE status = 'processing'),
	count(*) FILTER (WHERE status = 'dead'),
	coalesce(extract(epoch FROM {{now}} - min(next_attempt_at) FILTER (WHERE status = 'pending' AND next_attempt_at <= {{now}})), 0)::float8
FROM {{events}}
WHERE status IN ('pending', 'processing', 'dead') AND (namespace || ':' || topic) = ANY($1::text[])
GROUP BY namespace, topic`

	eventColumns = `id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts,
	next_attempt_at, locked_by, locked_until, last_error, created_at, updated_at`

	// listWhere is the filter shared by qList and qReplayFilter.
	listWhere = `($1::text IS NULL OR status = $1)
  AND ($2::text IS NULL OR namespace = $2)
  AND ($3::text IS NULL OR topic = $3)
  AND ($4::uuid IS NULL OR tenant_id = $4)
  AND ($5::timestamptz IS NULL OR created_at >= $5)
  AND ($6::timestamptz IS NULL OR created_at < $6)
  AND ($7::timestamptz IS NULL OR (created_at, id) > ($7, $8::uuid))`

	qList = `SELECT ` + eventColumns + ` FROM {{events}}
WHERE ` + listWhere + `
ORDER BY created_at, id
LIMIT $9`

	replaySet = `status = 'pending', attempts = 0, next_attempt_at = {{now}},
	last_error = format('replayed by %s at %s', $R::text, to_char({{now}} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'))
		|| coalesce('; error before replay: ' || last_error, ''),
	updated_at = {{now}}`

	qReplayIDs = `UPDATE {{events}} SET ` + replaySet + `
WHERE id = ANY($1::uuid[]) AND status = 'dead'
RETURNING id`

	qReplayFilter = `UPDATE {{events}} SET ` + replaySet + `
WHERE id IN (SELECT id FROM {{events}} WHERE status = 'dead' AND ` + listWhere + `
	ORDER BY created_at, id LIMIT $9 FOR UPDATE SKIP LOCKED)
RETURNING id`

	qGet = `SELECT ` + eventColumns + ` FROM {{events}} WHERE id = $1`
)

// queries holds the statements with the names filled in.
type queries struct {
	insertOne, insertOneNotify, lookupDuplicate string
	insertMany, notifyMany, lookupDuplicates    string
	claim, complete, completeAsync              string
	sweep, purge, elect, resign                 string
	stats, depth, list, replayIDs, replayFilter string
	get                                         string
}

// newQueries fills the templates. nowParam is the position of the clock
// parameter each statement takes when a test clock is set ("" for the
// database clock: no parameter at all).
func newQueries(schema string, syncCommit, testClock bool) queries {
	events := pgx.Identifier{schema, TableName}.Sanitize()
	leaders := pgx.Identifier{schema, LeadersTableName}.Sanitize()
	async := `(SELECT set_config('synchronous_commit', 'off', true)) AS async_commit, `
	if syncCommit {
		async = ""
	}
	// bind fills one template. clockArg is the number of the parameter
	// that carries the test clock.
	bind := func(q string, clockArg string, asyncPart string) string {
		now, stmtNow := "now()", "statement_timestamp()"
		if testClock {
			now, stmtNow = "$"+clockArg+"::timestamptz", "$"+clockArg+"::timestamptz"
		}
		return strings.NewReplacer("{{events}}", events, "{{leaders}}", leaders, "{{async}}", asyncPart,
			"{{now}}", now, "{{stmt_now}}", stmtNow, "$R", "$"+replayByArg(q)).Replace(q)
	}
	return queries{
		insertOne:        bind(qInsertOne, "", ""),
		insertOneNotify:  bind(qInsertOneNotify, "", ""),
		lookupDuplicate:  bind(qLookupDuplicate, "", ""),
		insertMany:       bind(qInsertMany, "", ""),
		notifyMany:       qNotifyMany,
		lookupDuplicates: bind(qLookupDuplicates, "", ""),
		claim:            bind(qClaim, "6", async),
		complete:         bind(qComplete, "6", ""),
		completeAsync:    bind(qComplete, "6", async),
		sweep:            bind(qSweep, "4", ""),
		purge:            bind(qPurge, "4", ""),
		elect:            bind(qElect, "4", ""),
		resign:           bind(qResign, "", ""),
		stats:            bind(qStats, "1", ""),
		depth:            bind(qDepth, "2", ""),
		list:             bind(qList, "", ""),
		replayIDs:        bind(qReplayIDs, "3", ""),
		replayFilter:     bind(qReplayFilter, "11", ""),
		get:              bind(qGet, "", ""),
	}
}

// replayByArg is the parameter number of the "replayed by" text.
func replayByArg(q string) string {
	if q == qReplayFilter {
		return "10"
	}
	return "2"
}
