package outbox_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// Every spelling of a tenant's key finds the same row, stored in one
// canonical spelling; a key with a tenant's prefix cannot be enqueued
// without that tenant, so no one can pre-claim another tenant's key.
func TestTenantKeys(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tenant := uuid.New()
	hyph, hex := tenant.String(), strings.ReplaceAll(tenant.String(), "-", "")
	var first uuid.UUID
	for i, prefix := range []string{hyph, strings.ToUpper(hyph), hex, strings.ToUpper(hex)} {
		m := keyed(i, prefix+"/order-1")
		m.TenantID = outbox.Tenant(tenant)
		res, err := client.Enqueue(ctx, pool, m)
		if err != nil {
			t.Fatalf("spelling %d: %v", i, err)
		}
		if i == 0 {
			first = res.ID
		} else if !res.AlreadyEnqueued || res.ID != first {
			t.Fatalf("spelling %d (%s): %+v, want the first row %s", i, prefix, res, first)
		}
	}
	if e := get(t, client, first); e.DedupeKey == nil || *e.DedupeKey != hyph+"/order-1" {
		t.Fatalf("stored key %v, want the canonical %s/order-1", e.DedupeKey, hyph)
	}

	// Forging: the tenant's prefix without the tenant, in either form.
	for _, prefix := range []string{hyph, hex} {
		_, err := client.Enqueue(ctx, pool, keyed(9, prefix+"/order-2"))
		if !errors.Is(err, outbox.ErrTenantMismatch) {
			t.Fatalf("a key with tenant %s's prefix and no TenantID: %v, want ErrTenantMismatch", tenant, err)
		}
	}
	other := keyed(9, hyph+"/order-2")
	other.TenantID = outbox.Tenant(uuid.New())
	if _, err := client.Enqueue(ctx, pool, other); !errors.Is(err, outbox.ErrTenantMismatch) {
		t.Fatalf("another tenant's prefix: %v, want ErrTenantMismatch", err)
	}
	// The nil UUID's prefix: no tenant can own it, so the error does not
	// say to set TenantID to it (which ErrInvalidTenant refuses).
	_, err := client.Enqueue(ctx, pool, keyed(9, uuid.Nil.String()+"/order-2"))
	if !errors.Is(err, outbox.ErrTenantMismatch) || strings.Contains(err.Error(), "set TenantID") {
		t.Fatalf("a key with the nil UUID's prefix: %v, want ErrTenantMismatch that does not say to set TenantID", err)
	}
	if n := countRows(t, pool, "true"); n != 1 {
		t.Fatalf("%d rows after refused enqueues, want 1", n)
	}
	// A key that merely looks like data is fine without a tenant.
	if _, err := client.Enqueue(ctx, pool, keyed(10, "order:"+hyph)); err != nil {
		t.Fatal(err)
	}

	// The length limit holds for the key as stored: a 512-byte key with the
	// 32-hex prefix would be stored 4 bytes longer. It is refused before any
	// SQL runs, and the caller's transaction goes on; 508 bytes are fine.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, size := range []int{512, 508} {
		m := keyed(11, hex+"/"+strings.Repeat("x", size-len(hex)-1))
		m.TenantID = outbox.Tenant(tenant)
		_, err := client.Enqueue(ctx, tx, m)
		switch {
		case size == 512 && !errors.Is(err, outbox.ErrInvalidDedupeKey):
			t.Fatalf("a %d-byte key with the 32-hex prefix: %v, want ErrInvalidDedupeKey", size, err)
		case size == 508 && err != nil:
			t.Fatalf("a %d-byte key with the 32-hex prefix (512 as stored): %v", size, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("the transaction after a refused key: %v", err)
	}
}

// The database holds writers that bypass the library to the same rules:
// names, key length, tenant binding, headers, ordering, payload size. Each
// refusal names the constraint of the rule broken (since migration 0020 the
// message rules are one constraint whose function raises the violation under
// the rule's own name); a row that breaks several is refused under the name
// PostgreSQL reported before 0020, the first of them by name.
func TestDatabaseChecks(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tenant := uuid.New()
	insert := `INSERT INTO modkit_outbox_events (id, namespace, topic, tenant_id, dedupe_key, payload, headers, ordering_seq)
		VALUES (gen_random_uuid(), $1, $2, $3, $4, $5::jsonb, $6::jsonb, $7)`
	for name, c := range map[string]struct {
		args       []any
		constraint string
	}{
		"empty topic":                    {[]any{"shop", "", nil, nil, `{}`, nil, nil}, "name_pattern_check"},
		"an empty key, upper-case topic": {[]any{"shop", "T", nil, "", `{}`, nil, nil}, "dedupe_key_check"},
		"long key, array headers, Shop":  {[]any{"Shop", "t", nil, strings.Repeat("k", 600), `{}`, `[1]`, nil}, "dedupe_key_length_check"},
		"namespace with spaces and SQL":  {[]any{"Shop:Order Paid; --", "t", nil, nil, `{}`, nil, nil}, "name_pattern_check"},
		"upper-case topic":               {[]any{"shop", "OrderPaid", nil, nil, `{}`, nil, nil}, "name_pattern_check"},
		"empty key":                      {[]any{"shop", "t", nil, "", `{}`, nil, nil}, "dedupe_key_check"},
		"key of 513 bytes":               {[]any{"shop", "t", nil, strings.Repeat("k", 513), `{}`, nil, nil}, "dedupe_key_length_check"},
		"tenant prefix without tenant":   {[]any{"shop", "t", nil, tenant.String() + "/k", `{}`, nil, nil}, "tenant_key_check"},
		"bare hex prefix without tenant": {[]any{"shop", "t", nil, strings.ReplaceAll(tenant.String(), "-", "") + "/k", `{}`, nil, nil}, "tenant_key_check"},
		"another tenant's prefix":        {[]any{"shop", "t", uuid.New(), tenant.String() + "/k", `{}`, nil, nil}, "tenant_key_check"},
		"non-canonical spelling":         {[]any{"shop", "t", tenant, strings.ToUpper(tenant.String()) + "/k", `{}`, nil, nil}, "tenant_key_check"},
		"tenant key without prefix":      {[]any{"shop", "t", tenant, "k", `{}`, nil, nil}, "tenant_key_check"},
		"headers that are an array":      {[]any{"shop", "t", nil, nil, `{}`, `["a"]`, nil}, "headers_check"},
		"headers of 70 kB":               {[]any{"shop", "t", nil, nil, `{}`, `{"h":"` + strings.Repeat("a", 70<<10) + `"}`, nil}, "headers_check"},
		"a sequence without a key":       {[]any{"shop", "t", nil, nil, `{}`, nil, 1}, "ordering_check"},
		"5 MB payload":                   {[]any{"shop", "t", nil, nil, `{"x":"` + strings.Repeat("a", 5<<20) + `"}`, nil, nil}, "payload_size_check"},
	} {
		_, err := pool.Exec(ctx, insert, c.args...)
		var pgErr *pgconn.PgError
		if want := "modkit_outbox_events_" + c.constraint; !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != want {
			t.Errorf("%s: %v, want a check violation (23514) of %s", name, err, want)
		}
	}
	if _, err := pool.Exec(ctx, insert, "shop", "t", tenant, tenant.String()+"/k", `{}`, `{"h":"v"}`, nil); err != nil {
		t.Fatalf("a valid row: %v", err)
	}
	if n := countRows(t, pool, "true"); n != 1 {
		t.Fatalf("%d rows after the refused inserts and a valid one, want 1", n)
	}
}

// A dedupe race under REPEATABLE READ is a typed, retryable error.
func TestDedupeRaceRepeatableRead(t *testing.T) {
	client, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil { // takes the snapshot
		t.Fatal(err)
	}
	if _, err := client.Enqueue(ctx, pool, keyed(1, "race")); err != nil {
		t.Fatal(err)
	}
	_, err = client.Enqueue(ctx, tx, keyed(2, "race"))
	if !errors.Is(err, outbox.ErrConflict) {
		t.Fatalf("enqueue racing a committed duplicate under REPEATABLE READ: %v, want ErrConflict", err)
	}
	// Retried, the whole transaction sees the first event.
	_ = tx.Rollback(ctx)
	res, err := client.Enqueue(ctx, pool, keyed(2, "race"))
	if err != nil || !res.AlreadyEnqueued {
		t.Fatalf("retry: %+v %v", res, err)
	}
}
