package outbox_test

// Bad input (issue 7, item 12): fuzz targets for message validation and for
// the configurable identifiers (schema and table names). Plain `go test`
// runs their seed corpus; `go test -fuzz=FuzzMessageValidation
// ./modkit/outbox` explores further.
//
// That every validation error path writes nothing is also covered case by
// case by TestEnqueueValidation (single and batch enqueue, no row written).

import (
	"encoding/json"
	"errors"
	"math/big"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// fuzzPayloadLimit keeps fuzzed payloads small, and lets the corpus reach
// the size limit.
const fuzzPayloadLimit = 4096

// FuzzMessageValidation feeds arbitrary namespaces, topics, dedupe keys,
// tenants and payloads to Enqueue, in a transaction that is rolled back.
// Either the message is rejected with a typed validation error
// (ErrInvalidMessage, *ValidationError), nothing is written and the
// transaction stays usable, or it is stored and reads back exactly (the
// payload as the same JSON value: jsonb normalises whitespace, key order,
// duplicate keys and number spelling).
func FuzzMessageValidation(f *testing.F) {
	tdb := pgtest.NewDB(f)
	pool := tdb.Provider.Pool
	client, err := outbox.New(outboxpg.New(pool), outbox.Config{MaxPayloadBytes: fuzzPayloadLimit, DisableNotify: true})
	if err != nil {
		f.Fatal(err)
	}
	tenant := uuid.MustParse("0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65")
	hex := strings.ReplaceAll(tenant.String(), "-", "")
	none := []byte{}
	for _, s := range []struct {
		ns, topic, key string
		hasKey         bool
		payload        string
		tenant         []byte
	}{
		{"chat", "turn_done", "", false, `{"a":1}`, none},
		{"mini-chat", "usage.snapshot_v2", "k/1", true, `[1,"x",null,true,{"b":[]}]`, none},
		{"Chat", "t", "", false, `{}`, none},
		{"a:b", "t", "", false, `{}`, none},
		{strings.Repeat("a", 128), strings.Repeat("b", 128), "", false, `1`, none},
		{strings.Repeat("a", 129), "t", "", false, `1`, none},
		{"n", "x'; DROP TABLE modkit_outbox_events; --", "", false, `{}`, none},
		{"n", "t", "", false, ``, none},
		{"n", "t", "", false, `{"a":`, none},
		{"n", "t", "", false, `{} {}`, none},
		{"n", "t", "", false, `{"a":"x\u0000y"}`, none},
		{"n", "t", "", false, `{"\u0000":1}`, none},
		{"n", "t", "", false, `{"a":"\\u0000 is only text"}`, none},
		{"n", "t", "", false, `"` + strings.Repeat("x", fuzzPayloadLimit) + `"`, none},
		{"n", "t", "", false, `{"z":1,"a":2,"a":3,"n":1.50,"m":-0,"e":1e2,"u":"\u00e9\ud83d\ude00"}`, none},
		{"n", "t", "", true, `{}`, none},
		{"n", "t", " \t", true, `{}`, none},
		{"n", "t", strings.Repeat("k", 512), true, `{}`, none},
		{"n", "t", strings.Repeat("k", 513), true, `{}`, none},
		{"n", "t", "a\x00b", true, `{}`, none},
		{"n", "t", "a\xffb", true, `{}`, none},
		{"n", "t", "'; DELETE FROM modkit_outbox_events; --", true, `{}`, none},
		{"n", "t", "", false, `{}`, make([]byte, 16)},
		{"n", "t", hex + "/turn/1", true, `{}`, tenant[:]},
		{"n", "t", strings.ToUpper(tenant.String()) + "/turn/2", true, `{}`, tenant[:]},
		{"n", "t", "3f2a9c4e-1b7d-4e8a-9c6f-5d4b3a2e1f0c/turn/3", true, `{}`, tenant[:]},
		{"n", "t", hex, true, `{}`, tenant[:]},
		{"n", "t", "", false, `{"deep":[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}`, tenant[:]},
	} {
		f.Add(s.ns, s.topic, s.key, s.hasKey, []byte(s.payload), s.tenant)
	}
	f.Fuzz(func(t *testing.T, namespace, topic, key string, hasKey bool, payload, tenantBytes []byte) {
		m := outbox.Message{Namespace: namespace, Topic: topic, Payload: payload}
		if hasKey {
			m.DedupeKey = &key
		}
		if len(tenantBytes) == 16 {
			id := uuid.UUID(tenantBytes)
			m.TenantID = &id
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		res, err := client.Enqueue(ctx, tx, m)
		if err != nil {
			var ve *outbox.ValidationError
			if !errors.Is(err, outbox.ErrInvalidMessage) || !errors.As(err, &ve) || !errors.Is(err, ve.Kind) {
				t.Fatalf("untyped error %v for %+v", err, m)
			}
			// Nothing written, the transaction still usable, and the batch
			// path rejects it too, writing none of the batch.
			if n := countIn(t, tx); n != 0 {
				t.Fatalf("%d rows written by a rejected message", n)
			}
			_, berr := client.EnqueueBatch(ctx, tx, []outbox.Message{msg(0), m})
			if !errors.As(berr, &ve) || ve.Index != 1 || !errors.Is(berr, outbox.ErrInvalidMessage) {
				t.Fatalf("batch: %v, want a validation error at index 1", berr)
			}
			if n := countIn(t, tx); n != 0 {
				t.Fatalf("%d rows written by a rejected batch", n)
			}
			return
		}
		var got struct {
			ns, topic string
			tenant    *uuid.UUID
			key       *string
			payload   []byte
		}
		if err := tx.QueryRow(ctx, `SELECT namespace, topic, tenant_id, dedupe_key, payload FROM modkit_outbox_events WHERE id = $1`, res.ID).
			Scan(&got.ns, &got.topic, &got.tenant, &got.key, &got.payload); err != nil {
			t.Fatal(err)
		}
		// A tenant's key is stored with its prefix in the canonical
		// spelling.
		wantKey := m.DedupeKey
		if k := m.DedupeKey; k != nil && m.TenantID != nil {
			n := 36
			if len(*k) > 32 && (*k)[32] == '/' {
				n = 32
			}
			canonical := m.TenantID.String() + (*k)[n:]
			wantKey = &canonical
		}
		if got.ns != m.Namespace || got.topic != m.Topic || !equalPtr(got.tenant, m.TenantID) || !equalPtr(got.key, wantKey) {
			t.Fatalf("stored (%q, %q, %v, %v), want (%q, %q, %v, %v)", got.ns, got.topic, got.tenant, got.key,
				m.Namespace, m.Topic, m.TenantID, wantKey)
		}
		if !sameJSON(t, m.Payload, got.payload) {
			t.Fatalf("payload %s stored as %s", m.Payload, got.payload)
		}
	})
}

func countIn(t *testing.T, tx pgx.Tx) int {
	t.Helper()
	var n int
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM modkit_outbox_events").Scan(&n); err != nil {
		t.Fatalf("the transaction is no longer usable: %v", err)
	}
	return n
}

func equalPtr[T comparable](a, b *T) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}

