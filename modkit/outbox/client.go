package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Config configures a Client. The zero value is valid: the outbox tables in
// the public schema, default limits, notifications on.
type Config struct {
	// Schema holding the outbox tables. Default "public". Client.Migrate
	// creates them there; every enqueue, dispatcher and Admin call of the
	// client uses it.
	Schema string
	// MaxPayloadBytes caps Message.Payload, its JSON text, with each
	// number counted as PostgreSQL prints it: every digit (1e6 as 1000000),
	// since every read of the event prints it so. Default 1 MiB.
	// The database refuses a payload whose stored (binary jsonb) form
	// exceeds 4 MiB on its own, unless the owner raises that limit with
	// SELECT <schema>.modkit_outbox_set_payload_limit(bytes). The stored
	// form of an object of strings is about its text's size; of an array
	// of small numbers, up to six times it (a 700 KB payload of them can
	// pass this check and fail the database's). Such a refusal also
	// matches ErrPayloadTooLarge, but it comes from the INSERT, which
	// aborts the caller's transaction.
	MaxPayloadBytes int
	// ErrorMaxLen caps the publish error stored in last_error, in bytes.
	// Default 2048; at least 64.
	ErrorMaxLen int
	// NotifyInterval is the least time between two NOTIFYs this client
	// sends for one (namespace, topic). A transaction that sent NOTIFY holds
	// a database-wide lock from just before its commit until after it, so
	// notifying commits are serialised; a busy producer therefore announces
	// a burst once rather than per event, and a woken dispatcher keeps
	// re-checking for DispatcherConfig.WakeWindow (which must exceed this,
	// or events may wait for the dispatcher's poll; NewDispatcher warns
	// when its client's NotifyInterval is not below it).
	// Events of a transaction that commits long after its enqueue, or after
	// a rolled-back transaction took the NOTIFY slot, may wait for the
	// dispatcher's poll (an enqueue that failed, or found only duplicates,
	// announces nothing and gives the slot back). Default 1ms (it was 10ms: at 500 events/s, 1ms
	// gave a p50 of 1.9ms from commit to publish against 2.6ms). Where
	// commits are slow (a few milliseconds each), notifying commits queue
	// behind each other: eight producers enqueueing as fast as they could
	// made about a fifth fewer commits with 1ms than with 10ms on such a
	// machine. A service that enqueues heavily and can wait a few
	// milliseconds more for delivery may raise it (BENCHMARKS.md).
	NotifyInterval time.Duration
	// DisableNotify stops enqueues from sending NOTIFY at all: dispatchers
	// then rely on polling alone. Set it, with DispatcherConfig.PollOnly,
	// behind PgBouncer in transaction mode when the dispatchers only poll;
	// not when their listener has a connection of its own (outboxpg's
	// Driver.ListenOn), which it would leave without a wake-up (README,
	// Behind PgBouncer).
	DisableNotify bool
	// SynchronousCommit makes claims and the outcomes recorded on the
	// client's own connections wait for their WAL flush. By default they
	// commit asynchronously (for those statements only), which saves a disk
	// flush per claim and per batch of outcomes. It cannot lose or duplicate
	// more than at-least-once allows: if the server crashes, the last
	// fraction of a second of claims and outcomes may be rolled back, so
	// those events are published again, possibly while the first publish is
	// still running. Set it if your publishers must never overlap even
	// across a server crash. Enqueues and transactional handlers always keep
	// the caller's transaction's setting.
	SynchronousCommit bool
	// Logger for the client's dispatchers and migrations. Default
	// slog.Default().
	Logger *slog.Logger
	// Now, when set, replaces the database clock for claims, leases,
	// retries, sweeps, purges, elections and Admin. Tests use it to move
	// time without waiting; leave it nil in production, where the database
	// clock is the only authority. Enqueued events still take the
	// database's time as their created_at and next_attempt_at.
	Now func() time.Time
}

const (
	schemaDefault         = db.SchemaDefault
	payloadLimitDefault   = 1 << 20
	errorMaxLenDefault    = 2048
	notifyIntervalDefault = time.Millisecond
	dedupeKeyMaxLen       = 512
	purgeBatch            = 1000
	completeMaxBatch      = 1000
	errorMaxLenMin        = 64
	replayByMaxLen        = 200
	listLimitDefault      = 100
	listLimitMax          = 1000
	replayFilterLimitMax  = 10000
	maintenanceRolePrefix = "maintenance:"
)

