package outboxpg

import (
	"strings"

	"github.com/jackc/pgx/v5"
)

// The statements of the PostgreSQL driver. Every write and every read goes
// through the outbox's SECURITY DEFINER functions (created by migration
// 0004, some replaced since), so the driver works for a login role holding
// only the outbox role it needs (producer, dispatcher, operator or reader)
// and never touches a table directly, except for the enqueue of events
// without an ordering key: one event by a plain INSERT (qInsertKeyless or
// qInsertKeylessNotify without a dedupe key, qInsertPlain or qInsertDirect
// with one, the second of each pair announcing its topic), a large batch by
// COPY. A producer may do both (it may INSERT the message columns and
// nothing else, and the table's checks hold for them); a duplicate, and
// every event with an ordering key, go to the enqueue functions.
//
// {{fn}} stands for the quoted schema followed by a dot; {{channel}} for
// the schema's NotifyChannel as a string literal; {{async}}, joined
// into a statement's FROM list, makes that statement's implicit transaction
// commit without waiting for its WAL flush (empty with
// Options.SynchronousCommit); {{now}} is the test clock parameter, when one
// is set (see newQueries), and NULL (the database clock) otherwise.
const (
	qInsertOne = `SELECT id, duplicate FROM {{fn}}modkit_outbox_enqueue($1, $2, $3, $4, $5, $6::jsonb, $7, $8::jsonb, $9)`

	// qInsertDirect enqueues one event with a dedupe key and without an
	// ordering key that announces its topic (qInsertPlain when it does
	// not; an event without a dedupe key takes qInsertKeyless or
	// qInsertKeylessNotify) by a plain INSERT of the message columns,
	// which a producer may write (as the COPY path does; the table's
	// checks hold for it): the enqueue function's call cost a tenth of the
	// enqueue rate (BENCHMARKS.md, "Enqueue without the function call").
	// Its row count says how many rows it inserted, 0 on any unique
	// conflict (ON CONFLICT without a target, which needs no SELECT
	// privilege; nor does a RETURNING list that names no column). The
	// RETURNING list runs only for an inserted row, so the topic is
	// announced only then; in pgbench it ran at 1.01-1.15x (median 1.06x)
	// the rate of the data-modifying CTE, count and join it replaced
	// (BENCHMARKS.md, "NOTIFY in the RETURNING list"). On 0 the driver asks the enqueue
	// function, which finds the existing event.
	qInsertDirect = `INSERT INTO {{table}} (id, namespace, topic, tenant_id, dedupe_key, payload, headers)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7::jsonb)
ON CONFLICT DO NOTHING
RETURNING pg_catalog.pg_notify({{channel}}, $2 || ':' || $3)`

	// qInsertPlain is qInsertDirect without the announcement, for the
	// enqueues that need none (most: a client announces a topic at most
	// once per Config.NotifyInterval): a bare INSERT whose row count says
	// whether it inserted.
	qInsertPlain = `INSERT INTO {{table}} (id, namespace, topic, tenant_id, dedupe_key, payload, headers)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7::jsonb)
ON CONFLICT DO NOTHING`

	// qInsertKeyless and qInsertKeylessNotify enqueue one event without a
	// dedupe key or ordering key: nothing but its fresh primary key could
	// conflict, so they leave out ON CONFLICT, whose check of the unique
	// indexes and speculative insertion cost a one-row INSERT about 4% of
	// its server time (BENCHMARKS.md, "Keyless enqueues without ON
	// CONFLICT"). The second announces the topic in its RETURNING list. (An
	// id that repeats one already stored, as likely as two of 62 random bits
	// drawn in the same millisecond being equal, fails the statement.)
	qInsertKeyless = `INSERT INTO {{table}} (id, namespace, topic, tenant_id, payload, headers)
VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb)`

	qInsertKeylessNotify = qInsertKeyless + `
RETURNING pg_catalog.pg_notify({{channel}}, $2 || ':' || $3)`

	qInsertMany = `SELECT ord, id FROM {{fn}}modkit_outbox_enqueue_many($1::uuid[], $2::text[], $3::text[], $4::uuid[], $5::text[], $6::jsonb[], $7::text[], $8::jsonb[], $9::text[])`

	qClaim = `SELECT c.id, c.namespace, c.topic, c.tenant_id, c.dedupe_key, c.payload, c.attempts, c.lease_token,
	c.locked_until, c.created_at, c.repaired, c.headers, c.ordering_key, c.ordering_seq
FROM {{async}}{{fn}}modkit_outbox_claim_chained($1, $2::text[], $3, $4, $5::interval, $6::text[], $7::int[], {{now}}) AS c`

	qComplete = `SELECT id FROM {{async}}{{fn}}modkit_outbox_complete($1, $2::uuid[], $3::uuid[], $4::text[], $5::text[], $6::bigint[], {{now}}) AS id`

	// qRecorded finds the outcomes a worker recorded under the tokens it
	// presented (migration 0035; store.RecordedOutcomes).
	qRecorded = `SELECT ord FROM {{fn}}modkit_outbox_recorded_outcomes($1, $2::uuid[], $3::uuid[]) AS ord`

	qCompleteOne = `SELECT {{fn}}modkit_outbox_complete_one($1, $2, $3, $4, $5, $6, {{now}})`

	qSweep = `SELECT id, topic, repaired FROM {{fn}}modkit_outbox_sweep($1::text[], $2, $3, {{now}})`

	qPurge         = `SELECT {{fn}}modkit_outbox_purge($1::text[], $2::interval, $3, {{now}})`
	qPurgeRecorded = `SELECT {{fn}}modkit_outbox_purge_recorded($1::text[], $2::interval, $3, {{now}})`
	// The dispatchers' purge from a watermark (migration 0025); without
	// the function, qPurge serves (store.Purge).
	qPurgeFrom = `SELECT purged, cutoff FROM {{fn}}modkit_outbox_purge_from($1::text[], $2::interval, $3, $4::timestamptz, {{now}})`

	qElect = `SELECT r FROM {{fn}}modkit_outbox_elect($1::text[], $2, $3::interval, {{now}}) AS r`

	qResign = `SELECT {{fn}}modkit_outbox_resign($1, $2::text[])`

	qStats = `SELECT namespace, topic, status, count, oldest_due_seconds FROM {{fn}}modkit_outbox_stats({{now}})`

	// qBacklog is qStats for pending, processing and dead events only,
	// read from their indexes (migration 0027); without the function,
	// qStats serves (store.Backlog).
	qBacklog = `SELECT namespace, topic, status, count, oldest_due_seconds FROM {{fn}}modkit_outbox_backlog({{now}})`
	qServed  = `SELECT namespace || ':' || topic FROM {{fn}}modkit_outbox_served_topics({{now}})`

	qDepth = `SELECT topic, pending, processing, dead, oldest_due_seconds, stuck FROM {{fn}}modkit_outbox_depth($1::text[], {{now}})`

	eventColumns = `id, namespace, topic, tenant_id, dedupe_key, payload, status, attempts,
	next_attempt_at, locked_by, locked_until, last_error, created_at, updated_at, headers, ordering_key, ordering_seq`

	filterParams = `$1::text, $2::text, $3::text, $4::uuid, $5::timestamptz, $6::timestamptz, $7::timestamptz, $8::uuid, $9::int`

	qList         = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_list(` + filterParams + `)`
	qListPayloads = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_list_payloads(` + filterParams + `)`
	qGet          = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_get($1)`
	qGetPayload   = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_get_payload($1)`

	qHistory = `SELECT attempt_no, outcome, coalesce(attempt, 0), worker, lease_token, claimed_at, finished_at,
	coalesce(detail, ''), coalesce(actor, '') FROM {{fn}}modkit_outbox_history($1)`

	qReplayIDs    = `SELECT id FROM {{fn}}modkit_outbox_replay($1::uuid[], $2, {{now}}) AS id`
	qReplayFilter = `SELECT id FROM {{fn}}modkit_outbox_replay_filter(` + filterParams + `, $10, {{now}}) AS id`

	qPurgeDeadIDs     = `SELECT id FROM {{fn}}modkit_outbox_purge_dead($1::uuid[], $2, {{now}}) AS id`
	qPurgeDeadFilter  = `SELECT id FROM {{fn}}modkit_outbox_purge_dead_filter(` + filterParams + `, $10, {{now}}) AS id`
	qDeadLetterIDs    = `SELECT id FROM {{fn}}modkit_outbox_dead_letter($1::uuid[], $2, {{now}}) AS id`
	qDeadLetterFilter = `SELECT id FROM {{fn}}modkit_outbox_dead_letter_filter(` + filterParams + `, $10, {{now}}) AS id`

	qPruneSequences    = `SELECT pruned, last_stream FROM {{fn}}modkit_outbox_prune_sequences($1, $2)`
	qPrunableSequences = `SELECT {{fn}}modkit_outbox_prunable_sequences()`

	qBlockedKeys = `SELECT namespace, topic, ordering_key, head_id, head_seq, waiting, last_error, dead_since
FROM {{fn}}modkit_outbox_blocked_keys($1)`
	qSkipHead    = `SELECT {{fn}}modkit_outbox_skip_head($1, $2, {{now}})`
	qReleaseHeld = `SELECT {{fn}}modkit_outbox_release_held($1::text[], $2::text[], $3)`

	qRolesPresent = `SELECT array_agg(r ORDER BY r) FROM unnest($1::text[]) AS r WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r)`
)

