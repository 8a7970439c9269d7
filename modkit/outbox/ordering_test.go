package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// orderedLogDDL is the downstream of orderedPublisher: one row per publish
// call, timed by the database clock, so that the publishes of several
// processes can be compared.
const orderedLogDDL = `CREATE TABLE ordered_log (
	id          bigserial   PRIMARY KEY,
	event_id    uuid        NOT NULL,
	okey        text        NOT NULL,
	seq         bigint      NOT NULL,
	worker      text        NOT NULL,
	started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
	finished_at timestamptz,
	ok          boolean
)`

// orderedLogPool opens a pool for orderedPublisher on dsn with a
// connection for every publish in flight in one process (at most 40), so
// that recording a publish never waits for a connection (a publish that did
// would outlive its lease, which is not what the test is about).
func orderedLogPool(dsn string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 40
	return pgxpool.NewWithConfig(context.Background(), cfg)
}

// orderedPublisher records each publish in ordered_log (its start, then its
// end) and fails a tenth of them. pool comes from orderedLogPool.
func orderedPublisher(pool *pgxpool.Pool, worker string) func(context.Context, outbox.Delivery) error {
	return func(ctx context.Context, d outbox.Delivery) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		// The start and the end are recorded whatever the publish deadline,
		// so that an unfinished row means the process died inside the
		// publish, never that the deadline cut the recording short (an
		// INSERT cancelled by its context may still have committed).
		var id int64
		if err := pool.QueryRow(context.WithoutCancel(ctx), `INSERT INTO ordered_log (event_id, okey, seq, worker) VALUES ($1, $2, $3, $4) RETURNING id`,
			d.ID, d.OrderingKey, d.Sequence, worker).Scan(&id); err != nil {
			return err
		}
		ok := rand.IntN(10) != 0
		if _, err := pool.Exec(context.WithoutCancel(ctx), `UPDATE ordered_log SET finished_at = clock_timestamp(), ok = $2 WHERE id = $1`, id, ok); err != nil {
			return err
		}
		if !ok {
			return errors.New("downstream refused")
		}
		return nil
	}
}

// enqueueOneKey enqueues n events of ordering key "k", one transaction
// each, and returns their ids in order.
func enqueueOneKey(t *testing.T, c *outbox.Client, pool *pgxpool.Pool, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	for i := range ids {
		m := msg(i)
		m.OrderingKey = "k"
		res, err := c.Enqueue(ctx, pool, m)
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = res.ID
	}
	return ids
}

// failPermanently is a publisher that fails poison permanently and
// delivers the rest.
func failPermanently(poison uuid.UUID) func(context.Context, outbox.Delivery) error {
	return func(_ context.Context, d outbox.Delivery) error {
		if d.ID == poison {
			return outbox.Permanent(errors.New("poison"))
		}
		return nil
	}
}

// withoutRechecks is cfg with no wake window and a poll (and release of
// held events) longer than the test's guard: only an immediate wake-up
// claims what an outcome freed.
func withoutRechecks(cfg outbox.DispatcherConfig) outbox.DispatcherConfig {
	cfg.LeaseDuration, cfg.PollInterval, cfg.WakeWindow = 4*guard, guard+time.Second, time.Nanosecond
	return cfg
}

// enqueueKeyed enqueues perKey events for each of keys, interleaving the
// keys, and returns the ids by key in enqueue order.
func enqueueKeyed(t *testing.T, c *outbox.Client, pool *pgxpool.Pool, keys []string, perKey int) map[string][]uuid.UUID {
	t.Helper()
	out := map[string][]uuid.UUID{}
	for i := 0; i < perKey; i++ {
		msgs := make([]outbox.Message, len(keys))
		for j, k := range keys {
			msgs[j] = msg(i)
			msgs[j].OrderingKey = k
		}
		for start := 0; start < len(msgs); start += 500 {
			res, err := c.EnqueueBatch(ctx, pool, msgs[start:min(len(msgs), start+500)])
			if err != nil {
				t.Fatal(err)
			}
			for j, r := range res {
				k := keys[start+j]
				out[k] = append(out[k], r.ID)
			}
		}
	}
	return out
}

