package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
)

// Status is an event's state (seed 004 §4).
type Status string

// The event states. pending → processing → delivered | pending (retry) | dead.
const (
	StatusPending    Status = "pending"
	StatusProcessing Status = "processing"
	StatusDelivered  Status = "delivered"
	StatusDead       Status = "dead"
)

// Defaults and limits of Config and ClaimConfig.
const (
	ErrorMaxLenDefault    = 2048
	NotifyIntervalDefault = 10 * time.Millisecond
	BatchSizeDefault      = 100
	BatchSizeMax          = 10000
	LeaseDurationDefault  = 30 * time.Second
	LeaseDurationMin      = 100 * time.Millisecond
)

// Config configures a Store. The zero value is valid.
type Config struct {
	// Schema holding modkit_outbox_events. Empty means unqualified names,
	// resolved through the connection's search_path (usually public).
	Schema string
	// WorkerID identifies this worker in locked_by. Zero means a random id.
	WorkerID uuid.UUID
	// Retry is the backoff used by Nack and Complete.
	Retry RetryPolicy
	// MaxPayloadBytes caps Message.Payload. Default PayloadLimitDefault.
	MaxPayloadBytes int
	// ErrorMaxLen caps last_error, in bytes. Default ErrorMaxLenDefault.
	ErrorMaxLen int
	// NotifyInterval is the least time between two NOTIFYs this process
	// sends for one (namespace, topic). A transaction that sent NOTIFY holds
	// a database-wide lock from just before its commit until after it, so
	// notifying commits are serialised; a busy producer therefore announces
	// a burst once rather than per event, and the dispatcher, once woken,
	// keeps re-checking for DispatcherConfig.WakeWindow (which must exceed
	// this). Events of a transaction that commits long after its enqueue,
	// or after a rolled-back transaction took the NOTIFY slot, may wait for
	// the dispatcher's poll. Default NotifyIntervalDefault.
	NotifyInterval time.Duration
	// DisableNotify stops enqueues from sending NOTIFY at all: dispatchers
	// then rely on polling alone.
	DisableNotify bool
	// SynchronousCommit makes claims and the outcomes recorded on the
	// Store's own connections (ClaimBatch, Complete, Ack, Nack, Release)
	// wait for their WAL flush. By default they commit asynchronously
	// (synchronous_commit = off for those statements only), which saves a
	// disk flush per claim and per batch of outcomes. It cannot lose or
	// duplicate more than at-least-once allows: if the server crashes, the
	// last fraction of a second of claims and outcomes may be rolled back,
	// so those events are claimed and published again. One consequence:
	// a worker whose claim was rolled back by such a crash does not know it,
	// so its publish may still be running when another worker reclaims the
	// event and publishes it too; the first worker's ack then fails with
	// ErrLeaseLost. At-least-once holds either way; set SynchronousCommit if
	// your publishers must never overlap even across a server crash.
	// Enqueues and CompleteTx/AckTx always keep the caller's transaction's
	// setting.
	SynchronousCommit bool
}

// WithDefaults returns cfg with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.WorkerID == uuid.Nil {
		c.WorkerID = uuid.New()
	}
	c.Retry = c.Retry.WithDefaults()
	c.MaxPayloadBytes = cmp.Or(c.MaxPayloadBytes, PayloadLimitDefault)
	c.ErrorMaxLen = cmp.Or(c.ErrorMaxLen, ErrorMaxLenDefault)
	c.NotifyInterval = cmp.Or(c.NotifyInterval, NotifyIntervalDefault)
	return c
}

func (c Config) validate() error {
	if c.Schema != "" {
		if err := db.ValidateSchema(c.Schema); err != nil {
			return fmt.Errorf("outbox: Config.Schema: %w", err)
		}
	}
	if err := c.Retry.validate(); err != nil {
		return err
	}
	if c.MaxPayloadBytes < 0 {
		return fmt.Errorf("outbox: Config.MaxPayloadBytes is %d; it must be positive", c.MaxPayloadBytes)
	}
	if c.ErrorMaxLen < 64 {
		return fmt.Errorf("outbox: Config.ErrorMaxLen is %d; it must be at least 64", c.ErrorMaxLen)
	}
	if c.NotifyInterval < 0 {
		return fmt.Errorf("outbox: Config.NotifyInterval is %v; it must not be negative", c.NotifyInterval)
	}
	return nil
}

