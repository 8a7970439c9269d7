// Package driver is the seam between the outbox and a database engine: the
// operations the outbox client, its dispatcher and its Admin need, and
// nothing else. The outbox never writes SQL itself; an engine is one package
// implementing Driver (today outboxpg, for PostgreSQL through pgx).
//
// Users do not call these methods: they pass a Driver to outbox.New. The
// interface is for engine authors and may grow between minor versions.
//
// # Contract shared by every method
//
//   - Time comes from the database clock. Options.Now, when set, replaces it
//     (tests move time with it); it never comes from the application's clock
//     otherwise.
//   - Rows are identified by id; a claim's lease token fences every later
//     write: Complete changes a row only while it is processing under the
//     presented token and its lease has not expired.
//   - Runners (the tx arguments) are the caller's own connection or
//     transaction (see modkit/db.Runner); work done through them commits or
//     rolls back with the caller.
//
// # How other engines fit
//
// SQLite (pure Go, for example modernc.org/sqlite) and MySQL 8 / MariaDB
// 10.6+ implement the same methods; this is how each would, so that the seam
// stays honest:
//
//   - Insert: SQLite `INSERT … ON CONFLICT (namespace, topic, dedupe_key)
//     WHERE dedupe_key IS NOT NULL DO NOTHING RETURNING id` (3.35+), then a
//     SELECT for the duplicates. MySQL has no partial unique index: a
//     generated column `dedupe_scope = IF(dedupe_key IS NULL, NULL,
//     CONCAT(namespace, ':', topic, ':', dedupe_key))` with a UNIQUE index
//     (NULLs do not collide), `INSERT IGNORE` (or ON DUPLICATE KEY UPDATE
//     id = id) and a SELECT of the existing ids; the batch form is one
//     multi-row INSERT. NotifyTopics is ignored by both (no LISTEN/NOTIFY).
//   - Claim: MySQL 8 / MariaDB 10.6 support `SELECT … FOR UPDATE SKIP
//     LOCKED` but not UPDATE … RETURNING: in one transaction, select the due
//     ids with SKIP LOCKED and LIMIT, UPDATE them by id with a fresh lease
//     token (UUID()), and SELECT them back. SQLite has one writer:
//     `UPDATE … WHERE id IN (SELECT … LIMIT n) RETURNING …` inside BEGIN
//     IMMEDIATE is already exclusive, no SKIP LOCKED needed. Ordering and
//     due-ness use the same columns.
//   - Complete: one UPDATE per outcome kind joined to the outcome ids
//     (MySQL: a derived table of VALUES ROW(…); SQLite: json_each over a
//     JSON array), each with `lease_token = ? AND status = 'processing' AND
//     locked_until > ?` (DeliveredDeleted: a DELETE with the same guard);
//     the ids changed are read back by a SELECT in the same transaction
//     (MySQL) or RETURNING (SQLite).
//   - Sweep, Purge, Replay: plain UPDATE/DELETE with LIMIT (MySQL) or a
//     rowid subquery (SQLite), in batches.
//   - Elect: the leader table is engine-neutral: an upsert that takes a row
//     whose lease expired (`INSERT … ON DUPLICATE KEY UPDATE holder =
//     IF(expires_at < ?, VALUES(holder), holder)` on MySQL, `INSERT … ON
//     CONFLICT DO UPDATE … WHERE` on SQLite) and a SELECT of the rows held.
//   - Stats, Backlog, Depth, List, Get: plain SELECTs; keyset paging on (created_at,
//     id) works everywhere.
//   - Listen: neither engine has notifications. The method returns
//     ErrListenUnsupported at once and the dispatcher polls (it always polls
//     anyway; notifications only cut latency).
//   - InTx: the engine's own transaction (*sql.Tx) handed to transactional
//     handlers.
//   - Migrate: each engine ships its own migration files for the same
//     columns (uuid as BINARY(16) or TEXT, jsonb as JSON or TEXT).
package driver

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/google/uuid"
)

// Driver opens the outbox's operations for one configuration.
type Driver interface {
	// Open binds the driver to opts (schema, commit mode, clock). It does
	// no I/O.
	Open(opts Options) (Store, error)
}

