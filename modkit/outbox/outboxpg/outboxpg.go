// Package outboxpg is the outbox's PostgreSQL driver, on pgx. Pass it to
// outbox.New:
//
//	client, err := outbox.New(outboxpg.New(pool), outbox.Config{Schema: "public"})
//
// Its SQL lives in queries.go as named statements; the tables come from the
// migrations in the repository's migrations/ folder (Store.Migrate, or
// Client.Migrate, applies them).
package outboxpg

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// TableName is the outbox table's name.
const TableName = "modkit_outbox_events"

// LeadersTableName is the table of maintenance leases (one row per role).
const LeadersTableName = "modkit_outbox_leaders"

// NotifyChannel returns the channel on which enqueues into schema announce
// themselves (payload "namespace:topic"), so that its idle dispatchers wake
// at once: "modkit_outbox." followed by the schema's name, cut to the 63
// bytes PostgreSQL allows a channel's name. Outboxes in different schemas
// of one database so do not wake each other's dispatchers (two schemas
// whose names agree in their first 49 bytes share a channel: their
// dispatchers then also wake for each other's topics, which costs an empty
// claim and loses nothing). Migration 0032 moved the enqueue functions to
// it from LegacyNotifyChannel.
func NotifyChannel(schema string) string {
	c := LegacyNotifyChannel + "." + schema
	return c[:min(len(c), maxChannelLen)]
}

// LegacyNotifyChannel is the channel that every schema's enqueues shared
// before migration 0032. Dispatchers still listen on it and wake for what
// it announces, so that producers of an earlier version (and an enqueue
// function not yet migrated) still wake them during a rolling upgrade.
// Dispatchers of an earlier version listen only there: until they are
// upgraded they find at their poll what newer producers announce and, once
// migration 0032 has run, what the enqueue functions announce.
const LegacyNotifyChannel = "modkit_outbox"

// maxChannelLen is the longest channel name PostgreSQL accepts (NAMEDATALEN
// less one).
const maxChannelLen = 63

// Driver is the PostgreSQL driver on one pgx pool.
type Driver struct {
	pool *pgxpool.Pool
	// listen, when set, is what the notification listener connects with
	// (ListenOn).
	listen *pgx.ConnConfig
}

// New returns a driver on pool. The pool runs claims, outcomes, admin
// queries and maintenance; enqueues run on the caller's runner.
func New(pool *pgxpool.Pool) *Driver { return &Driver{pool: pool} }

// ListenOn returns a copy of d whose dispatchers' notification listener
// connects with cfg instead of the pool's settings: give it a direct
// connection to the server when the pool goes through PgBouncer in
// transaction mode, where LISTEN does not work, and the dispatchers are
// woken at once all the same (README, "Behind PgBouncer?"). The listener
// holds one connection per dispatcher; cfg is copied, and the pool's
// BeforeConnect and AfterConnect hooks are not run for it. A nil cfg
// means the pool's settings again.
func (d *Driver) ListenOn(cfg *pgx.ConnConfig) *Driver {
	var c Driver
	if d != nil {
		c = *d
	}
	c.listen = nil
	if cfg != nil {
		c.listen = cfg.Copy()
	}
	return &c
}

// Open implements driver.Driver.
func (d *Driver) Open(opts driver.Options) (driver.Store, error) {
	if d == nil || d.pool == nil {
		return nil, errors.New("outboxpg: New needs a non-nil *pgxpool.Pool")
	}
	if err := db.ValidateSchema(opts.Schema); err != nil {
		return nil, err
	}
	q, err := db.AsQuerier(d.pool)
	if err != nil {
		return nil, err
	}
	return &store{
		pool: d.pool, poolQ: q, opts: opts, listen: d.listen,
		sql:   newQueries(opts.Schema, opts.SynchronousCommit, opts.Now != nil),
		table: pgx.Identifier{opts.Schema, TableName},
	}, nil
}

type store struct {
	// noPayloads: this role may not read payloads (the reader role).
	noPayloads atomic.Bool
	// noPurgeFrom: the schema lacks modkit_outbox_purge_from (migration
	// 0025); purges walk from the oldest event, as before it, until the
	// store is opened again.
	noPurgeFrom atomic.Bool
	// noBacklog: the schema lacks modkit_outbox_backlog (migration 0027);
	// Backlog counts with modkit_outbox_stats, as before it, until the
	// store is opened again.
	noBacklog atomic.Bool
	pool      *pgxpool.Pool
	poolQ     db.Querier
	opts      driver.Options
	sql       queries
	table     pgx.Identifier  // for COPY
	listen    *pgx.ConnConfig // Driver.ListenOn's, or nil
}

// args appends the test clock, when there is one, to a statement's
// arguments.
func (s *store) args(args ...any) []any {
	if s.opts.Now != nil {
		return append(args, s.opts.Now())
	}
	return args
}

func uuidArg(id uuid.UUID) pgtype.UUID { return pgtype.UUID{Bytes: id, Valid: true} }

func nullUUID(id *uuid.UUID) pgtype.UUID {
	if id == nil {
		return pgtype.UUID{}
	}
	return uuidArg(*id)
}

func ptrUUID(u pgtype.UUID) *uuid.UUID {
	if !u.Valid {
		return nil
	}
	id := uuid.UUID(u.Bytes)
	return &id
}

// Insert implements driver.Store.
func (s *store) Insert(ctx context.Context, tx any, rows []driver.InsertRow, notify []string) ([]driver.Inserted, error) {
	q, err := db.AsQuerier(tx)
	if err != nil {
		return nil, err
	}
	if len(rows) == 1 {
		return s.insertOne(ctx, q, rows[0], len(notify) > 0)
	}
	return s.insertMany(ctx, tx, q, rows, notify)
}