func (c Config) withDefaults() Config {
	c.Schema = cmp.Or(c.Schema, schemaDefault)
	c.MaxPayloadBytes = cmp.Or(c.MaxPayloadBytes, payloadLimitDefault)
	c.ErrorMaxLen = cmp.Or(c.ErrorMaxLen, errorMaxLenDefault)
	c.NotifyInterval = cmp.Or(c.NotifyInterval, notifyIntervalDefault)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c Config) validate() error {
	switch {
	case c.MaxPayloadBytes < 0:
		return configError("Config.MaxPayloadBytes is %d; it must be positive", c.MaxPayloadBytes)
	case c.ErrorMaxLen < errorMaxLenMin:
		return configError("Config.ErrorMaxLen is %d; it must be at least %d", c.ErrorMaxLen, errorMaxLenMin)
	case c.NotifyInterval < 0:
		return configError("Config.NotifyInterval is %v; it must not be negative", c.NotifyInterval)
	}
	return nil
}

func configError(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
}

// Client is the outbox bound to one database, schema and Config: it
// enqueues into callers' transactions, builds dispatchers and serves Admin.
// Build it once per process with New and share it; it is safe for
// concurrent use.
type Client struct {
	cfg    Config
	store  driver.Store
	notify notifyGate
	admin  *Admin
	// batchMaxBytes bounds what one EnqueueBatch sends (batchMaxBytesDefault;
	// tests lower it).
	batchMaxBytes int
}

// batchMaxBytesDefault is the most one EnqueueBatch takes, its messages'
// payloads, headers and keys together. A batch goes to the database as one
// statement's arrays on some paths (ordering keys, database/sql), and a
// statement or an array value cannot pass 1 GiB: past it the driver closed
// the caller's connection with an error of its own, after minutes of work.
const batchMaxBytesDefault = 512 << 20

