package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// sequenceRow reads the sequence row of testTopic's key: its stream and
// last sequence; ok is false without one.
func sequenceRow(t *testing.T, pool *pgxpool.Pool, key string) (stream, last int64, ok bool) {
	t.Helper()
	err := pool.QueryRow(ctx, `SELECT stream_id, last_seq FROM modkit_outbox_sequences
		WHERE namespace = $1 AND topic = $2 AND ordering_key = $3`, testTopic.Namespace, testTopic.Topic, key).Scan(&stream, &last)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return stream, last, true
}

// enqueueKeys enqueues one event of each key, through the pool, and
// returns their ids.
func enqueueKeys(t *testing.T, c *outbox.Client, pool *pgxpool.Pool, keys ...string) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, len(keys))
	for i, k := range keys {
		res, err := c.Enqueue(ctx, pool, orderedMsg(i, k, ""))
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = res.ID
	}
	return ids
}

// deleteEventsOf deletes, as the owner, every event of the keys (as a
// purge or DeleteOnDelivery would, without the wait).
func deleteEventsOf(t *testing.T, pool *pgxpool.Pool, keys ...string) {
	t.Helper()
	if _, err := pool.Exec(ctx, "DELETE FROM modkit_outbox_events WHERE ordering_key = ANY($1)", keys); err != nil {
		t.Fatal(err)
	}
}

// PruneSequences deletes the sequence rows of the keys with no event left,
// at most its limit, and keeps those of keys with an event of any status:
// pending, leased, held, dead (skipped or not), delivered.
func TestPruneSequences(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	admin := client.Admin()
	gone := []string{"gone-1", "gone-2", "gone-3"}
	enqueueKeys(t, client, pool, gone...)
	enqueueKeys(t, client, pool, gone...) // two events each
	deleteEventsOf(t, pool, gone...)
	kept := []string{"pending", "leased", "held", "dead", "skipped", "delivered"}
	ids := enqueueKeys(t, client, pool, kept...)
	byKey := map[string]uuid.UUID{}
	for i, k := range kept {
		byKey[k] = ids[i]
	}
	// "held": its first event dies, its second is held behind it, and the
	// first is deleted, so that only a held event is left of the key.
	for _, q := range []string{
		`UPDATE modkit_outbox_events SET status = 'processing', locked_by = gen_random_uuid(), lease_token = gen_random_uuid(),
			locked_until = now() + interval '1 hour', claimed_at = now(), attempts = 1 WHERE id = '` + byKey["leased"].String() + `'`,
		`UPDATE modkit_outbox_events SET status = 'dead', attempts = 1 WHERE id IN ('` + byKey["dead"].String() + `', '` +
			byKey["skipped"].String() + `', '` + byKey["held"].String() + `')`,
		`UPDATE modkit_outbox_events SET head_skipped = true WHERE id = '` + byKey["skipped"].String() + `'`,
		`UPDATE modkit_outbox_events SET status = 'delivered', attempts = 1 WHERE id = '` + byKey["delivered"].String() + `'`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	held, err := client.Enqueue(ctx, pool, orderedMsg(9, "held", ""))
	if err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, pool, "id = $1 AND held", held.ID); n != 1 {
		t.Fatalf("the second event of key held is not held (%d)", n)
	}
	if _, err := pool.Exec(ctx, "DELETE FROM modkit_outbox_events WHERE id = $1", byKey["held"]); err != nil {
		t.Fatal(err)
	}

	if n, err := admin.PrunableSequences(ctx); err != nil || n != 3 {
		t.Fatalf("prunable sequences: %d, %v; want 3", n, err)
	}
	if _, err := admin.PruneSequences(ctx, -1); !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("a negative limit: %v, want ErrInvalidConfig", err)
	}
	if n, err := admin.PruneSequences(ctx, 2); err != nil || n != 2 {
		t.Fatalf("prune at most 2: %d, %v", n, err)
	}
	if n, err := admin.PrunableSequences(ctx); err != nil || n != 1 {
		t.Fatalf("prunable sequences after pruning 2: %d, %v; want 1", n, err)
	}
	if n, err := admin.PruneSequences(ctx, 0); err != nil || n != 1 {
		t.Fatalf("prune all: %d, %v; want the last one", n, err)
	}
	if n, err := admin.PruneSequences(ctx, 0); err != nil || n != 0 {
		t.Fatalf("prune again: %d, %v; want none", n, err)
	}
	for _, k := range gone {
		if _, _, ok := sequenceRow(t, pool, k); ok {
			t.Errorf("key %s has no event and kept its sequence row", k)
		}
	}
	for _, k := range kept {
		if _, _, ok := sequenceRow(t, pool, k); !ok {
			t.Errorf("key %s has an event and lost its sequence row", k)
		}
	}

	// A schema without migration 0045: ErrNotMigrated.
	if _, err := pool.Exec(ctx, "DROP FUNCTION modkit_outbox_prune_sequences, modkit_outbox_prunable_sequences"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.PruneSequences(ctx, 0); !errors.Is(err, outbox.ErrNotMigrated) {
		t.Fatalf("prune without migration 0045: %v, want ErrNotMigrated", err)
	}
	if _, err := admin.PrunableSequences(ctx); !errors.Is(err, outbox.ErrNotMigrated) {
		t.Fatalf("count without migration 0045: %v, want ErrNotMigrated", err)
	}
}

