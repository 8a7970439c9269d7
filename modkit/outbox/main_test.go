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
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var ctx = context.Background()

// testTopic is the pair most tests publish.
var testTopic = outbox.Topic{Namespace: "test", Topic: "events"}

// newClient gives the test a database of its own (migrated into public)
// and a Client on its pool.
func newClient(t *testing.T, cfg outbox.Config) (*outbox.Client, *pgtest.DB) {
	t.Helper()
	tdb := pgtest.NewDB(t)
	return clientOn(t, tdb.Provider.Pool, cfg), tdb
}

// clientOn builds a Client on pool.
func clientOn(t *testing.T, pool *pgxpool.Pool, cfg outbox.Config) *outbox.Client {
	t.Helper()
	c, err := outbox.New(outboxpg.New(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func msg(i int) outbox.Message {
	return outbox.Message{Namespace: testTopic.Namespace, Topic: testTopic.Topic, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}
}

func keyed(i int, key string) outbox.Message {
	m := msg(i)
	m.DedupeKey = outbox.Key(key)
	return m
}

// enqueueN enqueues n test events through the pool and returns their ids.
func enqueueN(t *testing.T, c *outbox.Client, pool *pgxpool.Pool, n int) []uuid.UUID {
	t.Helper()
	return enqueueTopic(t, c, pool, testTopic, n)
}

// enqueueTopic enqueues n events of topic through r, the caller's runner,
// and returns their ids.
func enqueueTopic(t *testing.T, c *outbox.Client, r db.Runner, topic outbox.Topic, n int) []uuid.UUID {
	t.Helper()
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}
	}
	res, err := c.EnqueueBatch(ctx, r, msgs)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]uuid.UUID, n)
	for i, e := range res {
		ids[i] = e.ID
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

func get(t *testing.T, c *outbox.Client, id uuid.UUID) outbox.Event {
	t.Helper()
	e, err := c.Admin().Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// testClock is a movable clock for Config.Now: it only moves when told. It
// starts an hour ahead of the real time, because enqueued events take the
// database's time as their next_attempt_at, and must be due by the test
// clock for as long as a test runs.
type testClock struct{ at outbox.AtomicTime }

func newTestClock() *testClock {
	c := &testClock{}
	c.at.Store(time.Now().Add(time.Hour))
	return c
}

func (c *testClock) Now() time.Time          { return c.at.Load() }
func (c *testClock) Advance(d time.Duration) { c.at.Store(c.at.Load().Add(d)) }

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))