// New returns a Client on drv (outboxpg.New(pool) for PostgreSQL) with cfg.
// It does no I/O. Run Client.Migrate (or the migrations in migrations/ with
// your own tool) before the first enqueue.
func New(drv driver.Driver, cfg Config) (*Client, error) {
	if drv == nil {
		return nil, configError("New needs a driver, such as outboxpg.New(pool)")
	}
	cfg = cfg.withDefaults()
	if err := db.ValidateSchema(cfg.Schema); err != nil {
		return nil, fmt.Errorf("%w: Config.Schema: %w", ErrInvalidConfig, err)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	store, err := drv.Open(driver.Options{Schema: cfg.Schema, SynchronousCommit: cfg.SynchronousCommit, Now: cfg.Now, Logger: cfg.Logger})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	c := &Client{cfg: cfg, store: store, batchMaxBytes: batchMaxBytesDefault}
	c.admin = &Admin{c: c}
	return c, nil
}

// Migrate applies the outbox's migrations to Config.Schema (creating it if
// needed). It is safe to run from several processes at once and does
// nothing when the schema is up to date.
func (c *Client) Migrate(ctx context.Context) error {
	if err := c.store.Migrate(ctx); err != nil {
		return fmt.Errorf("outbox: migrate schema %q: %w", c.cfg.Schema, err)
	}
	return nil
}

// MigrateTo is Migrate that stops after migration version (39 for
// 0039_…): the later ones are left for another call, or for Migrate. A
// deploy can so apply a migration that locks a large table at a time of its
// choosing (README, "Upgrading"). A version that is not one of the outbox's
// migrations is refused, matching db.ErrUnknownVersion, and nothing is
// applied.
func (c *Client) MigrateTo(ctx context.Context, version int64) error {
	if version <= 0 { // the driver reads 0 as every migration
		return fmt.Errorf("outbox: migrate schema %q up to %d: %w: versions start at 1", c.cfg.Schema, version, db.ErrUnknownVersion)
	}
	if err := c.store.MigrateTo(ctx, version); err != nil {
		return fmt.Errorf("outbox: migrate schema %q up to %04d: %w", c.cfg.Schema, version, err)
	}
	return nil
}

// Config returns the configuration in force, defaults filled in.
func (c *Client) Config() Config { return c.cfg }

// Admin returns the client's operator API.
func (c *Client) Admin() *Admin { return c.admin }

// Enqueue writes msg through tx, the caller's own transaction or connection
// (a modkit/db Runner: a pgx.Tx or pool as it is, a bun or database/sql
// handle wrapped with db.SQL). The event becomes
// visible to dispatchers when tx commits, and vanishes if it rolls back.
//
// A message whose (Namespace, Topic, DedupeKey) matches an existing row is
// not inserted again: the result names the existing row with
// AlreadyEnqueued set, and err is nil. Invalid messages are rejected before
// any SQL runs with an error matching ErrInvalidMessage, and leave tx
// usable.
func (c *Client) Enqueue(ctx context.Context, tx db.Runner, msg Message) (_ Enqueued, err error) {
	if err := validate(0, &msg, c.cfg.MaxPayloadBytes); err != nil {
		if v, ok := err.(*ValidationError); ok {
			v.single = true // "message 0" would puzzle a caller who passed one
		}
		return Enqueued{}, err
	}
	ctx, span := startEnqueueSpan(ctx, msg.Namespace+":"+msg.Topic, 1)
	defer func() { endSpan(span, err) }()
	id, err := uuid.NewV7()
	if err != nil {
		return Enqueued{}, fmt.Errorf("outbox: new event id: %w", err)
	}
	var notify []string
	slot, announce := c.shouldNotify(msg.Namespace, msg.Topic)
	if announce {
		notify = []string{msg.Namespace + ":" + msg.Topic}
	}
	row := driver.InsertRow{ID: id, Namespace: msg.Namespace, Topic: msg.Topic, TenantID: msg.TenantID, DedupeKey: storedKey(&msg),
		Payload: msg.Payload, Headers: withTraceContext(ctx, msg.Headers), OrderingKey: orderingKey(msg.OrderingKey)}
	res, err := c.store.Insert(ctx, tx, []driver.InsertRow{row}, notify)
	if err != nil {
		slot.giveBack()
		return Enqueued{}, c.enqueueError(fmt.Sprintf("enqueue %s/%s", msg.Namespace, msg.Topic), err)
	}
	if res[0].Duplicate {
		slot.giveBack() // a duplicate announces nothing
	}
	return Enqueued{ID: res[0].ID, AlreadyEnqueued: res[0].Duplicate}, nil
}

// EnqueueBatch is Enqueue for many messages at once, in one statement (COPY
// for large batches through a pgx.Tx or pool), and returns one result per
// message, in order. All messages are validated first; if any is invalid
// nothing is written and the error's ValidationError.Index names it. A
// batch takes at most 512 MiB of payloads, headers and keys together; a
// larger one is refused the same way, with ErrPayloadTooLarge.
// Messages with the same dedupe key in one batch yield one row, the first
// of them's, as one Enqueue after another would: every result names it,
// and the later ones are AlreadyEnqueued.
func (c *Client) EnqueueBatch(ctx context.Context, tx db.Runner, msgs []Message) (_ []Enqueued, err error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	total := 0
	for i := range msgs {
		m := &msgs[i]
		if err := validate(i, m, c.cfg.MaxPayloadBytes); err != nil {
			return nil, err
		}
		total += len(m.Payload) + len(m.OrderingKey)
		if m.DedupeKey != nil {
			total += len(*m.DedupeKey)
		}
		for k, v := range m.Headers {
			total += len(k) + len(v)
		}
		if total > c.batchMaxBytes {
			return nil, &ValidationError{Index: i, Field: "Payload", Kind: ErrPayloadTooLarge, Reason: fmt.Sprintf(
				"the batch's messages up to this one total %d bytes, and one EnqueueBatch takes at most %d: "+
					"split the batch into several calls (in the same transaction, if they must commit together)", total, c.batchMaxBytes)}
		}
	}
	destination := msgs[0].Namespace + ":" + msgs[0].Topic
	for _, m := range msgs[1:] {
		if m.Namespace != msgs[0].Namespace || m.Topic != msgs[0].Topic {
			destination = "" // several topics
			break
		}
	}
	ctx, span := startEnqueueSpan(ctx, destination, len(msgs))
	defer func() { endSpan(span, err) }()
	ids, err := newEventIDs(len(msgs))
	if err != nil {
		return nil, err
	}
	rows := make([]driver.InsertRow, len(msgs))
	var notify []string
	var slots []notifySlot
	ordered := false
	for i, m := range msgs {
		rows[i] = driver.InsertRow{ID: ids[i], Namespace: m.Namespace, Topic: m.Topic, TenantID: m.TenantID, DedupeKey: storedKey(&m),
			Payload: m.Payload, Headers: withTraceContext(ctx, m.Headers), OrderingKey: orderingKey(m.OrderingKey)}
		ordered = ordered || m.OrderingKey != ""
		if i > 0 && m.Namespace == msgs[i-1].Namespace && m.Topic == msgs[i-1].Topic {
			continue // the message before decided for this topic
		}
		if t := m.Namespace + ":" + m.Topic; !slices.Contains(notify, t) {
			if slot, ok := c.shouldNotify(m.Namespace, m.Topic); ok {
				notify, slots = append(notify, t), append(slots, slot)
			}
		}
	}
	// A batch with ordering keys is written in key order, not batch order
	// (so that two batches take the keys' locks in one order), which would
	// let a later message of a repeated dedupe key win: the later ones are
	// left out here, and answered with the first one's row.
	var firstOf []int
	if ordered {
		rows, firstOf = firstOfEachKey(rows)
	}
	res, err := c.store.Insert(ctx, tx, rows, notify)
	// A batch that inserted nothing announces nothing (one that inserted a
	// row announces all its topics).
	if len(slots) > 0 && (err != nil || !slices.ContainsFunc(res, func(r driver.Inserted) bool { return !r.Duplicate })) {
		for _, s := range slots {
			s.giveBack()
		}
	}
	if err != nil {
		return nil, c.enqueueError("enqueue batch", err)
	}
	out := make([]Enqueued, len(msgs))
	for i := range out {
		switch {
		case firstOf == nil:
			out[i] = Enqueued{ID: res[i].ID, AlreadyEnqueued: res[i].Duplicate}
		case firstOf[i] < 0: // written: the -1-firstOf[i]th row
			r := res[-1-firstOf[i]]
			out[i] = Enqueued{ID: r.ID, AlreadyEnqueued: r.Duplicate}
		default: // a repeat of the message at firstOf[i]
			out[i] = Enqueued{ID: out[firstOf[i]].ID, AlreadyEnqueued: true}
		}
	}
	return out, nil
}

// firstOfEachKey leaves out of rows those that repeat an earlier row's
// (namespace, topic, dedupe key). It returns rows unchanged and nil when
// none does; otherwise the rows kept and, for each row given, -1-k when it
// is the kth row kept, or the index of the earlier row it repeats.
func firstOfEachKey(rows []driver.InsertRow) ([]driver.InsertRow, []int) {
	type key struct{ namespace, topic, dedupe string }
	var first map[key]int
	var firstOf []int
	var kept []driver.InsertRow // made at the first repeat
	for i, r := range rows {
		if r.DedupeKey != nil {
			k := key{r.Namespace, r.Topic, *r.DedupeKey}
			if j, ok := first[k]; ok {
				if firstOf == nil {
					firstOf = make([]int, len(rows))
					kept = make([]driver.InsertRow, i, len(rows))
					copy(kept, rows[:i])
					for m := range i {
						firstOf[m] = -1 - m
					}
				}
				firstOf[i] = j
				continue
			}
			if first == nil {
				first = make(map[key]int)
			}
			first[k] = i
		}
		if firstOf != nil {
			firstOf[i] = -1 - len(kept)
			kept = append(kept, r)
		}
	}
	if firstOf == nil {
		return rows, nil
	}
	return kept, firstOf
}

// ErrNotMigrated matches errors of calls that found the outbox's tables (or
// schema, or functions) missing from Config.Schema: run Client.Migrate, add
// outbox.WithMigrations to the fx app, or apply the files in migrations/
// with your own tool, before the first enqueue or dispatcher start.
var ErrNotMigrated = errors.New("outbox: the outbox is not migrated")

// notMigratedError wraps a driver error that says the outbox's objects are
// missing, so that it matches both ErrNotMigrated and the cause.
type notMigratedError struct {
	schema string
	err    error
}

func (e *notMigratedError) Error() string {
	what := "the outbox tables are missing from schema %q"
	if c := pgCode(e.err); c == "42883" || c == "42703" {
		what = "schema %q lacks the outbox's objects, all of them or those of a later migration"
	}
	return fmt.Sprintf("%v: %v ("+what+": run Client.Migrate, or add outbox.WithMigrations to the fx app, "+
		"or run modkit-outbox migrate up, or apply modkit's migrations/ with your tool)", ErrNotMigrated, e.err, e.schema)
}

func (e *notMigratedError) Unwrap() []error { return []error{ErrNotMigrated, e.err} }

// notMigrated reports whether err says the outbox's objects do not exist:
// PostgreSQL's undefined_table (42P01), undefined_column (42703),
// undefined_function (42883) or invalid_schema_name (3F000). The outbox's
// own statements name only its own objects, so these mean the migrations
// have not run, or not all of them (a column a later one added).
func notMigrated(err error) bool {
	switch pgCode(err) {
	case "42P01", "42703", "42883", "3F000":
		return true
	}
	return false
}

// pgCode is the SQLSTATE of a PostgreSQL error in err's chain, or "".
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// payloadSizeConstraint is the table's check of a payload's stored size.
const payloadSizeConstraint = "modkit_outbox_events_payload_size_check"

// pgConstraint returns the constraint a PostgreSQL error names, if any.
func pgConstraint(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.ConstraintName
	}
	return ""
}