// More rows than a batch go, a batch at a time, and a limit above a batch
// is honoured exactly.
func TestPruneSequencesInBatches(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	msgs := make([]outbox.Message, 2500)
	for i := range msgs {
		msgs[i] = orderedMsg(i, fmt.Sprintf("k%d", i), "")
	}
	if _, err := client.EnqueueBatch(ctx, pool, msgs); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "DELETE FROM modkit_outbox_events"); err != nil {
		t.Fatal(err)
	}
	if n, err := client.Admin().PruneSequences(ctx, 1500); err != nil || n != 1500 {
		t.Fatalf("prune at most 1500: %d, %v", n, err)
	}
	if n, err := client.Admin().PruneSequences(ctx, 0); err != nil || n != 1000 {
		t.Fatalf("prune the rest: %d, %v; want 1000", n, err)
	}
}

// A key used again after its row was pruned starts again: a new stream,
// sequence 1, and its events are delivered in order.
func TestPrunedKeyStartsAgain(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	admin := client.Admin()
	log := newOutcomeLog()
	var mu sync.Mutex
	var seqs []int64
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(_ context.Context, d outbox.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		seqs = append(seqs, d.Sequence)
		return nil
	}})
	first := enqueueOneKey(t, client, pool, 3)
	log.waitFor(t, "the key's first events delivered", allEnded(outbox.StatusDelivered, first))
	oldStream, last, _ := sequenceRow(t, pool, "k")
	if last != 3 {
		t.Fatalf("last sequence %d, want 3", last)
	}
	if n, err := admin.PruneSequences(ctx, 0); err != nil || n != 0 {
		t.Fatalf("prune while delivered events are kept: %d, %v; want none", n, err)
	}
	if n, err := admin.Purge(ctx, 0, testTopic); err != nil || n != 3 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	if n, err := admin.PruneSequences(ctx, 0); err != nil || n != 1 {
		t.Fatalf("prune after the purge: %d, %v; want the key's row", n, err)
	}
	again := enqueueOneKey(t, client, pool, 3)
	for i, id := range again {
		if e := get(t, client, id); e.Sequence != int64(i+1) {
			t.Fatalf("event %d of the key used again has sequence %d, want %d", i, e.Sequence, i+1)
		}
	}
	if stream, _, ok := sequenceRow(t, pool, "k"); !ok || stream == oldStream {
		t.Fatalf("the key used again has stream %d (%v), want a new one (not %d)", stream, ok, oldStream)
	}
	log.waitFor(t, "the key's new events delivered", allEnded(outbox.StatusDelivered, again))
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seqs, []int64{1, 2, 3, 1, 2, 3}) {
		t.Fatalf("delivered sequences %v, want 1, 2, 3 and then 1, 2, 3", seqs)
	}
}