// Options binds a Store.
type Options struct {
	// Schema (or database) holding the outbox tables. Required.
	Schema string
	// SynchronousCommit makes claims and outcomes written on the driver's
	// own connections wait for durability. Off by default: a lost claim or
	// outcome only means a redelivery.
	SynchronousCommit bool
	// Now replaces the database clock when set (tests only).
	Now func() time.Time
	// Logger receives the driver's own records (migrations applied).
	Logger *slog.Logger
}

// Store is every operation the outbox needs from its database. Methods are
// safe for concurrent use.
type Store interface {
	// Insert writes rows through tx, the caller's runner, skipping rows
	// whose (namespace, topic, dedupe_key) exists. It returns one result
	// per row, in order. notifyTopics ("namespace:topic") are announced to
	// listening dispatchers, when the engine can.
	Insert(ctx context.Context, tx any, rows []InsertRow, notifyTopics []string) ([]Inserted, error)
	// Claim leases up to Limit due events of the listed topics to the
	// caller, oldest first.
	Claim(ctx context.Context, p ClaimParams) ([]Claimed, error)
	// Complete records worker's outcomes, each fenced by its lease token,
	// the worker and the lease's expiry, and appends each recorded outcome
	// to the event's history in the same write. tx nil means the driver's
	// own connection, and settled[i] reports whether outcomes[i] was
	// recorded. With a tx (the caller's runner) exactly one outcome is
	// allowed, and an outcome that cannot be recorded is an error:
	// ErrLeaseLost, or ErrInvalidState for an outcome a worker may not
	// record.
	Complete(ctx context.Context, tx any, worker uuid.UUID, outcomes []Outcome) (settled []bool, err error)
	// InTx runs fn in a transaction of the driver's own database and
	// commits when fn returns nil. tx is the engine's transaction type
	// (pgx.Tx for outboxpg).
	InTx(ctx context.Context, fn func(ctx context.Context, tx any) error) error
	// Sweep repairs expired leases of the topics (the event goes back to
	// pending and its history records the lost claim) and dead-letters
	// events whose attempts reached MaxAttempts and that no live lease
	// holds. It returns each event it changed.
	Sweep(ctx context.Context, p SweepParams) ([]Swept, error)
	// Purge deletes delivered events of the topics older than Retention
	// (and settled at or after p.From, when it is set), Limit rows per
	// statement, until a statement deletes fewer than Limit; it returns
	// how many, and the cutoff that last statement purged below (see
	// PurgeResult).
	Purge(ctx context.Context, p PurgeParams) (PurgeResult, error)
	// Elect takes or renews the leases of the named roles for holder and
	// returns the roles the holder leads after the call.
	Elect(ctx context.Context, p ElectParams) ([]string, error)
	// Resign gives up holder's leases on the roles, if it holds them.
	Resign(ctx context.Context, holder uuid.UUID, roles []string) error
	// Stats counts events per (namespace, topic, status).
	Stats(ctx context.Context) ([]StatsRow, error)
	// Backlog is Stats for the pending, processing and dead events only:
	// it returns no row of delivered events, and its cost should follow
	// the backlog and the dead events, not the delivered events kept
	// (outboxpg: from their indexes, since migration 0027).
	Backlog(ctx context.Context) ([]StatsRow, error)
	// Served returns the topics ("namespace:topic") whose maintenance
	// role (see Elect) a holder leads now: those a running dispatcher
	// serves. ErrServedUnknown: the engine (or the schema's version)
	// cannot tell.
	Served(ctx context.Context) ([]string, error)
	// Depth reads the gauges of the listed topics.
	Depth(ctx context.Context, topics []string) ([]DepthRow, error)
	// List returns events matching f, oldest first, at most f.Limit.
	List(ctx context.Context, f ListFilter) ([]Event, error)
	// Get returns one event or ErrNotFound.
	Get(ctx context.Context, id uuid.UUID) (Event, error)
	// Series counts the delivered events of the last Window per Bucket
	// and topic, with their enqueue-to-delivery latency (see series.go).
	Series(ctx context.Context, p SeriesParams) (SeriesResult, error)
	// Settled returns delivered and dead events whose last change is at or
	// after p.Since (and after the cursor, when p has one), oldest change
	// first (by updated_at, then id), at most p.Limit.
	Settled(ctx context.Context, p SettledParams) ([]Event, error)
	// Replay puts dead events matching p back to pending with their
	// attempts reset, records who did it in their history, and returns
	// their ids.
	Replay(ctx context.Context, p ReplayParams) ([]uuid.UUID, error)
	// PurgeDead deletes the dead events p selects (as Replay selects
	// them), records who did it in their history, and returns their ids.
	PurgeDead(ctx context.Context, p ReplayParams) ([]uuid.UUID, error)
	// DeadLetter makes the pending events p selects dead (as Replay
	// selects dead ones; p.Filter.Status is "pending"), leaving leased
	// ones alone, records who did it in their history, and returns their
	// ids.
	DeadLetter(ctx context.Context, p ReplayParams) ([]uuid.UUID, error)
	// PruneSequences deletes at most limit (at least 1) of the ordering
	// keys' sequence rows whose key has no event left, of any status,
	// among those after the row after (a stream id; 0 for the first),
	// and returns how many it deleted and the last row it took (0 when
	// none is left), for the next call's after. A row that an enqueue under way
	// holds is skipped, and a READ COMMITTED enqueue never fails for a row deleted: a
	// key used again after its row went starts a new stream at sequence
	// 1. A schema that cannot (outboxpg: without migration 0045) fails
	// with the engine's "undefined function" error.
	PruneSequences(ctx context.Context, limit int, after int64) (pruned, last int64, err error)
	// PrunableSequences counts the sequence rows PruneSequences would
	// delete now.
	PrunableSequences(ctx context.Context) (int64, error)
	// History returns an event's attempts ledger, oldest first. It is
	// kept after the event is purged; an unknown id has an empty history.
	History(ctx context.Context, id uuid.UUID) ([]Attempt, error)
	// BlockedKeys lists ordering keys whose earliest undelivered event is
	// dead and not skipped, at most limit, longest dead first.
	BlockedKeys(ctx context.Context, limit int) ([]BlockedKey, error)
	// ReleaseHeld lets into the claim the events of the topics that wait
	// behind an ordering predecessor that has settled (delivered, purged,
	// skipped, or dead in one of skipDead) but were enqueued while it
	// settled, at most limit; it returns how many.
	ReleaseHeld(ctx context.Context, topics, skipDead []string, limit int) (int64, error)
	// SkipHead lets the later events of a dead event's ordering key go on
	// without it, recording who did it; false when id is not such an event.
	SkipHead(ctx context.Context, id uuid.UUID, by string) (bool, error)
	// Listen calls onReady once it listens, then wake with each
	// notification's payload, until ctx ends or the connection is lost
	// (the error says which). ErrListenUnsupported: the engine cannot.
	// A driver that checks that its listener hears notifications sent by
	// other sessions calls wake with the empty topic when a check comes
	// back, and returns an error wrapping ErrListenDeaf when one does not.
	Listen(ctx context.Context, onReady func(), wake func(topic string)) error
	// Migrate applies the engine's migrations for this schema.
	Migrate(ctx context.Context) error
	// MigrateTo applies those up to version, which must be one of them
	// (0: all of them, as Migrate).
	MigrateTo(ctx context.Context, version int64) error
	// Fatal reports whether err cannot be cured by retrying (missing
	// table, permissions, bad SQL, no such database, a refused login), as
	// opposed to a lost connection.
	Fatal(err error) bool
}