// enqueueError turns driver failures into errors that say what to do.
func (c *Client) enqueueError(what string, err error) error {
	switch {
	case errors.Is(err, db.ErrUnsupportedRunner):
		return fmt.Errorf("outbox: %s: %w", what, err)
	case notMigrated(err):
		return fmt.Errorf("outbox: %s: %w", what, &notMigratedError{schema: c.cfg.Schema, err: err})
	case pgCode(err) == "25P02": // in_failed_sql_transaction
		return fmt.Errorf("outbox: %s: %w (an earlier statement of this transaction failed: roll it back and retry the whole transaction)", what, err)
	case pgCode(err) == "25006": // read_only_sql_transaction
		return fmt.Errorf("outbox: %s: %w (the transaction is read-only, or the server is a standby: enqueue in a read-write "+
			"transaction on the primary)", what, err)
	case errors.Is(err, driver.ErrInvisibleDuplicate), errors.Is(err, driver.ErrSerialization):
		return fmt.Errorf("outbox: %s: %w: %w", what, ErrConflict, err)
	case pgCode(err) == "40P01": // deadlock_detected: two transactions enqueued ordering keys (or dedupe keys) in opposite orders
		return fmt.Errorf("outbox: %s: %w (enqueue a transaction's ordering keys, and dedupe keys, in one order, sorted say, to avoid it): %w", what, ErrConflict, err)
	case pgConstraint(err) == payloadSizeConstraint:
		return fmt.Errorf("outbox: %s: %w: its stored (binary jsonb) form exceeds the database's limit, 4 MiB unless raised "+
			"with %s.modkit_outbox_set_payload_limit(bytes); see Config.MaxPayloadBytes: %w", what, ErrPayloadTooLarge, c.cfg.Schema, err)
	case poolerConflict(err):
		return fmt.Errorf("outbox: %s: %w (%s)", what, err, poolerHint)
	case c.store.Fatal(err) && (refusedConnection(err) || pgCode(err) == privilegeDenied):
		return fmt.Errorf("outbox: %s: %w (%s)", what, err, fatalHint(err, roleProducer))
	case c.store.Fatal(err):
		return fmt.Errorf("outbox: %s: %w (is the outbox migrated into schema %q? see Client.Migrate)", what, err, c.cfg.Schema)
	}
	return fmt.Errorf("outbox: %s: %w", what, err)
}

