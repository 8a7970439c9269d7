package db_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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
			return db.SQL(tx), tx.Commit, tx.Rollback
		}},
		{"bun.IDB(tx)", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			tx, err := p.Bun.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var idb bun.IDB = &tx
			return db.SQL(idb), tx.Commit, tx.Rollback
		}},
		{"bun.IDB(db)", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			var idb bun.IDB = p.Bun
			return db.SQL(idb), nil, nil
		}},
		{"*sql.Tx", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			tx, err := p.SQL.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return db.SQL(tx), tx.Commit, tx.Rollback
		}},
		{"*sql.DB", func(t *testing.T, p *db.Provider) (db.Runner, func() error, func() error) {
			return db.SQL(p.SQL), nil, nil
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
	for _, r := range []any{nil, 42, "postgres://", (*bun.Tx)(nil), (*bun.DB)(nil),
		(*pgxpool.Pool)(nil), (*pgxpool.Conn)(nil), (*pgxpool.Tx)(nil), (*pgx.Conn)(nil),
		// bun values around no database/sql handle, bare and through db.SQL
		bun.Tx{}, &bun.Tx{}, bun.Conn{}, &bun.Conn{}, &bun.DB{},
		db.SQL(bun.Tx{}), db.SQL(&bun.Tx{}), db.SQL(bun.Conn{}), db.SQL(&bun.DB{}),
		db.SQL((*sql.Tx)(nil)), db.SQL((*sql.DB)(nil)), db.SQL((*sql.Conn)(nil))} {
		if _, err := db.AsQuerier(r); !errors.Is(err, db.ErrUnsupportedRunner) {
			t.Errorf("AsQuerier(%#v): want ErrUnsupportedRunner, got %v", r, err)
		}
	}
}

// Every supported handle is a Runner at compile time: pgx values as they
// are, database/sql and bun values through db.SQL.
var (
	_ db.Runner = pgx.Tx(nil)
	_ db.Runner = (*pgxpool.Pool)(nil)
	_ db.Runner = (*pgxpool.Conn)(nil)
	_ db.Runner = (*pgx.Conn)(nil)
	_ db.Runner = db.SQL((*sql.Tx)(nil))
	_ db.Runner = db.SQL((*sql.DB)(nil))
	_ db.Runner = db.SQL((*sql.Conn)(nil))
	_ db.Runner = db.SQL(bun.Tx{})
	_ db.Runner = db.SQL(bun.IDB(nil))
)

// db.SQL's result works as a pgx-shaped Runner when called directly.
func TestSQLRunnerMethods(t *testing.T) {
	ctx := context.Background()
	p := pgtest.NewDB(t).Provider
	for name, r := range map[string]db.Runner{"*sql.DB": db.SQL(p.SQL), "*bun.DB": db.SQL(p.Bun)} {
		t.Run(name, func(t *testing.T) {
			table := pgx.Identifier{"probe_" + strings.NewReplacer("*", "", ".", "_").Replace(name)}.Sanitize()
			if _, err := r.Exec(ctx, "CREATE TABLE "+table+" (v int)"); err != nil {
				t.Fatal(err)
			}
			tag, err := r.Exec(ctx, "INSERT INTO "+table+" VALUES ($1), ($2)", 1, 2)
			if err != nil || tag.RowsAffected() != 2 {
				t.Fatalf("Exec: %v rows, %v", tag.RowsAffected(), err)
			}
			rows, err := r.Query(ctx, "SELECT v FROM "+table+" WHERE v >= $1 ORDER BY v", 1)
			if err != nil {
				t.Fatal(err)
			}
			if fds := rows.FieldDescriptions(); len(fds) != 1 || fds[0].Name != "v" {
				t.Fatalf("FieldDescriptions: %+v", fds)
			}
			var got []any
			for rows.Next() {
				vals, err := rows.Values()
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, vals...)
			}
			rows.Close()
			if rows.Err() != nil || len(got) != 2 || got[0] != int64(1) || got[1] != int64(2) {
				t.Fatalf("Query: %v, %v", got, rows.Err())
			}
			if err := r.QueryRow(ctx, "SELECT v FROM "+table+" WHERE false").Scan(new(int)); !errors.Is(err, pgx.ErrNoRows) {
				t.Fatalf("QueryRow with no row: %v, want pgx.ErrNoRows", err)
			}
		})
	}
	// A nil pointer of a type db.SQL does not list (a wrapper with
	// database/sql's methods, as sqlx's are) is refused too; it panicked at
	// its first call.
	for _, r := range []db.Runner{db.SQL(nil), db.SQL((*sql.Tx)(nil)), db.SQL((*bun.Tx)(nil)), db.SQL((*txWrapper)(nil))} {
		if _, err := r.Exec(ctx, "SELECT 1"); !errors.Is(err, db.ErrUnsupportedRunner) {
			t.Errorf("Exec through %#v: %v, want ErrUnsupportedRunner", r, err)
		}
		if _, err := db.AsQuerier(r); !errors.Is(err, db.ErrUnsupportedRunner) {
			t.Errorf("AsQuerier(%#v): %v, want ErrUnsupportedRunner", r, err)
		}
	}
}

// txWrapper is a type of its own with database/sql's methods, as sqlx's
// *sqlx.Tx is.
type txWrapper struct{ *sql.Tx }