// Producer writes events into the caller's transactions. Store embeds one;
// the package-level Enqueue and EnqueueBatch use one with the default Config.
type Producer struct {
	cfg    Config
	sql    statements
	table  pgx.Identifier // for COPY
	notify notifyGate
}

// NewProducer returns a Producer for cfg (see Config; only Schema,
// MaxPayloadBytes, NotifyInterval and DisableNotify matter to it).
func NewProducer(cfg Config) (*Producer, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	table := pgx.Identifier{TableName}
	if cfg.Schema != "" {
		table = pgx.Identifier{cfg.Schema, TableName}
	}
	return &Producer{cfg: cfg, sql: newStatements(cfg.Schema, cfg.SynchronousCommit), table: table}, nil
}

var defaultProducer = sync.OnceValue(func() *Producer {
	p, err := NewProducer(Config{})
	if err != nil {
		panic(err) // the zero Config is valid
	}
	return p
})

// Enqueue writes msg through r, the caller's own transaction or connection
// (any db.Runner: pgx, bun or database/sql), using the default Config: the
// table is found through the search_path. The event becomes visible to
// dispatchers when r's transaction commits, and vanishes if it rolls back.
//
// A message whose (Namespace, Topic, DedupeKey) matches an existing row is
// not inserted again: the result names the existing row with
// AlreadyEnqueued set, and err is nil. Invalid messages are rejected before
// any SQL runs, with an error matching ErrInvalidMessage.
func Enqueue(ctx context.Context, r db.Runner, msg Message) (Enqueued, error) {
	return defaultProducer().Enqueue(ctx, r, msg)
}

// EnqueueBatch is Enqueue for many messages at once, in one INSERT or COPY; see
// Producer.EnqueueBatch.
func EnqueueBatch(ctx context.Context, r db.Runner, msgs []Message) ([]Enqueued, error) {
	return defaultProducer().EnqueueBatch(ctx, r, msgs)
}

// Enqueue writes msg through r; see the package-level Enqueue.
func (p *Producer) Enqueue(ctx context.Context, r db.Runner, msg Message) (Enqueued, error) {
	if err := validate(0, &msg, p.cfg.MaxPayloadBytes); err != nil {
		return Enqueued{}, err
	}
	q, err := db.AsQuerier(r)
	if err != nil {
		return Enqueued{}, err
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Enqueued{}, fmt.Errorf("outbox: new event id: %w", err)
	}
	stmt := p.sql.enqueue
	if p.shouldNotify(msg.Namespace, msg.Topic) {
		stmt = p.sql.enqueueNotify
	}
	args := []any{pgtype.UUID{Bytes: id, Valid: true}, msg.Namespace, msg.Topic, nullUUID(msg.TenantID), msg.DedupeKey, string(msg.Payload)}
	var out Enqueued
	err = q.QueryRow(ctx, stmt, args...).Scan(&out.ID, &out.AlreadyEnqueued)
	if errors.Is(err, db.ErrNoRows) {
		// A duplicate: the insert returned no row. A new statement sees
		// the original, even one a concurrent transaction committed after
		// the insert's snapshot.
		out.AlreadyEnqueued = true
		err = q.QueryRow(ctx, p.sql.lookupDuplicate, msg.Namespace, msg.Topic, *msg.DedupeKey).Scan(&out.ID)
		if errors.Is(err, db.ErrNoRows) {
			return Enqueued{}, fmt.Errorf("outbox: enqueue %s/%s: dedupe key conflicts with a row this transaction cannot see "+
				"(REPEATABLE READ or SERIALIZABLE isolation, or it was just purged); retry the transaction", msg.Namespace, msg.Topic)
		}
	}
	if err != nil {
		return Enqueued{}, fmt.Errorf("outbox: enqueue %s/%s: %w", msg.Namespace, msg.Topic, err)
	}
	return out, nil
}