// A prune and an enqueue of the same key, in either order, in open
// transactions: the prune skips a row an enqueue holds, and an enqueue that
// waits for a row being pruned starts the key afresh once the prune commits
// (or goes on from the row if it rolls back). No enqueue fails, and every
// event's sequence follows its stream's. Each of the enqueue functions'
// ways of taking the row: one event, a batch without dedupe keys (update,
// then insert), a batch with them (select for update, then insert).
func TestPruneSequencesBesideEnqueues(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	admin := client.Admin()
	ways := map[string]func(r pgx.Tx, key string) (uuid.UUID, error){
		"enqueue": func(r pgx.Tx, key string) (uuid.UUID, error) {
			res, err := client.Enqueue(ctx, r, orderedMsg(1, key, ""))
			return res.ID, err
		},
		"batch": func(r pgx.Tx, key string) (uuid.UUID, error) {
			res, err := client.EnqueueBatch(ctx, r, []outbox.Message{orderedMsg(1, key, ""), orderedMsg(2, "other-"+key, "")})
			if err != nil {
				return uuid.Nil, err
			}
			return res[0].ID, nil
		},
		"batch with dedupe keys": func(r pgx.Tx, key string) (uuid.UUID, error) {
			res, err := client.EnqueueBatch(ctx, r, []outbox.Message{orderedMsg(1, key, uuid.NewString()), orderedMsg(2, "other-"+key, uuid.NewString())})
			if err != nil {
				return uuid.Nil, err
			}
			return res[0].ID, nil
		},
	}
	// prepared: a key whose two events are gone, so its row is prunable.
	prepared := func(t *testing.T, key string) int64 {
		t.Helper()
		enqueueKeys(t, client, pool, key, key)
		deleteEventsOf(t, pool, key)
		stream, last, ok := sequenceRow(t, pool, key)
		if !ok || last != 2 {
			t.Fatalf("key %s: row %v, last sequence %d", key, ok, last)
		}
		return stream
	}
	begin := func(t *testing.T) pgx.Tx {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return tx
	}
	wantEvent := func(t *testing.T, id uuid.UUID, key string, stream, seq int64) {
		t.Helper()
		var gotStream, gotSeq int64
		if err := pool.QueryRow(ctx, "SELECT ordering_stream, ordering_seq FROM modkit_outbox_events WHERE id = $1", id).
			Scan(&gotStream, &gotSeq); err != nil {
			t.Fatal(err)
		}
		rowStream, rowLast, ok := sequenceRow(t, pool, key)
		if gotSeq != seq || (stream != 0 && gotStream != stream) || !ok || rowStream != gotStream || rowLast != seq {
			t.Fatalf("event of %s: stream %d, sequence %d; the key's row %v: stream %d, last %d; want sequence %d (stream %d)",
				key, gotStream, gotSeq, ok, rowStream, rowLast, seq, stream)
		}
	}
	var ids sync.Map // the ids of the enqueues run in goroutines, by key
	// enqueueWaiting enqueues in a transaction of its own, in a goroutine,
	// and waits until it waits for a lock.
	enqueueWaiting := func(t *testing.T, enqueue func(pgx.Tx, string) (uuid.UUID, error), key string) <-chan error {
		t.Helper()
		var id uuid.UUID
		done := make(chan error, 1)
		go func() {
			done <- pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
				id, err = enqueue(tx, key)
				return err
			})
		}()
		eventually(t, "the enqueue waiting for the prune's lock", func() bool {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
				AND datname = current_database() AND query LIKE '%modkit_outbox_enqueue%'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 1
		})
		out := make(chan error, 1)
		go func() {
			err := <-done
			if err == nil && id == uuid.Nil {
				err = errors.New("no id")
			}
			ids.Store(key, id)
			out <- err
		}()
		return out
	}
	for name, enqueue := range ways {
		t.Run(name, func(t *testing.T) {
			// The enqueue first: its open transaction holds the row; the
			// prune skips it, without waiting, and the enqueue goes on.
			key := name + "/enqueue-first"
			stream := prepared(t, key)
			tx := begin(t)
			id, err := enqueue(tx, key)
			if err != nil {
				t.Fatal(err)
			}
			if n, err := admin.PruneSequences(ctx, 0); err != nil || n != 0 {
				t.Fatalf("prune beside an open enqueue: %d, %v; want none", n, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			wantEvent(t, id, key, stream, 3)

			// The prune first, committed: the waiting enqueue starts the
			// key again.
			key = name + "/prune-first"
			stream = prepared(t, key)
			ptx := begin(t)
			var n int64
			if err := ptx.QueryRow(ctx, "SELECT pruned FROM modkit_outbox_prune_sequences(1000, 0)").Scan(&n); err != nil || n != 1 {
				t.Fatalf("prune in a transaction: %d, %v", n, err)
			}
			waited := enqueueWaiting(t, enqueue, key)
			if err := ptx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := recv(t, "the enqueue that waited for the prune", waited); err != nil {
				t.Fatalf("the enqueue that waited for a committed prune: %v", err)
			}
			v, _ := ids.Load(key)
			wantEvent(t, v.(uuid.UUID), key, 0, 1)
			if s, _, _ := sequenceRow(t, pool, key); s == stream {
				t.Fatalf("the key started again on its old stream %d", s)
			}

			// The prune first, rolled back: the enqueue goes on from the
			// row.
			key = name + "/prune-rolled-back"
			stream = prepared(t, key)
			ptx = begin(t)
			if err := ptx.QueryRow(ctx, "SELECT pruned FROM modkit_outbox_prune_sequences(1000, 0)").Scan(&n); err != nil || n != 1 {
				t.Fatalf("prune in a transaction: %d, %v", n, err)
			}
			waited = enqueueWaiting(t, enqueue, key)
			if err := ptx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			if err := recv(t, "the enqueue that waited for the prune", waited); err != nil {
				t.Fatalf("the enqueue that waited for a rolled-back prune: %v", err)
			}
			v, _ = ids.Load(key)
			wantEvent(t, v.(uuid.UUID), key, stream, 3)
		})
	}
}

// Producers and a pruner at once, on a few keys whose events are deleted
// as soon as they are enqueued (as DeleteOnDelivery would): no enqueue and
// no prune fails, and each stream's sequences run from 1 without a gap or
// a repeat. This is where a key may get an event between a prune's
// snapshot and its lock, which no test can force.
func TestPruneSequencesUnderLoad(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	type place struct{ stream, seq int64 }
	var mu sync.Mutex
	var places []place
	var producers, pruner sync.WaitGroup
	errs := make(chan error, 4)
	for p := range 3 {
		producers.Add(1)
		go func() {
			defer producers.Done()
			for i := range 150 {
				res, err := client.Enqueue(ctx, pool, orderedMsg(i, fmt.Sprintf("k%d", (i+p)%4), ""))
				if err != nil {
					errs <- fmt.Errorf("enqueue: %w", err)
					return
				}
				var at place
				if err := pool.QueryRow(ctx, "DELETE FROM modkit_outbox_events WHERE id = $1 RETURNING ordering_stream, ordering_seq",
					res.ID).Scan(&at.stream, &at.seq); err != nil {
					errs <- fmt.Errorf("delete: %w", err)
					return
				}
				mu.Lock()
				places = append(places, at)
				mu.Unlock()
			}
		}()
	}
	stop := make(chan struct{})
	var pruned int64
	pruner.Add(1)
	go func() {
		defer pruner.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, err := client.Admin().PruneSequences(ctx, 0)
			if err != nil {
				errs <- fmt.Errorf("prune: %w", err)
				return
			}
			pruned += n
		}
	}()
	producers.Wait()
	close(stop)
	pruner.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	byStream := map[int64][]int64{}
	for _, at := range places {
		byStream[at.stream] = append(byStream[at.stream], at.seq)
	}
	for stream, seqs := range byStream {
		slices.Sort(seqs)
		for i, seq := range seqs {
			if seq != int64(i+1) {
				t.Fatalf("stream %d has sequences %v; want 1 to %d", stream, seqs, len(seqs))
			}
		}
	}
	if pruned == 0 || len(byStream) <= 4 {
		t.Fatalf("%d rows pruned, %d streams: the keys never started again", pruned, len(byStream))
	}
	t.Logf("%d rows pruned; %d streams of 4 keys", pruned, len(byStream))
}

// The operator role may prune and count; the reader role may count only.
func TestPruneSequencesRoles(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueueKeys(t, client, pool, "a", "b")
	deleteEventsOf(t, pool, "a", "b")
	reader := clientOn(t, tdb.LoginAs(t, outboxpg.RoleReader), outbox.Config{})
	if n, err := reader.Admin().PrunableSequences(ctx); err != nil || n != 2 {
		t.Fatalf("reader counts: %d, %v; want 2", n, err)
	}
	var pgErr *pgconn.PgError
	if _, err := reader.Admin().PruneSequences(ctx, 0); !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Fatalf("reader prunes: %v; want SQLSTATE 42501", err)
	}
	operator := clientOn(t, tdb.LoginAs(t, outboxpg.RoleOperator), outbox.Config{})
	if n, err := operator.Admin().PruneSequences(ctx, 0); err != nil || n != 2 {
		t.Fatalf("operator prunes: %d, %v; want 2", n, err)
	}
}