// Roles are the database roles migration 0004 creates and grants.
var Roles = []string{RoleProducer, RoleDispatcher, RoleOperator, RoleReader}

// The outbox's runtime roles (NOLOGIN group roles, cluster-wide; grant them
// to your login roles).
const (
	// RoleProducer may enqueue (through the enqueue functions, or the
	// message columns of the events table for COPY) and nothing else: it
	// cannot read events, not even its own dedupe keys.
	RoleProducer = "modkit_outbox_producer"
	// RoleDispatcher may claim, complete, repair, sweep, purge and read
	// gauges, for the topics it names; no direct table access.
	RoleDispatcher = "modkit_outbox_dispatcher"
	// RoleOperator may read stats, list and show events with payloads and
	// history, replay dead events and purge, and prune the sequence rows
	// of ordering keys without events (since migration 0045); each replay
	// is recorded with its session_user.
	RoleOperator = "modkit_outbox_operator"
	// RoleReader may read stats, list and show events without payloads,
	// and history.
	RoleReader = "modkit_outbox_reader"
)

// queries holds the statements with the names filled in.
type queries struct {
	insertOne, insertDirect, insertPlain string
	insertKeyless, insertKeylessNotify   string
	insertMany                           string
	claim, complete, completeAsync       string
	completeOne, sweep, purge, elect     string
	recorded                             string
	purgeRecorded, purgeFrom             string
	resign, stats, backlog, depth        string
	served                               string
	list, listPayload                    string
	get, getPayload, history             string
	replayIDs, replayFilter              string
	purgeDeadIDs, purgeDeadFilter        string
	deadLetterIDs, deadLetterFilter      string
	pruneSequences, prunableSequences    string
	blockedKeys, skipHead, releaseHeld   string
}