func (s *store) insertOne(ctx context.Context, q db.Querier, r driver.InsertRow, notify bool) ([]driver.Inserted, error) {
	out := []driver.Inserted{{}}
	headers, err := headersArg(r.Headers)
	if err != nil {
		return nil, err
	}
	if r.OrderingKey == nil && r.DedupeKey == nil { // only its fresh id is unique: nothing to skip
		stmt := s.sql.insertKeyless
		if notify {
			stmt = s.sql.insertKeylessNotify
		}
		if _, err = q.Exec(ctx, stmt, uuidArg(r.ID), r.Namespace, r.Topic, nullUUID(r.TenantID), string(r.Payload), headers); err != nil {
			return nil, insertError(err)
		}
		out[0].ID = r.ID
		return out, nil
	}
	if r.OrderingKey == nil { // sequences come from the function
		stmt := s.sql.insertPlain
		if notify {
			stmt = s.sql.insertDirect
		}
		inserted, err := q.Exec(ctx, stmt, uuidArg(r.ID), r.Namespace, r.Topic, nullUUID(r.TenantID), r.DedupeKey,
			string(r.Payload), headers)
		if err != nil {
			return nil, insertError(err)
		}
		if inserted == 1 {
			out[0].ID = r.ID
			return out, nil
		}
		// A conflict: the function finds the event that holds the dedupe
		// key (or inserts this one, if it was purged in between).
	}
	err = q.QueryRow(ctx, s.sql.insertOne, uuidArg(r.ID), r.Namespace, r.Topic, nullUUID(r.TenantID), r.DedupeKey,
		string(r.Payload), notify, headers, r.OrderingKey).Scan(&out[0].ID, &out[0].Duplicate)
	if err != nil {
		return nil, insertError(err)
	}
	return out, nil
}

// delayMillis is a retry delay in whole milliseconds, the unit the outcome
// functions take, rounded up: a delay under a millisecond must not become
// an immediate retry.
func delayMillis(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

// insertError maps the enqueue functions' SQLSTATEs to the driver's errors.
func insertError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "P7004":
			return fmt.Errorf("%w: %w", driver.ErrInvisibleDuplicate, err)
		case "40001":
			return fmt.Errorf("%w: %w", driver.ErrSerialization, err)
		}
	}
	return err
}

// headersArg encodes headers as the JSON text of a jsonb parameter; nil for
// none.
func headersArg(h map[string]string) (*string, error) {
	if len(h) == 0 {
		return nil, nil
	}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("outboxpg: encode headers: %w", err)
	}
	s := string(b)
	return &s, nil
}

// scanHeaders decodes a headers column.
// scanHeaders decodes an event's headers. The database takes any JSON
// object, and an event written with one's own SQL may hold {"retries": 3}:
// a value that is not a string becomes its JSON text ("3"), so that such
// an event neither loses the header nor fails the claim of the events
// leased with it (their leases were taken, and they went unpublished until
// the sweep buried them).
func scanHeaders(b []byte) (map[string]string, error) {
	if b == nil {
		return nil, nil
	}
	var h map[string]string
	// A null value decodes as "" here: read those the slow way, as "null".
	if err := json.Unmarshal(b, &h); err == nil && !hasEmptyValue(h) {
		return h, nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("outboxpg: decode headers: %w", err)
	}
	h = make(map[string]string, len(raw))
	for k, v := range raw {
		var s string
		if len(v) > 0 && v[0] == '"' && json.Unmarshal(v, &s) == nil {
			h[k] = s
		} else {
			h[k] = string(v)
		}
	}
	return h, nil
}

func hasEmptyValue(h map[string]string) bool {
	for _, v := range h {
		if v == "" {
			return true
		}
	}
	return false
}

type columns struct {
	ids                         []pgtype.UUID // binary encoding, far cheaper than uuid.UUID's text
	namespaces, topics, payload []string
	tenants                     []pgtype.UUID
	keys, headers, orderingKeys []*string
	ordered                     bool // some row has an ordering key
}

func toColumns(rows []driver.InsertRow) (columns, error) {
	n := len(rows)
	c := columns{ids: make([]pgtype.UUID, n), namespaces: make([]string, n), topics: make([]string, n),
		payload: make([]string, n), tenants: make([]pgtype.UUID, n), keys: make([]*string, n), headers: make([]*string, n),
		orderingKeys: make([]*string, n)}
	for i, r := range rows {
		c.ids[i], c.tenants[i] = uuidArg(r.ID), nullUUID(r.TenantID)
		c.namespaces[i], c.topics[i], c.keys[i], c.payload[i] = r.Namespace, r.Topic, r.DedupeKey, string(r.Payload)
		h, err := headersArg(r.Headers)
		if err != nil {
			return c, err
		}
		c.headers[i] = h
		c.orderingKeys[i] = r.OrderingKey
		c.ordered = c.ordered || r.OrderingKey != nil
	}
	if !c.ordered {
		c.orderingKeys = nil
	}
	return c, nil
}

func (s *store) insertMany(ctx context.Context, tx any, q db.Querier, rows []driver.InsertRow, notify []string) ([]driver.Inserted, error) {
	n := len(rows)
	out := make([]driver.Inserted, n)
	for i := range out {
		out[i].ID = rows[i].ID
	}
	copied, err := s.tryCopy(ctx, tx, rows, notify)
	if err != nil {
		return nil, err
	}
	if copied { // the COPY's statement announced the topics
		return out, nil
	}
	c, err := toColumns(rows)
	if err != nil {
		return nil, err
	}
	// The function announces the topics itself when it inserted a row.
	res, err := q.Query(ctx, s.sql.insertMany, c.ids, c.namespaces, c.topics, c.tenants, c.keys, c.payload, notify, c.headers, c.orderingKeys)
	if err != nil {
		return nil, insertError(err)
	}
	defer res.Close()
	for res.Next() {
		var ord int64
		var id pgtype.UUID
		if err := res.Scan(&ord, &id); err != nil {
			return nil, err
		}
		if ord < 1 || ord > int64(n) {
			return nil, fmt.Errorf("outboxpg: enqueue_many returned position %d of %d", ord, n)
		}
		out[ord-1] = driver.Inserted{ID: id.Bytes, Duplicate: true}
	}
	err = res.Err()
	if err != nil {
		return nil, insertError(err)
	}
	return out, nil
}

