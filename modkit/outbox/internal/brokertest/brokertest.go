// Package brokertest is the shared harness of the broker publishers' tests
// (outboxnats, outboxkafka, outboxamqp, outboxhttp): it enqueues a run of
// events, delivers them through a dispatcher that is SIGKILLed in a child
// process or whose broker connection is cut, lets a survivor finish, and
// checks what reached the broker against what was enqueued.
package brokertest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

// Topic is the topic every scenario enqueues to.
var Topic = outbox.Topic{Namespace: "test", Topic: "events"}

// guard bounds every wait on a signal; reaching it fails the test. It
// catches hangs and is not a performance assertion.
const guard = 2 * time.Minute

// Events is how many events a scenario delivers: 10,000, or
// BROKERTEST_EVENTS when it is set.
func Events(t testing.TB) int {
	t.Helper()
	if s := os.Getenv("BROKERTEST_EVENTS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("BROKERTEST_EVENTS=%q: want a positive number", s)
		}
		return n
	}
	return 10000
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Enqueue enqueues n events of Topic in batches and returns their ids in
// order. Every third event has a tenant, every fifth a dedupe key, and each
// carries the header "x-seq" with its index.
func Enqueue(t testing.TB, c *outbox.Client, d *outboxtest.DB, n int) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	ids := make([]uuid.UUID, 0, n)
	const batch = 1000
	for start := 0; start < n; start += batch {
		msgs := make([]outbox.Message, 0, batch)
		for i := start; i < min(n, start+batch); i++ {
			m := outbox.Message{Namespace: Topic.Namespace, Topic: Topic.Topic,
				Headers: map[string]string{"x-seq": strconv.Itoa(i)},
				Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}
			if i%3 == 0 {
				tenant := uuid.New()
				m.TenantID = &tenant
			}
			if i%5 == 0 {
				key := fmt.Sprintf("key-%d", i)
				if m.TenantID != nil {
					key = m.TenantID.String() + "/" + key
				}
				m.DedupeKey = &key
			}
			msgs = append(msgs, m)
		}
		res, err := c.EnqueueBatch(ctx, d.Provider.Pool, msgs)
		if err != nil {
			t.Fatalf("enqueue: %v", err)
		}
		for _, e := range res {
			ids = append(ids, e.ID)
		}
	}
	return ids
}

// Config is the dispatcher configuration the scenarios run: big claims,
// wide concurrency, quick retries and enough attempts to ride out a cut
// connection.
func Config(onOutcome func(outbox.Delivery, outbox.Outcome)) outbox.DispatcherConfig {
	return outbox.DispatcherConfig{
		BatchSize:     500,
		Concurrency:   64,
		LeaseDuration: time.Second,
		PollInterval:  20 * time.Millisecond,
		MaxAttempts:   50,
		Retry:         outbox.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: 50 * time.Millisecond},
		SweepInterval: 100 * time.Millisecond,
		StopTimeout:   10 * time.Second,
		Logger:        quiet,
		OnOutcome:     onOutcome,
	}
}

// Delivered runs a dispatcher of c for pub until no event of Topic is left
// pending or processing, then stops it. onPublished, if set, is called
// after each successful publish with the number of successes so far.
// Events dead-lettered on the way fail the test.
func Delivered(t testing.TB, c *outbox.Client, pub outbox.Publisher, onPublished func(n int)) {
	t.Helper()
	ctx := context.Background()
	if onPublished != nil {
		publish := pub.Publish
		var mu sync.Mutex
		n := 0
		pub.Publish = func(ctx context.Context, d outbox.Delivery) error {
			err := publish(ctx, d)
			if err == nil {
				mu.Lock()
				n++
				k := n
				mu.Unlock()
				onPublished(k)
			}
			return err
		}
	}
	wake := make(chan struct{}, 1)
	var deadMu sync.Mutex
	var dead []string
	d, err := c.NewDispatcher(Config(func(d outbox.Delivery, o outbox.Outcome) {
		if o.Status == outbox.StatusDead {
			deadMu.Lock()
			dead = append(dead, fmt.Sprintf("%s: %s", d.ID, o.Error))
			deadMu.Unlock()
		}
		select {
		case wake <- struct{}{}:
		default:
		}
	}), pub)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop the dispatcher: %v", err)
		}
	}()
	timeout := time.NewTimer(guard)
	defer timeout.Stop()
	for {
		stats, err := c.Admin().Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		left := int64(0)
		for _, s := range stats.Topics {
			if s.Topic == Topic {
				left += s.Pending + s.Processing
			}
		}
		if left == 0 {
			break
		}
		select {
		case <-wake:
		case <-timeout.C:
			t.Fatalf("%d events still pending or processing after %v", left, guard)
		}
	}
	deadMu.Lock()
	defer deadMu.Unlock()
	if len(dead) > 0 {
		t.Fatalf("%d events dead-lettered, first: %s", len(dead), dead[0])
	}
}

// Reattempted returns the events of Topic published more than once by the
// outbox (attempts > 1): the only ones a broker may hold twice.
func Reattempted(t testing.TB, d *outboxtest.DB) map[uuid.UUID]bool {
	t.Helper()
	rows, err := d.Provider.Pool.Query(context.Background(),
		`SELECT id FROM modkit_outbox_events WHERE namespace = $1 AND topic = $2 AND attempts > 1`,
		Topic.Namespace, Topic.Topic)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[uuid.UUID]bool{}
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		out[id] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Check compares got, the number of times the broker holds each event id,
// with ids, the events enqueued: every one must be there, nothing else may
// be, and an event may be there twice only if the outbox published it more
// than once (reattempted). With exactlyOnce, no duplicate is allowed at
// all. It logs the figures and returns the number of duplicates.
func Check(t testing.TB, ids []uuid.UUID, got map[uuid.UUID]int, reattempted map[uuid.UUID]bool, exactlyOnce bool) int {
	t.Helper()
	want := make(map[uuid.UUID]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	missing, dups, extra := 0, 0, 0
	for _, id := range ids {
		if got[id] == 0 {
			missing++
			if missing <= 5 {
				t.Errorf("event %s never reached the broker", id)
			}
		}
	}
	for id, n := range got {
		switch {
		case !want[id]:
			extra++
			t.Errorf("the broker holds %d message(s) with unknown id %s", n, id)
		case n > 1:
			dups += n - 1
			if exactlyOnce {
				t.Errorf("event %s is held %d times; want exactly once", id, n)
			} else if !reattempted[id] {
				t.Errorf("event %s is held %d times but was published in one attempt", id, n)
			}
		}
	}
	if missing > 0 {
		t.Errorf("%d of %d events missing at the broker", missing, len(ids))
	}
	t.Logf("%d events enqueued, %d distinct ids at the broker, %d duplicate message(s), %d event(s) published more than once by the outbox",
		len(ids), len(got)-extra, dups, len(reattempted))
	return dups
}
