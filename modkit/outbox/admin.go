package outbox

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// Event is a full outbox row, as the admin calls return it.
type Event struct {
	ID            uuid.UUID
	Namespace     string
	Topic         string
	TenantID      *uuid.UUID
	DedupeKey     *string
	Payload       []byte
	Status        Status
	Attempts      int
	NextAttemptAt time.Time
	LockedBy      *uuid.UUID
	LockedUntil   *time.Time
	LastError     *string
	CreatedAt     time.Time
	UpdatedAt     time.Time
}

func scanEvent(row pgx.Row) (Event, error) {
	var e Event
	var tenant, lockedBy pgtype.UUID
	err := row.Scan(&e.ID, &e.Namespace, &e.Topic, &tenant, &e.DedupeKey, &e.Payload, &e.Status, &e.Attempts,
		&e.NextAttemptAt, &lockedBy, &e.LockedUntil, &e.LastError, &e.CreatedAt, &e.UpdatedAt)
	if tenant.Valid {
		id := uuid.UUID(tenant.Bytes)
		e.TenantID = &id
	}
	if lockedBy.Valid {
		id := uuid.UUID(lockedBy.Bytes)
		e.LockedBy = &id
	}
	return e, err
}

// ErrEventNotFound is returned by Get for an unknown id.
var ErrEventNotFound = errors.New("outbox: event not found")

// Get returns one event by id.
func (s *Store) Get(ctx context.Context, id uuid.UUID) (Event, error) {
	e, err := scanEvent(s.pool.QueryRow(ctx, s.sql.get, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Event{}, fmt.Errorf("%w: %s", ErrEventNotFound, id)
	}
	if err != nil {
		return Event{}, fmt.Errorf("outbox: get %s: %w", id, err)
	}
	return e, nil
}

// TopicStats counts one (namespace, topic)'s events.
type TopicStats struct {
	Topic
	Pending, Processing, Delivered, Dead int64
	// OldestDueAge is how long the oldest due pending event has waited past
	// its next_attempt_at; zero when none is due.
	OldestDueAge time.Duration
}

// Stats summarises the table per (namespace, topic).
type Stats struct {
	Topics []TopicStats
	// Totals over all topics; OldestDueAge is the largest.
	Total TopicStats
}

// Stats counts events per status per (namespace, topic). It reads the whole
// table, delivered history included: it is for operators and dashboards,
// not for a tight loop.
func (s *Store) Stats(ctx context.Context) (Stats, error) {
	rows, err := s.pool.Query(ctx, s.sql.stats)
	if err != nil {
		return Stats{}, fmt.Errorf("outbox: stats: %w", err)
	}
	defer rows.Close()
	var out Stats
	index := map[Topic]int{}
	for rows.Next() {
		var t Topic
		var status Status
		var n int64
		var oldestDue *time.Time
		var now time.Time
		if err := rows.Scan(&t.Namespace, &t.Topic, &status, &n, &oldestDue, &now); err != nil {
			return Stats{}, fmt.Errorf("outbox: stats: %w", err)
		}
		i, ok := index[t]
		if !ok {
			i = len(out.Topics)
			index[t] = i
			out.Topics = append(out.Topics, TopicStats{Topic: t})
		}
		ts := &out.Topics[i]
		switch status {
		case StatusPending:
			ts.Pending += n
			out.Total.Pending += n
		case StatusProcessing:
			ts.Processing += n
			out.Total.Processing += n
		case StatusDelivered:
			ts.Delivered += n
			out.Total.Delivered += n
		case StatusDead:
			ts.Dead += n
			out.Total.Dead += n
		}
		if oldestDue != nil {
			ts.OldestDueAge = max(ts.OldestDueAge, now.Sub(*oldestDue))
			out.Total.OldestDueAge = max(out.Total.OldestDueAge, ts.OldestDueAge)
		}
	}
	if err := rows.Err(); err != nil {
		return Stats{}, fmt.Errorf("outbox: stats: %w", err)
	}
	return out, nil
}

// DeadFilter selects dead events for ListDead. Empty fields match anything.
type DeadFilter struct {
	Namespace string
	Topic     string
	TenantID  *uuid.UUID
	// Limit is the page size: default 100, at most 1000.
	Limit int
	// After is the NextPage of the previous page; empty for the first.
	After string
}

// DeadPage is one page of dead events, oldest first.
type DeadPage struct {
	Events []Event
	// NextPage is an opaque cursor for DeadFilter.After; empty on the last
	// page.
	NextPage string
}

// ErrInvalidCursor is returned by ListDead for a DeadFilter.After it did not
// produce.
var ErrInvalidCursor = errors.New("outbox: invalid page cursor: pass DeadPage.NextPage unchanged")

// ListDead returns dead events matching f, oldest first, a page at a time.
func (s *Store) ListDead(ctx context.Context, f DeadFilter) (DeadPage, error) {
	if f.Limit == 0 {
		f.Limit = 100
	}
	if f.Limit < 0 || f.Limit > 1000 {
		return DeadPage{}, fmt.Errorf("outbox: DeadFilter.Limit is %d; it must be between 1 and 1000", f.Limit)
	}
	var afterAt *time.Time
	var afterID pgtype.UUID
	if f.After != "" {
		at, id, err := decodeCursor(f.After)
		if err != nil {
			return DeadPage{}, err
		}
		afterAt, afterID = &at, pgtype.UUID{Bytes: id, Valid: true}
	}
	rows, err := s.pool.Query(ctx, s.sql.listDead, emptyNil(f.Namespace), emptyNil(f.Topic), nullUUID(f.TenantID),
		afterAt, afterID, f.Limit+1)
	if err != nil {
		return DeadPage{}, fmt.Errorf("outbox: list dead: %w", err)
	}
	defer rows.Close()
	var page DeadPage
	for rows.Next() {
		e, err := scanEvent(rows)
		if err != nil {
			return DeadPage{}, fmt.Errorf("outbox: list dead: %w", err)
		}
		page.Events = append(page.Events, e)
	}
	if err := rows.Err(); err != nil {
		return DeadPage{}, fmt.Errorf("outbox: list dead: %w", err)
	}
	if len(page.Events) > f.Limit {
		page.Events = page.Events[:f.Limit]
		last := page.Events[f.Limit-1]
		page.NextPage = encodeCursor(last.CreatedAt, last.ID)
	}
	return page, nil
}

func emptyNil(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func encodeCursor(at time.Time, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString([]byte(at.UTC().Format(time.RFC3339Nano) + "|" + id.String()))
}

func decodeCursor(c string) (time.Time, uuid.UUID, error) {
	raw, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return time.Time{}, uuid.Nil, ErrInvalidCursor
	}
	atText, idText, ok := strings.Cut(string(raw), "|")
	if !ok {
		return time.Time{}, uuid.Nil, ErrInvalidCursor
	}
	at, err1 := time.Parse(time.RFC3339Nano, atText)
	id, err2 := uuid.Parse(idText)
	if err1 != nil || err2 != nil {
		return time.Time{}, uuid.Nil, ErrInvalidCursor
	}
	return at, id, nil
}

// ReplayDead puts dead events back to pending, due now, with attempts reset
// to 0. by names who asked (an operator, a tool) and is recorded with the
// time in last_error, followed by the error the event died with. Ids that are
// unknown or not dead are skipped. It returns the ids replayed.
func (s *Store) ReplayDead(ctx context.Context, ids []uuid.UUID, by string) ([]uuid.UUID, error) {
	if strings.TrimSpace(by) == "" {
		return nil, errors.New("outbox: ReplayDead needs a non-empty 'by' (who is replaying) for the audit trail")
	}
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := s.pool.Query(ctx, s.sql.replayDead, ids, sanitizeError(by, 200))
	if err != nil {
		return nil, fmt.Errorf("outbox: replay dead: %w", err)
	}
	replayed, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, fmt.Errorf("outbox: replay dead: %w", err)
	}
	return replayed, nil
}