// Claim implements driver.Store.
func (s *store) Claim(ctx context.Context, p driver.ClaimParams) ([]driver.Claimed, error) {
	// The call is not prepared on the server; it goes in one round trip
	// with its arguments and results in binary (pgx caches the call's
	// parameter and result types per connection: in text, encoding the id
	// arrays and parsing the results took 5-8% of the client's CPU in a
	// drain). How the function's own statements are planned is its
	// business: a claim without chains runs on plans cached for the
	// connection, built so that no statistics can make them read the table
	// (migration 0010); a claim with chains is planned afresh each time,
	// because a plan cached from whatever the table looked like then made a
	// drain over a million delivered rows run at 0.1x or 0.9x of its
	// empty-table rate, depending on the connection.
	rows, err := s.pool.Query(ctx, s.sql.claim, append([]any{pgx.QueryExecModeCacheDescribe}, s.args(uuidArg(p.Worker), p.Topics, p.Limit, p.MaxAttempts, p.Lease, p.SkipDeadTopics, chainsArg(p))...)...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := make([]driver.Claimed, 0, p.Limit)
	// The scan targets live across rows (handed to Scan as interfaces,
	// they escape: declared per row they cost seven allocations a row)
	// and are zeroed before each row, so that no pointer or slice a
	// claimed event keeps is scanned into again.
	var c driver.Claimed
	var id, tenant, token pgtype.UUID
	var headers []byte
	var seq *int64
	for rows.Next() {
		c, headers, seq = driver.Claimed{}, nil, nil
		if err := rows.Scan(&id, &c.Namespace, &c.Topic, &tenant, &c.DedupeKey, &c.Payload, &c.Attempts,
			&token, &c.LockedTill, &c.CreatedAt, &c.Repaired, &headers, &c.OrderingKey, &seq); err != nil {
			return nil, err
		}
		if seq != nil {
			c.OrderingSeq = *seq
		}
		var err error
		if c.Headers, err = scanHeaders(headers); err != nil {
			return nil, err
		}
		c.ID, c.LeaseToken, c.TenantID = id.Bytes, token.Bytes, ptrUUID(tenant)
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	// UPDATE … RETURNING does not keep the subquery's order.
	slices.SortFunc(out, func(a, b driver.Claimed) int {
		if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
			return c
		}
		return slices.Compare(a.ID[:], b.ID[:])
	})
	return out, nil
}

// chainsArg is the claim's chain lengths, one per topic (the function
// refuses any other number), or nil (no chains).
func chainsArg(p driver.ClaimParams) []int32 {
	if p.Chains == nil {
		return nil
	}
	out := make([]int32, len(p.Chains))
	for i, n := range p.Chains {
		out[i] = int32(min(max(n, 1), math.MaxInt32))
	}
	return out
}

var outcomeNames = [...]string{driver.Delivered: "delivered", driver.Retry: "retry", driver.Dead: "dead", driver.Release: "released",
	driver.DeliveredDeleted: "delivered_deleted"}

func outcomeName(k driver.OutcomeKind) string {
	if int(k) < len(outcomeNames) {
		return outcomeNames[k]
	}
	return "" // refused by the database with P7003
}

// Complete implements driver.Store.
func (s *store) Complete(ctx context.Context, tx any, worker uuid.UUID, outcomes []driver.Outcome) ([]bool, error) {
	if len(outcomes) == 0 {
		return nil, nil
	}
	if tx != nil {
		if len(outcomes) != 1 {
			return nil, fmt.Errorf("outboxpg: Complete in a caller's transaction takes one outcome, not %d", len(outcomes))
		}
		q, err := db.AsQuerier(tx)
		if err != nil {
			return nil, err
		}
		// The caller's transaction keeps its own commit mode.
		o := outcomes[0]
		var errText *string
		if o.Error != "" {
			errText = &o.Error
		}
		_, err = q.Exec(ctx, s.sql.completeOne, s.args(uuidArg(worker), uuidArg(o.ID), uuidArg(o.LeaseToken),
			outcomeName(o.Kind), errText, delayMillis(o.Delay))...)
		if err != nil {
			return nil, completeError(err)
		}
		return []bool{true}, nil
	}
	n := len(outcomes)
	ids, tokens := make([]pgtype.UUID, n), make([]pgtype.UUID, n)
	kinds, errs := make([]string, n), make([]*string, n)
	delays := make([]int64, n)
	for i := range outcomes {
		o := &outcomes[i]
		ids[i], tokens[i], kinds[i], delays[i] = uuidArg(o.ID), uuidArg(o.LeaseToken), outcomeName(o.Kind), delayMillis(o.Delay)
		if o.Error != "" {
			errs[i] = &o.Error
		}
	}
	// On the driver's pool, sent as the claim is.
	args := append([]any{pgx.QueryExecModeCacheDescribe}, s.args(uuidArg(worker), ids, tokens, kinds, errs, delays)...)
	rows, err := s.pool.Query(ctx, s.sql.completeAsync, args...)
	if err != nil {
		return nil, completeError(err)
	}
	defer rows.Close()
	done := make(map[uuid.UUID]bool, n)
	for rows.Next() {
		var id pgtype.UUID
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		done[id.Bytes] = true
	}
	if err := rows.Err(); err != nil {
		return nil, completeError(err)
	}
	settled := make([]bool, n)
	for i, o := range outcomes {
		settled[i] = done[o.ID]
	}
	return settled, nil
}

// completeError maps the completion functions' SQLSTATEs to the driver's
// errors.
func completeError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "P7002":
			return fmt.Errorf("%w: %w", driver.ErrLeaseLost, err)
		case "P7003":
			return fmt.Errorf("%w: %w", driver.ErrInvalidState, err)
		}
	}
	return err
}

