package outbox_test

import (
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
)

func TestEnqueueThroughEveryRunner(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
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
			return tx, tx.Commit, tx.Rollback
		}},
		{"bun.IDB", func() (db.Runner, func() error, func() error) {
			tx, err := p.Bun.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var idb bun.IDB = &tx
			return idb, tx.Commit, tx.Rollback
		}},
		{"*sql.Tx", func() (db.Runner, func() error, func() error) {
			tx, err := p.SQL.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return tx, tx.Commit, tx.Rollback
		}},
	}
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			tenant := uuid.New()
			for _, finish := range []string{"commit", "rollback"} {
				r, commit, rollback := k.begin()
				m := keyed(1, tenant.String()+"/"+k.name+"/"+finish)
				m.TenantID = &tenant
				res, err := s.Enqueue(ctx, r, m)
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
				e := get(t, s, res.ID)
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
	for name, r := range map[string]db.Runner{"pool": p.Pool, "*sql.DB": p.SQL, "*bun.DB": p.Bun} {
		res, err := outbox.Enqueue(ctx, r, msg(2))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if n := countRows(t, p.Pool, "id = $1", res.ID); n != 1 {
			t.Fatalf("%s: row not visible", name)
		}
	}
	if _, err := outbox.Enqueue(ctx, "not a runner", msg(3)); !errors.Is(err, db.ErrUnsupportedRunner) {
		t.Fatalf("unsupported runner: %v", err)
	}
}

func TestEnqueueDedupe(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	first, err := outbox.Enqueue(ctx, pool, keyed(1, "k1"))
	if err != nil || first.AlreadyEnqueued {
		t.Fatalf("first: %+v %v", first, err)
	}
	second, err := outbox.Enqueue(ctx, pool, keyed(2, "k1"))
	if err != nil || !second.AlreadyEnqueued || second.ID != first.ID {
		t.Fatalf("second: %+v %v, want AlreadyEnqueued with id %s", second, err, first.ID)
	}
	// The key is scoped by namespace and topic.
	other := keyed(3, "k1")
	other.Topic = "other"
	third, err := outbox.Enqueue(ctx, pool, other)
	if err != nil || third.AlreadyEnqueued {
		t.Fatalf("other topic: %+v %v", third, err)
	}
	// Without a key, nothing is deduplicated.
	outbox.Enqueue(ctx, pool, msg(4))
	outbox.Enqueue(ctx, pool, msg(4))
	if n := countRows(t, pool, "true"); n != 4 {
		t.Fatalf("%d rows, want 4", n)
	}
}

// Seed 004 §6: a producer that loses an idempotency race observes "already
// enqueued" and no duplicate row is inserted.
func TestEnqueueDedupeRace(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
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
				results[i], err = outbox.Enqueue(ctx, tx, keyed(i, "race"))
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
	s, tdb := newStore(t, outbox.Config{MaxPayloadBytes: 100})
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
			_, err := s.Enqueue(ctx, pool, c.msg)
			var ve *outbox.ValidationError
			if !errors.Is(err, outbox.ErrInvalidMessage) || !errors.Is(err, c.kind) || !errors.As(err, &ve) || ve.Field != c.field {
				t.Fatalf("want %v on %s, got %v", c.kind, c.field, err)
			}
			// The batch path rejects it too, naming its index, and writes
			// none of the batch.
			_, err = s.EnqueueBatch(ctx, pool, []outbox.Message{msg(0), c.msg})
			if !errors.As(err, &ve) || ve.Index != 1 || !errors.Is(err, c.kind) {
				t.Fatalf("batch: want %v at index 1, got %v", c.kind, err)
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
		if _, err := s.Enqueue(ctx, pool, m); err != nil {
			t.Errorf("key %q: %v", key, err)
		}
	}
}

