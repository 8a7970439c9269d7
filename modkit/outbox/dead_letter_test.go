package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// DeadLetter makes pending events dead (migration 0044), as an operator
// must for the events of a topic no dispatcher serves, which every claim
// reads: before it, nothing but the table's owner could take them out of
// the backlog. It refuses what ReplayDead refuses, changing nothing; it
// leaves leased, delivered, dead and unknown events alone; it keeps each
// event's attempts and publish error and records who did it; ReplayDead
// brings the events back; the operator role may run it and the reader role
// may not.
func TestDeadLetterPendingEvents(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	st := admStore(t, pool, "public", nil)
	other := outbox.Topic{Namespace: "legacy", Topic: "orphan"}
	first := enqueueN(t, c, pool, 3)
	orphans := enqueueTopic(t, c, pool, other, 4)
	later := enqueueN(t, c, pool, 2)
	// Of testTopic: two delivered, one leased, then a retry waiting (with
	// a publish error to keep) and one pending.
	admSettle(t, st, driver.Delivered, "", admClaim(t, st, 2)...)
	lease := admClaim(t, st, 1)
	admSettle(t, st, driver.Retry, "the broker said no", admClaim(t, st, 1)...)
	delivered, leasedID, retrying, waiting := first[:2], lease[0].ID, later[0], later[1:]
	if leasedID != first[2] {
		t.Fatalf("leased %s, want %s", leasedID, first[2])
	}
	// The oldest orphan's lease ended without an outcome: its dispatcher
	// died, and no sweep serves its topic.
	if expired := admClaim(t, st, 1, other); len(expired) != 1 || expired[0].ID != orphans[0] {
		t.Fatalf("leased %v, want %s", expired, orphans[0])
	}
	if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET locked_until = now() - interval '1 second' WHERE id = $1", orphans[0]); err != nil {
		t.Fatal(err)
	}
	total, pendingRows := countRows(t, pool, "true"), countRows(t, pool, "status IN ('pending', 'processing')")

	admin := c.Admin()
	for name, try := range map[string]func() ([]uuid.UUID, error){
		"empty by": func() ([]uuid.UUID, error) { return admin.DeadLetter(ctx, " ", outbox.EventFilter{}, retrying) },
		"dead status": func() ([]uuid.UUID, error) {
			return admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusDead})
		},
		"ids and a filter": func() ([]uuid.UUID, error) {
			return admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{Topic: other.Topic}, retrying)
		},
		"nothing selected": func() ([]uuid.UUID, error) { return admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{}) },
		"limit over the maximum": func() ([]uuid.UUID, error) {
			return admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{Namespace: other.Namespace, Limit: 10001})
		},
	} {
		if got, err := try(); !errors.Is(err, outbox.ErrInvalidConfig) || len(got) != 0 {
			t.Fatalf("%s: dead-lettered %v, %v; want ErrInvalidConfig", name, got, err)
		}
	}
	if _, err := admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{}); err == nil ||
		!strings.Contains(err.Error(), "set EventFilter.Status to StatusPending") {
		t.Fatalf("an empty selection: %v; want it to say how to mean every pending event", err)
	}
	if n, p := countRows(t, pool, "true"), countRows(t, pool, "status IN ('pending', 'processing')"); n != total || p != pendingRows {
		t.Fatalf("%d rows, %d pending after refused calls; want %d, %d", n, p, total, pendingRows)
	}

	// By id: the pending ones only (a waiting retry counts), not the
	// delivered, the leased or an unknown id.
	got, err := admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{}, delivered[0], leasedID, retrying, uuid.New())
	if err != nil || !slices.Equal(got, []uuid.UUID{retrying}) {
		t.Fatalf("dead-lettered %v, %v; want %v", got, err, retrying)
	}
	e, err := admin.Get(ctx, retrying)
	if err != nil || e.Status != outbox.StatusDead || e.Attempts != 1 ||
		e.LastError == nil ||
		*e.LastError != "dead-lettered by bob@ops before it was delivered; last publish error: the broker said no" {
		t.Fatalf("the dead-lettered retry: %+v, %v; want dead, its attempt and error kept", e, err)
	}
	hist, err := admin.History(ctx, retrying)
	if err != nil || len(hist) == 0 {
		t.Fatalf("history %+v, %v", hist, err)
	}
	if last := hist[len(hist)-1]; last.Outcome != "dead_lettered" || !strings.Contains(last.Detail, "bob@ops") || last.Actor == "" ||
		last.No != len(hist) {
		t.Fatalf("history %+v, want it to end with dead_lettered by bob@ops", hist)
	}
	for _, id := range append(slices.Clone(delivered), leasedID) {
		if n := countRows(t, pool, "id = $1 AND status <> 'dead'", id); n != 1 {
			t.Fatalf("event %s, not pending, was dead-lettered", id)
		}
	}

	// By filter: the oldest first, at most Limit, of the topic named (the
	// event whose lease ended among them); then every pending event left
	// of it. The operator role may.
	operator := clientOn(t, tdb.LoginAs(t, "modkit_outbox_operator"), outbox.Config{Logger: quietLog})
	f := outbox.EventFilter{Namespace: other.Namespace, Topic: other.Topic, Limit: 3}
	if got, err := operator.Admin().DeadLetter(ctx, "ops", f); err != nil || !slices.Equal(sorted(got, orphans), orphans[:3]) {
		t.Fatalf("dead-lettered %v, %v; want %v", got, err, orphans[:3])
	}
	f.Limit = 0
	if got, err := operator.Admin().DeadLetter(ctx, "ops", f); err != nil || !slices.Equal(got, orphans[3:]) {
		t.Fatalf("dead-lettered %v, %v; want %v", got, err, orphans[3:])
	}
	for _, id := range waiting {
		if n := countRows(t, pool, "id = $1 AND status = 'pending'", id); n != 1 {
			t.Fatalf("event %s of another topic was dead-lettered", id)
		}
	}
	hist, err = admin.History(ctx, orphans[0])
	if n := len(hist); err != nil || n < 2 || hist[n-2].Outcome != "lease_expired" || hist[n-1].Outcome != "dead_lettered" ||
		hist[n-1].No != n {
		t.Fatalf("history of the event whose lease ended: %+v, %v; want lease_expired, then dead_lettered", hist, err)
	}
	if e, err := admin.Get(ctx, orphans[0]); err != nil || e.Status != outbox.StatusDead || e.Attempts != 1 || e.LockedUntil != nil {
		t.Fatalf("the event whose lease ended: %+v, %v; want dead, its attempt kept, no lease", e, err)
	}
	reader := clientOn(t, tdb.LoginAs(t, "modkit_outbox_reader"), outbox.Config{Logger: quietLog})
	if got, err := reader.Admin().DeadLetter(ctx, "eve", outbox.EventFilter{Status: outbox.StatusPending}); err == nil ||
		!strings.Contains(err.Error(), "modkit_outbox_operator") || len(got) != 0 {
		t.Fatalf("dead-letter by the reader role: %v, %v; want refused, naming the operator role", got, err)
	}

	// Replayed, they are pending again, due now, their attempts reset.
	if got, err := admin.ReplayDead(ctx, "bob@ops", outbox.EventFilter{Namespace: other.Namespace}); err != nil ||
		!slices.Equal(sorted(got, orphans), orphans) {
		t.Fatalf("replayed %v, %v; want %v", got, err, orphans)
	}
	if n := countRows(t, pool, "namespace = 'legacy' AND status = 'pending' AND attempts = 0"); n != len(orphans) {
		t.Fatalf("%d replayed events pending, want %d", n, len(orphans))
	}

	// Replayed and dead-lettered again: the publish error stays, the
	// earlier dead-lettering's words do not pile up.
	if _, err := admin.ReplayDead(ctx, "bob@ops", outbox.EventFilter{}, retrying); err != nil {
		t.Fatal(err)
	}
	if got, err := admin.DeadLetter(ctx, "alice", outbox.EventFilter{}, retrying); err != nil || len(got) != 1 {
		t.Fatalf("dead-letter again: %v, %v", got, err)
	}
	if e, err := admin.Get(ctx, retrying); err != nil || e.LastError == nil ||
		*e.LastError != "dead-lettered by alice before it was delivered; last publish error: the broker said no" {
		t.Fatalf("dead-lettered twice: %+v, %v", e, err)
	}

	// A schema without migration 0044: ErrNotMigrated.
	if _, err := pool.Exec(ctx, "DROP FUNCTION modkit_outbox_dead_letter_filter, modkit_outbox_dead_letter"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{Status: outbox.StatusPending}); !errors.Is(err, outbox.ErrNotMigrated) {
		t.Fatalf("dead-letter without migration 0044: %v, want ErrNotMigrated", err)
	}
}

