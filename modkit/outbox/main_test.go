package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var ctx = context.Background()

// testTopic is the pair most tests publish.
var testTopic = outbox.Topic{Namespace: "test", Topic: "events"}

func newStore(t *testing.T, cfg outbox.Config) (*outbox.Store, *pgtest.DB) {
	t.Helper()
	tdb := pgtest.NewDB(t)
	s, err := outbox.NewStore(tdb.Provider.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, tdb
}

func msg(i int) outbox.Message {
	return outbox.Message{Namespace: testTopic.Namespace, Topic: testTopic.Topic, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}
}

func keyed(i int, key string) outbox.Message {
	m := msg(i)
	m.DedupeKey = outbox.Key(key)
	return m
}

func enqueueN(t *testing.T, pool *pgxpool.Pool, n int) []uuid.UUID {
	t.Helper()
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = msg(i)
	}
	res, err := outbox.EnqueueBatch(ctx, pool, msgs)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]uuid.UUID, n)
	for i, r := range res {
		ids[i] = r.ID
	}
	return ids
}

func countRows(t *testing.T, pool *pgxpool.Pool, where string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events WHERE "+where, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func claimCfg(batch int) outbox.ClaimConfig {
	return outbox.ClaimConfig{BatchSize: batch, LeaseDuration: 30 * time.Second, MaxAttempts: 3, Topics: []outbox.Topic{testTopic}}
}

func mustClaim(t *testing.T, s *outbox.Store, cfg outbox.ClaimConfig) []outbox.ClaimedMessage {
	t.Helper()
	got, err := s.ClaimBatch(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// expireLease moves an event's lease into the past, as if its lease duration
// had elapsed, without waiting.
func expireLease(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) {
	t.Helper()
	if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET locked_until = now() - interval '1 second' WHERE id = $1 AND status = 'processing'", id); err != nil {
		t.Fatal(err)
	}
}

// makeDue makes a retried event due now.
func makeDue(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) {
	t.Helper()
	if _, err := pool.Exec(ctx, "UPDATE modkit_outbox_events SET next_attempt_at = now() WHERE id = $1", id); err != nil {
		t.Fatal(err)
	}
}

func get(t *testing.T, s *outbox.Store, id uuid.UUID) outbox.Event {
	t.Helper()
	e, err := s.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))