func TestEnqueueBatch(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	existing, err := outbox.Enqueue(ctx, pool, keyed(0, "k-0"))
	if err != nil {
		t.Fatal(err)
	}
	msgs := []outbox.Message{msg(1), keyed(2, "k-0"), keyed(3, "k-3"), keyed(4, "k-3"), msg(5)}
	tenant := uuid.New()
	msgs[4].TenantID = &tenant
	var res []outbox.Enqueued
	err = db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		res, err = outbox.EnqueueBatch(ctx, tx, msgs)
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
	if e := get(t, nil2store(t, pool), res[4].ID); e.TenantID == nil || *e.TenantID != tenant {
		t.Fatalf("tenant not stored: %+v", e)
	}
	// Rolled back batches leave nothing.
	_ = db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := outbox.EnqueueBatch(ctx, tx, []outbox.Message{msg(6), msg(7)}); err != nil {
			return err
		}
		return sql.ErrTxDone
	})
	if n := countRows(t, pool, "true"); n != 4 {
		t.Fatalf("%d rows after a rolled-back batch, want 4", n)
	}
}

func nil2store(t *testing.T, pool *pgxpool.Pool) *outbox.Store {
	t.Helper()
	s, err := outbox.NewStore(pool, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Enqueue announces new events on NotifyChannel; DisableNotify stays quiet.
// Notifications arrive in commit order, so the quiet enqueue, committed
// first, would have been seen first.
func TestEnqueueNotifies(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	conn, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "LISTEN "+outbox.NotifyChannel); err != nil {
		t.Fatal(err)
	}
	quiet, err := outbox.NewProducer(outbox.Config{DisableNotify: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := quiet.Enqueue(ctx, tdb.Provider.Pool, msg(1)); err != nil {
		t.Fatal(err)
	}
	loud := outbox.Message{Namespace: "loud", Topic: "t", Payload: json.RawMessage(`1`)}
	if _, err := outbox.Enqueue(ctx, tdb.Provider.Pool, loud); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	n, err := conn.WaitForNotification(wctx)
	if err != nil {
		t.Fatal(err)
	}
	if n.Channel != outbox.NotifyChannel || n.Payload != "loud:t" {
		t.Fatalf("notification %q on %q, want \"loud:t\" (the quiet enqueue must not notify)", n.Payload, n.Channel)
	}
}

func TestStoreInSchema(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: "tenant_outbox", Logger: quietLog})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := outbox.NewStore(pool, outbox.Config{Schema: "tenant_outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Enqueue(ctx, pool, msg(1)); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, pool, "true"); n != 0 {
		t.Fatal("schema store wrote into the search_path table")
	}
	got := mustClaim(t, s, claimCfg(10))
	if len(got) != 1 || s.Ack(ctx, got[0]) != nil {
		t.Fatalf("claim/ack in schema: %+v", got)
	}
	for _, bad := range []string{"x; DROP TABLE y", `a"b`, "9x"} {
		if _, err := outbox.NewStore(pool, outbox.Config{Schema: bad}); !errors.Is(err, db.ErrInvalidSchema) {
			t.Errorf("schema %q: %v", bad, err)
		}
	}
}

// Large batches through pgx take the COPY fast path, which falls back to the
// INSERT when a dedupe key already exists: through every kind of runner the
// results are the same, duplicates name the original rows, a fallback inside
// a transaction leaves it usable, and a rolled-back batch leaves nothing.
func TestEnqueueBatchLarge(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
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
			return tdb.Provider.Bun.RunInTx(ctx, nil, func(ctx context.Context, tx bun.Tx) error { return f(tx) })
		},
	}
	for name, run := range runners {
		t.Run(name, func(t *testing.T) {
			first := batch(name, 0, 200)
			var res1, res2 []outbox.Enqueued
			if err := run(func(r db.Runner) (err error) { res1, err = outbox.EnqueueBatch(ctx, r, first); return }); err != nil {
				t.Fatal(err)
			}
			// Half old keys, half new: the COPY must fail and the INSERT
			// sort them out.
			second := batch(name, 100, 300)
			if err := run(func(r db.Runner) (err error) { res2, err = outbox.EnqueueBatch(ctx, r, second); return }); err != nil {
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
		})
	}
	// A rolled-back COPY leaves nothing.
	err := db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := outbox.EnqueueBatch(ctx, tx, batch("rolled-back", 0, 100)); err != nil {
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
