package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/uptrace/bun"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

func TestEnqueueThroughEveryRunner(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	p := tdb.Provider
	type txKind struct {
		name  string
		begin func() (r db.Runner, commit, rollback func() error)
	}
	kinds := []txKind{
		{"pgx.Tx", func() (db.Runner, func() error, func() error) {
			tx, err := p.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return tx, func() error { return tx.Commit(ctx) }, func() error { return tx.Rollback(ctx) }
		}},
		{"bun.Tx", func() (db.Runner, func() error, func() error) {
			tx, err := p.Bun.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return db.SQL(tx), tx.Commit, tx.Rollback
		}},
		{"bun.IDB", func() (db.Runner, func() error, func() error) {
			tx, err := p.Bun.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var idb bun.IDB = &tx
			return db.SQL(idb), tx.Commit, tx.Rollback
		}},
		{"*sql.Tx", func() (db.Runner, func() error, func() error) {
			tx, err := p.SQL.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return db.SQL(tx), tx.Commit, tx.Rollback
		}},
	}
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			tenant := uuid.New()
			for _, finish := range []string{"commit", "rollback"} {
				r, commit, rollback := k.begin()
				m := keyed(1, tenant.String()+"/"+k.name+"/"+finish)
				m.TenantID = &tenant
				res, err := c.Enqueue(ctx, r, m)
				if err != nil || res.AlreadyEnqueued || res.ID == uuid.Nil {
					t.Fatalf("enqueue: %+v %v", res, err)
				}
				if n := countRows(t, p.Pool, "id = $1", res.ID); n != 0 {
					t.Fatal("event visible to other sessions before commit")
				}
				if finish == "rollback" {
					if err := rollback(); err != nil {
						t.Fatal(err)
					}
					if n := countRows(t, p.Pool, "id = $1", res.ID); n != 0 {
						t.Fatal("event persisted although the transaction rolled back")
					}
					continue
				}
				if err := commit(); err != nil {
					t.Fatal(err)
				}
				e := get(t, c, res.ID)
				// Seed 004 §3: the row's initial state.
				if e.Status != outbox.StatusPending || e.Attempts != 0 || e.LockedBy != nil || e.LockedUntil != nil ||
					e.LastError != nil || !e.NextAttemptAt.Equal(e.CreatedAt) || *e.TenantID != tenant ||
					*e.DedupeKey != *m.DedupeKey || string(e.Payload) != `{"n": 1}` {
					t.Fatalf("initial row: %+v", e)
				}
			}
		})
	}
	// Connections (autocommit) work too.
	for name, r := range map[string]db.Runner{"pool": p.Pool, "*sql.DB": db.SQL(p.SQL), "*bun.DB": db.SQL(p.Bun)} {
		res, err := c.Enqueue(ctx, r, msg(2))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if n := countRows(t, p.Pool, "id = $1", res.ID); n != 1 {
			t.Fatalf("%s: row not visible", name)
		}
	}
	// A wrong type does not compile; a nil runner (or a wrapped nil handle)
	// is refused before any SQL runs.
	batch := make([]outbox.Message, 64) // the COPY path
	for i := range batch {
		batch[i] = msg(4 + i)
	}
	for _, r := range []db.Runner{nil, (*pgxpool.Pool)(nil), (*pgxpool.Tx)(nil), (*pgx.Conn)(nil), db.SQL((*sql.Tx)(nil)), db.SQL((*bun.DB)(nil))} {
		if _, err := c.Enqueue(ctx, r, msg(3)); !errors.Is(err, db.ErrUnsupportedRunner) {
			t.Fatalf("runner %#v: %v, want ErrUnsupportedRunner", r, err)
		}
		if _, err := c.EnqueueBatch(ctx, r, batch); !errors.Is(err, db.ErrUnsupportedRunner) {
			t.Fatalf("batch on runner %#v: %v, want ErrUnsupportedRunner", r, err)
		}
	}
}

func TestEnqueueDedupe(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	first, err := c.Enqueue(ctx, pool, keyed(1, "k1"))
	if err != nil || first.AlreadyEnqueued {
		t.Fatalf("first: %+v %v", first, err)
	}
	second, err := c.Enqueue(ctx, pool, keyed(2, "k1"))
	if err != nil || !second.AlreadyEnqueued || second.ID != first.ID {
		t.Fatalf("second: %+v %v, want AlreadyEnqueued with id %s", second, err, first.ID)
	}
	// The key is scoped by namespace and topic.
	other := keyed(3, "k1")
	other.Topic = "other"
	third, err := c.Enqueue(ctx, pool, other)
	if err != nil || third.AlreadyEnqueued {
		t.Fatalf("other topic: %+v %v", third, err)
	}
	// Without a key, nothing is deduplicated.
	for range 2 {
		if res, err := c.Enqueue(ctx, pool, msg(4)); err != nil || res.AlreadyEnqueued {
			t.Fatalf("unkeyed: %+v %v", res, err)
		}
	}
	if n := countRows(t, pool, "true"); n != 4 {
		t.Fatalf("%d rows, want 4", n)
	}
}