// Eight dispatchers (six here on their own pools, two in processes that are
// SIGKILLed mid-run), 1,000 keys of 50 events, a tenth of the publishes
// failing: per key, first successful deliveries come in strictly increasing
// sequence, no publish of a sequence (failed and repeated ones included)
// starts before the previous sequence first succeeded, no two publishes of
// one key overlap in time, nothing is lost.
func TestOrderedDeliveryAcrossDispatchersAndKills(t *testing.T) {
	const keys, perKey = 1000, 50
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	if _, err := pool.Exec(ctx, orderedLogDDL); err != nil {
		t.Fatal(err)
	}
	names := make([]string, keys)
	for i := range names {
		names[i] = fmt.Sprintf("account-%04d", i)
	}
	byKey := enqueueKeyed(t, client, pool, names, perKey)

	logPool, err := orderedLogPool(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(logPool.Close)
	children := []*childProc{startChild(t, tdb.DSN, childOrdered), startChild(t, tdb.DSN, childOrdered)}
	for i := range 6 {
		cfg := testConfig(newOutcomeLog())
		cfg.MaxAttempts, cfg.OnOutcome = 20, nil
		startDispatcher(t, clientOn(t, tdb.NewPool(t), outbox.Config{}), cfg,
			// Six publishes in flight each: the six share logPool's 40
			// connections.
			outbox.Publisher{Topic: testTopic, Concurrency: 6, Publish: orderedPublisher(logPool, fmt.Sprintf("local-%d", i))})
	}
	// Kill each child once it has started some publishes; note when, by the
	// database clock, it was certainly dead.
	killedAt := map[int]time.Time{}
	for _, c := range children {
		for started := 0; started < 200; {
			if c.next(t).what == "start" {
				started++
			}
		}
		pid := c.cmd.Process.Pid
		c.kill(t)
		var now time.Time
		if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&now); err != nil {
			t.Fatal(err)
		}
		killedAt[pid] = now
	}
	eventuallyWithin(t, 8*time.Minute, "every event delivered", func() bool { return countRows(t, pool, "status = 'delivered'") == keys*perKey })

	// First successes in sequence order, per key.
	rows, err := pool.Query(ctx, `SELECT okey, seq FROM (
		SELECT DISTINCT ON (event_id) okey, seq, finished_at FROM ordered_log WHERE ok ORDER BY event_id, finished_at) f
		ORDER BY okey, finished_at`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close() // a failure inside the loop must not leave the pool's Close waiting
	last := map[string]int64{}
	var firsts int
	for rows.Next() {
		var k string
		var seq int64
		if err := rows.Scan(&k, &seq); err != nil {
			t.Fatal(err)
		}
		firsts++
		if seq != last[k]+1 {
			t.Errorf("key %s: first success of sequence %d after %d", k, seq, last[k])
		}
		last[k] = seq
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if firsts != keys*perKey {
		t.Fatalf("%d events succeeded at least once, want %d", firsts, keys*perKey)
	}
	for k, ids := range byKey {
		if last[k] != int64(len(ids)) {
			t.Errorf("key %s: last sequence delivered %d, want %d", k, last[k], len(ids))
		}
	}

	// Every publish, failed and repeated ones included, in start order per
	// key: none overlaps the one before it (a killed process's unfinished
	// publish ends at its death), and none starts before the previous
	// sequence's first success ended. (A sequence may be published again
	// after a later one: a process killed in the middle of a run of the
	// key's events, published one after another under one claim before
	// their outcomes were recorded, leaves the whole run to be delivered
	// again, in order, from its first event.)
	type span struct {
		worker     string
		seq        int64
		ok         bool
		start, end time.Time
	}
	spans := map[string][]span{}
	rows, err = pool.Query(ctx, `SELECT okey, worker, seq, coalesce(ok, false), started_at, finished_at FROM ordered_log
		ORDER BY okey, started_at, id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	unfinished := 0
	for rows.Next() {
		var k, w string
		var s span
		var end *time.Time
		if err := rows.Scan(&k, &w, &s.seq, &s.ok, &s.start, &end); err != nil {
			t.Fatal(err)
		}
		s.worker = w
		if end != nil {
			s.end = *end
		} else {
			var pid int
			if _, err := fmt.Sscanf(w, "child-%d", &pid); err != nil || killedAt[pid].IsZero() {
				t.Fatalf("publish by %s of key %s never finished, and %s was not killed", w, k, w)
			}
			s.end = killedAt[pid]
			unfinished++
		}
		spans[k] = append(spans[k], s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for k, ss := range spans {
		succeeded := map[int64]time.Time{} // the end of each sequence's first success
		for i, sp := range ss {
			if i > 0 && sp.start.Before(ss[i-1].end) {
				t.Errorf("key %s: a publish by %s started at %v, before the one by %s ended at %v",
					k, sp.worker, sp.start, ss[i-1].worker, ss[i-1].end)
			}
			if prev, ok := succeeded[sp.seq-1]; sp.seq > 1 && (!ok || sp.start.Before(prev)) {
				t.Errorf("key %s: a publish of sequence %d by %s started at %v, before sequence %d had succeeded",
					k, sp.seq, sp.worker, sp.start, sp.seq-1)
			}
			if _, ok := succeeded[sp.seq]; sp.ok && !ok {
				succeeded[sp.seq] = sp.end
			}
		}
	}
	checkLedger(t, pool)
	t.Logf("%d keys x %d events; %d publishes cut short by the kills", keys, perKey, unfinished)
}

// orderedMsg is test event i with ordering key key and, unless dedupe is
// empty, that dedupe key.
func orderedMsg(i int, key, dedupe string) outbox.Message {
	m := msg(i)
	m.OrderingKey = key
	if dedupe != "" {
		m.DedupeKey = outbox.Key(dedupe)
	}
	return m
}

// Sequences are allocated in the producer's transaction: gap-free, in
// commit order (producers of one key wait for each other), none for a
// rolled-back transaction or a duplicate; producers of other keys never
// wait.
func TestOrderingKeySequences(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	keyed := orderedMsg
	// A holds key k's sequence in an open transaction: a producer of
	// another key goes on at once; one of k waits until A ends.
	txA, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Enqueue(ctx, txA, keyed(1, "k", "")); err != nil {
		t.Fatal(err)
	}
	otherCtx, cancel := context.WithTimeout(ctx, guard)
	defer cancel()
	if _, err := client.Enqueue(otherCtx, pool, keyed(2, "other", "")); err != nil {
		t.Fatalf("a producer of another key: %v (it must not wait for k's transaction)", err)
	}
	waited := make(chan error, 1)
	go func() {
		_, err := client.Enqueue(ctx, pool, keyed(3, "k", ""))
		waited <- err
	}()
	eventually(t, "the second producer of k waiting on the first", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND datname = current_database() AND query LIKE '%modkit_outbox_enqueue(%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	// A rolls back: its sequence is not taken, the waiting one gets 1.
	if err := txA.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := recv(t, "the waiting producer", waited); err != nil {
		t.Fatal(err)
	}
	// A duplicate takes no sequence; a batch numbers its events in order.
	if _, err := client.Enqueue(ctx, pool, keyed(4, "k", "dup")); err != nil {
		t.Fatal(err)
	}
	if res, err := client.Enqueue(ctx, pool, keyed(5, "k", "dup")); err != nil || !res.AlreadyEnqueued {
		t.Fatalf("duplicate: %+v %v", res, err)
	}
	batch, err := client.EnqueueBatch(ctx, pool, []outbox.Message{keyed(6, "k", ""), keyed(7, "j", ""), keyed(8, "k", "dup"), keyed(9, "k", "")})
	if err != nil || !batch[2].AlreadyEnqueued {
		t.Fatalf("batch: %+v %v", batch, err)
	}
	seqOf := func(id uuid.UUID) (string, int64) {
		e := get(t, client, id)
		return e.OrderingKey, e.Sequence
	}
	for i, want := range []int64{3, 1, 0, 4} { // k: 1 (the waiter), 2 (dup), then 3 and 4 from the batch; j: 1
		if i == 2 {
			continue
		}
		if _, seq := seqOf(batch[i].ID); seq != want {
			t.Fatalf("batch event %d: sequence %d, want %d", i, seq, want)
		}
	}

	// Concurrent producers of one key with random rollbacks: the committed
	// sequences are exactly 1..n.
	var wg sync.WaitGroup
	var mu sync.Mutex
	committed := 0
	for p := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 25 {
				tx, err := pool.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				if _, err := client.Enqueue(ctx, tx, keyed(p*100+i, "hot", "")); err != nil {
					t.Error(err)
					_ = tx.Rollback(ctx)
					return
				}
				if rand.IntN(3) == 0 {
					_ = tx.Rollback(ctx)
					continue
				}
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				committed++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	rows, err := pool.Query(ctx, `SELECT ordering_seq FROM modkit_outbox_events WHERE ordering_key = 'hot' ORDER BY ordering_seq`)
	if err != nil {
		t.Fatal(err)
	}
	seqs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if len(seqs) != committed {
		t.Fatalf("%d sequences for %d commits", len(seqs), committed)
	}
	for i, s := range seqs {
		if s != int64(i+1) {
			t.Fatalf("sequences of the hot key are not 1..%d: %v", committed, seqs)
		}
	}
}

// The database holds writers that bypass the library to one event per key
// and sequence (migration 0008): an event carries its own key's stream id,
// and a stream's sequences are unique.
// A batch takes each ordering key's sequences with one write of the key's
// row, however many of its events it holds: one write an event left a
// version of the row that each later write and each event's foreign-key
// check walked, so a batch of n events of one key cost O(n²) (8,000 took
// 4.7 s, 50,000 did not finish in 40 s). Counted, in the transaction, by
// the server's own statistics. The batch's numbering is unchanged: each
// key's events in batch order from the key's next sequence, a duplicate
// taking none, every event after a key's first held behind the one before.
func TestBatchWritesEachKeysSequenceOnce(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ordered := orderedMsg
	// Key a has events already (sequences 1 and 2, the second a dedupe key
	// the batch repeats); key b is new.
	for i, dedupe := range []string{"", "taken"} {
		if _, err := client.Enqueue(ctx, pool, ordered(i, "a", dedupe)); err != nil {
			t.Fatal(err)
		}
	}
	var msgs []outbox.Message
	for i := range 300 {
		switch {
		case i%50 == 7:
			msgs = append(msgs, ordered(1000+i, "a", "taken")) // a duplicate of a's second event
		case i%3 == 0:
			msgs = append(msgs, ordered(1000+i, "b", ""))
		case i%3 == 1:
			msgs = append(msgs, ordered(1000+i, "a", ""))
		default:
			msgs = append(msgs, msg(1000+i)) // no key
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// The counts the session has not reported yet, which include its
	// earlier transactions' (a session reports them when idle outside a
	// transaction, at most once a second): the batch's are the difference.
	writes := func() (updates, inserts int64) {
		t.Helper()
		if err := tx.QueryRow(ctx, `SELECT n_tup_upd, n_tup_ins FROM pg_stat_xact_user_tables
			WHERE relid = 'modkit_outbox_sequences'::regclass`).Scan(&updates, &inserts); err != nil {
			t.Fatal(err)
		}
		return updates, inserts
	}
	updates0, inserts0 := writes()
	res, err := client.EnqueueBatch(ctx, tx, msgs)
	if err != nil {
		t.Fatal(err)
	}
	updates, inserts := writes()
	updates, inserts = updates-updates0, inserts-inserts0
	if updates > 2 || inserts > 1 {
		t.Errorf("the batch wrote the sequences' rows %d times and inserted %d; want at most one write of each key's row (2) and one insert (b's)",
			updates, inserts)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	next := map[string]int64{"a": 3, "b": 1}
	for i, m := range msgs {
		e := get(t, client, res[i].ID)
		switch {
		case m.OrderingKey == "":
			if e.OrderingKey != "" || e.Sequence != 0 {
				t.Fatalf("batch event %d, without a key: key %q, sequence %d", i, e.OrderingKey, e.Sequence)
			}
		case m.DedupeKey != nil:
			if !res[i].AlreadyEnqueued || e.Sequence != 2 {
				t.Fatalf("batch event %d, a duplicate: %+v, sequence %d; want a's second event", i, res[i], e.Sequence)
			}
		default:
			if e.OrderingKey != m.OrderingKey || e.Sequence != next[m.OrderingKey] {
				t.Fatalf("batch event %d: key %q sequence %d, want %q %d", i, e.OrderingKey, e.Sequence, m.OrderingKey, next[m.OrderingKey])
			}
			next[m.OrderingKey]++
		}
	}
	var held, heldWant int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE held), count(*) FILTER (WHERE ordering_seq > 1)
		FROM modkit_outbox_events WHERE ordering_key IS NOT NULL`).Scan(&held, &heldWant); err != nil {
		t.Fatal(err)
	}
	if held != heldWant {
		t.Errorf("%d events held, want %d (every event after its key's first, none delivered)", held, heldWant)
	}
	var lastA, lastB int64
	if err := pool.QueryRow(ctx, `SELECT max(last_seq) FILTER (WHERE ordering_key = 'a'), max(last_seq) FILTER (WHERE ordering_key = 'b')
		FROM modkit_outbox_sequences`).Scan(&lastA, &lastB); err != nil {
		t.Fatal(err)
	}
	if lastA != next["a"]-1 || lastB != next["b"]-1 {
		t.Errorf("the keys' last sequences: a %d, b %d; want %d and %d", lastA, lastB, next["a"]-1, next["b"]-1)
	}
}

// A batch with ordering keys and no dedupe key inserts its events in one
// statement (migration 0036): each key's events are numbered in batch order
// from the key's last sequence, the key's row written once, and a key's
// first event of the batch is held only while the event before it is
// undelivered; the rest are held behind the batch's own.
func TestBatchWithoutDedupeKeysNumbersEachKeysEvents(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	// Key a has a pending event (sequence 1); key b is new.
	if _, err := client.Enqueue(ctx, pool, orderedMsg(0, "a", "")); err != nil {
		t.Fatal(err)
	}
	var msgs []outbox.Message
	for i := range 90 {
		switch i % 3 {
		case 0:
			msgs = append(msgs, orderedMsg(100+i, "a", ""))
		case 1:
			msgs = append(msgs, orderedMsg(100+i, "b", ""))
		default:
			msgs = append(msgs, msg(100+i))
		}
	}
	res, err := client.EnqueueBatch(ctx, pool, msgs)
	if err != nil {
		t.Fatal(err)
	}
	next := map[string]int64{"a": 2, "b": 1}
	for i, m := range msgs {
		e := get(t, client, res[i].ID)
		if res[i].AlreadyEnqueued || e.OrderingKey != m.OrderingKey {
			t.Fatalf("batch event %d: %+v, key %q; want a new event of key %q", i, res[i], e.OrderingKey, m.OrderingKey)
		}
		if m.OrderingKey == "" {
			if e.Sequence != 0 {
				t.Fatalf("batch event %d, without a key: sequence %d", i, e.Sequence)
			}
			continue
		}
		if e.Sequence != next[m.OrderingKey] {
			t.Fatalf("batch event %d: key %q sequence %d, want %d", i, m.OrderingKey, e.Sequence, next[m.OrderingKey])
		}
		next[m.OrderingKey]++
	}
	var heldA, heldB, lastA, lastB int64
	if err := pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM modkit_outbox_events WHERE ordering_key = 'a' AND held),
			(SELECT count(*) FROM modkit_outbox_events WHERE ordering_key = 'b' AND held),
			(SELECT last_seq FROM modkit_outbox_sequences WHERE ordering_key = 'a'),
			(SELECT last_seq FROM modkit_outbox_sequences WHERE ordering_key = 'b')`).Scan(&heldA, &heldB, &lastA, &lastB); err != nil {
		t.Fatal(err)
	}
	// a: 31 events, every one after the pending first held; b: 30, the
	// first free.
	if heldA != 30 || heldB != 29 || lastA != 31 || lastB != 30 {
		t.Fatalf("held a %d, b %d; last sequences a %d, b %d; want 30, 29, 31, 30", heldA, heldB, lastA, lastB)
	}
}

func TestDatabaseHoldsOneEventPerKeyAndSequence(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	for i, key := range []string{"a", "a", "b"} {
		m := msg(i)
		m.OrderingKey = key
		if _, err := client.Enqueue(ctx, pool, m); err != nil {
			t.Fatal(err)
		}
	}
	stream := func(key string) int64 {
		var id int64
		if err := pool.QueryRow(ctx, `SELECT stream_id FROM modkit_outbox_sequences WHERE ordering_key = $1`, key).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	a, b := stream("a"), stream("b")
	if a == b {
		t.Fatalf("keys a and b share stream %d", a)
	}
	insert := `INSERT INTO modkit_outbox_events (id, namespace, topic, payload, ordering_key, ordering_seq, ordering_stream)
		SELECT gen_random_uuid(), namespace, topic, '{}', $1, $2, $3 FROM modkit_outbox_events LIMIT 1`
	for _, c := range []struct {
		name string
		args []any
		code string
	}{
		{"a sequence key a has", []any{"a", 2, a}, "23505"},
		{"key b's stream for key a", []any{"a", 3, b}, "23503"},
		{"a stream no key has", []any{"a", 3, a + b + 100}, "23503"},
		{"a key without a stream", []any{"a", 3, nil}, "23514"},
		{"a stream without a key", []any{nil, nil, a}, "23514"},
	} {
		_, err := pool.Exec(ctx, insert, c.args...)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != c.code {
			t.Errorf("%s: %v, want SQLSTATE %s", c.name, err, c.code)
		}
	}
	// An event moved to another key would leave its stream behind.
	_, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET ordering_key = 'b' WHERE ordering_key = 'a' AND ordering_seq = 1`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23503" {
		t.Errorf("moving an event to another key: %v, want SQLSTATE 23503", err)
	}
	if _, err := pool.Exec(ctx, insert, "a", 3, a); err != nil {
		t.Fatalf("the next sequence of key a, on its own stream: %v", err)
	}
}

