package outbox

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Status is an event's state: pending → processing → delivered | pending
// (retry) | dead.
type Status string

// The event states.
const (
	// StatusPending: waiting for its next attempt (next_attempt_at).
	StatusPending Status = "pending"
	// StatusProcessing: leased to a dispatcher that is publishing it.
	StatusProcessing Status = "processing"
	// StatusDelivered: published; kept until its topic's retention ends.
	StatusDelivered Status = "delivered"
	// StatusDead: failed permanently or used up its attempts; kept until
	// an operator replays or purges it.
	StatusDead Status = "dead"
)

func (s Status) valid() bool {
	switch s {
	case StatusPending, StatusProcessing, StatusDelivered, StatusDead:
		return true
	}
	return false
}

// Admin is the operator API of a Client: stats, listing, replay and purge.
// Get it from Client.Admin. Its calls run on the client's own connections.
type Admin struct{ c *Client }

// wrapErr prefixes err, a read's, with what failed (format and args), and
// makes an error that says the outbox's objects are missing match
// ErrNotMigrated, as the client's and the dispatcher's do.
func (a *Admin) wrapErr(err error, format string, args ...any) error {
	return a.wrapErrFor(roleReaders, err, format, args...)
}

// wrapWriteErr is wrapErr for the writes, which only the operator role may
// make.
func (a *Admin) wrapWriteErr(err error, format string, args ...any) error {
	return a.wrapErrFor(roleOperator, err, format, args...)
}

// wrapErrFor is wrapErr, whose privilege hint names role.
func (a *Admin) wrapErrFor(role string, err error, format string, args ...any) error {
	if notMigrated(err) {
		err = &notMigratedError{schema: a.c.cfg.Schema, err: err}
	}
	if pgCode(err) == privilegeDenied {
		return fmt.Errorf("outbox: "+format+": %w (schema %s: %s)", append(args, err, a.c.cfg.Schema, privilegeHint(role))...)
	}
	if poolerConflict(err) {
		return fmt.Errorf("outbox: "+format+": %w (%s)", append(args, err, poolerHint)...)
	}
	return fmt.Errorf("outbox: "+format+": %w", append(args, err)...)
}

// Schema is the schema of the outbox this Admin reads (Config.Schema), for
// tools that show it: two outboxes in one database can have the same
// topics.
func (a *Admin) Schema() string { return a.c.cfg.Schema }

// Rights is what the database lets the client's login do in the outbox, as
// Admin.Rights reports it.
type Rights struct {
	// User is the database login (current_user).
	User string
	// Known: the database could tell. It cannot on a schema that lacks the
	// functions asked about (not migrated, or migrated by an older
	// version), nor with a driver that does not say; Operate and
	// ReadPayloads are then false, and each call finds out for itself.
	Known bool
	// Operate: the login may replay, purge and skip dead events and purge
	// delivered ones (ReplayDead, PurgeDead, SkipHead, Purge): it is in
	// modkit_outbox_operator, or owns the outbox.
	Operate bool
	// ReadPayloads: the login may read payloads and headers; a login in
	// modkit_outbox_reader may not, and reads them as nil.
	ReadPayloads bool
}

// Rights asks the database what the client's login may do in the outbox,
// so that a tool can offer only what will work (the dashboard hides its
// sign-in from a login that may not replay). The database still decides at
// each call: a right granted or revoked afterwards holds from then on.
func (a *Admin) Rights(ctx context.Context) (Rights, error) {
	rc, ok := a.c.store.(driver.RightsChecker)
	if !ok {
		return Rights{}, nil
	}
	r, err := rc.Rights(ctx)
	if err != nil {
		return Rights{}, a.wrapErr(err, "rights")
	}
	return Rights{User: r.User, Known: r.Known, Operate: r.Operate, ReadPayloads: r.ReadPayloads}, nil
}