// MigrationChecker is implemented by a Store that can tell which of its
// engine's migrations the schema lacks. It is optional: a dispatcher asks
// once a start and logs a warning when some are missing (a library
// upgraded, its migrations not run).
type MigrationChecker interface {
	// MissingMigrations returns the names of the engine's migrations
	// ("0034_outbox_served_topics") that the schema's record of applied
	// migrations lacks, oldest first. It returns nil when nothing can be
	// told: the schema records none (its migrations were applied by
	// another tool), or the role may not read the record.
	MissingMigrations(ctx context.Context) ([]string, error)
}

// VacuumChecker is implemented by a Store that can tell whether its
// engine's automatic vacuum is off for the outbox's tables. It is
// optional: a dispatcher asks once a start and logs a warning when it is,
// since every claim and outcome leaves a dead row version behind.
type VacuumChecker interface {
	// AutovacuumOff says why automatic vacuum does not run on the outbox's
	// events ("" when it does, or when nothing can be told).
	AutovacuumOff(ctx context.Context) (string, error)
}

// RightsChecker is implemented by a Store that can tell what the role it
// connects as may do in the outbox. It is optional: without it, Admin.Rights
// reports nothing known, and each call finds out.
type RightsChecker interface {
	// Rights says what the connected role may do; Known is false when the
	// schema lacks the functions it asks about (not migrated, or an older
	// schema).
	Rights(ctx context.Context) (Rights, error)
}