// A dead head blocks its key and only its key; BlockedKeys lists it;
// SkipHead lets the rest go on and is recorded; a replayed head is
// delivered before the events behind it; a publisher may skip dead heads.
func TestDeadHeadBlocksItsKey(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	keyed := func(i int, key string) outbox.Message {
		m := msg(i)
		m.OrderingKey = key
		return m
	}
	var poison sync.Map // event ids that fail permanently
	var mu sync.Mutex
	delivered := map[string][]int64{}
	publish := func(_ context.Context, d outbox.Delivery) error {
		if _, bad := poison.Load(d.ID); bad {
			return outbox.Permanent(errors.New("rail rejected the instruction"))
		}
		mu.Lock()
		delivered[d.OrderingKey] = append(delivered[d.OrderingKey], d.Sequence)
		mu.Unlock()
		return nil
	}
	var ids = map[string][]uuid.UUID{}
	for i := range 3 {
		for _, k := range []string{"a", "b", "c"} {
			res, err := client.Enqueue(ctx, pool, keyed(i, k))
			if err != nil {
				t.Fatal(err)
			}
			ids[k] = append(ids[k], res.ID)
		}
	}
	poison.Store(ids["a"][0], true)
	poison.Store(ids["c"][0], true)
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: publish})
	log.waitFor(t, "b delivered and the heads of a and c dead", func(m map[uuid.UUID][]outbox.Outcome) bool {
		return finalCount(outbox.StatusDelivered, 3)(m) && finalCount(outbox.StatusDead, 2)(m)
	})
	blocked, err := client.Admin().BlockedKeys(ctx, 0)
	if err != nil || len(blocked) != 2 || blocked[0].Waiting != 2 || blocked[0].HeadSequence != 1 {
		t.Fatalf("blocked keys: %+v %v", blocked, err)
	}
	if e := get(t, client, ids["a"][1]); e.Status != outbox.StatusPending || e.Attempts != 0 {
		t.Fatalf("the event behind a's dead head ran: %+v", e)
	}
	// Skip a's head: a goes on without it. Replay c's head: c goes on
	// with it, in order.
	if err := client.Admin().SkipHead(ctx, "alice", ids["a"][0]); err != nil {
		t.Fatal(err)
	}
	if err := client.Admin().SkipHead(ctx, "alice", ids["b"][0]); !errors.Is(err, outbox.ErrNotFound) || !strings.Contains(err.Error(), "is delivered, not dead") {
		t.Fatalf("skipping a delivered event: %v, want ErrNotFound saying it is delivered", err)
	}
	if err := client.Admin().SkipHead(ctx, "alice", uuid.New()); !errors.Is(err, outbox.ErrNotFound) || !strings.Contains(err.Error(), "no event has id") {
		t.Fatalf("skipping an unknown id: %v, want ErrNotFound saying no event has it", err)
	}
	if err := client.Admin().SkipHead(ctx, "alice", ids["a"][0]); !errors.Is(err, outbox.ErrNotFound) || !strings.Contains(err.Error(), "skipped already") {
		t.Fatalf("skipping a skipped head again: %v, want ErrNotFound", err)
	}
	poison.Delete(ids["c"][0])
	if _, err := client.Admin().ReplayDead(ctx, "bob", outbox.EventFilter{}, ids["c"][0]); err != nil {
		t.Fatal(err)
	}
	log.waitFor(t, "a's and c's remaining events delivered", finalCount(outbox.StatusDelivered, 3+2+3))
	mu.Lock()
	got := map[string][]int64{"a": delivered["a"], "b": delivered["b"], "c": delivered["c"]}
	mu.Unlock()
	if !slices.Equal(got["a"], []int64{2, 3}) || !slices.Equal(got["b"], []int64{1, 2, 3}) || !slices.Equal(got["c"], []int64{1, 2, 3}) {
		t.Fatalf("deliveries by key: %v", got)
	}
	h, err := client.Admin().History(ctx, ids["a"][0])
	if err != nil || len(h) != 2 || h[1].Outcome != "skipped" || h[1].Detail == "" {
		t.Fatalf("history of the skipped head: %+v %v", h, err)
	}
	if blocked, _ := client.Admin().BlockedKeys(ctx, 0); len(blocked) != 0 {
		t.Fatalf("still blocked: %+v", blocked)
	}
}