// Event is a full outbox row, as Admin returns it.
type Event struct {
	ID        uuid.UUID // time-ordered (UUIDv7), made at enqueue
	Namespace string
	Topic     string
	TenantID  *uuid.UUID // nil without a tenant
	// DedupeKey as stored: with a tenant, prefixed with the tenant's id
	// and "/" (see Message.DedupeKey); nil without a key.
	DedupeKey *string
	// Payload as stored (jsonb's normal form: see Message.Payload); nil
	// when the database role may not read payloads (the reader role).
	Payload []byte
	Status  Status
	// Attempts counts the publishes tried (claims, each of which used an
	// attempt); a replay resets it to 0.
	Attempts int
	// NextAttemptAt is when a pending event is due: its enqueue time, or
	// its retry's backoff. Other events keep the time their last attempt
	// was due, which means nothing for them: a leased event's lease ends
	// at LockedUntil, and a delivered or dead one awaits no attempt.
	NextAttemptAt time.Time
	// LockedBy and LockedUntil are the worker holding the lease of a
	// processing event and the lease's end; nil otherwise.
	LockedBy    *uuid.UUID
	LockedUntil *time.Time
	// LastError is the last failed publish's error (sanitised, see
	// SanitizeError); nil when none failed. A replay keeps it.
	LastError *string
	// CreatedAt is the enqueue time by the database's clock (now(): the
	// start of the producer's transaction).
	CreatedAt time.Time
	// UpdatedAt is when the event last changed: its last claim, outcome
	// or operator action.
	UpdatedAt time.Time
	// Headers as enqueued; nil when there are none, or when the database
	// role may not read payloads (the reader role).
	Headers map[string]string
	// OrderingKey and Sequence: see Delivery ("" and 0 without a key).
	OrderingKey string
	Sequence    int64
}

func eventFrom(e driver.Event) Event {
	return Event{ID: e.ID, Namespace: e.Namespace, Topic: e.Topic, TenantID: e.TenantID, DedupeKey: e.DedupeKey,
		Payload: e.Payload, Status: Status(e.Status), Attempts: e.Attempts, NextAttemptAt: e.NextAttemptAt,
		LockedBy: e.LockedBy, LockedUntil: e.LockedUntil, LastError: e.LastError, CreatedAt: e.CreatedAt, UpdatedAt: e.UpdatedAt, Headers: e.Headers,
		OrderingKey: deref(e.OrderingKey), Sequence: derefInt(e.OrderingSeq)}
}

// Attempt is one entry of an event's history (the append-only attempts
// ledger): the outcome of one claim, or what the sweeper or an operator did.
type Attempt struct {
	// No numbers the event's entries from 1, without gaps.
	No int
	// Outcome is one of delivered (with Detail "deleted on delivery" when
	// Publisher.DeleteOnDelivery deleted the event), retry, dead, released
	// (given back unpublished), lease_expired (the claim ended without an
	// outcome: its dispatcher crashed or overran), swept (dead-lettered by
	// the sweeper: attempts used up), replayed (by an operator), skipped
	// (a dead head an operator skipped, Admin.SkipHead), dead_lettered (a
	// pending event an operator made dead, Admin.DeadLetter), purged (by an
	// operator's Admin.Purge or Admin.PurgeDead; the dispatchers' own
	// retention purge leaves no entry).
	Outcome string
	// Attempt is the event's attempt number during the claim this entry
	// closes; 0 for entries that close no claim.
	Attempt int
	// Worker and LeaseToken identify the claim (nil for entries that close
	// no claim).
	Worker     *uuid.UUID
	LeaseToken *uuid.UUID
	// ClaimedAt is when the claim began; FinishedAt when this entry was
	// written.
	ClaimedAt  *time.Time
	FinishedAt time.Time
	// Detail is the publish error, or what the sweeper or operator did.
	Detail string
	// Actor is the database session user of an operator's action.
	Actor string
}

// History returns an event's attempts ledger, oldest first. History is
// kept after the event itself is purged; an id with no history returns an
// empty slice. An id used again after its event was purged (the library
// never does; a producer's own SQL may) holds both events' entries, each
// numbered from 1, by number and then by time.
func (a *Admin) History(ctx context.Context, id uuid.UUID) ([]Attempt, error) {
	rows, err := a.c.store.History(ctx, id)
	if err != nil {
		return nil, a.wrapErr(err, "history of %s", id)
	}
	out := make([]Attempt, len(rows))
	for i, r := range rows {
		out[i] = Attempt{No: r.No, Outcome: r.Outcome, Attempt: r.Attempt, Worker: r.Worker, LeaseToken: r.LeaseToken,
			ClaimedAt: r.ClaimedAt, FinishedAt: r.FinishedAt, Detail: r.Detail, Actor: r.Actor}
	}
	return out, nil
}