// refusedConnection reports whether the server refused the connection
// itself: no such database, or a login refused (class 28).
func refusedConnection(err error) bool {
	code := pgCode(err)
	return code == "3D000" || strings.HasPrefix(code, "28")
}

// privilegeDenied is SQLSTATE insufficient_privilege.
const privilegeDenied = "42501"

// The outbox's roles, as privilege hints name them (outboxpg.Role*; the
// driver's package may not be imported here).
const (
	roleProducer   = "modkit_outbox_producer"
	roleDispatcher = "modkit_outbox_dispatcher"
	roleReaders    = "modkit_outbox_reader (to read) or modkit_outbox_operator (to read, replay, purge and skip)"
	roleOperator   = "modkit_outbox_operator (the reader role may only read)"
)

// fatalHint says what to check about an error the driver calls fatal, for
// a caller whose login role needs role.
func fatalHint(err error, role string) string {
	switch {
	case refusedConnection(err):
		return "the server refused the connection: check the database name, role and password the pool connects with"
	case pgCode(err) == privilegeDenied:
		return privilegeHint(role)
	}
	return "did the migrations run into this schema? see Client.Migrate"
}

// poolerConflict reports whether err is a prepared statement that exists
// already (42P05) or not at all (26000) on the server connection: pgx's
// statement cache behind a pooler in transaction mode (PgBouncer), which
// hands each transaction another server connection.
func poolerConflict(err error) bool {
	code := pgCode(err)
	return code == "42P05" || code == "26000"
}