// Rights is what a RightsChecker reports.
type Rights struct {
	// User is the connected role (current_user).
	User string
	// Known: the engine could tell; Operate and ReadPayloads are false
	// otherwise.
	Known bool
	// Operate: the role may replay, purge and skip dead events and purge
	// delivered ones.
	Operate bool
	// ReadPayloads: the role may read payloads and headers.
	ReadPayloads bool
}

// OutcomeFinder is implemented by a Store that can tell which outcomes a
// worker recorded under the lease tokens it presented. It is optional: an
// outcome write whose commit went through while its answer was lost (the
// connection dropped) is tried again, and the retry finds those leases
// ended by that commit; the dispatcher asks RecordedOutcomes about the
// outcomes the retry did not record rather than report their leases lost.
type OutcomeFinder interface {
	// RecordedOutcomes reports, for each of outcomes (by ID and
	// LeaseToken), whether worker recorded an outcome for that event under
	// that token.
	RecordedOutcomes(ctx context.Context, worker uuid.UUID, outcomes []Outcome) ([]bool, error)
}

// PoolSizer is implemented by a Store that can tell how many connections
// its pool opens at most. It is optional: a dispatcher with publishers
// that consume in a transaction (each holding a connection) warns when the
// pool is too small for them.
type PoolSizer interface {
	PoolSize() int
}

// Errors a Store returns.
var (
	// ErrServedUnknown: Served cannot tell which topics are served (for
	// outboxpg, a schema before migration 0034).
	ErrServedUnknown = errors.New("outbox driver: which topics are served is unknown")
	// ErrNotFound: Get found no event with that id.
	ErrNotFound = errors.New("outbox driver: event not found")
	// ErrListenUnsupported: the engine has no notifications; poll.
	ErrListenUnsupported = errors.New("outbox driver: listen not supported")
	// ErrListenDeaf: the listener's connection delivered no notification,
	// not even a check sent to it from another session; it listens where
	// no one notifies (behind a pooler in transaction mode, say).
	ErrListenDeaf = errors.New("the notification listener hears nothing, not even its own check sent from another session")
	// ErrInvisibleDuplicate: an insert conflicted with a row the caller's
	// transaction cannot see (REPEATABLE READ or SERIALIZABLE, or a purge
	// raced it).
	ErrInvisibleDuplicate = errors.New("outbox driver: dedupe key conflicts with a row this transaction cannot see")
	// ErrSerialization: the database aborted the caller's transaction
	// because of a concurrent one (SQLSTATE 40001); retrying the whole
	// transaction is the cure.
	ErrSerialization = errors.New("outbox driver: serialization failure")
	// ErrLeaseLost: a single outcome was not recorded because the event is
	// no longer leased to that worker under that token (the lease expired,
	// or the event was claimed again or settled). PostgreSQL: SQLSTATE
	// P7002.
	ErrLeaseLost = errors.New("outbox: lease lost")
	// ErrInvalidState: the outcome is not one a worker may record.
	// PostgreSQL: SQLSTATE P7003.
	ErrInvalidState = errors.New("outbox: invalid completion state")
)