// twoDeadOfThree enqueues three events of one key and makes the first two
// dead, as a chain whose leases all expired on their last attempt leaves
// them after the sweep; the third waits, held.
func twoDeadOfThree(t *testing.T) (*outbox.Client, *pgxpool.Pool, []uuid.UUID) {
	t.Helper()
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueOneKey(t, client, pool, 3)
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET status = 'dead', held = false, last_error = 'poison'
		WHERE id = ANY($1)`, ids[:2]); err != nil {
		t.Fatal(err)
	}
	return client, pool, ids
}

// Of a key's dead events only the head (the one whose predecessor no
// longer holds it back) is a blocked key's head, and only it may be
// skipped. Skipping the second of two dead events let the third be
// published while the first was dead and not skipped: the claim waits for
// the event just before only.
func TestSkipHeadOnlyTheKeysHead(t *testing.T) {
	client, _, ids := twoDeadOfThree(t)
	admin := client.Admin()
	heads := func(want uuid.UUID) {
		t.Helper()
		blocked, err := admin.BlockedKeys(ctx, 0)
		switch {
		case err != nil:
			t.Fatal(err)
		case want == uuid.Nil && len(blocked) != 0, want != uuid.Nil && (len(blocked) != 1 || blocked[0].Head != want):
			t.Fatalf("blocked keys %+v; want the head %v only", blocked, want)
		}
	}
	heads(ids[0])
	if err := admin.SkipHead(ctx, "alice", ids[1]); !errors.Is(err, outbox.ErrNotFound) || !strings.Contains(err.Error(), "must be skipped first") {
		t.Fatalf("skipping the dead event behind the key's dead head: %v, want ErrNotFound", err)
	}
	if h, err := admin.History(ctx, ids[1]); err != nil || len(h) != 0 {
		t.Fatalf("a refused skip wrote history: %+v %v", h, err)
	}
	log := newOutcomeLog()
	var mu sync.Mutex
	var published []int64
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(_ context.Context, d outbox.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		published = append(published, d.Sequence)
		return nil
	}})
	// Skipped in order, each head in turn: the key goes on.
	if err := admin.SkipHead(ctx, "alice", ids[0]); err != nil {
		t.Fatal(err)
	}
	heads(ids[1])
	if err := admin.SkipHead(ctx, "alice", ids[1]); err != nil {
		t.Fatal(err)
	}
	heads(uuid.Nil)
	log.waitFor(t, "the third event delivered", finalCount(outbox.StatusDelivered, 1))
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(published, []int64{3}) {
		t.Fatalf("published sequences %v; want [3]", published)
	}
}

// A purge of dead events never lets a key's later events overtake a dead
// event that stays: of two dead events of a key, the second alone is not
// purged; both together are, and the event after them is let into the
// claim by the purge itself.
func TestPurgeDeadKeepsTheKeysOrder(t *testing.T) {
	client, pool, ids := twoDeadOfThree(t)
	admin := client.Admin()
	if got, err := admin.PurgeDead(ctx, "alice", outbox.EventFilter{}, ids[1]); err != nil || len(got) != 0 {
		t.Fatalf("purge of the dead event behind the key's dead head: purged %v, %v; want none", got, err)
	}
	if got, err := admin.PurgeDead(ctx, "alice", outbox.EventFilter{}, ids[1], ids[0]); err != nil ||
		!slices.Equal(sortedIDs(got), sortedIDs(ids[:2])) {
		t.Fatalf("purge of both dead events: purged %v, %v; want both", got, err)
	}
	var held bool
	if err := pool.QueryRow(ctx, `SELECT held FROM modkit_outbox_events WHERE id = $1`, ids[2]).Scan(&held); err != nil || held {
		t.Fatalf("after the purge the third event is held: %v, %v", held, err)
	}
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	log.waitFor(t, "the third event delivered", finalCount(outbox.StatusDelivered, 1))
}

// A purge of a key's long run of dead events deletes the whole run in one
// call, in one statement (it went one event a round, each round reading
// every id left, at most 1,000 rounds: seconds to minutes for runs of
// thousands, and the first 1,000 only); the event after the run may be
// claimed at once. A dead event behind a pending one of its key is left.
// (The events are all of key "k": the run, its next event, pending, then
// one more pending and two dead behind it.)
func TestPurgeDeadOfALongRun(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	const run = 1500
	batch := make([]outbox.Message, run+1)
	for i := range batch {
		batch[i] = msg(i)
		batch[i].OrderingKey = "k"
	}
	res, err := client.EnqueueBatch(ctx, pool, batch)
	if err != nil {
		t.Fatal(err)
	}
	enqueueOneKey(t, client, pool, 3) // after the run's next event: one pending, then two dead
	var behind []uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT array_agg(id ORDER BY ordering_seq) FROM modkit_outbox_events
		WHERE ordering_key = 'k' AND ordering_seq > $1`, run+1).Scan(&behind); err != nil {
		t.Fatal(err)
	}
	dead := make([]uuid.UUID, 0, run+2)
	for _, r := range res[:run] {
		dead = append(dead, r.ID)
	}
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET status = 'dead', held = false, last_error = 'poison'
		WHERE id = ANY($1)`, append(slices.Clone(dead), behind[1:]...)); err != nil {
		t.Fatal(err)
	}
	got, err := client.Admin().PurgeDead(ctx, "alice", outbox.EventFilter{Status: outbox.StatusDead})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(sortedIDs(got), sortedIDs(dead)) {
		t.Fatalf("purged %d events; want the run's %d, and none of the dead events behind a pending one", len(got), len(dead))
	}
	var held bool
	if err := pool.QueryRow(ctx, `SELECT held FROM modkit_outbox_events WHERE id = $1`, res[run].ID).Scan(&held); err != nil || held {
		t.Fatalf("the event after the purged run is held (%v): it waits for the poll", err)
	}
	for _, id := range behind[1:] {
		if e := get(t, client, id); e.Status != outbox.StatusDead {
			t.Fatalf("a dead event behind a pending one of its key is %s after the purge; want dead, left", e.Status)
		}
	}
}

// A purge that waits for a replay of an event in the middle of the run it
// purges sees the replay: the events behind the replayed one stay, and the
// key's next event stays held. Read from the snapshot it began with, the
// purge deleted them and freed the next event to overtake the replayed one.
func TestPurgeDeadSeesAReplayItWaitedFor(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueOneKey(t, client, pool, 4)
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET status = 'dead', held = false, last_error = 'poison'
		WHERE id = ANY($1)`, ids[:3]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET held = true WHERE id = $1`, ids[3]); err != nil {
		t.Fatal(err)
	}
	replay, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = replay.Rollback(ctx) }()
	if _, err := replay.Exec(ctx, `SELECT * FROM modkit_outbox_replay($1, 'alice')`, []uuid.UUID{ids[1]}); err != nil {
		t.Fatal(err)
	}
	purged := make(chan []uuid.UUID, 1)
	failed := make(chan error, 1)
	go func() {
		got, err := client.Admin().PurgeDead(ctx, "bob", outbox.EventFilter{}, ids[:3]...)
		if err != nil {
			failed <- err
			return
		}
		purged <- got
	}()
	eventually(t, "the purge waiting for the replay's lock", func() bool {
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%purge_dead%')`).Scan(&waiting)
		return err == nil && waiting
	})
	if err := replay.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-purged:
		if !slices.Equal(got, ids[:1]) {
			t.Fatalf("purged %v; want the head %v only: the others are behind the replayed event", got, ids[0])
		}
	case err := <-failed:
		t.Fatal(err)
	case <-time.After(guard):
		t.Fatal("the purge did not return")
	}
	var held bool
	if err := pool.QueryRow(ctx, `SELECT held FROM modkit_outbox_events WHERE id = $1`, ids[3]).Scan(&held); err != nil || !held {
		t.Fatalf("the key's next event was freed to overtake the replayed one (held %v, %v)", held, err)
	}
}