// poolerHint says what to do about a poolerConflict.
const poolerHint = "a prepared statement of another server connection: is the pool behind PgBouncer in transaction mode? " +
	"set its max_prepared_statements (PgBouncer 1.21 or later), or add default_query_exec_mode=cache_describe to the " +
	"connection string; see the README's Behind PgBouncer"

// privilegeHint says which outbox role a login role refused a privilege
// needs.
func privilegeHint(role string) string {
	return "this login role lacks a privilege: grant it " + role + ", or connect as the outbox's owner; see the README's Least privilege"
}

// shouldNotify says whether an enqueue of the topic announces it, and if so
// returns the gate's slot, to give back when the enqueue announces nothing.
func (c *Client) shouldNotify(namespace, topic string) (notifySlot, bool) {
	if c.cfg.DisableNotify {
		return notifySlot{}, false
	}
	return c.notify.take(namespace+":"+topic, monotonicNanos(), c.cfg.NotifyInterval)
}

// gateEpoch is the origin of monotonicNanos.
var gateEpoch = time.Now()

// monotonicNanos reads the monotonic clock, in nanoseconds since gateEpoch
// plus one (never 0): a wall clock set back would stop a gate that compares
// wall-clock readings from announcing anything until it caught up.
func monotonicNanos() int64 { return int64(time.Since(gateEpoch)) + 1 }

// notifyGate lets at most one NOTIFY per key through per interval.
type notifyGate struct{ last sync.Map } // key -> *atomic.Int64 (monotonicNanos of the last NOTIFY, 0 before the first)

// take lets a NOTIFY for key through at now if none went through in the
// interval before, and returns its slot.
func (g *notifyGate) take(key string, now int64, interval time.Duration) (notifySlot, bool) {
	v, ok := g.last.Load(key)
	if !ok {
		v, _ = g.last.LoadOrStore(key, new(atomic.Int64))
	}
	last := v.(*atomic.Int64)
	prev := last.Load()
	if (prev == 0 || now-prev >= int64(interval)) && last.CompareAndSwap(prev, now) {
		return notifySlot{last: last, prev: prev, at: now}, true
	}
	return notifySlot{}, false
}

// allow is take without the slot.
func (g *notifyGate) allow(key string, now int64, interval time.Duration) bool {
	_, ok := g.take(key, now, interval)
	return ok
}

// notifySlot is a NOTIFY the gate let through.
type notifySlot struct {
	last     *atomic.Int64
	prev, at int64
}

// giveBack returns a slot whose enqueue sent no NOTIFY (it found only
// duplicates, which announce nothing, or it failed): the gate is as it was
// before the slot was taken, so the next enqueue of the topic announces it
// rather than waiting out the interval for a NOTIFY that never went out.
// It does nothing once a later enqueue has taken the gate.
func (s notifySlot) giveBack() {
	if s.last != nil {
		s.last.CompareAndSwap(s.at, s.prev)
	}
}