// InTx implements driver.Store: tx is a pgx.Tx.
func (s *store) InTx(ctx context.Context, fn func(ctx context.Context, tx any) error) error {
	return db.InTx(ctx, s.pool, func(ctx context.Context, tx pgx.Tx) error { return fn(ctx, tx) })
}

// Sweep implements driver.Store.
func (s *store) Sweep(ctx context.Context, p driver.SweepParams) ([]driver.Swept, error) {
	var all []driver.Swept
	for {
		rows, err := s.pool.Query(ctx, s.sql.sweep, s.args(p.Topics, p.MaxAttempts, p.Limit)...)
		if err != nil {
			return all, err
		}
		// A NULL repaired (migration 0031) is an event the sweep gave an
		// attempt back without a lease: neither repaired nor dead, so not
		// reported, but it counts toward the batch, or a batch of them
		// would end the loop while more is due.
		n := 0
		for rows.Next() {
			var sw driver.Swept
			var repaired pgtype.Bool
			if err := rows.Scan(&sw.ID, &sw.Topic, &repaired); err != nil {
				rows.Close()
				return all, err
			}
			n++
			if repaired.Valid {
				sw.Repaired = repaired.Bool
				all = append(all, sw)
			}
		}
		if err := rows.Err(); err != nil {
			return all, err
		}
		if n < p.Limit {
			return all, nil
		}
	}
}

// Purge implements driver.Store. The dispatchers' purge (not Recorded)
// runs modkit_outbox_purge_from, which starts at p.From and reports its
// cutoff; on a schema without it (migration 0025 not applied), the store
// falls back to modkit_outbox_purge for good, which walks from the oldest
// event and reports no cutoff, so that a dispatcher upgraded before its
// schema keeps purging.
func (s *store) Purge(ctx context.Context, p driver.PurgeParams) (driver.PurgeResult, error) {
	var res driver.PurgeResult
	if p.Recorded && !p.From.IsZero() {
		return res, errors.New("outboxpg: a recorded purge walks from the oldest event; PurgeParams.From must be zero")
	}
	for {
		var n int64
		var cutoff time.Time
		var err error
		switch {
		case p.Recorded:
			err = s.pool.QueryRow(ctx, s.sql.purgeRecorded, s.args(p.Topics, p.Retention, p.Limit)...).Scan(&n)
		case !s.noPurgeFrom.Load():
			from := pgtype.Timestamptz{Time: p.From, Valid: !p.From.IsZero()}
			err = s.pool.QueryRow(ctx, s.sql.purgeFrom, s.args(p.Topics, p.Retention, p.Limit, from)...).Scan(&n, &cutoff)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42883" && strings.Contains(pgErr.Message, "modkit_outbox_purge_from") {
				s.noPurgeFrom.Store(true)
				continue
			}
		default:
			err = s.pool.QueryRow(ctx, s.sql.purge, s.args(p.Topics, p.Retention, p.Limit)...).Scan(&n)
		}
		if err != nil {
			return driver.PurgeResult{Purged: res.Purged}, err
		}
		res.Purged += n
		if n < int64(p.Limit) {
			res.Cutoff = cutoff
			return res, nil
		}
	}
}

// Elect implements driver.Store.
func (s *store) Elect(ctx context.Context, p driver.ElectParams) ([]string, error) {
	rows, err := s.pool.Query(ctx, s.sql.elect, s.args(p.Roles, uuidArg(p.Holder), p.TTL)...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Resign implements driver.Store.
func (s *store) Resign(ctx context.Context, holder uuid.UUID, roles []string) error {
	_, err := s.pool.Exec(ctx, s.sql.resign, uuidArg(holder), roles)
	return err
}

// Stats implements driver.Store.
func (s *store) Stats(ctx context.Context) ([]driver.StatsRow, error) {
	return s.statsRows(ctx, s.sql.stats)
}

// Backlog implements driver.Store. On a schema without
// modkit_outbox_backlog (migration 0027 not applied) it counts with
// modkit_outbox_stats and leaves the delivered rows out, for good, so that
// an application upgraded before its schema still shows its backlog.
func (s *store) Backlog(ctx context.Context) ([]driver.StatsRow, error) {
	if !s.noBacklog.Load() {
		out, err := s.statsRows(ctx, s.sql.backlog)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42883" || !strings.Contains(pgErr.Message, "modkit_outbox_backlog") {
			return out, err
		}
		s.noBacklog.Store(true)
	}
	all, err := s.statsRows(ctx, s.sql.stats)
	return slices.DeleteFunc(all, func(r driver.StatsRow) bool { return r.Status == "delivered" }), err
}

// Served implements driver.Store (migration 0034; before it,
// driver.ErrServedUnknown).
func (s *store) Served(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, s.sql.served, s.args()...)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42883" && strings.Contains(pgErr.Message, "modkit_outbox_served_topics") {
			return nil, fmt.Errorf("%w: %w", driver.ErrServedUnknown, err)
		}
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// statsRows runs q, modkit_outbox_stats or modkit_outbox_backlog.
func (s *store) statsRows(ctx context.Context, q string) ([]driver.StatsRow, error) {
	rows, err := s.pool.Query(ctx, q, s.args()...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []driver.StatsRow
	for rows.Next() {
		var r driver.StatsRow
		var age float64
		if err := rows.Scan(&r.Namespace, &r.Topic, &r.Status, &r.Count, &age); err != nil {
			return nil, err
		}
		r.OldestDueAge = time.Duration(age * float64(time.Second))
		out = append(out, r)
	}
	return out, rows.Err()
}

// Depth implements driver.Store.
func (s *store) Depth(ctx context.Context, topics []string) ([]driver.DepthRow, error) {
	rows, err := s.pool.Query(ctx, s.sql.depth, s.args(topics)...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []driver.DepthRow
	for rows.Next() {
		var r driver.DepthRow
		var age float64
		if err := rows.Scan(&r.Topic, &r.Pending, &r.Processing, &r.Dead, &age, &r.Stuck); err != nil {
			return nil, err
		}
		r.OldestDueAge = time.Duration(age * float64(time.Second))
		out = append(out, r)
	}
	return out, rows.Err()
}

func emptyNil(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func zeroNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

func filterArgs(f driver.ListFilter) []any {
	var afterID pgtype.UUID
	if !f.AfterCreatedAt.IsZero() {
		afterID = uuidArg(f.AfterID)
	}
	return []any{emptyNil(f.Status), emptyNil(f.Namespace), emptyNil(f.Topic), nullUUID(f.TenantID),
		zeroNil(f.CreatedAfter), zeroNil(f.CreatedBefore), zeroNil(f.AfterCreatedAt), afterID, f.Limit}
}

// List implements driver.Store.
func (s *store) List(ctx context.Context, f driver.ListFilter) ([]driver.Event, error) {
	return withPayloads(s, func(payloads bool) ([]driver.Event, error) {
		q := s.sql.list
		if payloads {
			q = s.sql.listPayload
		}
		rows, err := s.pool.Query(ctx, q, filterArgs(f)...)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.Event, error) { return scanEvent(r) })
	})
}

// withPayloads runs a read that shows payloads when this role may see them
// (the operator role, or the owner) and hides them otherwise (the reader
// role). The first refusal is remembered, so a reader pays for it once.
func withPayloads[T any](s *store, read func(payloads bool) (T, error)) (T, error) {
	if !s.noPayloads.Load() {
		out, err := read(true)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			return out, err
		}
		s.noPayloads.Store(true)
	}
	return read(false)
}

