package app

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/internal/pgtest"
)

// The per-turn comparison checks whom a usage record bills: a record
// charged to another user than its turn's (or another chat) does not pair
// up. It compared the usage figures only, so such a run reconciled.
func TestMismatchComparesWhoWasBilled(t *testing.T) {
	tdb, tenants := reconciledRun(t)
	ctx, pool := t.Context(), tdb.Provider.Pool
	for i, column := range []string{"user_id", "chat_id"} { // one record each
		if _, err := pool.Exec(ctx, `UPDATE minichat_usage_records SET `+column+` = gen_random_uuid()
			WHERE (tenant_id, turn_id) IN (SELECT tenant_id, turn_id FROM minichat_usage_records ORDER BY turn_id OFFSET $1 LIMIT 1)`,
			i); err != nil {
			t.Fatal(err)
		}
		var s Summary
		if err := readSummary(ctx, pool, tenants, &s); err != nil {
			t.Fatal(err)
		}
		if s.TurnsMismatched != int64(i+1) {
			t.Fatalf("a usage record billed to another %s: %d turns mismatched, want %d", column, s.TurnsMismatched, i+1)
		}
	}
}

// A usage event lost after its turn was finalised (its row gone) does not
// hold the run up until its drain timeout: the run settles, and the
// reconciliation reports the turn without an event. waitSettled waited for
// the counts to agree, so a loss ended as "run not settled" (could not
// run) instead of a failed reconciliation.
func TestLostEventFailsTheReconciliation(t *testing.T) {
	tdb, tenants := reconciledRun(t)
	ctx, pool := t.Context(), tdb.Provider.Pool
	if _, err := pool.Exec(ctx, `DELETE FROM modkit_outbox_events WHERE id = (SELECT id FROM modkit_outbox_events
		WHERE tenant_id = ANY($1) AND status = 'delivered' ORDER BY id LIMIT 1)`, tenants); err != nil {
		t.Fatal(err)
	}
	sc := &scenario{opts: Options{DrainTimeout: time.Minute, MalformedEvents: 3, Turns: 10}, tenants: tenants, prov: tdb.Provider}
	if err := sc.waitSettled(ctx); err != nil { // a guard: settling waited for counts that cannot agree
		t.Fatalf("settling after a lost event: %v", err)
	}
	var s Summary
	if err := readSummary(ctx, pool, tenants, &s); err != nil {
		t.Fatal(err)
	}
	s.check(10, 3)
	if s.Reconciled || !strings.Contains(strings.Join(s.Mismatches, "\n"), "usage events for") {
		t.Fatalf("a lost event: reconciled %v, mismatches %q", s.Reconciled, s.Mismatches)
	}
}

// reconciledRun runs a small scenario that must reconcile, and returns its
// database and tenants.
func reconciledRun(t *testing.T) (*pgtest.DB, []uuid.UUID) {
	t.Helper()
	tdb := pgtest.NewDB(t)
	sum, err := Run(t.Context(), Options{DSN: tdb.DSN, Turns: 10, Users: 2, Seed: 3, DrainTimeout: 30 * time.Second,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil || !sum.Reconciled {
		t.Fatalf("run: %v, reconciled %v: %q", err, sum.Reconciled, sum.Mismatches)
	}
	var tenants []uuid.UUID
	if err := tdb.Provider.Pool.QueryRow(t.Context(), `SELECT array_agg(DISTINCT tenant_id ORDER BY tenant_id) FROM minichat_turns`).
		Scan(&tenants); err != nil {
		t.Fatal(err)
	}
	return tdb, tenants
}