// Seed 004 §6: a producer that loses an idempotency race observes "already
// enqueued" and no duplicate row is inserted.
func TestEnqueueDedupeRace(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	const n = 50
	var wg sync.WaitGroup
	start := make(chan struct{})
	results := make([]outbox.Enqueued, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				var err error
				results[i], err = c.Enqueue(ctx, tx, keyed(i, "race"))
				return err
			})
		}()
	}
	close(start)
	wg.Wait()
	fresh := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("enqueue %d: %v", i, errs[i])
		}
		if results[i].ID != results[0].ID {
			t.Fatalf("answers name different ids: %s and %s", results[i].ID, results[0].ID)
		}
		if !results[i].AlreadyEnqueued {
			fresh++
		}
	}
	if fresh != 1 {
		t.Fatalf("%d producers were told they inserted, want exactly 1", fresh)
	}
	if c := countRows(t, pool, "dedupe_key = 'race'"); c != 1 {
		t.Fatalf("%d rows for the key, want 1", c)
	}
}

func TestEnqueueValidation(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{MaxPayloadBytes: 100})
	pool := tdb.Provider.Pool
	tenant := uuid.MustParse("0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65")
	with := func(f func(*outbox.Message)) outbox.Message {
		m := msg(1)
		f(&m)
		return m
	}
	cases := []struct {
		name  string
		msg   outbox.Message
		kind  error
		field string
	}{
		{"empty namespace", with(func(m *outbox.Message) { m.Namespace = "" }), outbox.ErrInvalidNamespace, "Namespace"},
		{"upper-case namespace", with(func(m *outbox.Message) { m.Namespace = "Chat" }), outbox.ErrInvalidNamespace, "Namespace"},
		{"namespace with colon", with(func(m *outbox.Message) { m.Namespace = "a:b" }), outbox.ErrInvalidNamespace, "Namespace"},
		{"namespace too long", with(func(m *outbox.Message) { m.Namespace = strings.Repeat("a", 129) }), outbox.ErrInvalidNamespace, "Namespace"},
		{"empty topic", with(func(m *outbox.Message) { m.Topic = "" }), outbox.ErrInvalidTopic, "Topic"},
		{"topic with space", with(func(m *outbox.Message) { m.Topic = "usage snapshot" }), outbox.ErrInvalidTopic, "Topic"},
		{"topic injection", with(func(m *outbox.Message) { m.Topic = "x'; DROP TABLE modkit_outbox_events; --" }), outbox.ErrInvalidTopic, "Topic"},
		{"empty payload", with(func(m *outbox.Message) { m.Payload = nil }), outbox.ErrInvalidPayload, "Payload"},
		{"invalid JSON", with(func(m *outbox.Message) { m.Payload = json.RawMessage(`{"a":`) }), outbox.ErrInvalidPayload, "Payload"},
		{"two JSON values", with(func(m *outbox.Message) { m.Payload = json.RawMessage(`{} {}`) }), outbox.ErrInvalidPayload, "Payload"},
		{"NUL escape", with(func(m *outbox.Message) { m.Payload = json.RawMessage(`{"a":"x\u0000y"}`) }), outbox.ErrInvalidPayload, "Payload"},
		{"too large", with(func(m *outbox.Message) { m.Payload = json.RawMessage(`"` + strings.Repeat("x", 100) + `"`) }), outbox.ErrPayloadTooLarge, "Payload"},
		{"empty dedupe key", with(func(m *outbox.Message) { m.DedupeKey = outbox.Key("") }), outbox.ErrInvalidDedupeKey, "DedupeKey"},
		{"blank dedupe key", with(func(m *outbox.Message) { m.DedupeKey = outbox.Key("  \t") }), outbox.ErrInvalidDedupeKey, "DedupeKey"},
		{"long dedupe key", with(func(m *outbox.Message) { m.DedupeKey = outbox.Key(strings.Repeat("k", 513)) }), outbox.ErrInvalidDedupeKey, "DedupeKey"},
		{"NUL in dedupe key", with(func(m *outbox.Message) { m.DedupeKey = outbox.Key("a\x00b") }), outbox.ErrInvalidDedupeKey, "DedupeKey"},
		{"invalid UTF-8 key", with(func(m *outbox.Message) { m.DedupeKey = outbox.Key("a\xffb") }), outbox.ErrInvalidDedupeKey, "DedupeKey"},
		{"nil tenant", with(func(m *outbox.Message) { m.TenantID = outbox.Tenant(uuid.Nil) }), outbox.ErrInvalidTenant, "TenantID"},
		{"key of another tenant", with(func(m *outbox.Message) {
			m.TenantID = &tenant
			m.DedupeKey = outbox.Key(strings.ReplaceAll(uuid.NewString(), "-", "") + "/turn/req")
		}), outbox.ErrTenantMismatch, "DedupeKey"},
		{"tenant without slash", with(func(m *outbox.Message) {
			m.TenantID = &tenant
			m.DedupeKey = outbox.Key("0b7c6f1e5a4d4c3b9a2f1e0d9c8b7a65")
		}), outbox.ErrTenantMismatch, "DedupeKey"},
		{"tenant prefix only", with(func(m *outbox.Message) {
			m.TenantID = &tenant
			m.DedupeKey = outbox.Key("0b7c6f1e5a4d4c3b9a2f1e0d9c8b7a65x/t/r")
		}), outbox.ErrTenantMismatch, "DedupeKey"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := client.Enqueue(ctx, pool, c.msg)
			var ve *outbox.ValidationError
			if !errors.Is(err, outbox.ErrInvalidMessage) || !errors.Is(err, c.kind) || !errors.As(err, &ve) || ve.Field != c.field {
				t.Fatalf("want %v on %s, got %v", c.kind, c.field, err)
			}
			if strings.Contains(err.Error(), "message 0") {
				t.Errorf("Enqueue of one message names it by a batch index: %v", err)
			}
			// The batch path rejects it too, naming its index, and writes
			// none of the batch.
			_, err = client.EnqueueBatch(ctx, pool, []outbox.Message{msg(0), c.msg})
			if !errors.As(err, &ve) || ve.Index != 1 || !errors.Is(err, c.kind) || !strings.Contains(err.Error(), "message 1: "+c.field) {
				t.Fatalf("batch: want %v at index 1, named in the text, got %v", c.kind, err)
			}
		})
	}
	if n := countRows(t, pool, "true"); n != 0 {
		t.Fatalf("%d rows written by invalid messages", n)
	}
	// The tenant rule accepts both hex forms, in any case.
	for i, key := range []string{
		"0b7c6f1e5a4d4c3b9a2f1e0d9c8b7a65/turn/1",
		"0B7C6F1E5A4D4C3B9A2F1E0D9C8B7A65/turn/2",
		"0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65/turn/3",
		"0B7C6F1E-5A4D-4C3B-9A2F-1E0D9C8B7A65/turn/4",
	} {
		m := keyed(i, key)
		m.TenantID = &tenant
		if _, err := client.Enqueue(ctx, pool, m); err != nil {
			t.Errorf("key %q: %v", key, err)
		}
	}
}