func scanEvent(row pgx.Row) (driver.Event, error) {
	var e driver.Event
	var tenant, lockedBy pgtype.UUID
	var headers []byte
	err := row.Scan(&e.ID, &e.Namespace, &e.Topic, &tenant, &e.DedupeKey, &e.Payload, &e.Status, &e.Attempts,
		&e.NextAttemptAt, &lockedBy, &e.LockedUntil, &e.LastError, &e.CreatedAt, &e.UpdatedAt, &headers, &e.OrderingKey, &e.OrderingSeq)
	e.TenantID, e.LockedBy = ptrUUID(tenant), ptrUUID(lockedBy)
	if err == nil {
		e.Headers, err = scanHeaders(headers)
	}
	return e, err
}

// Get implements driver.Store.
func (s *store) Get(ctx context.Context, id uuid.UUID) (driver.Event, error) {
	e, err := withPayloads(s, func(payloads bool) (driver.Event, error) {
		q := s.sql.get
		if payloads {
			q = s.sql.getPayload
		}
		return scanEvent(s.pool.QueryRow(ctx, q, uuidArg(id)))
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return driver.Event{}, driver.ErrNotFound
	}
	return e, err
}

// BlockedKeys implements driver.Store.
func (s *store) BlockedKeys(ctx context.Context, limit int) ([]driver.BlockedKey, error) {
	rows, err := s.pool.Query(ctx, s.sql.blockedKeys, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.BlockedKey, error) {
		var b driver.BlockedKey
		err := r.Scan(&b.Namespace, &b.Topic, &b.OrderingKey, &b.HeadID, &b.HeadSeq, &b.Waiting, &b.LastError, &b.DeadSince)
		return b, err
	})
}

// ReleaseHeld implements driver.Store.
func (s *store) ReleaseHeld(ctx context.Context, topics, skipDead []string, limit int) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, s.sql.releaseHeld, topics, skipDead, limit).Scan(&n)
	return n, err
}

// SkipHead implements driver.Store.
func (s *store) SkipHead(ctx context.Context, id uuid.UUID, by string) (bool, error) {
	var ok bool
	err := s.pool.QueryRow(ctx, s.sql.skipHead, s.args(uuidArg(id), by)...).Scan(&ok)
	return ok, err
}

// History implements driver.Store.
func (s *store) History(ctx context.Context, id uuid.UUID) ([]driver.Attempt, error) {
	rows, err := s.pool.Query(ctx, s.sql.history, uuidArg(id))
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.Attempt, error) {
		var a driver.Attempt
		var worker, token pgtype.UUID
		err := r.Scan(&a.No, &a.Outcome, &a.Attempt, &worker, &token, &a.ClaimedAt, &a.FinishedAt, &a.Detail, &a.Actor)
		a.Worker, a.LeaseToken = ptrUUID(worker), ptrUUID(token)
		return a, err
	})
}

// Replay implements driver.Store.
func (s *store) Replay(ctx context.Context, p driver.ReplayParams) ([]uuid.UUID, error) {
	return s.changeSelected(ctx, s.sql.replayIDs, s.sql.replayFilter, p)
}

// PurgeDead implements driver.Store.
func (s *store) PurgeDead(ctx context.Context, p driver.ReplayParams) ([]uuid.UUID, error) {
	return s.changeSelected(ctx, s.sql.purgeDeadIDs, s.sql.purgeDeadFilter, p)
}

// PruneSequences implements driver.Store (migration 0045).
func (s *store) PruneSequences(ctx context.Context, limit int, after int64) (pruned, last int64, err error) {
	err = s.pool.QueryRow(ctx, s.sql.pruneSequences, limit, after).Scan(&pruned, &last)
	return pruned, last, err
}