// EnqueueBatch writes msgs through r in one INSERT (plus one lookup when
// some were duplicates) and returns one result per message, in order.
// Batches of 64 or more through a pgx.Tx or a *pgxpool.Pool are first tried
// with COPY, under a savepoint on a pgx.Tx; if a dedupe key already exists
// the COPY is undone and the INSERT runs instead, so results are the same
// either way (a batch full of duplicates pays for both). All
// messages are validated first; if any is invalid nothing is written and the
// error's ValidationError.Index names it. Messages with the same dedupe key
// in one batch yield one row, and both results name it.
func (p *Producer) EnqueueBatch(ctx context.Context, r db.Runner, msgs []Message) ([]Enqueued, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	for i := range msgs {
		if err := validate(i, &msgs[i], p.cfg.MaxPayloadBytes); err != nil {
			return nil, err
		}
	}
	q, err := db.AsQuerier(r)
	if err != nil {
		return nil, err
	}
	n := len(msgs)
	ids := make([]pgtype.UUID, n) // pgtype.UUID: binary encoding, far cheaper than uuid.UUID's text
	namespaces, topics := make([]string, n), make([]string, n)
	tenants := make([]pgtype.UUID, n)
	keys := make([]*string, n)
	payloads := make([]string, n)
	var pairs []string
	for i, m := range msgs {
		id, err := uuid.NewV7()
		if err != nil {
			return nil, fmt.Errorf("outbox: new event id: %w", err)
		}
		ids[i] = pgtype.UUID{Bytes: id, Valid: true}
		namespaces[i], topics[i], keys[i], payloads[i] = m.Namespace, m.Topic, m.DedupeKey, string(m.Payload)
		if m.TenantID != nil {
			tenants[i] = pgtype.UUID{Bytes: *m.TenantID, Valid: true}
		}
		if pair := m.Namespace + ":" + m.Topic; !slices.Contains(pairs, pair) && p.shouldNotify(m.Namespace, m.Topic) {
			pairs = append(pairs, pair)
		}
	}
	copied, err := p.tryCopy(ctx, r, ids, namespaces, topics, tenants, keys, payloads)
	if err != nil {
		return nil, fmt.Errorf("outbox: enqueue batch: %w", err)
	}
	if copied {
		out := make([]Enqueued, n)
		for i := range out {
			out[i] = Enqueued{ID: ids[i].Bytes}
		}
		return out, p.notifyPairs(ctx, q, pairs)
	}
	rows, err := q.Query(ctx, p.sql.enqueueBatch, ids, namespaces, topics, tenants, keys, payloads)
	if err != nil {
		return nil, fmt.Errorf("outbox: enqueue batch: %w", err)
	}
	inserted := make(map[uuid.UUID]bool, n)
	for rows.Next() {
		var id pgtype.UUID
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, fmt.Errorf("outbox: enqueue batch: %w", err)
		}
		inserted[id.Bytes] = true
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox: enqueue batch: %w", err)
	}
	out := make([]Enqueued, n)
	var dupIdx []int
	for i := range msgs {
		if inserted[ids[i].Bytes] {
			out[i] = Enqueued{ID: ids[i].Bytes}
		} else {
			dupIdx = append(dupIdx, i)
		}
	}
	if len(dupIdx) > 0 {
		if err := p.resolveDuplicates(ctx, q, msgs, dupIdx, out); err != nil {
			return nil, err
		}
	}
	if len(dupIdx) == n {
		pairs = nil // nothing new to announce
	}
	return out, p.notifyPairs(ctx, q, pairs)
}

func (p *Producer) notifyPairs(ctx context.Context, q db.Querier, pairs []string) error {
	if len(pairs) == 0 {
		return nil
	}
	if _, err := q.Exec(ctx, p.sql.notifyMany, pairs); err != nil {
		return fmt.Errorf("outbox: enqueue batch: notify: %w", err)
	}
	return nil
}

// copyMinBatch is the smallest batch EnqueueBatch tries to COPY.
const copyMinBatch = 64

// copyColumns are the columns the COPY fast path writes; status and
// attempts take their defaults ('pending', 0).
var copyColumns = []string{"id", "namespace", "topic", "tenant_id", "dedupe_key", "payload"}