// newQueries fills the templates. With testClock, {{now}} becomes the
// statement's last parameter (one past its own), which store.args appends.
func newQueries(schema string, syncCommit, testClock bool) queries {
	fn := pgx.Identifier{schema}.Sanitize() + "."
	table := pgx.Identifier{schema, TableName}.Sanitize()
	async := `(SELECT set_config('synchronous_commit', 'off', true)) AS async_commit, `
	if syncCommit {
		async = ""
	}
	bind := func(q string, clockArg string, asyncPart string) string {
		now := "NULL::timestamptz"
		if testClock && clockArg != "" {
			now = "$" + clockArg + "::timestamptz"
		}
		return strings.NewReplacer("{{fn}}", fn, "{{table}}", table, "{{channel}}", quoteLiteral(NotifyChannel(schema)), "{{async}}", asyncPart, "{{now}}", now).Replace(q)
	}
	return queries{
		insertOne:           bind(qInsertOne, "", ""),
		insertDirect:        bind(qInsertDirect, "", ""),
		insertPlain:         bind(qInsertPlain, "", ""),
		insertKeyless:       bind(qInsertKeyless, "", ""),
		insertKeylessNotify: bind(qInsertKeylessNotify, "", ""),
		insertMany:          bind(qInsertMany, "", ""),
		claim:               bind(qClaim, "8", async),
		blockedKeys:         bind(qBlockedKeys, "", ""),
		skipHead:            bind(qSkipHead, "3", ""),
		releaseHeld:         bind(qReleaseHeld, "", ""),
		complete:            bind(qComplete, "7", ""),
		completeAsync:       bind(qComplete, "7", async),
		completeOne:         bind(qCompleteOne, "7", ""),
		recorded:            bind(qRecorded, "", ""),
		sweep:               bind(qSweep, "4", ""),
		purge:               bind(qPurge, "4", ""),
		purgeRecorded:       bind(qPurgeRecorded, "4", ""),
		purgeFrom:           bind(qPurgeFrom, "5", ""),
		elect:               bind(qElect, "4", ""),
		resign:              bind(qResign, "", ""),
		stats:               bind(qStats, "1", ""),
		backlog:             bind(qBacklog, "1", ""),
		served:              bind(qServed, "1", ""),
		depth:               bind(qDepth, "2", ""),
		list:                bind(qList, "", ""),
		listPayload:         bind(qListPayloads, "", ""),
		get:                 bind(qGet, "", ""),
		getPayload:          bind(qGetPayload, "", ""),
		history:             bind(qHistory, "", ""),
		replayIDs:           bind(qReplayIDs, "3", ""),
		replayFilter:        bind(qReplayFilter, "11", ""),
		purgeDeadIDs:        bind(qPurgeDeadIDs, "3", ""),
		purgeDeadFilter:     bind(qPurgeDeadFilter, "11", ""),
		deadLetterIDs:       bind(qDeadLetterIDs, "3", ""),
		deadLetterFilter:    bind(qDeadLetterFilter, "11", ""),
		pruneSequences:      bind(qPruneSequences, "", ""),
		prunableSequences:   bind(qPrunableSequences, "", ""),
	}
}