// A purge checks each event's own predecessor: behind a skipped dead event
// that must stay (a pending event holds it back), the next dead event goes.
// The set-based purge first judged a run by its first event only and kept
// them all.
func TestPurgeDeadBehindASkippedEventThatStays(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueOneKey(t, client, pool, 3)
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET head_skipped = true, held = false WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET status = 'dead', held = false, last_error = 'poison',
		head_skipped = (id = $2) WHERE id = ANY($1)`, ids[1:], ids[1]); err != nil {
		t.Fatal(err)
	}
	got, err := client.Admin().PurgeDead(ctx, "alice", outbox.EventFilter{}, ids[1:]...)
	if err != nil || !slices.Equal(got, ids[2:]) {
		t.Fatalf("purged %v, %v; want the third event only (the second, skipped, is behind a pending one)", got, err)
	}
}

// A head skipped with SkipHead stays skipped when it is replayed: dead
// again, it does not block its key once more (BlockedKeys listed it,
// though the key's later events went on).
func TestReplayedSkippedHeadStaysSkipped(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	admin := client.Admin()
	ids := enqueueOneKey(t, client, pool, 2)
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: failPermanently(ids[0])})
	log.waitFor(t, "the head dead", finalCount(outbox.StatusDead, 1))
	if err := admin.SkipHead(ctx, "alice", ids[0]); err != nil {
		t.Fatalf("skip the head: %v", err)
	}
	log.waitFor(t, "the second delivered", finalCount(outbox.StatusDelivered, 1))
	if got, err := admin.ReplayDead(ctx, "bob", outbox.EventFilter{}, ids[0]); err != nil || len(got) != 1 {
		t.Fatalf("replay the skipped head: %v, %v", got, err)
	}
	log.waitFor(t, "the replayed head dead again", func(m map[uuid.UUID][]outbox.Outcome) bool { return len(m[ids[0]]) == 2 })
	if blocked, err := admin.BlockedKeys(ctx, 0); err != nil || len(blocked) != 0 {
		t.Fatalf("blocked keys after the skipped head died again: %+v, %v; want none", blocked, err)
	}
	m := msg(3)
	m.OrderingKey = "k"
	if _, err := client.Enqueue(ctx, pool, m); err != nil {
		t.Fatal(err)
	}
	log.waitFor(t, "a later event of the key delivered", finalCount(outbox.StatusDelivered, 2))
}

// sortedIDs returns ids sorted.
func sortedIDs(ids []uuid.UUID) []uuid.UUID {
	out := slices.Clone(ids)
	slices.SortFunc(out, func(a, b uuid.UUID) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// A chain's links are not buried for attempts its claims charged them:
// three claims of a chain whose leases all ended (a dispatcher that died
// publishing the head, three times) used up the links' attempts too, and
// the sweep dead-lettered events that were never tried. The claims that
// take a chain over from an expired lease charge its head only, and the
// sweep gives the links the attempt of the last lease back: the head dies,
// the links wait behind it with no attempt counted.
func TestSweepSparesLinksBehindTheirHead(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueOneKey(t, client, pool, 4)
	start := time.Now().Add(time.Minute)
	for i := range 3 {
		rows, err := pool.Query(ctx, `SELECT id FROM modkit_outbox_claim_chained(gen_random_uuid(), ARRAY['test:events'], 10, 3,
			interval '5 seconds', NULL, ARRAY[4], $1)`, start.Add(time.Duration(i)*10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for rows.Next() {
			n++
		}
		if rows.Close(); rows.Err() != nil || n != 4 {
			t.Fatalf("claim %d leased %d events of the chain (%v); want 4", i+1, n, rows.Err())
		}
	}
	if _, err := pool.Exec(ctx, `SELECT * FROM modkit_outbox_sweep(ARRAY['test:events'], 3, 100, $1)`, start.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if e := get(t, client, ids[0]); e.Status != outbox.StatusDead {
		t.Fatalf("the head, out of attempts, is %s; want dead", e.Status)
	}
	for i, id := range ids[1:] {
		if e := get(t, client, id); e.Status != outbox.StatusPending || e.Attempts != 0 {
			t.Fatalf("link %d, never published: %s with %d attempts; want pending with none counted", i+2, e.Status, e.Attempts)
		}
	}
	h, err := client.Admin().History(ctx, ids[1])
	if err != nil || len(h) == 0 || !strings.Contains(h[len(h)-1].Detail, "its attempt is not counted") {
		t.Fatalf("the link's history does not say its attempt is not counted: %+v, %v", h, err)
	}
}

// With SkipDeadHeads, a dead event does not hold its key back.
func TestSkipDeadHeadsPolicy(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	var first uuid.UUID
	for i := range 3 {
		m := msg(i)
		m.OrderingKey = "k"
		res, err := client.Enqueue(ctx, pool, m)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = res.ID
		}
	}
	var mu sync.Mutex
	var seqs []int64
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, SkipDeadHeads: true,
		Publish: func(_ context.Context, d outbox.Delivery) error {
			if d.ID == first {
				return outbox.Permanent(errors.New("poison"))
			}
			mu.Lock()
			seqs = append(seqs, d.Sequence)
			mu.Unlock()
			return nil
		}})
	log.waitFor(t, "the rest of the key delivered", finalCount(outbox.StatusDelivered, 2))
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seqs, []int64{2, 3}) {
		t.Fatalf("delivered sequences %v, want [2 3]", seqs)
	}
}

// Events held behind a dead head of a SkipDeadHeads topic go on while the
// dispatcher is busy with other events. The dead outcome does not free the
// held successor; the dispatcher's release of held events does, once per
// PollInterval. It ran only when the poll timer fired, which every claim
// that was not full pushed back: under steady traffic (here an unrelated
// event every 10 ms, five claims a PollInterval), never.
func TestHeldEventsGoOnUnderSteadyTraffic(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	poison := make(chan uuid.UUID, 1)
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.PollInterval = 50 * time.Millisecond
	startDispatcher(t, client, cfg, outbox.Publisher{Topic: testTopic, SkipDeadHeads: true,
		Publish: func(_ context.Context, d outbox.Delivery) error {
			select {
			case id := <-poison:
				if d.ID != id {
					poison <- id
					break
				}
				return outbox.Permanent(errors.New("poison"))
			default:
			}
			return nil
		}})
	// Steady traffic, until the test ends.
	trafficCtx, stopTraffic := context.WithCancel(ctx)
	trafficDone := make(chan struct{})
	t.Cleanup(func() { stopTraffic(); <-trafficDone })
	go func() {
		defer close(trafficDone)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-trafficCtx.Done():
				return
			case <-tick.C:
			}
			if _, err := client.Enqueue(trafficCtx, pool, msg(1000+i)); err != nil && trafficCtx.Err() == nil {
				t.Errorf("traffic: %v", err)
				return
			}
		}
	}()
	log.waitFor(t, "the traffic flowing", finalCount(outbox.StatusDelivered, 1))

	// The key's head and two successors in one transaction: the successors
	// are held behind the head from the start.
	msgs := []outbox.Message{msg(0), msg(1), msg(2)}
	for i := range msgs {
		msgs[i].OrderingKey = "k"
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
	var ids []uuid.UUID
	for _, m := range msgs {
		res, err := client.Enqueue(ctx, tx, m)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, res.ID)
	}
	poison <- ids[0]
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	log.waitFor(t, "the key's successors delivered past its dead head", allEnded(outbox.StatusDelivered, ids[1:]))
}

// On a SkipDeadHeads topic the events behind a head that dies go on at
// once: the dispatcher releases them when it records the dead outcome,
// rather than at its next release (here a PollInterval longer than the
// test's guard).
func TestSkipDeadHeadsGoesOnAtOnce(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	ids := enqueueOneKey(t, client, tdb.Provider.Pool, 3)
	log := newOutcomeLog()
	startDispatcher(t, client, withoutRechecks(testConfig(log)),
		outbox.Publisher{Topic: testTopic, SkipDeadHeads: true, Publish: failPermanently(ids[0])})
	log.waitFor(t, "the key's successors delivered past its dead head", finalCount(outbox.StatusDelivered, 2))
}

// Events that the maintenance pass frees (the dead head of a SkipDeadHeads
// topic, settled by another dispatcher) are claimed at once, not at the
// poll (here longer than the test's guard). The pass woke nobody, so when
// it freed a key's successors before the completer's own release after a
// dead head (which wakes the claimer) could, they waited for the poll: a
// flake of TestSkipDeadHeadsGoesOnAtOnce.
func TestMaintenanceReleaseIsClaimedAtOnce(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	enqueueOneKey(t, client, pool, 3)
	st := admStore(t, pool, "public", nil)
	head := admClaim(t, st, 1) // leased elsewhere: the dispatcher claims nothing of the key
	log := newOutcomeLog()
	cfg := withoutRechecks(testConfig(log))
	cfg.SweepInterval = 50 * time.Millisecond
	_, pass := startMaintained(t, client, cfg, outbox.Publisher{Topic: testTopic, SkipDeadHeads: true,
		Publish: func(context.Context, outbox.Delivery) error { return nil }})
	// Past the claimer's one release after its start (it claimed no
	// ordered event, so it makes no other), which would otherwise free
	// the successors itself.
	pass.waitPasses(t, 2)
	admSettle(t, st, driver.Dead, "dead elsewhere", head...)
	log.waitFor(t, "the key's successors delivered past its dead head", finalCount(outbox.StatusDelivered, 2))
}

// An event left held behind a settled predecessor by an earlier process
// (its enqueue committed while the predecessor's delivery did, so the
// delivery could not free it) is released by a dispatcher that starts
// afterwards, even though that dispatcher claims no other ordered event.
// The release ran only after a dispatcher had claimed an ordered event, so
// a key whose only remaining events were held stayed held for ever.
func TestHeldEventLeftByAnEarlierProcessGoesOn(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueOneKey(t, client, pool, 2)
	// The head delivered behind the library's back, as if its outcome had
	// committed before the second's enqueue: the second stays held.
	if _, err := pool.Exec(ctx, `UPDATE modkit_outbox_events SET status = 'delivered' WHERE id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	var held bool
	if err := pool.QueryRow(ctx, `SELECT held FROM modkit_outbox_events WHERE id = $1`, ids[1]).Scan(&held); err != nil || !held {
		t.Fatalf("the second event held: %v, %v; the test needs it held", held, err)
	}
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic,
		Publish: func(context.Context, outbox.Delivery) error { return nil }})
	log.waitFor(t, "the held event delivered", func(m map[uuid.UUID][]outbox.Outcome) bool {
		os := m[ids[1]]
		return len(os) > 0 && os[len(os)-1].Status == outbox.StatusDelivered
	})
}