// tryCopy is EnqueueBatch's fast path: COPY, which PostgreSQL writes in
// bulk, about a third faster than the INSERT … SELECT unnest(…) ON CONFLICT
// it replaces. COPY cannot skip a conflicting dedupe key, so it is tried
// optimistically: when a key already exists the COPY fails with a unique
// violation, is undone (on a pgx.Tx by a savepoint, so the caller's
// transaction goes on), and tryCopy reports false for the INSERT path to
// sort the duplicates out. It is used for batches of at least copyMinBatch
// messages without a key repeated inside the batch, through a pgx.Tx or a
// *pgxpool.Pool; other runners (database/sql, bun, *pgx.Conn, which may be
// inside a transaction the library cannot see) always take the INSERT path.
func (p *Producer) tryCopy(ctx context.Context, r db.Runner, ids []pgtype.UUID, namespaces, topics []string,
	tenants []pgtype.UUID, keys []*string, payloads []string) (bool, error) {
	if len(ids) < copyMinBatch || repeatsKey(namespaces, topics, keys) {
		return false, nil
	}
	src := pgx.CopyFromSlice(len(ids), func(i int) ([]any, error) {
		return []any{ids[i], namespaces[i], topics[i], tenants[i], keys[i], payloads[i]}, nil
	})
	var err error
	switch r := r.(type) {
	case pgx.Tx:
		var sp pgx.Tx
		if sp, err = r.Begin(ctx); err != nil { // SAVEPOINT
			return false, err
		}
		if _, err = sp.CopyFrom(ctx, p.table, copyColumns, src); err == nil {
			err = sp.Commit(ctx) // RELEASE SAVEPOINT
		}
		if err != nil {
			_ = sp.Rollback(ctx) // ROLLBACK TO SAVEPOINT: the caller's transaction stays usable
		}
	case *pgxpool.Pool:
		_, err = r.CopyFrom(ctx, p.table, copyColumns, src) // a transaction of its own
	default:
		return false, nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" { // unique_violation: a dedupe key exists
		return false, nil
	}
	return err == nil, err
}

// repeatsKey reports whether two messages of a batch share a dedupe key.
func repeatsKey(namespaces, topics []string, keys []*string) bool {
	seen := make(map[[3]string]struct{}, len(keys))
	for i, k := range keys {
		if k == nil {
			continue
		}
		key := [3]string{namespaces[i], topics[i], *k}
		if _, dup := seen[key]; dup {
			return true
		}
		seen[key] = struct{}{}
	}
	return false
}

func (p *Producer) resolveDuplicates(ctx context.Context, q db.Querier, msgs []Message, idx []int, out []Enqueued) error {
	ns, tp, dk := make([]string, len(idx)), make([]string, len(idx)), make([]string, len(idx))
	for j, i := range idx {
		ns[j], tp[j], dk[j] = msgs[i].Namespace, msgs[i].Topic, *msgs[i].DedupeKey
	}
	rows, err := q.Query(ctx, p.sql.lookupDuplicates, ns, tp, dk)
	if err != nil {
		return fmt.Errorf("outbox: enqueue batch: look up duplicates: %w", err)
	}
	defer rows.Close()
	existing := map[[3]string]uuid.UUID{}
	for rows.Next() {
		var id uuid.UUID
		var k [3]string
		if err := rows.Scan(&id, &k[0], &k[1], &k[2]); err != nil {
			return fmt.Errorf("outbox: enqueue batch: look up duplicates: %w", err)
		}
		existing[k] = id
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("outbox: enqueue batch: look up duplicates: %w", err)
	}
	for _, i := range idx {
		id, ok := existing[[3]string{msgs[i].Namespace, msgs[i].Topic, *msgs[i].DedupeKey}]
		if !ok {
			return fmt.Errorf("outbox: enqueue batch: message %d: dedupe key conflicts with a row this transaction cannot see "+
				"(REPEATABLE READ or SERIALIZABLE isolation, or it was just purged); retry the transaction", i)
		}
		out[i] = Enqueued{ID: id, AlreadyEnqueued: true}
	}
	return nil
}

func (p *Producer) shouldNotify(namespace, topic string) bool {
	return !p.cfg.DisableNotify && p.notify.allow(namespace+":"+topic, p.cfg.NotifyInterval)
}

// notifyGate lets at most one NOTIFY per key through per interval.
type notifyGate struct{ last sync.Map } // key -> *atomic.Int64 (unix nanos)

func (g *notifyGate) allow(key string, interval time.Duration) bool {
	now := time.Now().UnixNano()
	v, ok := g.last.Load(key)
	if !ok {
		v, _ = g.last.LoadOrStore(key, new(atomic.Int64))
	}
	last := v.(*atomic.Int64)
	prev := last.Load()
	return now-prev >= int64(interval) && last.CompareAndSwap(prev, now)
}