// BlockedKey is an ordering key held back by a dead event: its later events
// wait until the dead one is replayed and delivered, or skipped.
type BlockedKey struct {
	Topic       Topic
	OrderingKey string
	// Head is the dead event and HeadSequence its place in the key.
	Head         uuid.UUID
	HeadSequence int64
	// Waiting counts the key's later events that are pending or leased.
	Waiting int64
	// LastError is the error the head died with.
	LastError string
	// DeadSince is when the head died.
	DeadSince time.Time
}

// blockedKeysMax bounds BlockedKeys.
const blockedKeysMax = 10000

// BlockedKeys lists the ordering keys whose earliest undelivered event is
// dead and not skipped, longest dead first, at most limit (default 100,
// at most 10000). Under a publisher with SkipDeadHeads such keys are not
// held back, but their dead events are listed all the same.
func (a *Admin) BlockedKeys(ctx context.Context, limit int) ([]BlockedKey, error) {
	if limit < 0 || limit > blockedKeysMax {
		return nil, configError("BlockedKeys limit is %d; use 1 to %d, or 0 for 100", limit, blockedKeysMax)
	}
	if limit == 0 {
		limit = 100
	}
	rows, err := a.c.store.BlockedKeys(ctx, limit)
	if err != nil {
		return nil, a.wrapErr(err, "blocked keys")
	}
	out := make([]BlockedKey, len(rows))
	for i, r := range rows {
		out[i] = BlockedKey{Topic: Topic{r.Namespace, r.Topic}, OrderingKey: r.OrderingKey, Head: r.HeadID, HeadSequence: r.HeadSeq,
			Waiting: r.Waiting, LastError: deref(r.LastError), DeadSince: r.DeadSince}
	}
	return out, nil
}

// SkipHead lets the later events of a dead event's ordering key go on
// without it: id must be the head of a blocked key (see BlockedKeys), a
// dead event with an ordering key whose predecessor no longer holds it
// back. Of two dead events of one key, the later is skipped only after the
// earlier: skipping it first would let the events after it overtake the
// earlier one. The event stays dead (ReplayDead can still deliver it,
// then out of order), its UpdatedAt the time it died; its history records
// the skip with by and the database session user. An id that is not such an event is an error
// matching ErrNotFound, and changes nothing.
func (a *Admin) SkipHead(ctx context.Context, by string, id uuid.UUID) error {
	if strings.TrimSpace(by) == "" {
		return configError("SkipHead needs a non-empty 'by' (who is skipping) for the audit trail")
	}
	ok, err := a.c.store.SkipHead(ctx, id, sanitizeError(by, replayByMaxLen))
	if err != nil {
		return a.wrapWriteErr(err, "skip head %s", id)
	}
	if ok {
		return nil
	}
	// Why not, read afterwards for the message only (it may have changed
	// since; the skip changed nothing either way).
	ev, err := a.Get(ctx, id)
	switch {
	case errors.Is(err, ErrNotFound):
		return fmt.Errorf("%w: SkipHead: no event has id %s", ErrNotFound, id)
	case err == nil && ev.Status != StatusDead:
		return fmt.Errorf("%w: SkipHead: event %s is %s, not dead; only a dead event holds its ordering key back", ErrNotFound, id, ev.Status)
	case err == nil && ev.OrderingKey == "":
		return fmt.Errorf("%w: SkipHead: event %s has no ordering key, so it holds nothing back; use PurgeDead or ReplayDead for it",
			ErrNotFound, id)
	}
	return fmt.Errorf("%w: SkipHead: event %s is not the dead head of its ordering key: it was skipped already, or a dead event "+
		"before it must be skipped first (see BlockedKeys)", ErrNotFound, id)
}

