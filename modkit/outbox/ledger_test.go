package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// lease is one event's lease: its holder and token.
type lease struct{ worker, token uuid.UUID }

// leasesHeld returns the leases of the events processing now.
func leasesHeld(t *testing.T, pool *pgxpool.Pool) map[uuid.UUID]lease {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT id, locked_by, lease_token FROM modkit_outbox_events WHERE status = 'processing'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[uuid.UUID]lease{}
	for rows.Next() {
		var id uuid.UUID
		var l lease
		if err := rows.Scan(&id, &l.worker, &l.token); err != nil {
			t.Fatal(err)
		}
		out[id] = l
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// checkLeaseExpired fails the test unless each of the leases (of a worker
// that died holding them) is closed by exactly one ledger entry, and those
// the dead worker did not settle are closed as lease_expired. (An outcome
// statement in flight when the process died may still commit: the server
// runs a query whose client is gone until it writes the reply.) It returns
// how many were lease_expired.
func checkLeaseExpired(t *testing.T, pool *pgxpool.Pool, leases map[uuid.UUID]lease) int {
	t.Helper()
	expired := 0
	for id, l := range leases {
		var n int
		var outcome string
		if err := pool.QueryRow(ctx, `SELECT count(*), coalesce(min(outcome), '') FROM modkit_outbox_attempts
			WHERE event_id = $1 AND worker = $2 AND lease_token = $3`, id, l.worker, l.token).Scan(&n, &outcome); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Errorf("event %s: the lease of worker %s is closed by %d ledger entries, want 1", id, l.worker, n)
		}
		if outcome == "lease_expired" {
			expired++
		}
	}
	if len(leases) > 0 && expired == 0 {
		t.Errorf("none of the %d leases the dead worker held was recorded as lease_expired", len(leases))
	}
	return expired
}

// checkLedger fails the test unless the attempts ledger agrees with the
// events: each event's entries are numbered 1..ledger_seq without gaps; a
// delivered event has exactly one delivered entry, and it is the last; an
// event that never ran has none; and (with no releases or replays) the
// entries that close a claim number exactly the event's attempts (a
// lease_expired entry of an ordered event behind an undelivered one says
// its attempt is not counted, migration 0031).
func checkLedger(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	var events, gaps, badDelivered, badClaims int
	err := pool.QueryRow(ctx, `WITH l AS (
		SELECT event_id, count(*) AS n, max(attempt_no) AS top, min(attempt_no) AS bottom,
			count(*) FILTER (WHERE outcome = 'delivered') AS delivered,
			count(*) FILTER (WHERE outcome IN ('delivered', 'retry', 'dead')
				OR (outcome = 'lease_expired' AND detail NOT LIKE '%its attempt is not counted%')) AS claims,
			count(*) FILTER (WHERE outcome IN ('released', 'replayed')) AS resets
		FROM modkit_outbox_attempts GROUP BY event_id)
	SELECT count(*),
		count(*) FILTER (WHERE coalesce(l.n, 0) <> e.ledger_seq OR coalesce(l.top, 0) <> e.ledger_seq OR coalesce(l.bottom, 1) <> 1),
		count(*) FILTER (WHERE (e.status = 'delivered') <> (coalesce(l.delivered, 0) = 1) OR coalesce(l.delivered, 0) > 1
			OR (e.status = 'delivered' AND NOT EXISTS (SELECT 1 FROM modkit_outbox_attempts a
				WHERE a.event_id = e.id AND a.attempt_no = e.ledger_seq AND a.outcome = 'delivered'))),
		count(*) FILTER (WHERE coalesce(l.resets, 0) = 0 AND coalesce(l.claims, 0) <> e.attempts)
	FROM modkit_outbox_events e LEFT JOIN l ON l.event_id = e.id`).Scan(&events, &gaps, &badDelivered, &badClaims)
	if err != nil {
		t.Fatal(err)
	}
	if gaps != 0 || badDelivered != 0 || badClaims != 0 {
		t.Fatalf("ledger of %d events: %d with gaps or a count other than ledger_seq, %d whose delivered entries disagree with their status, "+
			"%d whose claim entries differ from their attempts", events, gaps, badDelivered, badClaims)
	}
}

// Eight dispatchers on their own pools deliver 50,000 events while a tenth
// of the publishes fail at random: the ledger holds one entry per claim,
// one delivered entry per event, numbered without gaps.
func TestLedgerEightDispatchers(t *testing.T) {
	const n, dispatchers = 50_000, 8
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	for start := 0; start < n; start += 5000 {
		msgs := make([]outbox.Message, 5000)
		for i := range msgs {
			msgs[i] = msg(start + i)
		}
		if _, err := client.EnqueueBatch(ctx, pool, msgs); err != nil {
			t.Fatal(err)
		}
	}
	var failed atomic.Int64
	publish := func(_ context.Context, d outbox.Delivery) error {
		if rand.IntN(10) == 0 {
			failed.Add(1)
			return errors.New("downstream hiccup")
		}
		return nil
	}
	for range dispatchers {
		cfg := testConfig(newOutcomeLog())
		cfg.MaxAttempts, cfg.OnOutcome, cfg.BatchSize = 20, nil, 200
		startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfg, outbox.Publisher{Topic: testTopic, Publish: publish})
	}
	eventually(t, "every event delivered", func() bool { return countRows(t, pool, "status = 'delivered'") == n })
	checkLedger(t, pool)
	var retries, delivered, total int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE outcome = 'retry'), count(*) FILTER (WHERE outcome = 'delivered'), count(*)
		FROM modkit_outbox_attempts`).Scan(&retries, &delivered, &total); err != nil {
		t.Fatal(err)
	}
	var attempts int
	if err := pool.QueryRow(ctx, `SELECT sum(attempts) FROM modkit_outbox_events`).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if delivered != n || retries != int(failed.Load()) || total != attempts {
		t.Fatalf("ledger: %d delivered entries (want %d), %d retry entries (%d publishes failed), %d entries for %d attempts",
			delivered, n, retries, failed.Load(), total, attempts)
	}
	t.Logf("%d events, %d failed publishes retried, %d ledger entries", n, retries, total)
}

// An event id used again after its event was delivered and purged (the
// producer role may insert any id) is delivered again, and the dispatchers
// go on: the second event's ledger rows took the numbers of the first
// one's, its outcome write failed with a unique violation, and so did
// every claim of its topics once its lease expired, so nothing of them was
// delivered until the owner repaired the ledger by hand (a security
// review, with the producer role's rights; migration 0039).
func TestAnIDUsedAgainAfterItsEventWasPurged(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	reused := uuid.New()
	insert := func() {
		t.Helper()
		if _, err := pool.Exec(ctx, "INSERT INTO modkit_outbox_events (id, namespace, topic, payload) VALUES ($1, $2, $3, '{}')",
			reused, testTopic.Namespace, testTopic.Topic); err != nil {
			t.Fatal(err)
		}
	}
	insert()
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	delivered := func(id uuid.UUID, n int) func(map[uuid.UUID][]outbox.Outcome) bool {
		return func(m map[uuid.UUID][]outbox.Outcome) bool {
			return len(slices.DeleteFunc(slices.Clone(m[id]), func(o outbox.Outcome) bool { return o.Status != outbox.StatusDelivered })) >= n
		}
	}
	log.waitFor(t, "the first event delivered", delivered(reused, 1))
	if n, err := client.Admin().Purge(ctx, 0, testTopic); err != nil || n != 1 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	insert()
	other := enqueueN(t, client, pool, 1)[0]
	log.waitFor(t, "the second event of the id delivered, and another event", func(m map[uuid.UUID][]outbox.Outcome) bool {
		return delivered(reused, 2)(m) && delivered(other, 1)(m)
	})
	h, err := client.Admin().History(ctx, reused)
	if err != nil {
		t.Fatal(err)
	}
	var outcomes []string
	for _, a := range h {
		outcomes = append(outcomes, fmt.Sprintf("%d %s", a.No, a.Outcome))
	}
	if want := []string{"1 delivered", "1 delivered", "2 purged"}; !slices.Equal(outcomes, want) {
		t.Fatalf("history of the id: %v; want both events' entries, by number then time: %v", outcomes, want)
	}
}