func nullUUID(id *uuid.UUID) pgtype.UUID {
	if id == nil {
		return pgtype.UUID{}
	}
	return pgtype.UUID{Bytes: *id, Valid: true}
}

// Store claims and settles events for a worker, and administers the table.
// It is safe for concurrent use.
type Store struct {
	*Producer
	pool  *pgxpool.Pool
	poolQ db.Querier
}

// NewStore returns a Store on pool. The pool runs claims, settlements and
// admin queries; enqueues run on the caller's runner.
func NewStore(pool *pgxpool.Pool, cfg Config) (*Store, error) {
	if pool == nil {
		return nil, errors.New("outbox: NewStore needs a pool")
	}
	p, err := NewProducer(cfg)
	if err != nil {
		return nil, err
	}
	poolQ, err := db.AsQuerier(pool)
	if err != nil {
		return nil, err
	}
	return &Store{Producer: p, pool: pool, poolQ: poolQ}, nil
}

// Config returns the Store's configuration, with defaults filled in.
func (s *Store) Config() Config { return s.cfg }

// WorkerID is the id this Store writes into locked_by.
func (s *Store) WorkerID() uuid.UUID { return s.cfg.WorkerID }

// Topic names a (namespace, topic) pair.
type Topic struct {
	Namespace string
	Topic     string
}

func (t Topic) String() string { return t.Namespace + "/" + t.Topic }

func (t Topic) key() string { return t.Namespace + ":" + t.Topic }

// ClaimConfig says what and how much to claim (seed 004 §1.7).
type ClaimConfig struct {
	// BatchSize is the most events one claim returns. Default
	// BatchSizeDefault, at most BatchSizeMax.
	BatchSize int
	// LeaseDuration is how long the claimer owns the events. Default
	// LeaseDurationDefault, at least LeaseDurationMin.
	LeaseDuration time.Duration
	// MaxAttempts is the total number of delivery attempts, the first
	// included. Events that used them all are not claimed; they are
	// dead-lettered by Nack or SweepExhausted. Default MaxAttemptsDefault.
	MaxAttempts int
	// Topics the claimer publishes. Required: nothing else is claimed.
	Topics []Topic
}

// WithDefaults returns c with zero fields set to their defaults.
func (c ClaimConfig) WithDefaults() ClaimConfig {
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	c.LeaseDuration = cmp.Or(c.LeaseDuration, LeaseDurationDefault)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, MaxAttemptsDefault)
	return c
}

func (c ClaimConfig) validate() error {
	if c.BatchSize < 1 || c.BatchSize > BatchSizeMax {
		return fmt.Errorf("outbox: BatchSize is %d; it must be between 1 and %d", c.BatchSize, BatchSizeMax)
	}
	if c.LeaseDuration < LeaseDurationMin {
		return fmt.Errorf("outbox: LeaseDuration is %v; it must be at least %v", c.LeaseDuration, LeaseDurationMin)
	}
	if c.MaxAttempts < 1 {
		return fmt.Errorf("outbox: MaxAttempts is %d; it must be at least 1", c.MaxAttempts)
	}
	return validateTopics(c.Topics)
}

func validateTopics(topics []Topic) error {
	if len(topics) == 0 {
		return ErrNoTopics
	}
	for _, t := range topics {
		if !validName(t.Namespace) || !validName(t.Topic) {
			return fmt.Errorf("outbox: topic %q/%q: namespace and topic must match %s", t.Namespace, t.Topic, NamePattern)
		}
	}
	return nil
}

func topicKeys(topics []Topic) []string {
	keys := make([]string, len(topics))
	for i, t := range topics {
		keys[i] = t.key()
	}
	return keys
}

// ClaimedMessage is an event leased to this worker (seed 004 §1.7), with the
// lease's fencing token.
type ClaimedMessage struct {
	ID        uuid.UUID
	Namespace string
	Topic     string
	TenantID  *uuid.UUID
	DedupeKey *string
	Payload   []byte
	// Attempts counts delivery attempts including this one (1 on the first).
	Attempts int
	// MaxAttempts is the budget the event was claimed under.
	MaxAttempts int
	// LeaseToken fences this claim: only its holder can settle the event.
	LeaseToken uuid.UUID
	// LeaseExpiresAt is locked_until, by the database clock.
	LeaseExpiresAt time.Time
	// CreatedAt is when the event was enqueued (its transaction's start).
	CreatedAt time.Time
}