// A HandleTx handler's commit frees the next event of its key, and the
// dispatcher claims it at once, as it does after a publish's delivery. It
// waited for a re-check of the wake window or, past the window (here a
// nanosecond), for the poll (here longer than the test's guard).
func TestHandleTxFreesTheNextEventOfItsKeyAtOnce(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	enqueueOneKey(t, client, tdb.Provider.Pool, 2)
	log := newOutcomeLog()
	startDispatcher(t, client, withoutRechecks(testConfig(log)), outbox.Publisher{Topic: testTopic,
		HandleTx: func(context.Context, pgx.Tx, outbox.Delivery) error { return nil }})
	log.waitFor(t, "both events of the key delivered", finalCount(outbox.StatusDelivered, 2))
}

// An operator who purges a key's dead head (Admin.PurgeDead) lets the
// key's later events go on, as skipping it does.
func TestPurgedDeadHeadLetsItsKeyGoOn(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	ids := enqueueOneKey(t, client, tdb.Provider.Pool, 3)
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: failPermanently(ids[0])})
	log.waitFor(t, "the head dead", finalCount(outbox.StatusDead, 1))
	if got, err := client.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{}, ids[0]); err != nil || len(got) != 1 {
		t.Fatalf("purge the dead head: %v, %v", got, err)
	}
	log.waitFor(t, "the rest of the key delivered", finalCount(outbox.StatusDelivered, 2))
}