// PrunableSequences implements driver.Store (migration 0045).
func (s *store) PrunableSequences(ctx context.Context) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, s.sql.prunableSequences).Scan(&n)
	return n, err
}

// DeadLetter implements driver.Store.
func (s *store) DeadLetter(ctx context.Context, p driver.ReplayParams) ([]uuid.UUID, error) {
	return s.changeSelected(ctx, s.sql.deadLetterIDs, s.sql.deadLetterFilter, p)
}

// changeSelected runs byIDs (with p's ids) or byFilter (with p's filter), each
// with p.By, and returns the ids of the events it changed (dead events,
// or pending ones for DeadLetter).
func (s *store) changeSelected(ctx context.Context, byIDs, byFilter string, p driver.ReplayParams) ([]uuid.UUID, error) {
	var rows pgx.Rows
	var err error
	if len(p.IDs) > 0 {
		// pgtype.UUIDs, which encode in text as well: []uuid.UUID does
		// not, and a pool in pgx's exec or simple protocol mode (the
		// usual advice behind PgBouncer) failed to send it.
		ids := make([]pgtype.UUID, len(p.IDs))
		for i, id := range p.IDs {
			ids[i] = uuidArg(id)
		}
		rows, err = s.pool.Query(ctx, byIDs, s.args(ids, p.By)...)
	} else {
		rows, err = s.pool.Query(ctx, byFilter, s.args(append(filterArgs(p.Filter), p.By)...)...)
	}
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
}

// The listener's check: after listenQuiet without a notification it sends
// one to itself through the pool, from another session, and gives up on
// the connection when it is not back within listenEchoWait. A connection
// whose server went away behind a proxy that keeps the client's side open
// otherwise waits forever without an error, and every event waits for the
// poll. Behind PgBouncer in transaction mode LISTEN registers on a server
// connection that hands the notifications to no one: a check the listener
// sent on its own connection came back there all the same, so it is sent
// from the pool; only when the pool cannot send it (exhausted, say) does
// the listener send it itself, which checks its connection alone.
var (
	listenQuiet    = 30 * time.Second
	listenEchoWait = 10 * time.Second
)

// listenEchoPrefix begins the payload of the listener's check: a space, so
// that no topic ("namespace:topic") can be taken for it.
const listenEchoPrefix = " modkit-outbox listener check "

// Listen implements driver.Store on a connection of its own (LISTEN needs
// one session for its whole life, which a pooled connection is not),
// opened with the pool's connection settings and its BeforeConnect and
// AfterConnect hooks (rotating credentials, service discovery), or with
// Driver.ListenOn's. A check the pool sent that comes back calls wake
// with the empty topic; one that does not ends it, with an error wrapping
// driver.ErrListenDeaf when the listener's own connection still answers
// (it listens where no one notifies), and as a silent connection when it
// does not.
func (s *store) Listen(ctx context.Context, onReady func(), wake func(topic string)) error {
	conn, err := s.listenConn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	channel := NotifyChannel(s.opts.Schema)
	for _, c := range []string{channel, LegacyNotifyChannel} {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{c}.Sanitize()); err != nil {
			return err
		}
	}
	onReady()
	echo := listenEchoPrefix + uuid.NewString()
	var echoSent time.Time // zero: no check under way
	fromPool := false      // the check under way was sent by the pool
	for {
		wait := listenQuiet
		if !echoSent.IsZero() {
			wait = listenEchoWait - time.Since(echoSent)
		}
		wctx, cancel := context.WithTimeout(ctx, wait)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		if err == nil {
			if n.Payload == echo {
				// Only a check the pool sent shows that the listener hears
				// other sessions; one it sent itself comes back even where
				// it hears no one.
				if fromPool {
					wake("")
				}
				echoSent = time.Time{}
			} else {
				wake(n.Payload)
			}
			continue
		}
		if ctx.Err() != nil || wctx.Err() == nil || conn.PgConn().IsClosed() {
			return err // stopped, or the connection failed
		}
		// The wait ran out (its deadline leaves the connection usable):
		// quiet for listenQuiet, or the check did not come back.
		silent := fmt.Errorf("outboxpg: the notification listener's connection delivered no notification, not even its own check, "+
			"for %v: reconnecting", listenQuiet+listenEchoWait)
		if !echoSent.IsZero() {
			if !fromPool {
				return silent
			}
			// The pool's check did not come back: deaf if the listener's
			// own connection still answers, silent (a dead connection)
			// if it does not.
			actx, cancel := context.WithTimeout(ctx, listenEchoWait/2)
			_, err := conn.Exec(actx, "SELECT 1", pgx.QueryExecModeSimpleProtocol)
			cancel()
			switch {
			case ctx.Err() != nil:
				return ctx.Err()
			case err != nil:
				return silent
			}
			return fmt.Errorf("outboxpg: %w (for %v): reconnecting. Behind PgBouncer in transaction mode LISTEN does not work: "+
				"give the listener a direct connection (Driver.ListenOn), or set DispatcherConfig.PollOnly and Config.DisableNotify "+
				"on the producers", driver.ErrListenDeaf, listenQuiet+listenEchoWait)
		}
		// In the simple protocol: no statement is prepared, on any pooler.
		echoSent = time.Now()
		const notify = "SELECT pg_catalog.pg_notify($1, $2)"
		pctx, cancel := context.WithTimeout(ctx, listenEchoWait/2)
		_, err = s.pool.Exec(pctx, notify, pgx.QueryExecModeSimpleProtocol, channel, echo)
		cancel()
		fromPool = err == nil
		timedOut := false
		if err != nil && ctx.Err() == nil {
			ectx, cancel := context.WithTimeout(ctx, listenEchoWait-time.Since(echoSent))
			_, err = conn.Exec(ectx, notify, pgx.QueryExecModeSimpleProtocol, channel, echo)
			timedOut = ectx.Err() != nil
			cancel()
		}
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case err != nil && timedOut:
			return silent // the check's own statement got no answer
		case err != nil:
			return err
		}
	}
}

