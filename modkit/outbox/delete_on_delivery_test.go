package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// A topic with DeleteOnDelivery loses each event in the write that records
// its delivery: the ledger keeps the delivery, Admin.Get no longer finds the
// event, and its dedupe key is free again. A topic beside it without the
// option keeps its delivered events.
func TestDeleteOnDelivery(t *testing.T) {
	t.Parallel()
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	kept := outbox.Topic{Namespace: "test", Topic: "kept"}

	msgs := make([]outbox.Message, 0, 20)
	for i := range 10 {
		msgs = append(msgs, keyed(i, fmt.Sprintf("key-%d", i)))
		msgs = append(msgs, outbox.Message{Namespace: kept.Namespace, Topic: kept.Topic, Payload: []byte(fmt.Sprintf(`{"n":%d}`, i))})
	}
	res, err := c.EnqueueBatch(ctx, pool, msgs)
	if err != nil {
		t.Fatal(err)
	}

	log := newOutcomeLog()
	noop := func(context.Context, outbox.Delivery) error { return nil }
	startDispatcher(t, c, testConfig(log),
		outbox.Publisher{Topic: testTopic, Publish: noop, DeleteOnDelivery: true},
		outbox.Publisher{Topic: kept, Publish: noop})
	log.waitFor(t, "20 deliveries", finalCount(outbox.StatusDelivered, 20))

	if n := countRows(t, pool, "topic = 'events'"); n != 0 {
		t.Errorf("%d events of the DeleteOnDelivery topic are still in the table, want 0", n)
	}
	if n := countRows(t, pool, "topic = 'kept' AND status = 'delivered'"); n != 10 {
		t.Errorf("%d delivered events of the other topic are kept, want 10", n)
	}
	for i, r := range res {
		if msgs[i].Topic != testTopic.Topic {
			continue
		}
		if _, err := c.Admin().Get(ctx, r.ID); !errors.Is(err, outbox.ErrNotFound) {
			t.Errorf("Get of deleted event %s: %v, want ErrNotFound", r.ID, err)
		}
		h, err := c.Admin().History(ctx, r.ID)
		if err != nil {
			t.Fatal(err)
		}
		if len(h) != 1 || h[0].Outcome != "delivered" || h[0].Attempt != 1 || h[0].Detail != "deleted on delivery" {
			t.Errorf("history of deleted event %s: %+v, want one delivered entry of attempt 1, detail \"deleted on delivery\"", r.ID, h)
		}
	}

	// The dedupe key is free again: the same key enqueues a new event.
	again, err := c.Enqueue(ctx, pool, keyed(0, "key-0"))
	if err != nil {
		t.Fatal(err)
	}
	if again.AlreadyEnqueued || again.ID == res[0].ID {
		t.Errorf("enqueue of key-0 after its delivery: %+v, want a new event (the first was %s)", again, res[0].ID)
	}
}

// The delete is fenced like any outcome: a worker whose lease is gone
// deletes nothing.
func TestDeleteOnDeliveryIsFenced(t *testing.T) {
	t.Parallel()
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	id := enqueueN(t, c, pool, 1)[0]

	// The first dispatcher's publish blocks until its lease has been taken
	// over; its delivery must then change nothing.
	taken := make(chan struct{})
	publishing := make(chan struct{})
	var once sync.Once
	slowLog := newOutcomeLog()
	cfg := testConfig(slowLog)
	slow := startDispatcher(t, c, cfg, outbox.Publisher{Topic: testTopic, DeleteOnDelivery: true,
		Publish: func(ctx context.Context, d outbox.Delivery) error {
			once.Do(func() { close(publishing) })
			select {
			case <-taken:
			case <-ctx.Done():
			}
			return nil
		}})
	select {
	case <-publishing:
	case <-time.After(guard):
		t.Fatal("the event was never published")
	}
	// Take the lease over as a second worker would after it expired.
	tag, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET lease_token = gen_random_uuid(), locked_by = gen_random_uuid()
		WHERE id = $1 AND status = 'processing'`, id)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("taking the lease over: %v (%d rows)", err, tag.RowsAffected())
	}
	close(taken)
	slowLog.waitFor(t, "the stale delivery's outcome", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m[id]) > 0 })
	slowLog.mu.Lock()
	o := slowLog.byID[id][0]
	slowLog.mu.Unlock()
	if !o.LeaseLost {
		t.Errorf("the stale worker's delivery was recorded: %+v, want LeaseLost", o)
	}
	if err := slow.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, pool, "id = $1 AND status = 'processing'", id); n != 1 {
		t.Errorf("the event taken over is gone or changed (%d processing rows), want it untouched", n)
	}
}

// A transactional handler's writes and the delete commit together.
func TestDeleteOnDeliveryHandleTx(t *testing.T) {
	t.Parallel()
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE handled (id uuid PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	ids := enqueueN(t, c, pool, 5)
	log := newOutcomeLog()
	startDispatcher(t, c, testConfig(log), outbox.Publisher{Topic: testTopic, DeleteOnDelivery: true,
		HandleTx: func(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
			_, err := tx.Exec(ctx, `INSERT INTO handled VALUES ($1)`, d.ID)
			return err
		}})
	log.waitFor(t, "5 deliveries", finalCount(outbox.StatusDelivered, 5))
	for _, id := range ids {
		var handled, left int
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM handled WHERE id = $1),
			(SELECT count(*) FROM modkit_outbox_events WHERE id = $1)`, id).Scan(&handled, &left); err != nil {
			t.Fatal(err)
		}
		if handled != 1 || left != 0 {
			t.Errorf("event %s: handled %d times, %d rows left; want 1 and 0", id, handled, left)
		}
	}
}

// The events of an ordering key still go one at a time and in order when
// each one is deleted on delivery: a deleted event lets its successor in.
func TestDeleteOnDeliveryKeepsOrder(t *testing.T) {
	t.Parallel()
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	const keys, perKey = 4, 6
	var msgs []outbox.Message
	for i := range perKey {
		for k := range keys {
			m := msg(i)
			m.OrderingKey = fmt.Sprintf("k%d", k)
			msgs = append(msgs, m)
		}
	}
	if _, err := c.EnqueueBatch(ctx, pool, msgs); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string][]int64{}
	log := newOutcomeLog()
	startDispatcher(t, c, testConfig(log), outbox.Publisher{Topic: testTopic, DeleteOnDelivery: true,
		Publish: func(ctx context.Context, d outbox.Delivery) error {
			mu.Lock()
			defer mu.Unlock()
			seen[d.OrderingKey] = append(seen[d.OrderingKey], d.Sequence)
			return nil
		}})
	log.waitFor(t, "every event delivered", finalCount(outbox.StatusDelivered, keys*perKey))
	mu.Lock()
	defer mu.Unlock()
	for k, seqs := range seen {
		for i, s := range seqs {
			if s != int64(i+1) {
				t.Errorf("key %s published in the order %v, want 1..%d", k, seqs, perKey)
				break
			}
		}
	}
	if n := countRows(t, pool, "true"); n != 0 {
		t.Errorf("%d events left in the table, want 0", n)
	}
}

func TestDeleteOnDeliveryRefusesRetention(t *testing.T) {
	t.Parallel()
	c, _ := newClient(t, outbox.Config{})
	_, err := c.NewDispatcher(outbox.DispatcherConfig{}, outbox.Publisher{Topic: testTopic, DeleteOnDelivery: true,
		Retention: 1, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("NewDispatcher with DeleteOnDelivery and a Retention: %v, want ErrInvalidConfig", err)
	}
}
