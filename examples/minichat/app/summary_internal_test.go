package app

import (
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/internal/pgtest"
)

// The per-turn comparison checks whom a usage record bills: a record
// charged to another user than its turn's (or another chat) does not pair
// up. It compared the usage figures only, so such a run reconciled.
func TestMismatchComparesWhoWasBilled(t *testing.T) {
	tdb := pgtest.NewDB(t)
	ctx, pool := t.Context(), tdb.Provider.Pool
	sum, err := Run(ctx, Options{DSN: tdb.DSN, Turns: 10, Users: 2, Seed: 3, DrainTimeout: 30 * time.Second,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil || !sum.Reconciled {
		t.Fatalf("run: %v, reconciled %v: %q", err, sum.Reconciled, sum.Mismatches)
	}
	rows, err := pool.Query(ctx, `SELECT DISTINCT tenant_id FROM minichat_turns`)
	if err != nil {
		t.Fatal(err)
	}
	var tenants []uuid.UUID
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		tenants = append(tenants, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
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