// sorted returns ids in the order they have in order.
func sorted(ids, order []uuid.UUID) []uuid.UUID {
	slices.SortFunc(ids, func(a, b uuid.UUID) int { return slices.Index(order, a) - slices.Index(order, b) })
	return ids
}

// An event of an ordering key dead-lettered is a dead event of its key like
// any other. The key's head: the events after it wait behind it
// (BlockedKeys lists it) until it is purged. An event held behind pending
// ones: once those are delivered it is the key's dead head, and replayed,
// it is delivered, and then the rest, in order.
func TestDeadLetteredEventsOfAKeyHoldItBack(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	admin := client.Admin()
	ids := enqueueOneKey(t, client, pool, 5)
	blockedBy := func(head uuid.UUID, waiting int64) {
		t.Helper()
		blocked, err := admin.BlockedKeys(ctx, 0)
		if err != nil || len(blocked) != 1 || blocked[0].Head != head || blocked[0].Waiting != waiting {
			t.Fatalf("blocked keys %+v, %v; want the key held back by %s, %d waiting", blocked, err, head, waiting)
		}
	}

	if got, err := admin.DeadLetter(ctx, "bob@ops", outbox.EventFilter{}, ids[0], ids[2]); err != nil || len(got) != 2 {
		t.Fatalf("dead-letter the key's head and its third event: %v, %v", got, err)
	}
	blockedBy(ids[0], 3)
	var mu sync.Mutex
	var order []uuid.UUID
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(_ context.Context, d outbox.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, d.ID)
		return nil
	}})
	if got, err := admin.PurgeDead(ctx, "bob@ops", outbox.EventFilter{}, ids[0]); err != nil || len(got) != 1 {
		t.Fatalf("purge the dead-lettered head: %v, %v", got, err)
	}
	log.waitFor(t, "the second event delivered", finalCount(outbox.StatusDelivered, 1))
	blockedBy(ids[2], 2)
	if got, err := admin.ReplayDead(ctx, "bob@ops", outbox.EventFilter{}, ids[2]); err != nil || len(got) != 1 {
		t.Fatalf("replay the dead-lettered event: %v, %v", got, err)
	}
	log.waitFor(t, "the rest of the key delivered", finalCount(outbox.StatusDelivered, 4))
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(order, ids[1:]) {
		t.Fatalf("published %v, want %v in order, each once", order, ids[1:])
	}
}