// sameJSON reports whether a and b are the same JSON value: objects with the
// same members (the last of duplicate keys counting, as in jsonb), arrays
// element by element, numbers by exact decimal value.
func sameJSON(t *testing.T, a, b []byte) bool {
	t.Helper()
	decode := func(doc []byte) any {
		d := json.NewDecoder(strings.NewReader(string(doc)))
		d.UseNumber()
		var v any
		if err := d.Decode(&v); err != nil {
			t.Fatalf("decode %s: %v", doc, err)
		}
		return v
	}
	return equalJSON(decode(a), decode(b))
}

func equalJSON(a, b any) bool {
	switch a := a.(type) {
	case map[string]any:
		b, ok := b.(map[string]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for k, v := range a {
			if w, ok := b[k]; !ok || !equalJSON(v, w) {
				return false
			}
		}
		return true
	case []any:
		b, ok := b.([]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for i := range a {
			if !equalJSON(a[i], b[i]) {
				return false
			}
		}
		return true
	case json.Number:
		b, ok := b.(json.Number)
		if !ok {
			return false
		}
		x, okx := new(big.Rat).SetString(a.String())
		y, oky := new(big.Rat).SetString(b.String())
		return okx && oky && x.Cmp(y) == 0
	default:
		return a == b
	}
}

// TestPayloadValidationMatchesJSONB pins validation to what PostgreSQL's
// jsonb really stores: Go's json.Valid accepts invalid UTF-8, \u0000,
// unpaired surrogate escapes and numbers beyond numeric's range, all of
// which jsonb refuses. Each case is sent to the server as jsonb directly to
// learn the truth, then through Enqueue: a payload the server refuses must be
// rejected with ErrInvalidPayload before any SQL runs, leaving the caller's
// transaction usable; one it stores must be accepted.
func TestPayloadValidationMatchesJSONB(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	zeros := strings.Repeat("0", 16383)
	for _, payload := range []string{
		`{"a":"\ud800"}`, `{"a":"\udc00"}`, `"\ud83d\ude00"`, `"\uD83D\uDE00"`, `"\ud83dx"`, `"\ud83d\u0041"`, `"\ud83d"`,
		"{\"a\":\"\xff\"}", "\"\xc3\x28\"", `"\u0000"`, `"\\u0000"`, `{"\u0000":1}`,
		`1e131071`, `1e131072`, `9.9e131071`, `123e131069`, `123e131070`, `0.001e131074`, `0.001e131075`,
		`1e-16383`, `1e-16384`, `0.5e-16383`, `12.5e-16382`, `0e-20000`, `0e200000`, `0.0e131072`,
		`0e1073741822`, `0e1073741823`, `1e1000000`, `-1e-1000000`, `1E+5`, `-0`, `[1e2,-3.5E-2,0.0]`,
		`0.` + zeros[1:] + `1`, `0.` + zeros + `1`, `"e1e1000000"`,
	} {
		if !json.Valid([]byte(payload)) {
			t.Fatalf("%q is not valid JSON to Go; the case shows nothing", payload)
		}
		_, serverErr := pool.Exec(ctx, "SELECT $1::text::jsonb", payload)
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Enqueue(ctx, tx, outbox.Message{Namespace: "n", Topic: "t", Payload: json.RawMessage(payload)})
		switch {
		case serverErr == nil && err != nil:
			t.Errorf("%.60q: jsonb stores it but Enqueue refused it: %v", payload, err)
		case serverErr != nil && err == nil:
			t.Errorf("%.60q: jsonb refuses it (%v) but Enqueue accepted it", payload, serverErr)
		case serverErr != nil && !errors.Is(err, outbox.ErrInvalidPayload):
			t.Errorf("%.60q: want ErrInvalidPayload, got %v", payload, err)
		case serverErr != nil:
			if _, after := tx.Exec(ctx, "SELECT 1"); after != nil {
				t.Errorf("%.60q: the caller's transaction was aborted: %v", payload, after)
			}
			if n := countIn(t, tx); n != 0 {
				t.Errorf("%.60q: rejected but %d rows written", payload, n)
			}
		}
		_ = tx.Rollback(ctx)
	}
}

// jsonb keeps a number as numeric, which prints every digit: the payload
// limit counts numbers as PostgreSQL prints them, so a few bytes of 1e131071
// cannot come back as gigabytes that no read (no claim) can return. For
// each number, a limit of its printed size (or its text's, if longer)
// takes it, and one byte less refuses it with ErrPayloadTooLarge before
// any SQL runs.
func TestPayloadLimitCountsNumbersAsPrinted(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	for _, number := range []string{
		`1e3`, `1E+3`, `-1e3`, `1.5e3`, `1.50e1`, `1.5e-3`, `-1.5e-3`, `0.001e5`, `0.00123e-2`, `12.5e-16382`,
		`0e9`, `0.000e-5000`, `-0e-3`, `1e0`, `10e-1`, `1e131071`, `-9.9e131071`, `1e-16383`, `123`, `-0.5`,
	} {
		var printed int
		if err := pool.QueryRow(ctx, "SELECT octet_length($1::text::jsonb::text)", number).Scan(&printed); err != nil {
			t.Fatal(err)
		}
		limit := max(printed, len(number))
		payload := json.RawMessage(`[` + number + `]`) // the brackets print as written
		for _, c := range []struct {
			limit int
			ok    bool
		}{{limit + 2, true}, {limit + 1, false}} {
			cl := clientOn(t, pool, outbox.Config{MaxPayloadBytes: c.limit})
			_, err := cl.Enqueue(ctx, pool, outbox.Message{Namespace: "n", Topic: "t", Payload: payload})
			switch {
			case c.ok && err != nil:
				t.Errorf("%s (printed in %d bytes) with a limit of %d: %v", payload, printed+2, c.limit, err)
			case !c.ok && !errors.Is(err, outbox.ErrPayloadTooLarge):
				t.Errorf("%s (printed in %d bytes) with a limit of %d: %v, want ErrPayloadTooLarge", payload, printed+2, c.limit, err)
			}
		}
	}
	// A payload of such numbers far past the limit as printed, though
	// small as written, is refused and writes nothing.
	poison := json.RawMessage("[" + strings.Repeat("1e131071,", 99) + "1e131071]")
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	before := countIn(t, tx)
	c := clientOn(t, pool, outbox.Config{})
	_, err = c.Enqueue(ctx, tx, outbox.Message{Namespace: "n", Topic: "t", Payload: poison})
	if !errors.Is(err, outbox.ErrPayloadTooLarge) || !strings.Contains(err.Error(), "as PostgreSQL prints its numbers") {
		t.Fatalf("%d bytes printing as %d MB: %v, want ErrPayloadTooLarge saying why", len(poison), 100*131072/1_000_000, err)
	}
	if n := countIn(t, tx) - before; n != 0 {
		t.Fatalf("refused but %d rows written", n)
	}
}

// safeIdentifier is what an accepted schema or table name must look like
// for it to be harmless in SQL even unquoted.
var safeIdentifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// FuzzSchemaName checks the configurable identifiers: a schema (or
// migrations table) name is accepted or refused consistently by
// db.ValidateSchema, outbox.New (Config.Schema) and db.MigratorConfig;
// refusals are ErrInvalidSchema (and, from outbox.New, ErrInvalidConfig);
// accepted names are plain identifiers, and migrating and using an outbox
// in such a schema touches exactly that schema, as named (quoted, so
// case-sensitive), never another one.
func FuzzSchemaName(f *testing.F) {
	tdb := pgtest.NewDB(f)
	pool := tdb.Provider.Pool
	for _, s := range []string{
		"tenant_outbox", "Tenant", "_x", strings.Repeat("a", 63), strings.Repeat("a", 64),
		"x; DROP TABLE y", `a"b`, `"public"`, "9x", "", "a b", "ümlaut", "a-b", "a.b", "public", "pg_x",
		"x\n", "modkit_outbox_events",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		verr := db.ValidateSchema(name)
		_, perr := outbox.New(outboxpg.New(pool), outbox.Config{Schema: name})
		_, merr := db.NewMigrator(pool, db.MigratorConfig{Schema: name})
		_, terr := db.NewMigrator(pool, db.MigratorConfig{Table: name})
		if name == "" { // the defaults: public, the standard table
			if perr != nil || merr != nil || terr != nil {
				t.Fatalf("empty name: %v / %v / %v", perr, merr, terr)
			}
			return
		}
		if verr != nil {
			for what, err := range map[string]error{"ValidateSchema": verr, "outbox.Config.Schema": perr,
				"MigratorConfig.Schema": merr, "MigratorConfig.Table": terr} {
				if !errors.Is(err, db.ErrInvalidSchema) {
					t.Fatalf("%q refused by ValidateSchema but %s gives %v", name, what, err)
				}
			}
			if !errors.Is(perr, outbox.ErrInvalidConfig) {
				t.Fatalf("%q: outbox.New gives %v, want ErrInvalidConfig", name, perr)
			}
			return
		}
		if perr != nil || merr != nil || terr != nil {
			t.Fatalf("%q accepted by ValidateSchema, refused elsewhere: %v / %v / %v", name, perr, merr, terr)
		}
		if !safeIdentifier.MatchString(name) {
			t.Fatalf("%q accepted but is not a plain identifier", name)
		}
		if q := (pgx.Identifier{name}).Sanitize(); q != `"`+name+`"` {
			t.Fatalf("%q quotes as %s", name, q)
		}
		useSchema(t, pool, name)
	})
}

// useSchema migrates a new schema called name with Client.Migrate,
// enqueues an event through a Client configured with it, claims and
// delivers it through the driver in that schema, checks through the
// client's Admin that it is delivered, and that the event lives in that
// schema's table and nowhere else; then drops the schema. Schemas that
// already exist (public, the catalogs) are left alone.
func useSchema(t *testing.T, pool *pgxpool.Pool, name string) {
	t.Helper()
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		return
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %q: %v", name, err)
		}
	})
	c := clientOn(t, pool, outbox.Config{Schema: name, DisableNotify: true})
	if err := c.Migrate(ctx); err != nil {
		t.Fatalf("migrate schema %q: %v", name, err)
	}
	res, err := c.Enqueue(ctx, pool, keyed(1, name))
	if err != nil {
		t.Fatal(err)
	}
	st := admStore(t, pool, name, nil)
	got := admClaim(t, st, 10)
	if len(got) != 1 || got[0].ID != res.ID {
		t.Fatalf("claim in schema %q: %+v", name, got)
	}
	admSettle(t, st, driver.Delivered, "", got...)
	if e := get(t, c, res.ID); e.Status != outbox.StatusDelivered {
		t.Fatalf("event in schema %q: %+v", name, e)
	}
	// Find the event in every outbox table of the database.
	rows, err := pool.Query(ctx, `SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relname = 'modkit_outbox_events' AND c.relkind = 'r'`)
	if err != nil {
		t.Fatal(err)
	}
	schemas, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var holders []string
	for _, sch := range schemas {
		var n int
		q := "SELECT count(*) FROM " + pgx.Identifier{sch, "modkit_outbox_events"}.Sanitize() + " WHERE id = $1 AND status = 'delivered'"
		if err := pool.QueryRow(ctx, q, res.ID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			holders = append(holders, sch)
		}
	}
	if len(holders) != 1 || holders[0] != name {
		t.Fatalf("the event of schema %q is in %q", name, holders)
	}
}
