package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// admStore opens the PostgreSQL driver on pool in schema, with the clock now
// (nil: the database's), to set up states (claimed, delivered, dead) that
// the tests of Admin start from.
func admStore(t testing.TB, pool *pgxpool.Pool, schema string, now func() time.Time) driver.Store {
	t.Helper()
	st, err := outboxpg.New(pool).Open(driver.Options{Schema: schema, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// admWorker is the worker admClaim claims as and admSettle settles as.
var admWorker = uuid.New()

// admClaim leases up to limit due events of topics (default testTopic),
// oldest first.
func admClaim(t testing.TB, st driver.Store, limit int, topics ...outbox.Topic) []driver.Claimed {
	t.Helper()
	if len(topics) == 0 {
		topics = []outbox.Topic{testTopic}
	}
	keys := make([]string, len(topics))
	for i, tp := range topics {
		keys[i] = tp.Namespace + ":" + tp.Topic
	}
	got, err := st.Claim(ctx, driver.ClaimParams{Topics: keys, Limit: limit, MaxAttempts: 3, Worker: admWorker, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// admSettle records the same outcome for every claimed event and checks
// that each was recorded.
func admSettle(t testing.TB, st driver.Store, kind driver.OutcomeKind, errText string, claimed ...driver.Claimed) {
	t.Helper()
	outcomes := make([]driver.Outcome, len(claimed))
	for i, c := range claimed {
		outcomes[i] = driver.Outcome{ID: c.ID, LeaseToken: c.LeaseToken, Kind: kind, Error: errText}
	}
	settled, err := st.Complete(ctx, nil, admWorker, outcomes)
	if err != nil {
		t.Fatal(err)
	}
	for i, ok := range settled {
		if !ok {
			t.Fatalf("outcome of %s not recorded", claimed[i].ID)
		}
	}
}

// admKillAll dead-letters every claimable event of topics (default
// testTopic), as a publisher failing with Permanent(errors.New("poison"))
// would.
func admKillAll(t testing.TB, st driver.Store, topics ...outbox.Topic) []driver.Claimed {
	t.Helper()
	got := admClaim(t, st, 1000, topics...)
	admSettle(t, st, driver.Dead, "attempt 1 of 3 failed permanently: poison", got...)
	return got
}

// admCatchUp moves clock just past the enqueue time of the events, so that
// they are due by it (the database's clock stamps enqueues; the test clock
// starts at the application's).
func admCatchUp(t *testing.T, clock *testClock, c *outbox.Client, ids ...uuid.UUID) {
	t.Helper()
	for _, id := range ids {
		if e := get(t, c, id); !e.NextAttemptAt.Before(clock.Now()) {
			clock.Advance(e.NextAttemptAt.Sub(clock.Now()) + time.Millisecond)
		}
	}
}

func admIDs(events []outbox.Event) []uuid.UUID {
	out := make([]uuid.UUID, len(events))
	for i, e := range events {
		out[i] = e.ID
	}
	return out
}

func admClaimedIDs(claimed []driver.Claimed) []uuid.UUID {
	out := make([]uuid.UUID, len(claimed))
	for i, c := range claimed {
		out[i] = c.ID
	}
	return out
}

// admListAll pages through List with f and returns every event and the number
// of pages.
func admListAll(t *testing.T, c *outbox.Client, f outbox.EventFilter) ([]outbox.Event, int) {
	t.Helper()
	var all []outbox.Event
	for pages := 1; ; pages++ {
		page, err := c.Admin().List(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		if f.Limit > 0 && len(page.Events) > f.Limit {
			t.Fatalf("page of %d events, limit %d", len(page.Events), f.Limit)
		}
		all = append(all, page.Events...)
		if page.NextPage == "" {
			return all, pages
		}
		if len(page.Events) == 0 {
			t.Fatal("an empty page with a next page")
		}
		f.After = page.NextPage
	}
}

func TestStats(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if st, err := c.Admin().Stats(ctx); err != nil || len(st.Topics) != 0 || st.Total != (outbox.TopicStats{}) {
		t.Fatalf("stats of an empty table: %+v %v", st, err)
	}
	enqueueN(t, c, pool, 5)
	st := admStore(t, pool, "public", nil)
	got := admClaim(t, st, 3)
	admSettle(t, st, driver.Delivered, "", got[0])
	admSettle(t, st, driver.Dead, "x", got[1])
	if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: "other", Topic: "t", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET next_attempt_at = now() - interval '1 hour' WHERE namespace = 'other'"); err != nil {
		t.Fatal(err)
	}

	stats, err := c.Admin().Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(stats.Topics) != 2 {
		t.Fatalf("topics: %+v", stats.Topics)
	}
	other, test := stats.Topics[0], stats.Topics[1]
	if test.Topic != testTopic || test.Pending != 2 || test.Processing != 1 || test.Delivered != 1 || test.Dead != 1 {
		t.Fatalf("test topic: %+v", test)
	}
	if other.Topic != (outbox.Topic{Namespace: "other", Topic: "t"}) || other.Pending != 1 || other.OldestDueAge < time.Hour ||
		stats.Total.OldestDueAge != other.OldestDueAge {
		t.Fatalf("other topic: %+v, total %+v", other, stats.Total)
	}
	if stats.Total.Pending != 3 || stats.Total.Processing != 1 || stats.Total.Delivered != 1 || stats.Total.Dead != 1 {
		t.Fatalf("total: %+v", stats.Total)
	}
}

// TestBacklog: Backlog returns Stats's counts of pending, processing and
// dead events, held events of an ordering key among them (waiting behind
// their predecessor, or leased as links of a chain), and no delivered
// events: a topic whose events were all delivered is left out.
func TestBacklog(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if b, err := c.Admin().Backlog(ctx); err != nil || len(b.Topics) != 0 || b.Total != (outbox.TopicStats{}) {
		t.Fatalf("backlog of an empty table: %+v %v", b, err)
	}
	enqueueN(t, c, pool, 5)
	st := admStore(t, pool, "public", nil)
	got := admClaim(t, st, 3)
	admSettle(t, st, driver.Delivered, "", got[0])
	admSettle(t, st, driver.Dead, "x", got[1])
	done := outbox.Topic{Namespace: "done", Topic: "t"}
	enqueueTopic(t, c, pool, done, 2)
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 2, done)...)
	ordered := outbox.Topic{Namespace: "ordered", Topic: "t"}
	for i := range 3 { // the first waits to be claimed, the other two are held behind it
		if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: ordered.Namespace, Topic: ordered.Topic, OrderingKey: "k",
			Payload: []byte(fmt.Sprintf(`{"n":%d}`, i))}); err != nil {
			t.Fatal(err)
		}
	}
	// A chain of another key leased in one claim: its links stay held while
	// leased (migration 0021), so they are held and processing.
	leased := outbox.Topic{Namespace: "leased", Topic: "t"}
	for i := range 3 {
		if _, err := c.Enqueue(ctx, pool, outbox.Message{Namespace: leased.Namespace, Topic: leased.Topic, OrderingKey: "k",
			Payload: []byte(fmt.Sprintf(`{"n":%d}`, i))}); err != nil {
			t.Fatal(err)
		}
	}
	if chain, err := st.Claim(ctx, driver.ClaimParams{Topics: []string{"leased:t"}, Limit: 3, MaxAttempts: 3, Worker: admWorker,
		Lease: 30 * time.Second, Chains: []int{3}}); err != nil || len(chain) != 3 {
		t.Fatalf("chained claim: %d events, %v", len(chain), err)
	}
	var heldPending, heldLeased int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'processing')
		FROM modkit_outbox_events WHERE held`).Scan(&heldPending, &heldLeased); err != nil || heldPending != 2 || heldLeased != 2 {
		t.Fatalf("held events: %d pending, %d processing, %v; want 2 and 2 (the test relies on them)", heldPending, heldLeased, err)
	}
	if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET next_attempt_at = now() - interval '1 hour' WHERE namespace = 'ordered'"); err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	stats, err := c.Admin().Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	backlog, err := c.Admin().Backlog(ctx)
	if err != nil {
		t.Fatal(err)
	}
	between := time.Since(start) // the oldest due age grows by at most this from one call to the other
	var want []outbox.TopicStats
	for _, ts := range stats.Topics {
		if ts.Pending+ts.Processing+ts.Dead > 0 {
			want = append(want, ts)
		}
	}
	same := func(b, s outbox.TopicStats) bool {
		return b.Topic == s.Topic && b.Pending == s.Pending && b.Processing == s.Processing && b.Dead == s.Dead && b.Delivered == 0 &&
			b.OldestDueAge >= s.OldestDueAge && b.OldestDueAge <= s.OldestDueAge+between
	}
	if !slices.EqualFunc(backlog.Topics, want, same) || !same(backlog.Total, stats.Total) {
		t.Fatalf("backlog:\n%#v\nwant Stats without the delivered events:\n%#v", backlog, want)
	}
	if len(backlog.Topics) != 3 || backlog.Topics[0].Topic != leased || backlog.Topics[0].Processing != 3 ||
		backlog.Topics[1].Topic != ordered || backlog.Topics[1].Pending != 3 || backlog.Topics[1].OldestDueAge < time.Hour ||
		backlog.Topics[2].Topic != testTopic || backlog.Topics[2].Pending != 2 || backlog.Topics[2].Processing != 1 || backlog.Topics[2].Dead != 1 {
		t.Fatalf("backlog: %#v", backlog.Topics)
	}
}

func TestListAndReplayDead(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tenant := uuid.New()
	for i := range 5 {
		m := msg(i)
		if i%2 == 0 {
			m.TenantID = &tenant
		}
		if _, err := c.Enqueue(ctx, pool, m); err != nil {
			t.Fatal(err)
		}
	}
	st := admStore(t, pool, "public", nil)
	dead := admKillAll(t, st)
	if len(dead) != 5 {
		t.Fatalf("killed %d", len(dead))
	}

	// Paging: 2 + 2 + 1, oldest first, no overlap.
	all, pages := admListAll(t, c, outbox.EventFilter{Status: outbox.StatusDead, Namespace: testTopic.Namespace, Topic: testTopic.Topic, Limit: 2})
	if pages != 3 {
		t.Fatalf("%d pages, want 3", pages)
	}
	if !slices.Equal(admIDs(all), admClaimedIDs(dead)) {
		t.Fatalf("listed %v, want %v", admIDs(all), admClaimedIDs(dead))
	}
	for i, e := range all {
		if e.Status != outbox.StatusDead || e.LastError == nil || !strings.Contains(*e.LastError, "poison") {
			t.Fatalf("event %d: %+v", i, e)
		}
	}
	if err := c.Admin().SkipHead(ctx, "test", all[0].ID); !errors.Is(err, outbox.ErrNotFound) || !strings.Contains(err.Error(), "has no ordering key") {
		t.Fatalf("SkipHead of a dead event without an ordering key: %v, want ErrNotFound saying it has no key", err)
	}
	byTenant, err := c.Admin().List(ctx, outbox.EventFilter{Status: outbox.StatusDead, TenantID: &tenant})
	if err != nil || len(byTenant.Events) != 3 || byTenant.NextPage != "" {
		t.Fatalf("tenant filter: %d events, %v", len(byTenant.Events), err)
	}
	if page, err := c.Admin().List(ctx, outbox.EventFilter{Status: outbox.StatusDead, Namespace: "nope"}); err != nil || len(page.Events) != 0 {
		t.Fatalf("namespace filter ignored: %d events, %v", len(page.Events), err)
	}
	if _, err := c.Admin().List(ctx, outbox.EventFilter{After: "garbage!"}); !errors.Is(err, outbox.ErrInvalidCursor) || !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("bad cursor: %v, want ErrInvalidCursor matching ErrInvalidConfig", err)
	}
	// A bad cursor is a bad argument of the writes too (their refusals
	// match ErrInvalidConfig, as documented), and changes nothing.
	for name, call := range map[string]func(outbox.EventFilter) ([]uuid.UUID, error){
		"ReplayDead": func(f outbox.EventFilter) ([]uuid.UUID, error) { return c.Admin().ReplayDead(ctx, "test", f) },
		"PurgeDead":  func(f outbox.EventFilter) ([]uuid.UUID, error) { return c.Admin().PurgeDead(ctx, "test", f) },
	} {
		if ids, err := call(outbox.EventFilter{Status: outbox.StatusDead, After: "garbage!"}); !errors.Is(err, outbox.ErrInvalidConfig) ||
			!errors.Is(err, outbox.ErrInvalidCursor) || len(ids) != 0 {
			t.Fatalf("%s with a bad cursor: %v, %v; want ErrInvalidConfig and ErrInvalidCursor", name, ids, err)
		}
	}
	if page, err := c.Admin().List(ctx, outbox.EventFilter{Status: outbox.StatusDead}); err != nil || len(page.Events) == 0 {
		t.Fatalf("dead events after the refused calls: %d, %v", len(page.Events), err)
	}
	for _, limit := range []int{-1, 1001, 5000} {
		if _, err := c.Admin().List(ctx, outbox.EventFilter{Limit: limit}); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Fatalf("limit %d: %v, want ErrInvalidConfig", limit, err)
		}
	}
	if page, err := c.Admin().List(ctx, outbox.EventFilter{Limit: 1000}); err != nil || len(page.Events) != 5 {
		t.Fatalf("limit 1000: %d events, %v", len(page.Events), err)
	}

	// Replay two of them (and an id that is not dead, and an unknown one:
	// skipped).
	live := enqueueN(t, c, pool, 1)[0]
	replayed, err := c.Admin().ReplayDead(ctx, "alice@ops", outbox.EventFilter{}, dead[0].ID, dead[1].ID, live, uuid.New())
	if err != nil || len(replayed) != 2 || !slices.Contains(replayed, dead[0].ID) || !slices.Contains(replayed, dead[1].ID) {
		t.Fatalf("replay: %v %v", replayed, err)
	}
	e := get(t, c, dead[0].ID)
	if e.Status != outbox.StatusPending || e.Attempts != 0 || e.LockedBy != nil || e.LastError == nil ||
		!strings.Contains(*e.LastError, "poison") {
		t.Fatalf("replayed row: %+v", e)
	}
	// The replay is in the event's history, with who asked and the
	// database user who did it.
	h, err := c.Admin().History(ctx, dead[0].ID)
	if err != nil || len(h) != 2 || h[0].Outcome != "dead" || !strings.Contains(h[0].Detail, "poison") ||
		h[1].Outcome != "replayed" || h[1].Detail != "replayed by alice@ops" || h[1].Actor == "" || h[1].No != 2 {
		t.Fatalf("history after the replay: %+v %v", h, err)
	}
	if e := get(t, c, live); e.Status != outbox.StatusPending || e.LastError != nil {
		t.Fatalf("a live event was touched by a replay: %+v", e)
	}
	got := admClaim(t, st, 10)
	if len(got) != 3 { // two replayed + the live one
		t.Fatalf("claim after replay: %d events", len(got))
	}
	for _, by := range []string{"", " ", "\t\n"} {
		if _, err := c.Admin().ReplayDead(ctx, by, outbox.EventFilter{}, dead[2].ID); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Fatalf("replay by %q: %v, want ErrInvalidConfig", by, err)
		}
	}
	if e := get(t, c, dead[2].ID); e.Status != outbox.StatusDead {
		t.Fatalf("a refused replay changed the event: %+v", e)
	}
}

// List filters by status, namespace, topic, tenant and enqueue time (after
// inclusive, before exclusive), pages oldest first through any of them, and
// refuses what it cannot serve.
func TestListFilters(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	st := admStore(t, pool, "public", nil)
	other := outbox.Topic{Namespace: testTopic.Namespace, Topic: "other"}
	tenant := uuid.New()
	// Ten events, each in a transaction of its own (so created_at rises):
	// test/events and test/other alternately, every third with the tenant.
	var enqueued []uuid.UUID
	for i := range 10 {
		m := msg(i)
		if i%2 == 1 {
			m.Topic = other.Topic
		}
		if i%3 == 0 {
			m.TenantID = &tenant
		}
		res, err := c.Enqueue(ctx, pool, m)
		if err != nil {
			t.Fatal(err)
		}
		enqueued = append(enqueued, res.ID)
	}
	// Statuses: of test/events (0 2 4 6 8) deliver 0 and 2, kill 4, keep 6
	// processing, 8 pending; of test/other (1 3 5 7 9) kill 1 and 3.
	claimedEvents := admClaim(t, st, 4, testTopic)
	admSettle(t, st, driver.Delivered, "", claimedEvents[:2]...)
	admSettle(t, st, driver.Dead, "poison", claimedEvents[2])
	admSettle(t, st, driver.Dead, "poison", admClaim(t, st, 2, other)...)

	var events []outbox.Event
	for _, id := range enqueued {
		events = append(events, get(t, c, id))
	}
	statuses := map[outbox.Status]int{}
	for _, e := range events {
		statuses[e.Status]++
	}
	if statuses[outbox.StatusDelivered] != 2 || statuses[outbox.StatusDead] != 3 || statuses[outbox.StatusProcessing] != 1 ||
		statuses[outbox.StatusPending] != 4 {
		t.Fatalf("set-up statuses: %v", statuses)
	}
	// The expected answer of a filter, computed here from the rows.
	want := func(f outbox.EventFilter) []uuid.UUID {
		var out []uuid.UUID
		for _, e := range events {
			if (f.Status == "" || e.Status == f.Status) && (f.Namespace == "" || e.Namespace == f.Namespace) &&
				(f.Topic == "" || e.Topic == f.Topic) && (f.TenantID == nil || (e.TenantID != nil && *e.TenantID == *f.TenantID)) &&
				(f.CreatedAfter.IsZero() || !e.CreatedAt.Before(f.CreatedAfter)) &&
				(f.CreatedBefore.IsZero() || e.CreatedAt.Before(f.CreatedBefore)) {
				out = append(out, e.ID)
			}
		}
		return out
	}
	after, before := events[2].CreatedAt, events[7].CreatedAt
	for name, f := range map[string]outbox.EventFilter{
		"everything":           {},
		"pending":              {Status: outbox.StatusPending},
		"processing":           {Status: outbox.StatusProcessing},
		"delivered":            {Status: outbox.StatusDelivered},
		"dead":                 {Status: outbox.StatusDead},
		"topic alone":          {Topic: other.Topic},
		"namespace and topic":  {Namespace: testTopic.Namespace, Topic: testTopic.Topic},
		"tenant":               {TenantID: &tenant},
		"created after":        {CreatedAfter: after},
		"created before":       {CreatedBefore: before},
		"created between":      {CreatedAfter: after, CreatedBefore: before},
		"dead between":         {Status: outbox.StatusDead, CreatedAfter: events[1].CreatedAt, CreatedBefore: events[4].CreatedAt},
		"pending of tenant":    {Status: outbox.StatusPending, TenantID: &tenant},
		"after the last event": {CreatedAfter: events[9].CreatedAt.Add(time.Microsecond)},
		"empty window":         {CreatedAfter: after, CreatedBefore: after},
	} {
		for _, limit := range []int{0, 1, 3} {
			f.Limit = limit
			got, pages := admListAll(t, c, f)
			w := want(f)
			if !slices.Equal(admIDs(got), w) {
				t.Fatalf("%s, limit %d: listed %v, want %v", name, limit, admIDs(got), w)
			}
			if limit > 0 && pages != max(1, (len(w)+limit-1)/limit) {
				t.Fatalf("%s, limit %d: %d pages for %d events", name, limit, pages, len(w))
			}
		}
	}
	// The boundaries: after is inclusive, before exclusive.
	if got := want(outbox.EventFilter{CreatedAfter: after, CreatedBefore: before}); len(got) == 0 || got[0] != events[2].ID ||
		slices.Contains(got, events[7].ID) {
		t.Fatalf("the window [%v, %v) holds %v", after, before, got)
	}
	nilTenant := uuid.Nil
	for _, f := range []outbox.EventFilter{{Status: "bogus"}, {Status: "DEAD"}, {Limit: -1}, {Limit: 1001},
		{TenantID: &nilTenant}, {CreatedAfter: before, CreatedBefore: after}} {
		if _, err := c.Admin().List(ctx, f); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Fatalf("filter %+v: %v, want ErrInvalidConfig", f, err)
		}
		if _, err := c.Admin().ReplayDead(ctx, "bob@ops", f); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Fatalf("replay by filter %+v: %v, want ErrInvalidConfig", f, err)
		}
	}
	for _, cursor := range []string{"garbage!", "Zm9v", "bm90LWEtdGltZXxub3QtYW4taWQ"} {
		if _, err := c.Admin().List(ctx, outbox.EventFilter{After: cursor}); !errors.Is(err, outbox.ErrInvalidCursor) {
			t.Fatalf("cursor %q: %v, want ErrInvalidCursor", cursor, err)
		}
	}
}

// ReplayDead without ids replays the dead events matching the filter,
// oldest first, at most Limit of them, and nothing else; it refuses a
// Status other than dead and an empty by.
func TestReplayDeadByFilter(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	st := admStore(t, pool, "public", nil)
	other := outbox.Topic{Namespace: "other", Topic: "t"}
	tenant := uuid.New()
	var enqueued []uuid.UUID
	for i := range 8 {
		m := msg(i)
		if i >= 6 {
			m.Namespace, m.Topic = other.Namespace, other.Topic
		}
		if i == 1 || i == 3 {
			m.TenantID = &tenant
		}
		res, err := c.Enqueue(ctx, pool, m)
		if err != nil {
			t.Fatal(err)
		}
		enqueued = append(enqueued, res.ID)
	}
	dead := admClaimedIDs(admKillAll(t, st, testTopic, other))
	if !slices.Equal(dead, enqueued) {
		t.Fatalf("killed %v, want %v", dead, enqueued)
	}
	// One more event, delivered, and one pending: no replay touches them.
	extra := enqueueN(t, c, pool, 2)
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 1)...)
	statusOf := func(id uuid.UUID) outbox.Status { return get(t, c, id).Status }
	if statusOf(extra[0]) != outbox.StatusDelivered || statusOf(extra[1]) != outbox.StatusPending {
		t.Fatal("set-up of the extra events")
	}
	replay := func(f outbox.EventFilter) []uuid.UUID {
		t.Helper()
		got, err := c.Admin().ReplayDead(ctx, "bob@ops", f)
		if err != nil {
			t.Fatal(err)
		}
		slices.SortFunc(got, func(a, b uuid.UUID) int { return slices.Index(enqueued, a) - slices.Index(enqueued, b) })
		return got
	}

	// Refusals change nothing.
	for name, try := range map[string]func() error{
		"pending status": func() error {
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusPending})
			return err
		},
		"delivered status": func() error {
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusDelivered}, enqueued[0])
			return err
		},
		"bogus status": func() error {
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{Status: "bogus"})
			return err
		},
		"empty by": func() error {
			_, err := c.Admin().ReplayDead(ctx, "", outbox.EventFilter{Topic: testTopic.Topic})
			return err
		},
		"blank by": func() error {
			_, err := c.Admin().ReplayDead(ctx, "  ", outbox.EventFilter{})
			return err
		},
		"limit above 10000": func() error {
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{Limit: 10001})
			return err
		},
		"negative limit": func() error {
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{Limit: -1})
			return err
		},
		"ids and a filter": func() error {
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{Namespace: "elsewhere"}, enqueued[0])
			return err
		},
		"ids and a status": func() error {
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusDead}, enqueued[0])
			return err
		},
		"nothing selected": func() error {
			var selected []uuid.UUID // an empty selection from a form
			_, err := c.Admin().ReplayDead(ctx, "bob@ops", outbox.EventFilter{}, selected...)
			return err
		},
	} {
		if err := try(); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Fatalf("%s: %v, want ErrInvalidConfig", name, err)
		}
	}
	if n := countRows(t, pool, "status = 'dead'"); n != 8 {
		t.Fatalf("%d dead after refused replays, want 8", n)
	}

	// By namespace and topic: only the other topic's.
	if got := replay(outbox.EventFilter{Namespace: other.Namespace, Topic: other.Topic}); !slices.Equal(got, enqueued[6:]) {
		t.Fatalf("replayed %v, want %v", got, enqueued[6:])
	}
	// By tenant, with Status dead spelt out.
	if got := replay(outbox.EventFilter{Status: outbox.StatusDead, TenantID: &tenant}); !slices.Equal(got, []uuid.UUID{enqueued[1], enqueued[3]}) {
		t.Fatalf("replayed %v, want events 1 and 3", got)
	}
	// By time window, at most Limit, oldest first.
	window := outbox.EventFilter{CreatedAfter: get(t, c, enqueued[2]).CreatedAt, CreatedBefore: get(t, c, enqueued[5]).CreatedAt, Limit: 1}
	if got := replay(window); !slices.Equal(got, []uuid.UUID{enqueued[2]}) {
		t.Fatalf("replayed %v, want event 2", got)
	}
	window.Limit = 0
	if got := replay(window); !slices.Equal(got, []uuid.UUID{enqueued[4]}) { // 3 was replayed by tenant
		t.Fatalf("replayed %v, want event 4", got)
	}
	// Nothing left to match.
	if got := replay(window); len(got) != 0 {
		t.Fatalf("replayed %v again", got)
	}
	// An empty filter replays every dead event left.
	if got := replay(outbox.EventFilter{Status: outbox.StatusDead}); !slices.Equal(got, []uuid.UUID{enqueued[0], enqueued[5]}) {
		t.Fatalf("replayed %v, want events 0 and 5", got)
	}
	for _, id := range enqueued {
		e := get(t, c, id)
		if e.Status != outbox.StatusPending || e.Attempts != 0 || e.LastError == nil || !strings.Contains(*e.LastError, "poison") {
			t.Fatalf("replayed event: %+v", e)
		}
		if h, err := c.Admin().History(ctx, id); err != nil || len(h) == 0 || h[len(h)-1].Detail != "replayed by bob@ops" {
			t.Fatalf("history of a replayed event: %+v %v", h, err)
		}
	}
	if statusOf(extra[0]) != outbox.StatusDelivered || get(t, c, extra[1]).LastError != nil {
		t.Fatal("a replay touched an event that was not dead")
	}
}

// PurgeDead deletes dead events, by id or by filter (oldest first, at most
// Limit), and nothing else: pending and delivered events and unknown ids
// are passed over. Each deleted event's history ends with a purged entry
// naming who asked; its dedupe key is free again. It refuses an empty by
// and a Status other than dead, changing nothing.
func TestPurgeDead(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	st := admStore(t, pool, "public", nil)
	var dead []uuid.UUID
	for _, m := range []outbox.Message{keyed(0, "poison"), msg(1), msg(2), msg(3)} {
		res, err := c.Enqueue(ctx, pool, m)
		if err != nil {
			t.Fatal(err)
		}
		dead = append(dead, res.ID)
	}
	if got := admClaimedIDs(admKillAll(t, st, testTopic)); !slices.Equal(got, dead) {
		t.Fatalf("killed %v, want %v", got, dead)
	}
	extra := enqueueN(t, c, pool, 2) // one delivered, one pending
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 1)...)
	total := countRows(t, pool, "true")

	for name, try := range map[string]func() ([]uuid.UUID, error){
		"empty by": func() ([]uuid.UUID, error) { return c.Admin().PurgeDead(ctx, " ", outbox.EventFilter{}, dead[0]) },
		"pending status": func() ([]uuid.UUID, error) {
			return c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusPending})
		},
		"ids and a filter": func() ([]uuid.UUID, error) {
			return c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{Topic: "nothing"}, dead[1])
		},
		"nothing selected": func() ([]uuid.UUID, error) { return c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{}) },
		"limit over the maximum": func() ([]uuid.UUID, error) {
			return c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{Limit: 10001})
		},
	} {
		if got, err := try(); !errors.Is(err, outbox.ErrInvalidConfig) || len(got) != 0 {
			t.Fatalf("%s: purged %v, %v; want ErrInvalidConfig", name, got, err)
		}
	}
	if n := countRows(t, pool, "true"); n != total {
		t.Fatalf("%d rows after refused purges, want %d", n, total)
	}

	// By id: the dead one only.
	got, err := c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{}, dead[0], extra[0], extra[1], uuid.New())
	if err != nil || !slices.Equal(got, dead[:1]) {
		t.Fatalf("purged %v, %v; want %v", got, err, dead[:1])
	}
	if _, err := c.Admin().Get(ctx, dead[0]); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("the purged event: %v, want ErrNotFound", err)
	}
	hist, err := c.Admin().History(ctx, dead[0])
	if err != nil || len(hist) == 0 {
		t.Fatalf("history %+v, %v", hist, err)
	}
	if last := hist[len(hist)-1]; last.Outcome != "purged" || !strings.Contains(last.Detail, "bob@ops") || last.Actor == "" ||
		hist[len(hist)-2].Outcome != "dead" {
		t.Fatalf("history %+v, want dead then purged by bob@ops", hist)
	}
	again, err := c.Enqueue(ctx, pool, keyed(9, "poison"))
	if err != nil || again.AlreadyEnqueued {
		t.Fatalf("the purged event's dedupe key: %+v, %v; want it free", again, err)
	}

	// By filter: the oldest dead first, at most Limit.
	inOrder := func(ids []uuid.UUID) []uuid.UUID {
		slices.SortFunc(ids, func(a, b uuid.UUID) int { return slices.Index(dead, a) - slices.Index(dead, b) })
		return ids
	}
	if got, err := c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{Topic: testTopic.Topic, Limit: 2}); err != nil ||
		!slices.Equal(inOrder(got), dead[1:3]) {
		t.Fatalf("purged %v, %v; want %v", got, err, dead[1:3])
	}
	if got, err := c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusDead}); err != nil || !slices.Equal(got, dead[3:]) {
		t.Fatalf("purged %v, %v; want %v", got, err, dead[3:])
	}
	if n := countRows(t, pool, "status = 'dead'"); n != 0 {
		t.Fatalf("%d dead rows left", n)
	}
	for _, id := range append(extra, again.ID) {
		if n := countRows(t, pool, "id = $1", id); n != 1 {
			t.Fatalf("event %s, not dead, was purged", id)
		}
	}

	// A schema without migration 0026: ErrNotMigrated, which says how to
	// migrate.
	if _, err := pool.Exec(ctx, "DROP FUNCTION modkit_outbox_purge_dead_filter, modkit_outbox_purge_dead"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusDead}); !errors.Is(err, outbox.ErrNotMigrated) {
		t.Fatalf("purge dead without migration 0026: %v, want ErrNotMigrated", err)
	}
}

// Purge deletes delivered events older than the retention, of the topics it
// is given only, in batches; it refuses no topics, a bad topic and a
// negative retention. Time moves by the client's clock.
func TestPurge(t *testing.T) {
	clock := newTestClock()
	c, tdb := newClient(t, outbox.Config{Now: clock.Now})
	pool := tdb.Provider.Pool
	st := admStore(t, pool, "public", clock.Now)
	kept := outbox.Topic{Namespace: testTopic.Namespace, Topic: "kept"}
	keptMsg := func(i int) outbox.Message {
		m := msg(i)
		m.Topic = kept.Topic
		return m
	}
	// testTopic: 0 ("once") 1 2 delivered, 3 dead, 4 pending; kept: 5
	// delivered.
	var enqueued []uuid.UUID
	for _, m := range []outbox.Message{keyed(0, "once"), msg(1), msg(2), msg(3), msg(4), keptMsg(5)} {
		res, err := c.Enqueue(ctx, pool, m)
		if err != nil {
			t.Fatal(err)
		}
		enqueued = append(enqueued, res.ID)
	}
	admCatchUp(t, clock, c, enqueued...)
	got := admClaim(t, st, 4, testTopic)
	if !slices.Equal(admClaimedIDs(got), enqueued[:4]) {
		t.Fatalf("claimed %v", admClaimedIDs(got))
	}
	admSettle(t, st, driver.Delivered, "", got[:3]...)
	admSettle(t, st, driver.Dead, "poison", got[3])
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 1, kept)...)

	// Two hours later, one more delivered event of testTopic: recent.
	clock.Advance(2 * time.Hour)
	recent := enqueueN(t, c, pool, 1)[0]
	admCatchUp(t, clock, c, recent)
	got = admClaim(t, st, 2, testTopic) // the pending one and the recent one
	if !slices.Equal(admClaimedIDs(got), []uuid.UUID{enqueued[4], recent}) {
		t.Fatalf("claimed %v", admClaimedIDs(got))
	}
	admSettle(t, st, driver.Release, "", got[0])
	admSettle(t, st, driver.Delivered, "", got[1])
	if e := get(t, c, recent); e.Status != outbox.StatusDelivered {
		t.Fatalf("recent event: %+v", e)
	}
	if e := get(t, c, enqueued[4]); e.Status != outbox.StatusPending {
		t.Fatalf("pending event: %+v", e)
	}
	total := countRows(t, pool, "true")

	for name, try := range map[string]func() (int64, error){
		"no topics":          func() (int64, error) { return c.Admin().Purge(ctx, time.Hour) },
		"negative retention": func() (int64, error) { return c.Admin().Purge(ctx, -time.Second, testTopic) },
		"invalid topic": func() (int64, error) {
			return c.Admin().Purge(ctx, time.Hour, testTopic, outbox.Topic{Namespace: "Bad"})
		},
		"empty topic": func() (int64, error) { return c.Admin().Purge(ctx, time.Hour, outbox.Topic{}) },
	} {
		if n, err := try(); !errors.Is(err, outbox.ErrInvalidConfig) || n != 0 {
			t.Fatalf("%s: purged %d, %v; want ErrInvalidConfig", name, n, err)
		}
	}
	if n := countRows(t, pool, "true"); n != total {
		t.Fatalf("%d rows after refused purges, want %d", n, total)
	}

	// Three hours' retention: nothing is that old.
	if n, err := c.Admin().Purge(ctx, 3*time.Hour, testTopic, kept); err != nil || n != 0 {
		t.Fatalf("purged %d, %v; want 0", n, err)
	}
	// One hour: testTopic's three old delivered events, not the dead, the
	// pending, the recent one or the other topic's.
	if n, err := c.Admin().Purge(ctx, time.Hour, testTopic); err != nil || n != 3 {
		t.Fatalf("purged %d, %v; want 3", n, err)
	}
	if n := countRows(t, pool, "id = ANY($1)", enqueued[:3]); n != 0 {
		t.Fatal("old delivered rows survived")
	}
	for _, id := range append(enqueued[3:], recent) {
		if n := countRows(t, pool, "id = $1", id); n != 1 {
			t.Fatalf("row %s purged", id)
		}
	}
	if n, err := c.Admin().Purge(ctx, time.Hour, kept, outbox.Topic{Namespace: "none", Topic: "such"}); err != nil || n != 1 {
		t.Fatalf("purged %d of the kept topic, %v; want 1", n, err)
	}
	// Retention zero: every delivered event older than now.
	clock.Advance(time.Millisecond)
	if n, err := c.Admin().Purge(ctx, 0, testTopic); err != nil || n != 1 {
		t.Fatalf("purged %d with zero retention, %v; want the recent one", n, err)
	}
	if n := countRows(t, pool, "status = 'delivered'"); n != 0 {
		t.Fatalf("%d delivered rows left", n)
	}

	// The dedupe window ends with the row: after purging, the key is free.
	again, err := c.Enqueue(ctx, pool, keyed(7, "once"))
	if err != nil || again.AlreadyEnqueued || again.ID == enqueued[0] {
		t.Fatalf("re-enqueue after purge: %+v %v", again, err)
	}

	// Many rows go in batches, all of them.
	const many = 2345
	bulk := enqueueN(t, c, pool, many)
	admCatchUp(t, clock, c, bulk[len(bulk)-1])
	claimed := admClaim(t, st, many+10, testTopic)
	if len(claimed) < many {
		t.Fatalf("claimed %d of %d", len(claimed), many)
	}
	admSettle(t, st, driver.Delivered, "", claimed...)
	clock.Advance(2 * time.Hour)
	if n, err := c.Admin().Purge(ctx, time.Hour, testTopic); err != nil || n != int64(len(claimed)) {
		t.Fatalf("purged %d, %v; want %d", n, err, len(claimed))
	}
	if n := countRows(t, pool, "status = 'delivered'"); n != 0 {
		t.Fatalf("%d delivered rows left after a large purge", n)
	}
}

func TestGetUnknown(t *testing.T) {
	c, _ := newClient(t, outbox.Config{})
	if _, err := c.Admin().Get(ctx, uuid.New()); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatal(err)
	}
}

// Admin.SkipHead stamps its ledger entry with the client's clock
// (Config.Now), as the other Admin writes do, and leaves the event's
// UpdatedAt (the time of its outcome, which Settled and tail follow) as
// the death set it (since migration 0026; tail printed a skipped head again
// as dead).
func TestSkipHeadUsesTheClientClock(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	clock := newTestClock()
	c := clientOn(t, pool, outbox.Config{Now: clock.Now})
	m := msg(1)
	m.OrderingKey = "k"
	res, err := c.Enqueue(ctx, pool, m)
	if err != nil {
		t.Fatal(err)
	}
	admCatchUp(t, clock, c, res.ID)
	admKillAll(t, admStore(t, pool, "public", clock.Now))
	died := get(t, c, res.ID).UpdatedAt
	clock.Advance(100 * time.Hour)
	if err := c.Admin().SkipHead(ctx, "alice", res.ID); err != nil {
		t.Fatal(err)
	}
	if e := get(t, c, res.ID); !e.UpdatedAt.Equal(died) || e.Status != outbox.StatusDead {
		t.Fatalf("after the skip: %s, updated %v; want dead, updated when it died (%v)", e.Status, e.UpdatedAt, died)
	}
	h, err := c.Admin().History(ctx, res.ID)
	if err != nil || len(h) == 0 {
		t.Fatalf("history: %+v %v", h, err)
	}
	if last := h[len(h)-1]; last.Outcome != "skipped" || !last.FinishedAt.Equal(clock.Now().Truncate(time.Microsecond)) {
		t.Fatalf("the skip's entry: %s at %v, want skipped at the client's clock %v", last.Outcome, last.FinishedAt, clock.Now())
	}
}

// Unserved lists the topics whose events wait with no running dispatcher
// to publish them: a topic enqueued with no publisher anywhere (a typo),
// and a served topic once its last dispatcher has stopped. A topic served
// by a running dispatcher is not listed: not while the elected one runs,
// and not once it has stopped while another dispatcher of the topic, which
// holds no maintenance lease, leases its events. Nor is a topic with dead
// events only.
func TestUnserved(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	served := outbox.Topic{Namespace: "shop", Topic: "orders"}
	typo := outbox.Topic{Namespace: "shop", Topic: "oders"}
	deadOnly := outbox.Topic{Namespace: "shop", Topic: "dead_only"}
	enqueueTopic(t, c, pool, typo, 2)
	enqueueTopic(t, c, pool, deadOnly, 1)
	st := admStore(t, pool, "public", nil)
	admSettle(t, st, driver.Dead, "x", admClaim(t, st, 1, deadOnly)...)

	names := func(ts []outbox.TopicStats) []string {
		var out []string
		for _, s := range ts {
			out = append(out, fmt.Sprintf("%s pending %d processing %d", s.Topic, s.Pending, s.Processing))
		}
		return out
	}
	check := func(what string, want ...string) {
		t.Helper()
		got, err := c.Admin().Unserved(ctx)
		if err != nil || !slices.Equal(names(got), want) {
			t.Fatalf("%s: unserved %q, %v; want %q", what, names(got), err, want)
		}
	}
	check("before any dispatcher ran", "shop/oders pending 2 processing 0")

	// Two dispatchers of the served topic, whose publishers hold their
	// events until the test lets them go; one of them is elected.
	proceed := make(chan struct{}) // a send lets one held publish return
	defer close(proceed)
	started := make(chan struct{}, 4)
	type pass struct {
		d    *outbox.Dispatcher
		held []string
	}
	passes := make(chan pass, 16)
	var ds []*outbox.Dispatcher
	for range 2 {
		d, err := c.NewDispatcher(outbox.DispatcherConfig{Logger: quietLog, LeaseDuration: time.Minute, StopTimeout: 30 * time.Second},
			outbox.Publisher{Topic: served, Publish: func(ctx context.Context, _ outbox.Delivery) error {
				started <- struct{}{}
				select {
				case <-proceed:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			}})
		if err != nil {
			t.Fatal(err)
		}
		outbox.OnMaintenance(d, func(held []string) { passes <- pass{d, held} })
		if err := d.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = d.Stop(ctx) })
		ds = append(ds, d)
	}
	var leader, other *outbox.Dispatcher
	for seen := map[*outbox.Dispatcher]bool{}; len(seen) < 2; {
		p := recv(t, "both dispatchers' first maintenance pass", passes)
		seen[p.d] = true
		if len(p.held) > 0 {
			leader = p.d
		}
	}
	if leader == nil {
		t.Fatal("neither dispatcher was elected")
	}
	other = ds[0]
	if other == leader {
		other = ds[1]
	}
	enqueueTopic(t, c, pool, served, 1)
	recv(t, "the served topic's event to be published", started)
	check("while the elected dispatcher serves shop/orders", "shop/oders pending 2 processing 0")

	// The elected one stops and resigns; the other, not elected, leases the
	// next event: the topic is still served.
	proceed <- struct{}{}
	if err := leader.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	enqueueTopic(t, c, pool, served, 1)
	recv(t, "the other dispatcher to publish the next event", started)
	check("while a dispatcher without the maintenance lease serves shop/orders", "shop/oders pending 2 processing 0")

	// Once the last one has stopped, the topic's next event waits for
	// nobody.
	proceed <- struct{}{}
	if err := other.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	enqueueTopic(t, c, pool, served, 1)
	check("after the last stop", "shop/oders pending 2 processing 0", "shop/orders pending 1 processing 0")
}