// Get returns one event by id, or an error matching ErrNotFound.
func (a *Admin) Get(ctx context.Context, id uuid.UUID) (Event, error) {
	e, err := a.c.store.Get(ctx, id)
	if errors.Is(err, driver.ErrNotFound) {
		return Event{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if err != nil {
		return Event{}, a.wrapErr(err, "get %s", id)
	}
	return eventFrom(e), nil
}

// TopicStats counts one (namespace, topic)'s events. Stats.Total's Topic
// is empty.
type TopicStats struct {
	Topic
	Pending, Processing, Delivered, Dead int64
	// OldestDueAge is how long the oldest due pending event has waited past
	// its next_attempt_at; zero when none is due.
	OldestDueAge time.Duration
}

// String gives the topic and its counts, for logs and fmt ("shop/orders:
// 3 pending, 0 processing, 10 delivered, 1 dead, oldest due 2s"; "all
// topics: …" for a total). Without it the embedded Topic's String would
// print the topic alone.
func (s TopicStats) String() string {
	return fmt.Sprintf("%s: %d pending, %d processing, %d delivered, %d dead, oldest due %v",
		topicOrAll(s.Topic), s.Pending, s.Processing, s.Delivered, s.Dead, s.OldestDueAge)
}

// topicOrAll names a topic, or all topics for a total's empty one.
func topicOrAll(t Topic) string {
	if t == (Topic{}) {
		return "all topics"
	}
	return t.String()
}

// Stats summarises the table per (namespace, topic).
type Stats struct {
	// Topics, sorted by namespace, then topic, byte by byte (as
	// Series.Topics).
	Topics []TopicStats
	// Total over all topics; its OldestDueAge is the largest.
	Total TopicStats
}

// Stats counts events per status per (namespace, topic). It reads the whole
// table, delivered history included, so its cost grows with the delivered
// events kept (about half a second at a million on a small machine): where
// the counts are read often, a dashboard that refreshes or a health probe,
// use Backlog.
func (a *Admin) Stats(ctx context.Context) (Stats, error) {
	rows, err := a.c.store.Stats(ctx)
	if err != nil {
		return Stats{}, a.wrapErr(err, "stats")
	}
	return statsFrom(rows), nil
}

// Backlog is Stats without the delivered events: it counts the pending,
// processing and dead events per (namespace, topic), with the oldest due
// age, and leaves every Delivered zero. It reads only the indexes that hold
// those states (migration 0027; whatever the planner's costs since 0043,
// before which a large backlog could make it read the whole table), so its
// cost follows the backlog and the dead events, not the delivered events
// kept: every pending, leased and dead event is read. A topic appears when it has
// at least one such event. On a schema without migration 0027 it counts as
// Stats does, reading the whole table, and leaves the delivered out.
func (a *Admin) Backlog(ctx context.Context) (Stats, error) {
	rows, err := a.c.store.Backlog(ctx)
	if err != nil {
		return Stats{}, a.wrapErr(err, "backlog")
	}
	return statsFrom(rows), nil
}

// Unserved returns the topics whose due events no running dispatcher
// serves, with their backlog counts (as Backlog gives them), sorted as
// Backlog sorts them. Enqueue cannot know whether a
// dispatcher has a publisher for a topic, so an event of a topic nobody
// publishes (a producer's typo, a service not deployed yet, a publisher
// left out of the dispatcher) waits without an error anywhere; this is
// where it shows, and the CLI's stats and the dashboard's overview warn of
// it. A topic is listed when an event of it is due and none is leased, and
// no dispatcher holds its maintenance lease. Every running dispatcher takes
// part in the election of each of its topics, and the one elected renews
// the lease every DispatcherConfig.SweepInterval and gives it up when it
// stops; its topic's other dispatchers hold no lease, but they lease the
// topic's due events within their PollInterval. So a topic is listed once
// its last dispatcher has stopped, or up to three SweepIntervals after it
// died; and, for a moment, when its elected dispatcher has just stopped and
// the others have not yet claimed an event that just fell due. It needs
// migration 0034 (before it, or with a driver that cannot tell, an error
// matching ErrNotMigrated). It reads the backlog as Backlog does, at the
// same cost: a caller of both reads it twice.
func (a *Admin) Unserved(ctx context.Context) ([]TopicStats, error) {
	served, err := a.c.store.Served(ctx)
	if errors.Is(err, driver.ErrServedUnknown) && !notMigrated(err) {
		return nil, fmt.Errorf("outbox: topics served: %w: %w", ErrNotMigrated, err)
	}
	if err != nil {
		return nil, a.wrapErr(err, "topics served")
	}
	backlog, err := a.Backlog(ctx)
	if err != nil {
		return nil, err
	}
	var out []TopicStats
	for _, t := range backlog.Topics {
		if t.OldestDueAge > 0 && t.Processing == 0 && !slices.Contains(served, t.key()) {
			out = append(out, t)
		}
	}
	return out, nil
}

// statsFrom sums the driver's rows per topic and over all topics, and
// sorts the topics by their names' bytes (as Series does), whatever the
// database's collation.
func statsFrom(rows []driver.StatsRow) Stats {
	var out Stats
	index := map[Topic]int{}
	for _, r := range rows {
		t := Topic{r.Namespace, r.Topic}
		i, ok := index[t]
		if !ok {
			i = len(out.Topics)
			index[t] = i
			out.Topics = append(out.Topics, TopicStats{Topic: t})
		}
		ts := &out.Topics[i]
		for _, s := range []*TopicStats{ts, &out.Total} {
			switch Status(r.Status) {
			case StatusPending:
				s.Pending += r.Count
			case StatusProcessing:
				s.Processing += r.Count
			case StatusDelivered:
				s.Delivered += r.Count
			case StatusDead:
				s.Dead += r.Count
			}
			s.OldestDueAge = max(s.OldestDueAge, r.OldestDueAge)
		}
	}
	slices.SortFunc(out.Topics, func(a, b TopicStats) int { return compareTopics(a.Topic, b.Topic) })
	return out
}

// EventFilter selects events for Admin.List, Admin.ReplayDead and
// Admin.PurgeDead.
// Zero fields match anything.
type EventFilter struct {
	// Status to list. ReplayDead and PurgeDead act on dead events only and
	// refuse any other Status.
	Status    Status
	Namespace string
	Topic     string
	// TenantID matches the events of one tenant (the nil UUID, which no
	// event has, is refused).
	TenantID *uuid.UUID
	// CreatedAfter (inclusive) and CreatedBefore (exclusive) bound the
	// enqueue time; CreatedAfter after CreatedBefore is refused.
	CreatedAfter, CreatedBefore time.Time
	// Limit is List's page size: default 100, at most 1000. For
	// ReplayDead and PurgeDead by filter it caps how many events one call
	// changes: default and at most 10000.
	Limit int
	// After is the NextPage of the previous page; empty for the first.
	After string
}

// EventPage is one page of events, oldest first: of Admin.List, by
// enqueue time, or of Admin.SettledPage, by the time of the outcome.
type EventPage struct {
	Events []Event
	// NextPage is an opaque cursor for the After of the same call's next
	// page (EventFilter.After, or SettledQuery.After); empty on the last
	// page.
	NextPage string
}

func (f EventFilter) toDriver(limitDefault, limitMax int) (driver.ListFilter, error) {
	out := driver.ListFilter{Status: string(f.Status), Namespace: f.Namespace, Topic: f.Topic, TenantID: f.TenantID,
		CreatedAfter: f.CreatedAfter, CreatedBefore: f.CreatedBefore, Limit: f.Limit}
	if f.Status != "" && !f.Status.valid() {
		return out, configError("EventFilter.Status is %q; use one of pending, processing, delivered, dead", f.Status)
	}
	// A name no event can have is a mistake, not a filter that matches
	// nothing (and a NUL byte or invalid UTF-8 would reach the database).
	if f.Namespace != "" && !validName(f.Namespace) {
		return out, configError("EventFilter.Namespace is %q; a namespace is 1 to 128 of a-z, 0-9, '.', '_' and '-', starting with a letter or digit",
			truncateForMessage(f.Namespace))
	}
	if f.Topic != "" && !validName(f.Topic) {
		return out, configError("EventFilter.Topic is %q; a topic is 1 to 128 of a-z, 0-9, '.', '_' and '-', starting with a letter or digit",
			truncateForMessage(f.Topic))
	}
	// No event has the nil tenant (Enqueue refuses it), and bounds the
	// wrong way round are swapped by mistake.
	if f.TenantID != nil && *f.TenantID == uuid.Nil {
		return out, configError("EventFilter.TenantID is the nil UUID, which no event has; leave TenantID nil to match every tenant")
	}
	if !f.CreatedBefore.IsZero() && f.CreatedAfter.After(f.CreatedBefore) {
		return out, configError("EventFilter.CreatedAfter (%s) is after CreatedBefore (%s): no event can match; swap them",
			f.CreatedAfter.UTC().Format(time.RFC3339Nano), f.CreatedBefore.UTC().Format(time.RFC3339Nano))
	}
	if out.Limit == 0 {
		out.Limit = limitDefault
	}
	if out.Limit < 0 || out.Limit > limitMax {
		return out, configError("EventFilter.Limit is %d; it must be between 1 and %d", f.Limit, limitMax)
	}
	if f.After != "" {
		at, id, err := decodeCursor(f.After)
		if err != nil {
			return out, err
		}
		out.AfterCreatedAt, out.AfterID = at, id
	}
	return out, nil
}

// List returns events matching f, oldest first, a page at a time. A list
// of pending, processing or dead events reads the indexes of its status
// (migration 0024); a list of delivered events, or of every status, reads
// the whole table, as no index holds events by enqueue time: with millions
// of delivered events kept, filter by status where you can.
func (a *Admin) List(ctx context.Context, f EventFilter) (EventPage, error) {
	df, err := f.toDriver(listLimitDefault, listLimitMax)
	if err != nil {
		return EventPage{}, err
	}
	limit := df.Limit
	df.Limit++ // one more, to know whether there is a next page
	rows, err := a.c.store.List(ctx, df)
	if err != nil {
		return EventPage{}, a.wrapErr(err, "list events")
	}
	return pageOf(rows, limit, func(last Event) string { return encodeCursor(last.CreatedAt, last.ID) }), nil
}

// pageOf returns the first limit of rows, which were read with one row
// more than limit, as a page: when that extra row came back, there is a
// next page, whose cursor cursor makes from the page's last event.
func pageOf(rows []driver.Event, limit int, cursor func(last Event) string) EventPage {
	var page EventPage
	for _, e := range rows[:min(len(rows), limit)] {
		page.Events = append(page.Events, eventFrom(e))
	}
	if len(rows) > limit {
		page.NextPage = cursor(page.Events[limit-1])
	}
	return page
}

// ReplayDead puts dead events back to pending, due now, with their attempts
// reset: the ones in ids or, when ids is empty, those matching f (at most
// f.Limit, default 10000, oldest first). Ids and a filter (any field set,
// Status included) together are refused, and so is an empty filter
// without ids (an empty selection passed as ids... would otherwise mean
// every dead event): to mean every dead event, pass no ids and set
// f.Status to StatusDead. Refusals match ErrInvalidConfig and change
// nothing. by names who asked (an operator, a
// tool): each replay is recorded in the event's History as a "replayed"
// entry with by, the time and the database session user; last_error keeps
// the error the event died with. Ids that are unknown or not dead are
// skipped. It returns the ids replayed. A dead head skipped with SkipHead
// stays skipped (since migration 0033): if it dies again, its key goes on
// without it. Replayed, it is published out of order: after the key's
// events that went on meanwhile, and before or beside those not published
// yet (only the event right after it waits for it).
func (a *Admin) ReplayDead(ctx context.Context, by string, f EventFilter, ids ...uuid.UUID) ([]uuid.UUID, error) {
	p, err := selectionParams("ReplayDead", "replaying", StatusDead, by, f, ids)
	if err != nil {
		return nil, err
	}
	replayed, err := a.c.store.Replay(ctx, p)
	if err != nil {
		return nil, a.wrapWriteErr(err, "replay dead")
	}
	return replayed, nil
}

// PurgeDead deletes dead events: the ones in ids or, when ids is empty,
// those matching f (at most f.Limit, default 10000, oldest first), with
// ReplayDead's rules for ids and filters. It is
// for events that must never be published: a poison payload, an event made
// obsolete by hand. by names who asked, as for ReplayDead: each event's
// History keeps a "purged" entry with by, the time and the database
// session user. Deleting an event frees its dedupe key, and deleting the
// dead head of an ordering key lets the key's later events go on, as
// SkipHead does. A dead event behind an event of its ordering key that is
// not delivered is deleted only with that one (another dead event given in
// the same call); behind a pending or leased one, or a dead one not given,
// it is left, since alone it would let the key's later events overtake
// that one. A run of dead events of one key goes in one statement, however
// long. Ids that are unknown or not dead, and dead events left, are
// skipped: it returns the ids deleted.
func (a *Admin) PurgeDead(ctx context.Context, by string, f EventFilter, ids ...uuid.UUID) ([]uuid.UUID, error) {
	p, err := selectionParams("PurgeDead", "purging", StatusDead, by, f, ids)
	if err != nil {
		return nil, err
	}
	purged, err := a.c.store.PurgeDead(ctx, p)
	if err != nil {
		return nil, a.wrapWriteErr(err, "purge dead")
	}
	return purged, nil
}

// DeadLetter makes pending events dead, as if their last attempt had
// failed: the ones in ids or, when ids is empty, those matching f (at most
// f.Limit, default 10000, oldest first), with ReplayDead's rules for ids
// and filters (to mean every pending event, set f.Status to
// StatusPending). It is for events that must not be published now: those
// of a topic no dispatcher serves (see Unserved; every claim of every
// topic reads their due events), or of a producer's bug. Leased events
// are being published and are left alone, but not those whose lease has
// ended (a dispatcher died holding them; no sweep repairs the leases of a
// topic nobody serves): by filter they are selected with the pending
// ones, and their History records the lease's end first. Ids that are
// unknown, settled or under a live lease are skipped; it returns the ids
// dead-lettered. Each keeps its attempts;
// its LastError says who dead-lettered it, followed by the publish error
// it had, if any, and its History holds a "dead_lettered" entry with by and
// the database session user. ReplayDead brings such events back, and
// PurgeDead deletes them. An event with an ordering key is then a dead
// event of its key like any other: the key's later events wait behind it
// (unless its topic's publisher has SkipDeadHeads) until it is replayed,
// skipped (SkipHead) or purged. It needs migration 0044 (before it, an
// error matching ErrNotMigrated) and the operator role.
func (a *Admin) DeadLetter(ctx context.Context, by string, f EventFilter, ids ...uuid.UUID) ([]uuid.UUID, error) {
	p, err := selectionParams("DeadLetter", "dead-lettering", StatusPending, by, f, ids)
	if err != nil {
		return nil, err
	}
	dead, err := a.c.store.DeadLetter(ctx, p)
	if err != nil {
		return nil, a.wrapWriteErr(err, "dead-letter")
	}
	return dead, nil
}

// selectionParams checks the arguments of ReplayDead, PurgeDead and
// DeadLetter (call; doing, what its caller is doing, for the error; status,
// the events it acts on) and selects the events.
func selectionParams(call, doing string, status Status, by string, f EventFilter, ids []uuid.UUID) (driver.ReplayParams, error) {
	if strings.TrimSpace(by) == "" {
		return driver.ReplayParams{}, configError("%s needs a non-empty 'by' (who is %s) for the audit trail", call, doing)
	}
	if f.Status != "" && f.Status != status {
		return driver.ReplayParams{}, configError("%s acts on %s events only; EventFilter.Status is %q", call, status, f.Status)
	}
	narrows := f.Namespace != "" || f.Topic != "" || f.TenantID != nil || !f.CreatedAfter.IsZero() || !f.CreatedBefore.IsZero() || f.After != ""
	switch {
	case len(ids) > 0 && (narrows || f.Limit != 0 || f.Status != ""):
		return driver.ReplayParams{}, configError("%s was given event ids and a filter; give one or the other (with ids, the filter would be ignored)", call)
	case len(ids) == 0 && !narrows && f.Status == "":
		constant := "StatusDead"
		if status == StatusPending {
			constant = "StatusPending"
		}
		return driver.ReplayParams{}, configError("%s was given no event ids and an empty filter, which would select every %s event: "+
			"give ids, narrow the filter, or set EventFilter.Status to %s to mean every %s event", call, status, constant, status)
	}
	f.Status = status
	df, err := f.toDriver(replayFilterLimitMax, replayFilterLimitMax)
	if err != nil {
		return driver.ReplayParams{}, err
	}
	return driver.ReplayParams{IDs: ids, Filter: df, By: sanitizeError(by, replayByMaxLen)}, nil
}

// Purge deletes the delivered events of topics older than retention (a
// retention of 0 deletes all of them: it is not a default, as a zero
// DispatcherConfig.Retention is), in
// small batches so that no statement holds many locks or runs long, and
// returns how many it deleted. Deleting a row ends its dedupe window: the
// same key can be enqueued again afterwards. Dispatchers do this on their
// own for their topics (see DispatcherConfig.Retention); Purge is for
// topics no dispatcher serves, or for an operator in a hurry. Each event it
// deletes keeps its history, which records the purge with the database
// session user.
func (a *Admin) Purge(ctx context.Context, retention time.Duration, topics ...Topic) (int64, error) {
	if retention < 0 {
		return 0, configError("Purge retention is %v; it must not be negative", retention)
	}
	if len(topics) == 0 {
		return 0, configError("Purge needs the topics to purge; it never purges topics it was not told about")
	}
	keys := make([]string, len(topics))
	for i, t := range topics {
		if err := validateTopic(t); err != nil {
			return 0, err
		}
		keys[i] = t.key()
	}
	res, err := a.c.store.Purge(ctx, driver.PurgeParams{Topics: keys, Retention: retention, Limit: purgeBatch, Recorded: true})
	if err != nil {
		return res.Purged, a.wrapWriteErr(err, "purge delivered")
	}
	return res.Purged, nil
}

// pruneSequencesBatch is how many sequence rows one statement of
// PruneSequences deletes at most: each runs in a transaction of its own,
// so that none holds many locks or runs long.
const pruneSequencesBatch = 1000

// PruneSequences deletes the sequence rows of ordering keys that have no
// event left, at most limit of them (0: all there are), in batches of a
// transaction each, and returns how many it deleted. The database keeps
// one row per ordering key ever used (its last sequence and stream), and
// nothing else deletes them: keys per order or per aggregate grow the
// table without bound (about 210 bytes a key) once their events are
// purged. A key keeps its row while any event of it is in the table,
// whatever its status (pending, leased, held, dead, or delivered and not
// purged yet). A key used again after its row was pruned starts again, as
// a new key does: a new stream, sequence 1 (Delivery.Sequence goes back to
// 1): a consumer that drops what it has seen by key and sequence would
// drop the key's new events, so deduplicate by Delivery.ID when pruning.
// It never lets an event be lost or delivered out of order, nor fails a
// READ COMMITTED enqueue: a row an enqueue under way holds is skipped (run
// it again later), and an enqueue that waits for a row being pruned starts
// the key afresh (a REPEATABLE READ or SERIALIZABLE enqueue whose
// transaction began before the prune committed gets ErrConflict: retry
// it). Run it
// outside a transaction of REPEATABLE READ or SERIALIZABLE isolation (it
// runs on the client's pool, at the server's default isolation): there, a
// key enqueued meanwhile fails it with a serialization error. Rows
// deleted before an error are not restored; the count says how many. It
// needs migration 0045 (before it, an error matching ErrNotMigrated) and
// the operator role; PrunableSequences counts what it would delete.
func (a *Admin) PruneSequences(ctx context.Context, limit int) (int64, error) {
	if limit < 0 {
		return 0, configError("PruneSequences limit is %d; give the most rows to delete, or 0 for all of them", limit)
	}
	var total, after int64
	for {
		batch := pruneSequencesBatch
		if limit > 0 {
			batch = min(batch, limit-int(total))
		}
		// Each batch goes on after the last row the one before took, so
		// that the table is read once, not once a batch.
		n, last, err := a.c.store.PruneSequences(ctx, batch, after)
		total += n
		if err != nil {
			return total, a.wrapWriteErr(err, "prune sequences")
		}
		// None taken: no row is left after the last (those held by
		// enqueues under way are skipped).
		if last == 0 || (limit > 0 && total >= int64(limit)) {
			return total, nil
		}
		after = last
	}
}

// PrunableSequences counts the sequence rows of ordering keys that have
// no event left: how many PruneSequences would delete now. It reads the
// whole sequences table. It needs migration 0045 (before it, an error
// matching ErrNotMigrated) and the reader or operator role.
func (a *Admin) PrunableSequences(ctx context.Context) (int64, error) {
	n, err := a.c.store.PrunableSequences(ctx)
	if err != nil {
		return 0, a.wrapErr(err, "count prunable sequences")
	}
	return n, nil
}

func encodeCursor(at time.Time, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString([]byte(at.UTC().Format(time.RFC3339Nano) + "|" + id.String()))
}

// settledCursor starts the cursors of Admin.SettledPage, so that one of
// them given to List (or one of List's to SettledPage) is refused instead
// of read as a time of another column.
const settledCursor = "settled|"

func encodeSettledCursor(at time.Time, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString([]byte(settledCursor + at.UTC().Format(time.RFC3339Nano) + "|" + id.String()))
}

func decodeSettledCursor(c string) (time.Time, uuid.UUID, error) {
	raw, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return time.Time{}, uuid.Nil, ErrInvalidCursor
	}
	rest, ok := strings.CutPrefix(string(raw), settledCursor)
	if !ok {
		return time.Time{}, uuid.Nil, ErrInvalidCursor
	}
	return parseCursor(rest)
}

func decodeCursor(c string) (time.Time, uuid.UUID, error) {
	raw, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return time.Time{}, uuid.Nil, ErrInvalidCursor
	}
	return parseCursor(string(raw))
}

// parseCursor reads "time|id".
func parseCursor(raw string) (time.Time, uuid.UUID, error) {
	atText, idText, ok := strings.Cut(raw, "|")
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