// InsertRow is one validated event to insert.
type InsertRow struct {
	ID        uuid.UUID
	Namespace string
	Topic     string
	TenantID  *uuid.UUID
	DedupeKey *string
	Payload   []byte
	// Headers is stored as a JSON object; nil stores NULL.
	Headers map[string]string
	// OrderingKey, when set, gives the event the key's next sequence,
	// allocated in tx (gap-free; a duplicate takes none).
	OrderingKey *string
}

// Inserted is Insert's result for one row.
type Inserted struct {
	ID uuid.UUID
	// Duplicate: a row with the dedupe key existed; ID is that row's.
	Duplicate bool
}

// ClaimParams says what to claim.
type ClaimParams struct {
	// Topics to claim from ("namespace:topic").
	Topics []string
	// Limit is the most events to claim.
	Limit int
	// MaxAttempts: only events with fewer attempts are claimed.
	MaxAttempts int
	// Worker goes into locked_by.
	Worker uuid.UUID
	// Lease is how long the claim lasts.
	Lease time.Duration
	// SkipDeadTopics ("namespace:topic") are topics whose dead events do
	// not hold back the later events of their ordering key.
	SkipDeadTopics []string
	// Chains, when not nil, has one entry per topic: the most events of
	// one ordering key of Topics[i] to claim together (below 2: one). With
	// the first claimable event of a key (its head) the claim then also
	// leases the key's next events, contiguous in sequence, while they are
	// due and not leased, within Limit (heads in order, each with its
	// run, while they fit). The caller must
	// publish a key's claimed events one at a time in OrderingSeq order
	// (which need not be CreatedAt order), each only after the one before
	// it was delivered, and give back the rest (Release) when one is not.
	Chains []int
}

// Claimed is one leased event.
type Claimed struct {
	ID         uuid.UUID
	Namespace  string
	Topic      string
	TenantID   *uuid.UUID
	DedupeKey  *string
	Payload    []byte
	Attempts   int // including this claim
	LeaseToken uuid.UUID
	Headers    map[string]string
	// OrderingKey and OrderingSeq: the event's key and its place in the
	// key's sequence (nil and 0 without a key).
	OrderingKey *string
	OrderingSeq int64
	// Repaired: the event's previous lease had expired without an
	// outcome; this claim repaired it.
	Repaired bool
	// LockedTill is when the lease ends: the database's clock at the
	// claim's start plus ClaimParams.Lease (the dispatcher reads the
	// database clock's lead over its own from it, for delivery.lag).
	LockedTill time.Time
	CreatedAt  time.Time
}

// OutcomeKind is what Complete does with one event.
type OutcomeKind uint8

// The outcome kinds.
const (
	// Delivered: terminal success.
	Delivered OutcomeKind = iota + 1
	// Retry: pending again after Delay, with Error recorded.
	Retry
	// Dead: terminal failure, with Error recorded.
	Dead
	// Release: pending at once, the claim's attempt undone.
	Release
	// DeliveredDeleted: terminal success, and the event is deleted in the
	// same write; its history records it as delivered.
	DeliveredDeleted
)

// Outcome is one event's settlement.
type Outcome struct {
	ID         uuid.UUID
	LeaseToken uuid.UUID
	Kind       OutcomeKind
	Error      string // Retry and Dead: the publish error (last_error); Release: why (the history's detail only)
	Delay      time.Duration
}

// SweepParams selects exhausted events.
type SweepParams struct {
	Topics      []string
	MaxAttempts int
	Limit       int
}

// Swept is one event Sweep changed.
type Swept struct {
	ID    uuid.UUID
	Topic string // "namespace:topic"
	// Repaired: its expired lease was cleared and it is pending again;
	// otherwise it was dead-lettered.
	Repaired bool
}