// listenConn opens the listener's connection as the pool opens its own,
// or with Driver.ListenOn's settings.
func (s *store) listenConn(ctx context.Context) (*pgx.Conn, error) {
	if s.listen != nil {
		return pgx.ConnectConfig(ctx, s.listen.Copy())
	}
	cfg := s.pool.Config()
	cc := cfg.ConnConfig.Copy()
	if cfg.BeforeConnect != nil {
		if err := cfg.BeforeConnect(ctx, cc); err != nil {
			return nil, err
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, err
	}
	if cfg.AfterConnect != nil {
		if err := cfg.AfterConnect(ctx, conn); err != nil {
			conn.Close(context.WithoutCancel(ctx))
			return nil, err
		}
	}
	return conn, nil
}

// Migrate implements driver.Store with modkit/db's Migrator and the
// embedded migrations.
func (s *store) Migrate(ctx context.Context) error { return s.MigrateTo(ctx, 0) }

// MigrateTo implements driver.Store (Migrate: version 0, every migration).
func (s *store) MigrateTo(ctx context.Context, version int64) error {
	m, err := db.NewMigrator(s.pool, db.MigratorConfig{Schema: s.opts.Schema, Logger: s.opts.Logger})
	if err != nil {
		return err
	}
	all := m.Migrations()
	if version == 0 {
		version = all[len(all)-1].Version
	}
	if !slices.ContainsFunc(all, func(mig db.Migration) bool { return mig.Version == version }) {
		_, err := m.UpTo(ctx, version) // its error names the versions
		return err
	}
	if err := s.checkSchemaClosed(ctx, m); err != nil {
		return err
	}
	if _, err = m.UpTo(ctx, version); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
			return fmt.Errorf("%w; this login may not migrate schema %s, which has migrations to apply (a login that "+
				"holds only the outbox's roles may not): run them as the schema's owner before the application starts "+
				"(modkit-outbox migrate up), or migrate with a login that may", err, s.opts.Schema)
		}
		return err
	}
	var missing []string
	if err := s.pool.QueryRow(ctx, qRolesPresent, Roles).Scan(&missing); err != nil {
		return fmt.Errorf("outboxpg: look up the outbox roles: %w", err)
	}
	if len(missing) > 0 && s.opts.Logger != nil {
		s.opts.Logger.Warn("outbox: the migrating role may not create roles, so these were not created; "+
			"create them as a superuser (README, \"Least privilege\"), then run SELECT "+
			pgx.Identifier{s.opts.Schema}.Sanitize()+".modkit_outbox_grant_roles() as the owner",
			"missing_roles", missing)
	}
	return nil
}

// checkSchemaClosed refuses, before any migration runs, a schema where
// roles other than the migrating one may create objects: PUBLIC, or a login
// role that is not a superuser and cannot act as the migrating role (who
// owns the outbox's functions). The functions run as their owner, and a
// function created in their schema whose argument types match exactly wins
// over pg_catalog's: such a role could run its code as the owner. Migration
// 0028 refuses PUBLIC and the outbox's own roles only, and only when it
// runs; this check covers every role, and runs at every Migrate: with
// migrations to apply it refuses (nothing is migrated), and on a schema
// already up to date it logs a warning rather than stop an application
// that runs today.
func (s *store) checkSchemaClosed(ctx context.Context, m *db.Migrator) error {
	var schema string
	var open *string
	if err := s.pool.QueryRow(ctx, qSchemaOpenTo, s.opts.Schema).Scan(&schema, &open); err != nil {
		return fmt.Errorf("outboxpg: look up who may create objects in schema %q: %w", s.opts.Schema, err)
	}
	if open == nil {
		return nil
	}
	status, err := m.Status(ctx)
	if err != nil {
		return err
	}
	pending := slices.ContainsFunc(status, func(st db.MigrationStatus) bool { return !st.Applied })
	why := fmt.Sprintf("schema %s lets %s create objects in it, whose functions the outbox's functions (which run as "+
		"their owner) could be made to call: REVOKE CREATE ON SCHEMA %s FROM %s (PostgreSQL 15's default for public), "+
		"or give the outbox a schema of its own", schema, *open, schema, *open)
	if pending {
		return fmt.Errorf("outboxpg: %s; nothing was migrated", why)
	}
	if s.opts.Logger != nil {
		s.opts.Logger.Warn("outbox: " + why)
	}
	return nil
}

// qSchemaOpenTo returns schema $1's name as SQL writes it and who, other
// than the current role, may create objects in it (NULL for nobody, or no
// such schema): PUBLIC alone when it may; otherwise each login role, not a
// superuser, that may (itself or through a role it inherits from, as the
// database's owner does through pg_database_owner), or that is a member of
// a role that may, even without inheriting its rights (NOINHERIT: it may
// still SET ROLE to it), and is not a member of the current role (a member
// may act as it anyway).
const qSchemaOpenTo = `SELECT quote_ident($1), (
	SELECT CASE WHEN EXISTS (
			SELECT 1 FROM pg_catalog.aclexplode(coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) a
			WHERE a.grantee = 0 AND a.privilege_type = 'CREATE')
		THEN 'PUBLIC' ELSE (
			SELECT string_agg(quote_ident(r.rolname), ', ' ORDER BY r.rolname)
			FROM pg_catalog.pg_roles r
			WHERE r.rolcanlogin AND NOT r.rolsuper
			  AND (pg_catalog.has_schema_privilege(r.oid, n.oid, 'CREATE') OR EXISTS (
				SELECT 1 FROM pg_catalog.aclexplode(coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) g
				WHERE g.privilege_type = 'CREATE' AND g.grantee <> 0 AND pg_catalog.pg_has_role(r.oid, g.grantee, 'MEMBER')))
			  AND NOT pg_catalog.pg_has_role(r.oid, current_user, 'MEMBER')) END
	FROM pg_catalog.pg_namespace n
	WHERE n.nspname = $1)`