// A batch larger than one EnqueueBatch takes (512 MiB; lowered here) is
// refused before any SQL, on every path, naming the message that passes
// the limit; the caller's transaction goes on. It went to the database as
// one statement's arrays on some paths, and past 1 GiB the driver closed
// the caller's connection with an error of its own.
func TestEnqueueBatchTooLarge(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	outbox.SetBatchMaxBytes(c, 10_000)
	pool := tdb.Provider.Pool
	payload := json.RawMessage(`"` + strings.Repeat("x", 998) + `"`) // 1,000 bytes
	for name, size := range map[string]int{"arrays": 5, "ordering keys": 5, "COPY": 100} {
		msgs := make([]outbox.Message, size)
		for i := range msgs {
			msgs[i] = outbox.Message{Namespace: "n", Topic: "t", Payload: payload}
			if name == "ordering keys" {
				msgs[i].OrderingKey = "k"
			}
		}
		if name != "COPY" {
			// Headers and keys count too: 5 × (1,000 + 1,001 + 1) passes 10,000 at the fifth message.
			for i := range msgs {
				msgs[i].Headers = map[string]string{"h": strings.Repeat("v", 1000)}
			}
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.EnqueueBatch(ctx, tx, msgs)
		var verr *outbox.ValidationError
		if !errors.Is(err, outbox.ErrPayloadTooLarge) || !errors.As(err, &verr) || !strings.Contains(err.Error(), "split the batch") {
			t.Fatalf("%s: %v, want ErrPayloadTooLarge saying to split the batch", name, err)
		}
		if want := map[string]int{"arrays": 4, "ordering keys": 4, "COPY": 10}[name]; verr.Index != want {
			t.Errorf("%s: the error names message %d, want %d, the first past the limit", name, verr.Index, want)
		}
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatalf("%s: the caller's transaction is unusable after the refusal: %v", name, err)
		}
		_ = tx.Rollback(ctx)
		// The messages before the one named go.
		if _, err := c.EnqueueBatch(ctx, pool, msgs[:verr.Index]); err != nil {
			t.Fatalf("%s: the batch up to message %d: %v", name, verr.Index, err)
		}
	}
}