// ClaimBatch leases up to cfg.BatchSize due events of cfg.Topics to this
// worker in one statement (FOR UPDATE SKIP LOCKED), oldest first. Due means
// pending with next_attempt_at reached, or processing with an expired lease
// (its worker died); attempts must be below cfg.MaxAttempts. Each claimed
// event gets attempts+1, a fresh lease token and locked_until = now +
// LeaseDuration, all by the database clock.
func (s *Store) ClaimBatch(ctx context.Context, cfg ClaimConfig) ([]ClaimedMessage, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return s.claim(ctx, cfg, topicKeys(cfg.Topics))
}

func (s *Store) claim(ctx context.Context, cfg ClaimConfig, keys []string) ([]ClaimedMessage, error) {
	rows, err := s.pool.Query(ctx, s.sql.claim, cfg.MaxAttempts, keys, cfg.BatchSize, s.cfg.WorkerID, cfg.LeaseDuration)
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	defer rows.Close()
	out := make([]ClaimedMessage, 0, cfg.BatchSize)
	for rows.Next() {
		var m ClaimedMessage
		var id, tenant, token pgtype.UUID
		if err := rows.Scan(&id, &m.Namespace, &m.Topic, &tenant, &m.DedupeKey, &m.Payload, &m.Attempts,
			&token, &m.LeaseExpiresAt, &m.CreatedAt); err != nil {
			return nil, fmt.Errorf("outbox: claim: %w", err)
		}
		m.ID, m.LeaseToken = id.Bytes, token.Bytes
		if tenant.Valid {
			id := uuid.UUID(tenant.Bytes)
			m.TenantID = &id
		}
		m.MaxAttempts = cfg.MaxAttempts
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	// UPDATE … RETURNING does not keep the subquery's order.
	slices.SortFunc(out, func(a, b ClaimedMessage) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), slices.Compare(a.ID[:], b.ID[:]))
	})
	return out, nil
}

// Result is how a claimed event's publish went, for Complete.
type Result struct {
	Message ClaimedMessage
	// Err is the publish error: nil means delivered; an error marked with
	// Permanent dead-letters at once; any other error retries with backoff,
	// or dead-letters when the attempts are used up.
	Err error
	// Release gives the event back unpublished (pending, due now, the
	// claim's attempt not counted); Err is then ignored.
	Release bool
}

// Settlement is what Complete did with one event.
type Settlement struct {
	ID uuid.UUID
	// Status the event was moved to: delivered, pending (retry or
	// release) or dead. Meaningless when LeaseLost.
	Status Status
	// RetryIn is the backoff chosen for a retry.
	RetryIn time.Duration
	// LastError is what was stored in last_error (redacted, truncated).
	LastError string
	// LeaseLost: the worker no longer held the lease; nothing changed.
	LeaseLost bool
}

// Complete records many outcomes in one statement. Every event must still be
// leased to the caller under its LeaseToken, unexpired; the others are
// reported LeaseLost and left untouched. The returned slice matches results
// by index.
func (s *Store) Complete(ctx context.Context, results []Result) ([]Settlement, error) {
	return s.complete(ctx, s.poolQ, s.sql.completeAsync, results)
}

// CompleteTx is Complete through the caller's runner, so a consumer's own
// writes and the outcome commit or roll back together.
func (s *Store) CompleteTx(ctx context.Context, r db.Runner, results []Result) ([]Settlement, error) {
	q, err := db.AsQuerier(r)
	if err != nil {
		return nil, err
	}
	return s.complete(ctx, q, s.sql.complete, results)
}