// RecordedOutcomes implements driver.OutcomeFinder from the attempts
// ledger (migration 0035; before it, an error, and the dispatcher reports
// the leases lost as it did).
func (s *store) RecordedOutcomes(ctx context.Context, worker uuid.UUID, outcomes []driver.Outcome) ([]bool, error) {
	ids, tokens := make([]pgtype.UUID, len(outcomes)), make([]pgtype.UUID, len(outcomes))
	for i, o := range outcomes {
		ids[i], tokens[i] = uuidArg(o.ID), uuidArg(o.LeaseToken)
	}
	rows, err := s.pool.Query(ctx, s.sql.recorded, uuidArg(worker), ids, tokens)
	if err != nil {
		return nil, err
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, err
	}
	recorded := make([]bool, len(outcomes))
	for _, ord := range found {
		if ord < 1 || ord > int64(len(outcomes)) {
			return nil, fmt.Errorf("outboxpg: recorded outcomes: position %d of %d", ord, len(outcomes))
		}
		recorded[ord-1] = true
	}
	return recorded, nil
}

// PoolSize implements driver.PoolSizer: the pool's MaxConns.
func (s *store) PoolSize() int { return int(s.pool.Config().MaxConns) }

// AutovacuumOff implements driver.VacuumChecker: the server's autovacuum
// setting, and the events table's autovacuum_enabled storage parameter.
func (s *store) AutovacuumOff(ctx context.Context) (string, error) {
	var server, table bool
	err := s.pool.QueryRow(ctx, `SELECT current_setting('autovacuum')::bool,
		coalesce((SELECT o.option_value::bool FROM pg_catalog.pg_class c, pg_catalog.pg_options_to_table(c.reloptions) o
			WHERE c.oid = to_regclass($1) AND o.option_name = 'autovacuum_enabled'), true)`,
		pgx.Identifier{s.opts.Schema, "modkit_outbox_events"}.Sanitize()).Scan(&server, &table)
	switch {
	case err != nil:
		return "", fmt.Errorf("outboxpg: read the autovacuum settings: %w", err)
	case !server:
		return "the server's autovacuum setting is off", nil
	case !table:
		return "the table's autovacuum_enabled storage parameter is false", nil
	}
	return "", nil
}

// Rights implements driver.RightsChecker: whether the connected role may
// run the operator's replay (the operator role, or the outbox's owner: the
// same grant as every operator write) and read payloads (the reader role
// may not). A schema without those functions (not migrated, or before the
// signatures asked about) cannot tell: Known is false.
func (s *store) Rights(ctx context.Context) (driver.Rights, error) {
	var r driver.Rights
	var operate, payloads *bool
	err := s.pool.QueryRow(ctx, `SELECT current_user::text,
	has_function_privilege(to_regprocedure(format('%I.modkit_outbox_replay(uuid[], text, timestamptz)', $1::text)), 'EXECUTE'),
	has_function_privilege(to_regprocedure(format('%I.modkit_outbox_get_payload(uuid)', $1::text)), 'EXECUTE')`, s.opts.Schema).
		Scan(&r.User, &operate, &payloads)
	if err != nil {
		return driver.Rights{}, fmt.Errorf("outboxpg: read what the connected role may do in schema %s: %w", s.opts.Schema, err)
	}
	if operate != nil && payloads != nil {
		r.Known, r.Operate, r.ReadPayloads = true, *operate, *payloads
	}
	return r, nil
}

// MissingMigrations implements driver.MigrationChecker from the migrations
// table the modkit migrator keeps in the schema (db.MigrationsTable). A
// schema migrated by another tool (golang-migrate, goose, psql) has no such
// record, and a role that may not read it (the dispatcher and producer
// roles) cannot tell: nil for both.
func (s *store) MissingMigrations(ctx context.Context) ([]string, error) {
	var readable bool
	table := pgx.Identifier{s.opts.Schema, db.MigrationsTable}.Sanitize()
	if err := s.pool.QueryRow(ctx, `SELECT CASE WHEN to_regclass($1) IS NULL THEN false
		ELSE has_table_privilege(to_regclass($1), 'SELECT') END`, table).Scan(&readable); err != nil {
		return nil, fmt.Errorf("outboxpg: look up %s: %w", table, err)
	}
	if !readable {
		return nil, nil
	}
	m, err := db.NewMigrator(s.pool, db.MigratorConfig{Schema: s.opts.Schema})
	if err != nil {
		return nil, err
	}
	status, err := m.Status(ctx)
	if err != nil {
		return nil, err
	}
	var missing []string
	for _, st := range status {
		if !st.Applied {
			missing = append(missing, fmt.Sprintf("%04d_%s", st.Version, st.Name))
		}
	}
	if len(missing) == len(status) {
		return nil, nil // nothing recorded
	}
	return missing, nil
}

// Fatal implements driver.Store: class 42 (undefined table or column,
// insufficient privilege, syntax error), a missing schema, a missing
// database and a refused login (class 28: wrong password, no such role, no
// pg_hba.conf entry) cannot be cured by retrying.
func (s *store) Fatal(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) != 5 {
		return false
	}
	if pgErr.Code == "42P05" { // duplicate_prepared_statement: a pooler's, which the next attempt may not meet
		return false
	}
	switch pgErr.Code[:2] {
	case "42", "28":
		return true
	}
	return pgErr.Code == "3F000" || pgErr.Code == "3D000" // no such schema, no such database
}