func TestEnqueueBatch(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	existing, err := c.Enqueue(ctx, pool, keyed(0, "k-0"))
	if err != nil {
		t.Fatal(err)
	}
	msgs := []outbox.Message{msg(1), keyed(2, "k-0"), keyed(3, "k-3"), keyed(4, "k-3"), msg(5)}
	tenant := uuid.New()
	msgs[4].TenantID = &tenant
	var res []outbox.Enqueued
	err = db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		res, err = c.EnqueueBatch(ctx, tx, msgs)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != len(msgs) {
		t.Fatalf("%d results for %d messages", len(res), len(msgs))
	}
	if res[0].AlreadyEnqueued || res[4].AlreadyEnqueued {
		t.Fatalf("unkeyed messages reported as duplicates: %+v", res)
	}
	if !res[1].AlreadyEnqueued || res[1].ID != existing.ID {
		t.Fatalf("pre-existing key: %+v, want id %s", res[1], existing.ID)
	}
	if res[2].ID != res[3].ID || res[2].AlreadyEnqueued == res[3].AlreadyEnqueued {
		t.Fatalf("same key twice in one batch: %+v %+v, want one row and one duplicate", res[2], res[3])
	}
	if n := countRows(t, pool, "true"); n != 4 {
		t.Fatalf("%d rows, want 4", n)
	}
	if e := get(t, c, res[4].ID); e.TenantID == nil || *e.TenantID != tenant {
		t.Fatalf("tenant not stored: %+v", e)
	}
	// Rolled back batches leave nothing. (The rollback is asked for by
	// returning sql.ErrTxDone after a batch that was written.)
	if err := db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := c.EnqueueBatch(ctx, tx, []outbox.Message{msg(6), msg(7)}); err != nil {
			return err
		}
		return sql.ErrTxDone
	}); !errors.Is(err, sql.ErrTxDone) {
		t.Fatalf("the rolled-back batch: %v, want the error that asked for the rollback (the batch failed?)", err)
	}
	if n := countRows(t, pool, "true"); n != 4 {
		t.Fatalf("%d rows after a rolled-back batch, want 4", n)
	}
}

// Of the messages of one batch that share a dedupe key, the first is
// written and the later ones answer with its row, as one Enqueue after
// another would, also when ordering keys make the batch be written in key
// order rather than batch order.
func TestEnqueueBatchFirstOfAKeyWins(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	withOrdering := func(m outbox.Message, key string) outbox.Message { m.OrderingKey = key; return m }
	for name, msgs := range map[string][]outbox.Message{
		"plain":          {keyed(1, "plain-a"), keyed(2, "plain-a"), msg(3), keyed(4, "plain-a")},
		"ordering keys":  {withOrdering(keyed(1, "ord-a"), "z"), keyed(2, "ord-a"), withOrdering(keyed(3, "ord-b"), "z"), withOrdering(keyed(4, "ord-a"), "a")},
		"large, by COPY": append([]outbox.Message{keyed(1, "copy-a"), keyed(2, "copy-a")}, slices.Repeat([]outbox.Message{msg(3)}, 100)...),
	} {
		t.Run(name, func(t *testing.T) {
			res, err := c.EnqueueBatch(ctx, pool, msgs)
			if err != nil {
				t.Fatal(err)
			}
			for i, m := range msgs {
				j := slices.IndexFunc(msgs, func(o outbox.Message) bool {
					return o.DedupeKey != nil && m.DedupeKey != nil && *o.DedupeKey == *m.DedupeKey
				})
				if j < 0 || j == i {
					if res[i].AlreadyEnqueued {
						t.Fatalf("message %d, the first of its key: %+v, want written", i, res[i])
					}
					continue
				}
				if !res[i].AlreadyEnqueued || res[i].ID != res[j].ID {
					t.Fatalf("message %d repeats message %d's key: %+v, want a duplicate of %s", i, j, res[i], res[j].ID)
				}
			}
			e := get(t, c, res[0].ID)
			if string(e.Payload) != `{"n": 1}` || e.OrderingKey != msgs[0].OrderingKey {
				t.Fatalf("the row of the repeated key holds payload %s and ordering key %q; want the first message's {\"n\": 1} and %q",
					e.Payload, e.OrderingKey, msgs[0].OrderingKey)
			}
		})
	}
}

