package outboxpg_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// One event without an ordering key goes in by a plain INSERT: it announces
// its topic when asked and only when it inserted, a duplicate comes back as
// the existing event (through the enqueue function) and announces nothing,
// and inside a transaction that rolls back it leaves nothing behind.
// Notifications arrive in commit order, so a duplicate that wrongly
// notified would be seen before the marker.
func TestInsertOne(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	conn := listen(t, tdb.DSN)

	key := "k1"
	first := rows(1, "test", "events")
	first[0].DedupeKey = &key
	got, err := s.Insert(ctx, pool, first, []string{topic})
	if err != nil || len(got) != 1 || got[0].ID != first[0].ID || got[0].Duplicate {
		t.Fatalf("insert: %+v, %v; want the new event %v", got, err, first[0].ID)
	}
	dup := rows(1, "test", "events")
	dup[0].DedupeKey = &key
	got, err = s.Insert(ctx, pool, dup, []string{topic})
	if err != nil || len(got) != 1 || got[0].ID != first[0].ID || !got[0].Duplicate {
		t.Fatalf("duplicate: %+v, %v; want the existing event %v", got, err, first[0].ID)
	}
	// Without an announcement the enqueue is a bare INSERT; its duplicate
	// takes the same way to the existing event.
	quietDup := rows(1, "test", "events")
	quietDup[0].DedupeKey = &key
	got, err = s.Insert(ctx, pool, quietDup, nil)
	if err != nil || len(got) != 1 || got[0].ID != first[0].ID || !got[0].Duplicate {
		t.Fatalf("duplicate without an announcement: %+v, %v; want the existing event %v", got, err, first[0].ID)
	}
	// The INSERT's row count through database/sql and bun too (a new
	// event announces its topic, a duplicate does not), and the INSERT of
	// an event without a dedupe key (no ON CONFLICT), which announces its
	// topic.
	for name, r := range map[string]db.Runner{"database/sql": db.SQL(tdb.Provider.SQL), "bun": db.SQL(tdb.Provider.Bun)} {
		keyless := rows(1, "test", "events")
		got, err := s.Insert(ctx, r, keyless, []string{topic})
		if err != nil || len(got) != 1 || got[0].ID != keyless[0].ID || got[0].Duplicate {
			t.Fatalf("%s: insert without a dedupe key: %+v, %v; want the new event %v", name, got, err, keyless[0].ID)
		}
		fresh := rows(1, "test", "events")
		freshKey := "fresh via " + name
		fresh[0].DedupeKey = &freshKey
		got, err = s.Insert(ctx, r, fresh, []string{topic})
		if err != nil || len(got) != 1 || got[0].ID != fresh[0].ID || got[0].Duplicate {
			t.Fatalf("%s: insert: %+v, %v; want the new event %v", name, got, err, fresh[0].ID)
		}
		dup := rows(1, "test", "events")
		dup[0].DedupeKey = &key
		got, err = s.Insert(ctx, r, dup, []string{topic})
		if err != nil || len(got) != 1 || got[0].ID != first[0].ID || !got[0].Duplicate {
			t.Fatalf("%s: duplicate: %+v, %v; want the existing event %v", name, got, err, first[0].ID)
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Insert(ctx, tx, rows(1, "test", "events"), []string{topic}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	quiet := rows(1, "test", "quiet")
	if _, err := s.Insert(ctx, pool, quiet, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Insert(ctx, pool, rows(1, "test", "end"), []string{"test:end"}); err != nil {
		t.Fatal(err)
	}

	heard := heardUntil(t, conn, "test:end")
	if want := []string{topic, topic, topic, topic, topic, "test:end"}; !slices.Equal(heard, want) {
		t.Fatalf("notifications %q, want %q (the first insert, and the new events with and without a dedupe key through database/sql and bun; a duplicate, a rolled-back insert and an insert not asked to must not notify)", heard, want)
	}
	var events int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events").Scan(&events); err != nil {
		t.Fatal(err)
	}
	if events != 7 {
		t.Fatalf("%d events, want 7 (the first, two each through database/sql and bun, the quiet one and the marker)", events)
	}
	if e := get(t, s, quiet[0].ID); e.Status != "pending" || e.Attempts != 0 || e.LockedBy != nil {
		t.Fatalf("directly inserted event: %+v, want pending with no attempts", e)
	}
}

// The table's check on event names (migration 0017, written without regular
// expressions so that updates do not pay for them) accepts exactly the
// names of the pattern the client validates against: every string of up to
// three characters from a set of edge characters, lengths around the limit,
// and a corpus of random ones, as namespace and as topic.
func TestNameCheckMatchesPattern(t *testing.T) {
	_, tdb := newStore(t)
	pool := tdb.Provider.Pool
	pattern := regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,127}$`) // outbox's namePattern
	edge := []string{"", "a", "z", "0", "9", ".", "_", "-", "A", "Z", " ", "/", ":", "é", "\n", "`", "{", "@", "[", "^", "$", `\`, "*", "\x7f"}
	var names []string
	for _, a := range edge {
		for _, b := range edge {
			for _, c := range edge {
				names = append(names, a+b+c)
			}
		}
	}
	for n := 125; n <= 130; n++ {
		long := strings.Repeat("a", n)
		names = append(names, long, "-"+long, long+"é", long[:n-1]+"A")
	}
	rnd := rand.New(rand.NewPCG(1, 2))
	r := []rune("abcxyz0189._-AZ /é")
	for range 2000 {
		b := make([]rune, rnd.IntN(12))
		for i := range b {
			b[i] = r[rnd.IntN(len(r))]
		}
		names = append(names, string(b))
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `CREATE FUNCTION pg_temp.accepts(p_namespace text, p_topic text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO modkit_outbox_events (id, namespace, topic, payload) VALUES (gen_random_uuid(), p_namespace, p_topic, '{}');
    RETURN true;
EXCEPTION WHEN check_violation THEN
    RETURN false;
END $$`); err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(ctx, `SELECT n, pg_temp.accepts(n, 'ok'), pg_temp.accepts('ok', n) FROM unnest($1::text[]) AS n`, names)
	if err != nil {
		t.Fatal(err)
	}
	checked, valid := 0, 0
	for rows.Next() {
		var name string
		var asNamespace, asTopic bool
		if err := rows.Scan(&name, &asNamespace, &asTopic); err != nil {
			t.Fatal(err)
		}
		want := pattern.MatchString(name)
		if asNamespace != want || asTopic != want {
			t.Errorf("%q: the table accepts it as namespace %v, as topic %v; the pattern says %v", name, asNamespace, asTopic, want)
		}
		checked++
		if want {
			valid++
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if checked != len(names) || valid == 0 || valid == checked {
		t.Fatalf("checked %d of %d names, %d valid: the corpus must hold both kinds", checked, len(names), valid)
	}
}

// The checks on the message columns hold for new events and are not
// evaluated again by claims and outcomes (migration 0018), which never change
// those columns. So a payload limit lowered below events already enqueued
// refuses new events over it, while the events already there are still
// claimed, retried and delivered: before 0018, the claim's update of such an
// event broke the check and failed the whole claim.
func TestLoweredPayloadLimitLeavesEnqueuedEventsDeliverable(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	// 3,000 random letters: stored uncompressed, so the event stays over the
	// lowered limit as stored (a repetitive payload would be compressed
	// under it).
	rnd := rand.New(rand.NewPCG(3, 4))
	letters := make([]byte, 3000)
	for i := range letters {
		letters[i] = byte('a' + rnd.IntN(26))
	}
	big := `{"text":"` + string(letters) + `"}`
	first := driver.InsertRow{ID: uuid.Must(uuid.NewV7()), Namespace: "test", Topic: "events", Payload: []byte(big)}
	if _, err := s.Insert(ctx, pool, []driver.InsertRow{first}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "SELECT modkit_outbox_set_payload_limit(2048)"); err != nil {
		t.Fatal(err)
	}
	second := driver.InsertRow{ID: uuid.Must(uuid.NewV7()), Namespace: "test", Topic: "events", Payload: []byte(big)}
	_, err := s.Insert(ctx, pool, []driver.InsertRow{second}, nil)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != "modkit_outbox_events_payload_size_check" {
		t.Fatalf("an event over the lowered limit: %v, want a check violation of modkit_outbox_events_payload_size_check", err)
	}

	worker := uuid.New()
	got := claim(t, s, 10, 5, worker)
	if len(got) != 1 || got[0].ID != first.ID {
		t.Fatalf("claimed %+v, want the event enqueued before the limit was lowered", got)
	}
	if settled := complete(t, s, worker, outcome(got[0], driver.Retry)); !slices.Equal(settled, []bool{true}) {
		t.Fatalf("retry recorded: %v, want [true]", settled)
	}
	got = claim(t, s, 10, 5, worker)
	if len(got) != 1 || got[0].ID != first.ID {
		t.Fatalf("claimed %+v after the retry, want the same event", got)
	}
	if settled := complete(t, s, worker, outcome(got[0], driver.Delivered)); !slices.Equal(settled, []bool{true}) {
		t.Fatalf("delivery recorded: %v, want [true]", settled)
	}
	if e := get(t, s, first.ID); e.Status != "delivered" || e.Attempts != 2 {
		t.Fatalf("event after delivery: status %s, %d attempts; want delivered after 2", e.Status, e.Attempts)
	}
}

// A batch of copyMinBatch rows or more goes in by COPY in the binary format
// the driver encodes itself, with the announcement of its topics in the
// same query: every column comes back as written (NULLs, tenants, keys,
// payloads and headers with quotes, backslashes and non-ASCII text),
// through a pgx.Tx and a pool; a topic is announced exactly as given even
// when it needs quoting; a batch the table refuses changes nothing,
// announces nothing and, in a transaction, leaves it usable; a pgx
// CopyFromTracer sees each COPY; and a transaction already committed is
// refused before any SQL runs.
func TestInsertManyByCopy(t *testing.T) {
	s, tdb := newStore(t)
	pool := tdb.Provider.Pool
	conn := listen(t, tdb.DSN)
	tenant := uuid.Must(uuid.NewV7())
	batch := func(name string, n int) []driver.InsertRow {
		out := rows(n, "test", name)
		for i := range out {
			r := &out[i]
			r.Payload = []byte(fmt.Sprintf(`{"i": %d, "text": "quote \" backslash \\ tab \t é ✓ 𝄞", "list": [1, null, true]}`, i))
			if i%2 == 0 {
				r.TenantID = &tenant
			}
			if i%3 == 0 {
				key := fmt.Sprintf("%s-%d 'é' \\", name, i)
				if r.TenantID != nil { // a tenant's keys begin with its id
					key = tenant.String() + "/" + key
				}
				r.DedupeKey = &key
			}
			if i%5 == 0 {
				r.Headers = map[string]string{"traceparent": "00-abc-def-01", "quote": `it's "x" \ é`}
			}
		}
		return out
	}
	check := func(t *testing.T, want []driver.InsertRow, got []driver.Inserted) {
		t.Helper()
		if len(got) != len(want) {
			t.Fatalf("%d results for %d rows", len(got), len(want))
		}
		for i, w := range want {
			if got[i].ID != w.ID || got[i].Duplicate {
				t.Fatalf("result %d: %+v, want the new event %v", i, got[i], w.ID)
			}
			e := get(t, s, w.ID)
			var gotPayload, wantPayload any
			if err := json.Unmarshal(e.Payload, &gotPayload); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(w.Payload, &wantPayload); err != nil {
				t.Fatal(err)
			}
			if e.Namespace != w.Namespace || e.Topic != w.Topic || !reflect.DeepEqual(e.TenantID, w.TenantID) ||
				!reflect.DeepEqual(e.DedupeKey, w.DedupeKey) || !reflect.DeepEqual(gotPayload, wantPayload) ||
				!reflect.DeepEqual(e.Headers, w.Headers) || e.Status != "pending" || e.Attempts != 0 || e.OrderingKey != nil {
				t.Fatalf("row %d reads back as %+v (payload %s), want %+v (payload %s)", i, e, e.Payload, w, w.Payload)
			}
		}
	}
	const odd = `test:it's \ odd`

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	inTx := batch("in-tx", 100)
	got, err := s.Insert(ctx, tx, inTx, []string{"test:in-tx", odd})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	check(t, inTx, got)

	viaPool := batch("pool", 64)
	got, err = s.Insert(ctx, pool, viaPool, []string{"test:pool"})
	if err != nil {
		t.Fatal(err)
	}
	check(t, viaPool, got)

	// An empty namespace breaks the table's check: the COPY fails, its
	// announcement with it, and the transaction is aborted, as a failed
	// INSERT leaves it (and every other runner): the caller rolls it back.
	bad := batch("bad", 70)
	bad[69].Namespace = ""
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := s.Insert(ctx, tx, bad, []string{"test:bad"}); err == nil || !strings.Contains(err.Error(), "23514") {
		t.Fatalf("batch breaking a check in a transaction: %v, want a check violation (23514)", err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1"); err == nil || !strings.Contains(err.Error(), "25P02") {
		t.Fatalf("the transaction after a refused COPY: %v, want it aborted (25P02)", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Insert(ctx, pool, bad, []string{"test:bad"}); err == nil || !strings.Contains(err.Error(), "23514") {
		t.Fatalf("batch breaking a check through the pool: %v, want a check violation (23514)", err)
	}
	// A pgx CopyFromTracer on the connection sees each COPY, in a
	// transaction and through the pool, as it sees pgx's CopyFrom.
	tracer := &copyTracer{}
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tracer
	traced, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer traced.Close()
	if err := pgx.BeginFunc(ctx, traced, func(tx pgx.Tx) error {
		_, err := s.Insert(ctx, tx, batch("traced-tx", 64), nil)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Insert(ctx, traced, batch("traced-pool", 65), nil); err != nil {
		t.Fatal(err)
	}
	columns := []string{"id", "namespace", "topic", "tenant_id", "dedupe_key", "payload", "headers"}
	if want := []string{"start modkit_outbox_events " + strings.Join(columns, ","), "end COPY 64 <nil>",
		"start modkit_outbox_events " + strings.Join(columns, ","), "end COPY 65 <nil>"}; !slices.Equal(tracer.seen, want) {
		t.Fatalf("the tracer saw %q, want %q", tracer.seen, want)
	}

	// A pgx.Tx wrapper without a connection gets the INSERT path, through
	// its own methods, instead of a COPY on a nil connection.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		got, err := s.Insert(ctx, connlessTx{tx}, batch("connless", 64), nil)
		if err == nil && len(got) != 64 {
			err = fmt.Errorf("%d results for 64 rows", len(got))
		}
		return err
	}); err != nil {
		t.Fatalf("batch through a pgx.Tx without a connection: %v", err)
	}

	// The savepoint is released: the caller's transaction is left as it
	// was, plus the rows.
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := s.Insert(ctx, tx, batch("released", 64), nil); err != nil {
		t.Fatal(err)
	}
	var pgErr *pgconn.PgError
	if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT modkit_outbox_copy"); !errors.As(err, &pgErr) || pgErr.Code != "3B001" {
		t.Fatalf("releasing the driver's savepoint again: %v, want invalid_savepoint_specification (3B001)", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// A committed transaction's connection is back in the pool: nothing
	// may run on it.
	if _, err := s.Insert(ctx, tx, batch("closed", 64), []string{"test:closed"}); !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatalf("batch through a committed transaction: %v, want pgx.ErrTxClosed", err)
	}
	// In a transaction that a failed statement has aborted, the batch
	// fails as any statement would (25P02), its COPY data is ignored, and
	// the connection serves the next statement.
	pc, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Release()
	tx, err = pc.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("dividing by zero succeeded")
	}
	if _, err := s.Insert(ctx, tx, batch("aborted", 64), []string{"test:aborted"}); !errors.As(err, &pgErr) || pgErr.Code != "25P02" {
		t.Fatalf("batch in an aborted transaction: %v, want in_failed_sql_transaction (25P02)", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pc.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("the connection after a batch in an aborted transaction: %v", err)
	}
	if _, err := s.Insert(ctx, pool, rows(1, "test", "end"), []string{"test:end"}); err != nil {
		t.Fatal(err)
	}

	heard := heardUntil(t, conn, "test:end")
	if want := []string{"test:in-tx", odd, "test:pool", "test:end"}; !slices.Equal(heard, want) {
		t.Fatalf("notifications %q, want %q (refused batches must not announce)", heard, want)
	}
	var events int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events").Scan(&events); err != nil {
		t.Fatal(err)
	}
	if events != 100+64+64+65+64+1 {
		t.Fatalf("%d events, want %d", events, 100+64+64+65+64+1)
	}
}

// connlessTx is a pgx.Tx wrapper that has no connection to give.
type connlessTx struct{ pgx.Tx }

func (connlessTx) Conn() *pgx.Conn { return nil }

// listen opens a connection that listens on the public schema's
// outboxpg.NotifyChannel.
func listen(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(ctx) })
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{outboxpg.NotifyChannel("public")}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	return conn
}

// heardUntil returns the payloads conn receives up to and including
// marker, in order (notifications arrive in commit order).
func heardUntil(t *testing.T, conn *pgx.Conn, marker string) []string {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var heard []string
	for len(heard) == 0 || heard[len(heard)-1] != marker {
		n, err := conn.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("after %q: %v", heard, err)
		}
		heard = append(heard, n.Payload)
	}
	return heard
}

// copyTracer records the COPYs a connection reports to its tracer.
type copyTracer struct{ seen []string }

func (*copyTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (*copyTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *copyTracer) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceCopyFromStartData) context.Context {
	c.seen = append(c.seen, "start "+data.TableName[len(data.TableName)-1]+" "+strings.Join(data.ColumnNames, ","))
	return ctx
}

func (c *copyTracer) TraceCopyFromEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceCopyFromEndData) {
	c.seen = append(c.seen, fmt.Sprintf("end %s %v", data.CommandTag, data.Err))
}