// PurgeParams selects delivered events to delete.
type PurgeParams struct {
	Topics    []string
	Retention time.Duration
	Limit     int
	// Recorded: an operator's purge, recorded in each purged event's
	// history with the database session user (the dispatchers' own
	// retention purge is not). It walks from the oldest event: From must
	// be zero, and its result has no Cutoff.
	Recorded bool
	// From starts the walk: only events settled at or after it are
	// deleted, and the events settled before it are not read. Zero walks
	// from the oldest. The dispatcher passes a watermark, the Cutoff of
	// its previous complete purge minus a margin (maintenance.go).
	From time.Time
}

// PurgeResult is what Store.Purge did.
type PurgeResult struct {
	// Purged counts the deleted events.
	Purged int64
	// Cutoff is the time (in the database's clock, or the test clock)
	// before which the last statement deleted the topics' delivered
	// events settled at or after From: every one it could see and lock.
	// Zero when the purge did not complete (it failed, or was cut short
	// after a statement that deleted Limit events), for a Recorded purge,
	// and on a schema without migration 0025, where the purge walks from
	// the oldest event whatever From says.
	Cutoff time.Time
}

// ElectParams asks for leadership of roles.
type ElectParams struct {
	Roles  []string
	Holder uuid.UUID
	TTL    time.Duration
}

// StatsRow counts one (namespace, topic, status).
type StatsRow struct {
	Namespace, Topic, Status string
	Count                    int64
	// OldestDueAge: for pending rows, how long the oldest due one has
	// waited past next_attempt_at.
	OldestDueAge time.Duration
}

// DepthRow holds one topic's gauges.
type DepthRow struct {
	Topic                     string // "namespace:topic"
	Pending, Processing, Dead int64
	OldestDueAge              time.Duration
	// Stuck counts processing events whose lease expired without an
	// outcome (waiting for a claim or the sweeper to repair them).
	Stuck int64
}

// ListFilter selects events for List. Zero fields match anything.
type ListFilter struct {
	Status    string
	Namespace string
	Topic     string
	TenantID  *uuid.UUID
	// CreatedAfter and CreatedBefore bound created_at.
	CreatedAfter, CreatedBefore time.Time
	// After is the keyset cursor: rows after (AfterCreatedAt, AfterID).
	AfterCreatedAt time.Time
	AfterID        uuid.UUID
	Limit          int
}

// ReplayParams selects dead events to replay or purge: by id when IDs is
// non-empty, otherwise by the filter (Status is ignored: only dead rows are
// replayed or purged). By names who asked, for the events' history.
type ReplayParams struct {
	IDs    []uuid.UUID
	Filter ListFilter
	By     string
}

// Event is a full outbox row.
type Event struct {
	ID            uuid.UUID
	Namespace     string
	Topic         string
	TenantID      *uuid.UUID
	DedupeKey     *string
	Payload       []byte
	Status        string
	Attempts      int
	NextAttemptAt time.Time
	LockedBy      *uuid.UUID
	LockedUntil   *time.Time
	LastError     *string
	CreatedAt     time.Time
	UpdatedAt     time.Time
	// Headers are nil when the reader may not see payloads.
	Headers     map[string]string
	OrderingKey *string
	OrderingSeq *int64
}

// BlockedKey is an ordering key held back by a dead event.
type BlockedKey struct {
	Namespace, Topic, OrderingKey string
	HeadID                        uuid.UUID
	HeadSeq                       int64
	// Waiting counts the key's later events that are pending or leased.
	Waiting   int64
	LastError *string
	DeadSince time.Time
}

// Attempt is one row of an event's history: the outcome of one claim, or an
// operator's or the sweeper's action.
type Attempt struct {
	// No numbers the event's history rows from 1, without gaps.
	No int
	// Outcome: delivered, retry, dead, released, lease_expired (a claim
	// ended without an outcome), swept (dead-lettered by the sweeper),
	// replayed, skipped, purged.
	Outcome string
	// Attempt is the event's attempt counter during the claim the row
	// closes; 0 for rows that close no claim.
	Attempt    int
	Worker     *uuid.UUID
	LeaseToken *uuid.UUID
	ClaimedAt  *time.Time
	FinishedAt time.Time
	// Detail is the publish error, or what the sweeper or operator did.
	Detail string
	// Actor is the database session user of an operator action.
	Actor string
}