// Enqueue announces new events on its schema's outboxpg.NotifyChannel; DisableNotify
// stays quiet, and a client sends at most one NOTIFY per topic per
// NotifyInterval. Notifications arrive in commit order, so an enqueue that
// wrongly notified would be seen before the ones after it.
func TestEnqueueNotifies(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	conn, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{outboxpg.NotifyChannel("public")}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	quiet := clientOn(t, pool, outbox.Config{DisableNotify: true})
	if _, err := quiet.Enqueue(ctx, pool, msg(1)); err != nil {
		t.Fatal(err)
	}
	if _, err := quiet.EnqueueBatch(ctx, pool, []outbox.Message{msg(2), msg(3)}); err != nil {
		t.Fatal(err)
	}
	// An interval no test outlasts: the gate, not the clock, decides.
	loud := clientOn(t, pool, outbox.Config{NotifyInterval: time.Hour})
	topic := func(name string) outbox.Message {
		return outbox.Message{Namespace: "loud", Topic: name, Payload: json.RawMessage(`1`)}
	}
	for _, m := range []outbox.Message{topic("t"), topic("t"), topic("u")} {
		if _, err := loud.Enqueue(ctx, pool, m); err != nil {
			t.Fatal(err)
		}
	}
	// A batch announces each of its topics once; topics already announced
	// within the interval stay quiet.
	if _, err := loud.EnqueueBatch(ctx, pool, []outbox.Message{topic("v"), topic("t"), topic("v"), topic("w")}); err != nil {
		t.Fatal(err)
	}
	// An enqueue that announces nothing gives its turn back, so the
	// topic's next enqueue announces it: a duplicate (d), a batch of
	// duplicates only (e), and an enqueue that failed (f).
	keyed := func(name string) outbox.Message {
		m := topic(name)
		m.DedupeKey = outbox.Key("k")
		return m
	}
	if _, err := quiet.EnqueueBatch(ctx, pool, []outbox.Message{keyed("d"), keyed("e")}); err != nil {
		t.Fatal(err)
	}
	if res, err := loud.Enqueue(ctx, pool, keyed("d")); err != nil || !res.AlreadyEnqueued {
		t.Fatalf("enqueue of a duplicate: %+v, %v", res, err)
	}
	if res, err := loud.EnqueueBatch(ctx, pool, []outbox.Message{keyed("e"), keyed("e")}); err != nil || !res[0].AlreadyEnqueued {
		t.Fatalf("batch of duplicates: %+v, %v", res, err)
	}
	cancelled, cancelNow := context.WithCancel(ctx)
	cancelNow()
	if _, err := loud.Enqueue(cancelled, pool, topic("f")); err == nil {
		t.Fatal("an enqueue on a cancelled context did not fail")
	}
	for _, name := range []string{"d", "e", "f"} {
		if _, err := loud.Enqueue(ctx, pool, topic(name)); err != nil {
			t.Fatal(err)
		}
	}
	// A marker from a client of its own closes the sequence.
	if _, err := clientOn(t, pool, outbox.Config{}).Enqueue(ctx, pool, topic("end")); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, guard)
	defer cancel()
	var got []string
	for len(got) == 0 || got[len(got)-1] != "loud:end" {
		n, err := conn.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("after %q: %v", got, err)
		}
		if n.Channel != outboxpg.NotifyChannel("public") {
			t.Fatalf("notification on %q", n.Channel)
		}
		got = append(got, n.Payload)
	}
	want := []string{"loud:t", "loud:u", "loud:v", "loud:w", "loud:d", "loud:e", "loud:f", "loud:end"}
	if len(got) >= 4 {
		slices.Sort(got[2:4]) // one statement announces v and w, in no set order
	}
	if !slices.Equal(got, want) {
		t.Fatalf("notifications %q, want %q (the quiet client and repeats within the interval must not notify; an enqueue that announced nothing must leave the next one its turn)", got, want)
	}
}

// A client works in the schema of its Config: Client.Migrate creates the
// tables there, enqueues, dispatchers (claims, outcomes, maintenance
// leases) and Admin use them, and nothing touches public. A client without
// a Schema uses public whatever the connection's search_path.
func TestStoreInSchema(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	c := clientOn(t, pool, outbox.Config{Schema: "tenant_outbox", Logger: quietLog})
	// Before Migrate, enqueues fail and say what to do.
	if _, err := c.Enqueue(ctx, pool, msg(0)); err == nil ||
		!strings.Contains(err.Error(), `"tenant_outbox"`) || !strings.Contains(err.Error(), "Client.Migrate") {
		t.Fatalf("enqueue into an unmigrated schema: %v", err)
	}
	for range 2 { // migrating an up-to-date schema does nothing
		if err := c.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	countIn := func(schema, table string) int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, table}.Sanitize()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	res, err := c.Enqueue(ctx, pool, msg(1))
	if err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, pool, "true"); n != 0 {
		t.Fatal("the schema client wrote into public")
	}
	if n := countIn("tenant_outbox", outboxpg.TableName); n != 1 {
		t.Fatalf("%d rows in the schema's table, want 1", n)
	}

	log := newOutcomeLog()
	d, err := c.NewDispatcher(testConfig(log), outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	maintained := make(chan []string, 1)
	outbox.OnMaintenance(d, func(held []string) {
		select {
		case maintained <- held:
		default:
		}
	})
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	log.waitFor(t, "delivery in the schema", finalCount(outbox.StatusDelivered, 1))
	if e := get(t, c, res.ID); e.Status != outbox.StatusDelivered {
		t.Fatalf("event after delivery: %+v", e)
	}
	st, err := c.Admin().Stats(ctx)
	if err != nil || st.Total.Delivered != 1 || len(st.Topics) != 1 {
		t.Fatalf("stats in the schema: %+v %v", st, err)
	}
	select {
	case held := <-maintained:
		if !slices.Equal(held, []string{"maintenance:test:events"}) {
			t.Fatalf("maintenance held %q", held)
		}
	case <-time.After(guard):
		t.Fatal("no maintenance pass")
	}
	// The lease lives in the schema too (the dispatcher holds it until it
	// stops).
	if n := countIn("tenant_outbox", outboxpg.LeadersTableName); n != 1 {
		t.Fatalf("%d maintenance leases in the schema, want 1", n)
	}
	if n := countIn("public", outboxpg.LeadersTableName); n != 0 {
		t.Fatalf("%d maintenance leases in public, want 0", n)
	}

	// No search_path fallback: the default client writes public even when
	// the caller's transaction looks elsewhere first.
	err = db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL search_path TO tenant_outbox"); err != nil {
			return err
		}
		_, err := clientOn(t, pool, outbox.Config{}).Enqueue(ctx, tx, msg(2))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, pool, "true"); n != 1 {
		t.Fatalf("%d rows in public, want 1", n)
	}
	if n := countIn("tenant_outbox", outboxpg.TableName); n != 1 {
		t.Fatalf("%d rows in the schema's table, want still 1", n)
	}

	for _, bad := range []string{"x; DROP TABLE y", `a"b`, "9x", "pg_x"} {
		if _, err := outbox.New(outboxpg.New(pool), outbox.Config{Schema: bad}); !errors.Is(err, db.ErrInvalidSchema) || !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Errorf("schema %q: %v", bad, err)
		}
	}
}