// PurgeBatchDefault is how many rows PurgeDelivered deletes per statement.
const PurgeBatchDefault = 1000

// PurgeDelivered deletes delivered events last updated more than retention
// ago, batch rows per statement (default PurgeBatchDefault) so that no
// statement holds many locks or runs long, until none are left or ctx ends.
// It returns how many it deleted. Deleting a row ends its dedupe window: the
// same key can be enqueued again afterwards.
func (s *Store) PurgeDelivered(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	if retention < 0 {
		return 0, fmt.Errorf("outbox: retention is %v; it must not be negative", retention)
	}
	if batch == 0 {
		batch = PurgeBatchDefault
	}
	if batch < 0 || batch > BatchSizeMax {
		return 0, fmt.Errorf("outbox: purge batch is %d; it must be between 1 and %d", batch, BatchSizeMax)
	}
	var total int64
	for {
		tag, err := s.pool.Exec(ctx, s.sql.purgeDelivered, retention, batch)
		if err != nil {
			return total, fmt.Errorf("outbox: purge delivered: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}

// SweepExhausted dead-letters events of topics whose attempts are used up
// but which are not dead yet: above all an event whose final attempt was
// claimed by a worker that then crashed (processing, lease expired,
// attempts = maxAttempts), which the claim query never picks up again. It
// also catches pending events left over when maxAttempts was lowered.
// last_error says why. It returns the ids it dead-lettered.
func (s *Store) SweepExhausted(ctx context.Context, maxAttempts int, topics []Topic) ([]uuid.UUID, error) {
	if maxAttempts < 1 {
		return nil, fmt.Errorf("outbox: maxAttempts is %d; it must be at least 1", maxAttempts)
	}
	if err := validateTopics(topics); err != nil {
		return nil, err
	}
	var all []uuid.UUID
	for {
		rows, err := s.pool.Query(ctx, s.sql.sweepExhausted, maxAttempts, topicKeys(topics), PurgeBatchDefault)
		if err != nil {
			return all, fmt.Errorf("outbox: sweep exhausted: %w", err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		if err != nil {
			return all, fmt.Errorf("outbox: sweep exhausted: %w", err)
		}
		all = append(all, ids...)
		if len(ids) < PurgeBatchDefault {
			return all, nil
		}
	}
}
