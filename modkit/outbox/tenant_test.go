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
	if n := countRows(t, pool, "true"); n != 1 {
		t.Fatalf("%d rows after refused enqueues, want 1", n)
	}
	// A key that merely looks like data is fine without a tenant.
	if _, err := client.Enqueue(ctx, pool, keyed(10, "order:"+hyph)); err != nil {
		t.Fatal(err)
	}
}

// The database holds writers that bypass the library to the same rules:
// names, key length, tenant binding, payload size.
func TestDatabaseChecks(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	tenant := uuid.New()
	insert := `INSERT INTO modkit_outbox_events (id, namespace, topic, tenant_id, dedupe_key, payload) VALUES (gen_random_uuid(), $1, $2, $3, $4, $5::jsonb)`
	for name, args := range map[string][]any{
		"namespace with spaces and SQL":  {"Shop:Order Paid; --", "t", nil, nil, `{}`},
		"upper-case topic":               {"shop", "OrderPaid", nil, nil, `{}`},
		"key of 513 bytes":               {"shop", "t", nil, strings.Repeat("k", 513), `{}`},
		"tenant prefix without tenant":   {"shop", "t", nil, tenant.String() + "/k", `{}`},
		"bare hex prefix without tenant": {"shop", "t", nil, strings.ReplaceAll(tenant.String(), "-", "") + "/k", `{}`},
		"another tenant's prefix":        {"shop", "t", uuid.New(), tenant.String() + "/k", `{}`},
		"non-canonical spelling":         {"shop", "t", tenant, strings.ToUpper(tenant.String()) + "/k", `{}`},
		"tenant key without prefix":      {"shop", "t", tenant, "k", `{}`},
		"5 MB payload":                   {"shop", "t", nil, nil, `{"x":"` + strings.Repeat("a", 5<<20) + `"}`},
	} {
		_, err := pool.Exec(ctx, insert, args...)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" {
			t.Errorf("%s: %v, want a check violation (23514)", name, err)
		}
	}
	if _, err := pool.Exec(ctx, insert, "shop", "t", tenant, tenant.String()+"/k", `{}`); err != nil {
		t.Fatalf("a valid row: %v", err)
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