// New validates its arguments before doing anything; every refusal
// matches ErrInvalidConfig.
func TestNewClientConfigErrors(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	for name, try := range map[string]func() (*outbox.Client, error){
		"nil driver": func() (*outbox.Client, error) { return outbox.New(nil, outbox.Config{}) },
		"nil pool":   func() (*outbox.Client, error) { return outbox.New(outboxpg.New(nil), outbox.Config{}) },
		"negative payload limit": func() (*outbox.Client, error) {
			return outbox.New(outboxpg.New(pool), outbox.Config{MaxPayloadBytes: -1})
		},
		"short error limit": func() (*outbox.Client, error) { return outbox.New(outboxpg.New(pool), outbox.Config{ErrorMaxLen: 63}) },
		"negative interval": func() (*outbox.Client, error) {
			return outbox.New(outboxpg.New(pool), outbox.Config{NotifyInterval: -time.Millisecond})
		},
	} {
		if c, err := try(); !errors.Is(err, outbox.ErrInvalidConfig) || c != nil {
			t.Errorf("%s: %v, %v; want ErrInvalidConfig", name, c, err)
		}
	}
	if _, err := outbox.New(outboxpg.New(pool), outbox.Config{ErrorMaxLen: 64}); err != nil {
		t.Errorf("the smallest ErrorMaxLen: %v", err)
	}
}

// The default payload limit is 1 MiB.
func TestPayloadLimitDefault(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	body := func(size int) outbox.Message {
		m := msg(0)
		m.Payload = json.RawMessage(`"` + strings.Repeat("x", size-2) + `"`)
		return m
	}
	res, err := c.Enqueue(ctx, pool, body(1<<20))
	if err != nil {
		t.Fatalf("1 MiB payload: %v", err)
	}
	if e := get(t, c, res.ID); len(e.Payload) != 1<<20 {
		t.Fatalf("stored %d bytes, want %d", len(e.Payload), 1<<20)
	}
	if _, err := c.Enqueue(ctx, pool, body(1<<20+1)); !errors.Is(err, outbox.ErrPayloadTooLarge) {
		t.Fatalf("1 MiB + 1 payload: %v, want ErrPayloadTooLarge", err)
	}
	if _, err := c.EnqueueBatch(ctx, pool, []outbox.Message{msg(1), body(1<<20 + 1)}); !errors.Is(err, outbox.ErrPayloadTooLarge) {
		t.Fatalf("1 MiB + 1 payload in a batch: %v, want ErrPayloadTooLarge", err)
	}
	if n := countRows(t, pool, "true"); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
}