func (s *Store) complete(ctx context.Context, q db.Querier, stmt string, results []Result) ([]Settlement, error) {
	if len(results) == 0 {
		return nil, nil
	}
	n := len(results)
	out := make([]Settlement, n)
	ids, tokens := make([]pgtype.UUID, n), make([]pgtype.UUID, n)
	outcomes, errs := make([]string, n), make([]*string, n)
	delays := make([]int64, n)
	for i, res := range results {
		st := s.settle(res)
		out[i] = st
		ids[i] = pgtype.UUID{Bytes: res.Message.ID, Valid: true}
		tokens[i] = pgtype.UUID{Bytes: res.Message.LeaseToken, Valid: true}
		outcomes[i] = string(st.Status)
		if res.Release {
			outcomes[i] = "released"
		}
		if st.LastError != "" {
			errs[i] = &out[i].LastError
		}
		delays[i] = st.RetryIn.Milliseconds()
	}
	rows, err := q.Query(ctx, stmt, ids, tokens, outcomes, errs, delays)
	if err != nil {
		return nil, fmt.Errorf("outbox: complete %d events: %w", n, err)
	}
	defer rows.Close()
	settled := make(map[uuid.UUID]bool, n)
	for rows.Next() {
		var id pgtype.UUID
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("outbox: complete %d events: %w", n, err)
		}
		settled[id.Bytes] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox: complete %d events: %w", n, err)
	}
	for i := range out {
		out[i].LeaseLost = !settled[out[i].ID]
	}
	return out, nil
}

// settle decides the new status of one result.
func (s *Store) settle(res Result) Settlement {
	m := res.Message
	st := Settlement{ID: m.ID}
	switch {
	case res.Release:
		st.Status = StatusPending
	case res.Err == nil:
		st.Status = StatusDelivered
	case IsPermanent(res.Err):
		st.Status = StatusDead
		st.LastError = sanitizeError(fmt.Sprintf("attempt %d of %d failed permanently: %v", m.Attempts, m.MaxAttempts, res.Err), s.cfg.ErrorMaxLen)
	case m.Attempts >= m.MaxAttempts:
		st.Status = StatusDead
		st.LastError = sanitizeError(fmt.Sprintf("attempt %d of %d failed, no attempts left: %v", m.Attempts, m.MaxAttempts, res.Err), s.cfg.ErrorMaxLen)
	default:
		st.Status = StatusPending
		st.RetryIn = s.cfg.Retry.Backoff(m.Attempts)
		st.LastError = sanitizeError(fmt.Sprintf("attempt %d of %d failed: %v", m.Attempts, m.MaxAttempts, res.Err), s.cfg.ErrorMaxLen)
	}
	return st
}

func (s *Store) completeOne(ctx context.Context, res Result) (Settlement, error) {
	out, err := s.Complete(ctx, []Result{res})
	if err != nil {
		return Settlement{}, err
	}
	if out[0].LeaseLost {
		return out[0], fmt.Errorf("outbox: event %s: %w", res.Message.ID, ErrLeaseLost)
	}
	return out[0], nil
}

// Ack marks m delivered (seed 004: ack). It fails with ErrLeaseLost, and
// changes nothing, unless this worker still holds m's unexpired lease.
func (s *Store) Ack(ctx context.Context, m ClaimedMessage) error {
	_, err := s.completeOne(ctx, Result{Message: m})
	return err
}

// AckTx is Ack through the caller's runner: the delivered mark commits with
// the caller's transaction.
func (s *Store) AckTx(ctx context.Context, r db.Runner, m ClaimedMessage) error {
	out, err := s.CompleteTx(ctx, r, []Result{{Message: m}})
	if err != nil {
		return err
	}
	if out[0].LeaseLost {
		return fmt.Errorf("outbox: event %s: %w", m.ID, ErrLeaseLost)
	}
	return nil
}

// Nack records a failed publish of m (seed 004: nack): last_error is set and
// the lease cleared; the event is rescheduled with backoff, or dead-lettered
// when cause is Permanent or m used its last attempt. It returns the new
// status, or ErrLeaseLost (nothing changed).
func (s *Store) Nack(ctx context.Context, m ClaimedMessage, cause error) (Settlement, error) {
	if cause == nil {
		cause = errors.New("nack without a cause")
	}
	return s.completeOne(ctx, Result{Message: m, Err: cause})
}

// Release gives unpublished events back: pending, due now, their claim's
// attempt not counted. Events whose lease was lost are skipped silently.
func (s *Store) Release(ctx context.Context, msgs []ClaimedMessage) error {
	results := make([]Result, len(msgs))
	for i, m := range msgs {
		results[i] = Result{Message: m, Release: true}
	}
	_, err := s.Complete(ctx, results)
	return err
}
