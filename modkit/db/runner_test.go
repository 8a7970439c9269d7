package db_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/uptrace/bun"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
)

// runnerKind opens one kind of Runner on the test database. For transaction
// kinds, commit and rollback finish it; for connection kinds they are nil.
type runnerKind struct {
	name string
	open func(t *testing.T, p *db.Provider) (r db.Runner, commit, rollback func() error)
}

func runnerKinds() []runnerKind {
	ctx := context.Background()
	return []runnerKind{
		{"pgx.Tx", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			tx, err := p.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return tx, func() error { return tx.Commit(ctx) }, func() error { return tx.Rollback(ctx) }
		}},
		{"*pgxpool.Pool", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			return p.Pool, nil, nil
		}},
		{"*pgx.Conn", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			c, err := p.Pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(c.Release)
			return c.Conn(), nil, nil
		}},
		{"bun.Tx", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			tx, err := p.Bun.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return tx, tx.Commit, tx.Rollback
		}},
		{"bun.IDB(tx)", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			tx, err := p.Bun.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var idb bun.IDB = &tx
			return idb, tx.Commit, tx.Rollback
		}},
		{"bun.IDB(db)", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			var idb bun.IDB = p.Bun
			return idb, nil, nil
		}},
		{"*sql.Tx", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			tx, err := p.SQL.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return tx, tx.Commit, tx.Rollback
		}},
		{"*sql.DB", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			return p.SQL, nil, nil
		}},
	}
}

func count(t *testing.T, p *db.Provider, name string) int {
	t.Helper()
	var n int
	if err := p.Pool.QueryRow(context.Background(), "SELECT count(*) FROM runner_probe WHERE name = $1", name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestRunnerKinds(t *testing.T) {
	ctx := context.Background()
	tdb := pgtest.NewDB(t)
	p := tdb.Provider
	if _, err := p.Pool.Exec(ctx, "CREATE TABLE runner_probe (name text NOT NULL, v int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	for _, kind := range runnerKinds() {
		t.Run(kind.name, func(t *testing.T) {
			for _, finish := range []string{"commit", "rollback"} {
				r, commit, rollback := kind.open(t, p)
				q, err := db.AsQuerier(r)
				if err != nil {
					t.Fatal(err)
				}
				name := kind.name + "/" + finish
				n, err := q.Exec(ctx, "INSERT INTO runner_probe (name, v) VALUES ($1, $2), ($1, $3)", name, 1, 2)
				if err != nil || n != 2 {
					t.Fatalf("Exec: n=%d err=%v", n, err)
				}
				var sum int
				if err := q.QueryRow(ctx, "SELECT sum(v) FROM runner_probe WHERE name = $1", name).Scan(&sum); err != nil || sum != 3 {
					t.Fatalf("QueryRow: sum=%d err=%v", sum, err)
				}
				rows, err := q.Query(ctx, "SELECT v FROM runner_probe WHERE name = $1 ORDER BY v", name)
				if err != nil {
					t.Fatal(err)
				}
				var got []int
				for rows.Next() {
					var v int
					if err := rows.Scan(&v); err != nil {
						t.Fatal(err)
					}
					got = append(got, v)
				}
				rows.Close()
				if rows.Err() != nil || len(got) != 2 || got[0] != 1 || got[1] != 2 {
					t.Fatalf("Query: got %v err=%v", got, rows.Err())
				}
				if err := q.QueryRow(ctx, "SELECT v FROM runner_probe WHERE false").Scan(new(int)); !errors.Is(err, db.ErrNoRows) ||
					!errors.Is(err, pgx.ErrNoRows) || !errors.Is(err, sql.ErrNoRows) {
					t.Fatalf("no row: want ErrNoRows, got %v", err)
				}
				if commit == nil { // a connection, not a transaction: visible at once.
					if c := count(t, p, name); c != 2 {
						t.Fatalf("autocommit: %d rows visible, want 2", c)
					}
					break
				}
				if c := count(t, p, name); c != 0 {
					t.Fatalf("before %s: %d rows visible from another connection, want 0", finish, c)
				}
				want := 2
				if finish == "commit" {
					err = commit()
				} else {
					err, want = rollback(), 0
				}
				if err != nil {
					t.Fatal(err)
				}
				if c := count(t, p, name); c != want {
					t.Fatalf("after %s: %d rows, want %d", finish, c, want)
				}
			}
		})
	}
}

func TestAsQuerierRejectsUnsupported(t *testing.T) {
	for _, r := range []any{nil, 42, "postgres://", (*bun.Tx)(nil), (*bun.DB)(nil)} {
		if _, err := db.AsQuerier(r); !errors.Is(err, db.ErrUnsupportedRunner) {
			t.Errorf("AsQuerier(%#v): want ErrUnsupportedRunner, got %v", r, err)
		}
	}
}