// A payload within MaxPayloadBytes whose stored (binary jsonb) form exceeds
// the database's 4 MiB, an array of small numbers (800 KB of text, 4.8 MB
// stored): the database refuses it, and the error matches
// ErrPayloadTooLarge and names the limit, alone and in a batch (the
// enqueue function's path). It was a bare check violation.
func TestPayloadOverTheStoredLimit(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	m := msg(0)
	m.Payload = json.RawMessage("[" + strings.Repeat("0,", 400_000) + "0]")
	for name, enqueue := range map[string]func() error{
		"alone":      func() error { _, err := c.Enqueue(ctx, pool, m); return err },
		"in a batch": func() error { _, err := c.EnqueueBatch(ctx, pool, []outbox.Message{msg(1), m}); return err },
	} {
		err := enqueue()
		if !errors.Is(err, outbox.ErrPayloadTooLarge) || !strings.Contains(err.Error(), "modkit_outbox_set_payload_limit") {
			t.Fatalf("%s: %v, want ErrPayloadTooLarge naming the database's limit", name, err)
		}
	}
	if n := countRows(t, pool, "true"); n != 0 {
		t.Fatalf("%d rows, want none", n)
	}

	// In the caller's transaction, a batch large enough for COPY (pgx) and
	// one through database/sql: the refusal leaves the transaction
	// aborted alike, as the docs say (the COPY's savepoint was rolled back
	// to, leaving it usable, its batch silently gone on commit).
	big := []outbox.Message{m}
	for i := range 70 {
		big = append(big, msg(i))
	}
	pgxTx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pgxTx.Rollback(ctx) }()
	sqlTx, err := tdb.Provider.SQL.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sqlTx.Rollback() }()
	for name, tx := range map[string]db.Runner{"pgx.Tx, COPY": pgxTx, "database/sql": db.SQL(sqlTx)} {
		if _, err := c.EnqueueBatch(ctx, tx, big); !errors.Is(err, outbox.ErrPayloadTooLarge) {
			t.Fatalf("%s: %v, want ErrPayloadTooLarge", name, err)
		}
		q, _ := db.AsQuerier(tx)
		if _, err := q.Exec(ctx, "SELECT 1"); err == nil || !strings.Contains(err.Error(), "25P02") {
			t.Errorf("%s: a statement after the refused batch: %v, want the transaction aborted (25P02)", name, err)
		}
	}
}

// Two transactions that enqueue two ordering keys in opposite orders
// deadlock on the keys' sequences; the one PostgreSQL aborts gets
// ErrConflict (retry the whole transaction) with a hint to keep one order,
// and the other goes on.
func TestEnqueueDeadlockIsAConflict(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	keyed := func(key string) outbox.Message {
		m := msg(0)
		m.OrderingKey = key
		return m
	}
	begin := func() pgx.Tx {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		return tx
	}
	tx1, tx2 := begin(), begin()
	if _, err := c.Enqueue(ctx, tx1, keyed("a")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(ctx, tx2, keyed("b")); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	for _, step := range []struct {
		tx  pgx.Tx
		key string
	}{{tx1, "b"}, {tx2, "a"}} {
		go func() {
			_, err := c.Enqueue(ctx, step.tx, keyed(step.key))
			if err != nil {
				_ = step.tx.Rollback(ctx) // the victim lets the other go on
			}
			errs <- err
		}()
	}
	var conflicts int
	for range 2 {
		if err := <-errs; err != nil {
			if !errors.Is(err, outbox.ErrConflict) || !strings.Contains(err.Error(), "one order") {
				t.Fatalf("the deadlock's victim: %v, want ErrConflict with the hint", err)
			}
			conflicts++
		}
	}
	if conflicts != 1 {
		t.Fatalf("%d enqueues failed, want the deadlock's one victim", conflicts)
	}
}

// Large batches through pgx take the COPY fast path, which falls back to the
// INSERT when a dedupe key already exists: through every kind of runner the
// results are the same, duplicates name the original rows, a fallback inside
// a transaction leaves it usable, and a rolled-back batch leaves nothing.
func TestEnqueueBatchLarge(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	batch := func(prefix string, from, to int) []outbox.Message {
		var msgs []outbox.Message
		for i := from; i < to; i++ {
			msgs = append(msgs, keyed(i, fmt.Sprintf("%s-%d", prefix, i)))
		}
		return msgs
	}
	runners := map[string]func(func(db.Runner) error) error{
		"pgx.Tx": func(f func(db.Runner) error) error {
			return db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
				if err := f(tx); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, "SELECT 1") // still usable after a fallback
				return err
			})
		},
		"pool": func(f func(db.Runner) error) error { return f(pool) },
		"bun.Tx": func(f func(db.Runner) error) error {
			return tdb.Provider.Bun.RunInTx(ctx, nil, func(ctx context.Context, tx bun.Tx) error { return f(db.SQL(tx)) })
		},
	}
	for name, run := range runners {
		t.Run(name, func(t *testing.T) {
			first := batch(name, 0, 200)
			var res1, res2 []outbox.Enqueued
			if err := run(func(r db.Runner) (err error) { res1, err = c.EnqueueBatch(ctx, r, first); return }); err != nil {
				t.Fatal(err)
			}
			// Half old keys, half new: the COPY must fail and the INSERT
			// sort them out.
			second := batch(name, 100, 300)
			if err := run(func(r db.Runner) (err error) { res2, err = c.EnqueueBatch(ctx, r, second); return }); err != nil {
				t.Fatal(err)
			}
			for i, r := range res1 {
				if r.AlreadyEnqueued {
					t.Fatalf("first batch, message %d reported as a duplicate", i)
				}
			}
			for i, r := range res2 {
				if old := i < 100; r.AlreadyEnqueued != old || (old && r.ID != res1[100+i].ID) {
					t.Fatalf("second batch, message %d: %+v (first batch: %+v)", i, r, res1[min(100+i, 199)])
				}
			}
			if n := countRows(t, pool, "dedupe_key LIKE $1", name+"-%"); n != 300 {
				t.Fatalf("%d rows, want 300", n)
			}
			var ids []uuid.UUID
			for _, r := range slices.Concat(res1, res2[100:]) {
				ids = append(ids, r.ID)
			}
			if n := countRows(t, pool, "dedupe_key LIKE $1 AND id = ANY($2)", name+"-%", ids); n != 300 {
				t.Fatalf("%d rows carry the returned ids, want 300", n)
			}
			// The ids of a batch increase in message order, so its events
			// are claimed in that order.
			for i := 1; i < len(res1); i++ {
				if bytes.Compare(res1[i-1].ID[:], res1[i].ID[:]) >= 0 {
					t.Fatalf("first batch, id %d (%s) does not come after id %d (%s)", i, res1[i].ID, i-1, res1[i-1].ID)
				}
			}
			// A key repeated inside a batch, all keys new: the COPY fails
			// on the repeat and the INSERT writes one row, named by both
			// results.
			third := batch(name+"-repeat", 0, 100)
			third[70].DedupeKey = third[10].DedupeKey
			var res3 []outbox.Enqueued
			if err := run(func(r db.Runner) (err error) { res3, err = c.EnqueueBatch(ctx, r, third); return }); err != nil {
				t.Fatal(err)
			}
			if res3[70].ID != res3[10].ID || res3[10].AlreadyEnqueued || !res3[70].AlreadyEnqueued {
				t.Fatalf("repeated key: results %+v and %+v, want the second to name the first's row", res3[10], res3[70])
			}
			if n := countRows(t, pool, "dedupe_key LIKE $1", name+"-repeat-%"); n != 99 {
				t.Fatalf("%d rows for a batch of 100 with one key repeated, want 99", n)
			}
		})
	}
	// A rolled-back COPY leaves nothing.
	err := db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := c.EnqueueBatch(ctx, tx, batch("rolled-back", 0, 100)); err != nil {
			return err
		}
		return sql.ErrTxDone
	})
	if !errors.Is(err, sql.ErrTxDone) {
		t.Fatal(err)
	}
	if n := countRows(t, pool, "dedupe_key LIKE 'rolled-back-%'"); n != 0 {
		t.Fatalf("%d rows after a rolled-back batch, want 0", n)
	}
}