// killHeadAndStop runs a dispatcher of pub until one event is dead, then
// stops it: a key's head died in an earlier process.
func killHeadAndStop(t *testing.T, client *outbox.Client, pub outbox.Publisher) {
	t.Helper()
	log := newOutcomeLog()
	d, err := client.NewDispatcher(testConfig(log), pub)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	log.waitFor(t, "the head dead", finalCount(outbox.StatusDead, 1))
	if err := d.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

// The same after a restart: a dispatcher that started while the key's head
// was dead claims none of the key's events, yet the event after the head
// goes on once the head is purged: the purge lets it into the claim
// (migration 0031). Before, only a dispatcher that had claimed ordered
// events released it, and the key stayed blocked with nothing dead left to
// show for it.
func TestPurgedDeadHeadLetsItsKeyGoOnAfterRestart(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueOneKey(t, client, pool, 3)
	killHeadAndStop(t, client, outbox.Publisher{Topic: testTopic, Publish: failPermanently(ids[0])})
	released := make(chan struct{}, 1)
	restarted := clientWrappingStore(t, pool, func(st driver.Store) driver.Store {
		return &releaseReportingStore{Store: st, released: released}
	})
	log := newOutcomeLog()
	startDispatcher(t, restarted, testConfig(log), outbox.Publisher{Topic: testTopic, Publish: failPermanently(ids[0])})
	select { // the restarted dispatcher's first release has run: nothing to free yet
	case <-released:
	case <-time.After(guard):
		t.Fatal("the restarted dispatcher never released held events")
	}
	if got, err := client.Admin().PurgeDead(ctx, "bob@ops", outbox.EventFilter{}, ids[0]); err != nil || len(got) != 1 {
		t.Fatalf("purge the dead head: %v, %v", got, err)
	}
	log.waitFor(t, "the rest of the key delivered after the purge", finalCount(outbox.StatusDelivered, 2))
}

// Under SkipDeadHeads an event enqueued behind a dead head is held (the
// database does not know the policy) until a release lets it go. A
// dispatcher started after the head died claims no ordered event, so its
// claimer never released again, and the event waited for good; the
// maintenance pass releases its topics' held events.
func TestSkipDeadHeadsEnqueueBehindADeadHeadAfterRestart(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueOneKey(t, client, pool, 1)
	pub := outbox.Publisher{Topic: testTopic, Publish: failPermanently(ids[0]), SkipDeadHeads: true}
	killHeadAndStop(t, client, pub)
	log := newOutcomeLog()
	cfg := testConfig(log)
	cfg.SweepInterval = 100 * time.Millisecond
	_, pass := startMaintained(t, client, cfg, pub)
	pass.waitPasses(t, 1) // started, and past its first release
	m := msg(1)
	m.OrderingKey = "k"
	if _, err := client.Enqueue(ctx, pool, m); err != nil {
		t.Fatal(err)
	}
	log.waitFor(t, "the event behind the dead head delivered", finalCount(outbox.StatusDelivered, 1))
}

// releaseReportingStore reports each ReleaseHeld that returned.
type releaseReportingStore struct {
	driver.Store
	released chan struct{}
}

func (s *releaseReportingStore) ReleaseHeld(ctx context.Context, topics, skipDead []string, limit int) (int64, error) {
	n, err := s.Store.ReleaseHeld(ctx, topics, skipDead, limit)
	select {
	case s.released <- struct{}{}:
	default:
	}
	return n, err
}

// A dispatcher that knows its publish pace claims a key's due events
// together and publishes them one after another; when one fails, the rest
// go back unpublished with their attempt undone, and follow it in order
// once it is delivered.
func TestChainStopsAtFailedEvent(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	var mu sync.Mutex
	type call struct {
		seq     int64
		attempt int
	}
	var calls []call
	failed := false
	log := newOutcomeLog()
	startDispatcher(t, client, testConfig(log), outbox.Publisher{Topic: testTopic,
		Publish: func(_ context.Context, d outbox.Delivery) error {
			mu.Lock()
			defer mu.Unlock()
			calls = append(calls, call{d.Sequence, d.Attempt})
			if d.Sequence == 2 && !failed {
				failed = true
				return errors.New("rail busy")
			}
			return nil
		}})
	// One delivery first: until it knows how long a publish takes, the
	// dispatcher claims one event of a key at a time.
	if _, err := client.Enqueue(ctx, pool, msg(0)); err != nil {
		t.Fatal(err)
	}
	log.waitFor(t, "the first delivery", finalCount(outbox.StatusDelivered, 1))
	msgs := make([]outbox.Message, 5)
	for i := range msgs {
		msgs[i] = msg(i + 1)
		msgs[i].OrderingKey = "k"
	}
	enq, err := client.EnqueueBatch(ctx, pool, msgs)
	if err != nil {
		t.Fatal(err)
	}
	log.waitFor(t, "the key delivered", finalCount(outbox.StatusDelivered, 6))
	mu.Lock()
	defer mu.Unlock()
	want := []call{{0, 1}, {1, 1}, {2, 1}, {2, 2}, {3, 1}, {4, 1}, {5, 1}}
	if !slices.Equal(calls, want) {
		t.Fatalf("publishes (sequence, attempt) %v, want %v", calls, want)
	}
	// The events after the failure were leased with it (one claim) and
	// given back without a publish.
	h, err := client.Admin().History(ctx, enq[2].ID)
	if err != nil || len(h) != 2 || h[0].Outcome != "released" || h[1].Outcome != "delivered" ||
		!strings.Contains(h[0].Detail, "an earlier event of its ordering key was not delivered") {
		t.Fatalf("history of the event after the failed one: %+v %v, want released (saying why) then delivered", h, err)
	}
	if e := get(t, client, enq[2].ID); e.Attempts != 1 || e.LastError != nil {
		t.Fatalf("the event after the failed one: %d attempts, last error %v; want 1 and none", e.Attempts, e.LastError)
	}
}