// After the payload limit is lowered below an event enqueued under the old
// one, that event is still given back (a first attempt released) and
// replayed, and the other outcomes of the same write are recorded: the
// limit applies to new events only. A new event over it is refused.
func TestLoweredPayloadLimitSparesOlderEvents(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	big, small := msg(0), msg(1)
	var random strings.Builder // stored as it is: a repeated letter would compress below the limit
	for random.Len() < 6000 {
		random.WriteString(uuid.NewString())
	}
	big.Payload = json.RawMessage(`"` + random.String() + `"`)
	if _, err := c.EnqueueBatch(ctx, pool, []outbox.Message{big, small}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "SELECT modkit_outbox_set_payload_limit(1024)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "SELECT modkit_outbox_set_payload_limit(4194304)") })
	st := admStore(t, pool, "public", nil)
	claimed := admClaim(t, st, 2)
	if len(claimed) != 2 {
		t.Fatalf("claimed %d, want 2", len(claimed))
	}
	outcomes := make([]driver.Outcome, 2)
	for i, cl := range claimed {
		outcomes[i] = driver.Outcome{ID: cl.ID, LeaseToken: cl.LeaseToken, Kind: driver.Release, Error: "given back"}
		if len(cl.Payload) < 1000 {
			outcomes[i].Kind = driver.Delivered
		}
	}
	if settled, err := st.Complete(ctx, nil, admWorker, outcomes); err != nil || !settled[0] || !settled[1] {
		t.Fatalf("a release of the large event beside a delivery: %v, %v", settled, err)
	}
	// Dead, then replayed: pending with no attempt again.
	dead := admKillAll(t, st)
	if len(dead) != 1 {
		t.Fatalf("dead-lettered %d, want the large event", len(dead))
	}
	if ids, err := c.Admin().ReplayDead(ctx, "test", outbox.EventFilter{}, dead[0].ID); err != nil || len(ids) != 1 {
		t.Fatalf("replay of the large event: %v, %v", ids, err)
	}
	if _, err := c.Enqueue(ctx, pool, big); !errors.Is(err, outbox.ErrPayloadTooLarge) {
		t.Fatalf("a new event over the lowered limit: %v, want ErrPayloadTooLarge", err)
	}
}
