package db

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/uptrace/bun"
)

// Runner is the caller's own connection or transaction. Calls that take a
// Runner run their SQL through it, so the work joins the caller's
// transaction: it becomes visible on commit and vanishes on rollback.
//
// Runner is pgx's method set, so pgx values are Runners as they are:
// pgx.Tx, *pgxpool.Pool, *pgxpool.Conn and *pgx.Conn. database/sql and bun
// values go through SQL, which checks their type at compile time too:
//
//	client.Enqueue(ctx, tx, msg)         // tx is a pgx.Tx
//	client.Enqueue(ctx, db.SQL(tx), msg) // tx is a bun.Tx, a *sql.Tx, a bun.IDB, …
//
// Passing anything else (a *sql.Tx without SQL, a string) does not compile.
// Go offers no single interface that both pgx and database/sql types
// satisfy, and a type union cannot name interfaces such as pgx.Tx, hence
// the adapter for the second family. A nil Runner, a nil *pgxpool.Pool,
// *pgxpool.Conn or *pgx.Conn, or SQL of a nil pointer, makes the call fail
// with ErrUnsupportedRunner before any SQL runs.
type Runner interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ErrUnsupportedRunner is returned when a Runner is nil or wraps a nil
// handle, or when AsQuerier is given a value of no supported type.
var ErrUnsupportedRunner = errors.New("modkit/db: unsupported runner: pass a pgx.Tx, *pgxpool.Pool or *pgx.Conn, " +
	"or wrap a database/sql or bun handle (*sql.Tx, *sql.DB, bun.Tx, bun.IDB, …) with db.SQL")

// Querier is the small common surface that every Runner is adapted to. SQL
// uses PostgreSQL's $1, $2, … placeholders whatever the driver.
type Querier interface {
	// Exec runs a statement and returns the number of rows it affected.
	Exec(ctx context.Context, sql string, args ...any) (int64, error)
	// Query runs a statement that returns rows. The caller must Close them.
	Query(ctx context.Context, sql string, args ...any) (Rows, error)
	// QueryRow runs a statement expected to return at most one row. Scan
	// reports ErrNoRows when there was none.
	QueryRow(ctx context.Context, sql string, args ...any) Row
}

// Row is one result row; see Querier.QueryRow.
type Row interface {
	Scan(dest ...any) error
}

// Rows is a result set; see Querier.Query.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close()
}

// ErrNoRows is what Row.Scan returns when a query produced no row, whichever
// driver ran it. It matches both pgx.ErrNoRows and sql.ErrNoRows with
// errors.Is.
var ErrNoRows = noRowsError{}

type noRowsError struct{}

func (noRowsError) Error() string { return "modkit/db: no rows in result set" }
func (noRowsError) Is(target error) bool {
	return target == pgx.ErrNoRows || target == sql.ErrNoRows
}

// SQLQuerier is the method set shared by *sql.DB, *sql.Tx and *sql.Conn.
type SQLQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// AsQuerier adapts a Runner, or a value that reached a driver untyped (an
// engine's driver receives runners as any): pgx values, SQL's result, and
// the database/sql and bun handles themselves. bun values are unwrapped to
// the database/sql handle they embed, because bun's own query methods
// rewrite ? placeholders and inline arguments.
func AsQuerier(r any) (Querier, error) {
	switch v := r.(type) {
	case nil:
		return nil, fmt.Errorf("%w (got nil)", ErrUnsupportedRunner)
	case Querier:
		return v, nil
	case sqlRunner:
		if v.err != nil {
			return nil, v.err
		}
		return sqlQuerier{v.q}, nil
	case Runner:
		if nilHandle(v) {
			return nil, fmt.Errorf("%w (got nil %T)", ErrUnsupportedRunner, v)
		}
		return pgxQuerier{v}, nil
	case SQLQuerier:
		q, err := unwrapSQL(v)
		if err != nil {
			return nil, err
		}
		return sqlQuerier{q}, nil
	default:
		return nil, fmt.Errorf("%w (got %T)", ErrUnsupportedRunner, r)
	}
}

// unwrapSQL returns the database/sql handle under a bun value, and q itself
// for a database/sql one; a nil handle, or a bun value around one (a zero
// bun.Tx, say), is refused.
func unwrapSQL(q SQLQuerier) (SQLQuerier, error) {
	var inner SQLQuerier // the database/sql handle under a bun value
	switch v := q.(type) {
	case nil:
		return nil, fmt.Errorf("%w (got nil)", ErrUnsupportedRunner)
	case bun.Tx:
		inner = v.Tx
	case *bun.Tx:
		if v != nil {
			inner = v.Tx
		}
	case *bun.DB:
		if v != nil {
			inner = bunDBHandle(v)
		}
	case bun.Conn:
		inner = v.Conn
	case *bun.Conn:
		if v != nil {
			inner = v.Conn
		}
	case *sql.Tx, *sql.DB, *sql.Conn:
		if nilHandle(v) {
			return nil, fmt.Errorf("%w (got nil %T)", ErrUnsupportedRunner, q)
		}
		return q, nil
	default:
		// Another type with database/sql's methods (a wrapper such as
		// sqlx's *sqlx.Tx): a nil pointer of it would panic at its first
		// call.
		if v := reflect.ValueOf(q); v.Kind() == reflect.Pointer && v.IsNil() {
			return nil, fmt.Errorf("%w (got nil %T)", ErrUnsupportedRunner, q)
		}
		return q, nil
	}
	if nilHandle(inner) {
		return nil, fmt.Errorf("%w (got %T without a database/sql handle in it)", ErrUnsupportedRunner, q)
	}
	return inner, nil
}

// bunDBHandle returns the *sql.DB under d, nil for a bun.DB that bun.NewDB
// did not make: its handle sits behind a pointer to unexported state, which
// a zero bun.DB lacks, so reading it panics.
func bunDBHandle(d *bun.DB) (h *sql.DB) {
	defer func() {
		if recover() != nil {
			h = nil
		}
	}()
	return d.DB
}

// nilHandle reports whether h is nil or a nil pointer of one of the pgx
// and database/sql handle types, which would panic on its first statement.
func nilHandle(h any) bool {
	switch v := h.(type) {
	case nil:
		return true
	case *pgxpool.Pool:
		return v == nil
	case *pgxpool.Conn:
		return v == nil
	case *pgxpool.Tx:
		return v == nil
	case *pgx.Conn:
		return v == nil
	case *sql.Tx:
		return v == nil
	case *sql.DB:
		return v == nil
	case *sql.Conn:
		return v == nil
	}
	// Another implementation of pgx.Tx or of the Runner methods, a nil
	// pointer of which would panic as well.
	rv := reflect.ValueOf(h)
	return rv.Kind() == reflect.Pointer && rv.IsNil()
}

type pgxQuerier struct{ q Runner }

func (p pgxQuerier) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	tag, err := p.q.Exec(ctx, sql, args...)
	return tag.RowsAffected(), err
}

func (p pgxQuerier) Query(ctx context.Context, sql string, args ...any) (Rows, error) {
	rows, err := p.q.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return rows, nil
}

func (p pgxQuerier) QueryRow(ctx context.Context, sql string, args ...any) Row {
	return pgxRow{p.q.QueryRow(ctx, sql, args...)}
}

type pgxRow struct{ r pgx.Row }

func (r pgxRow) Scan(dest ...any) error {
	err := r.r.Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrNoRows
	}
	return err
}

type sqlQuerier struct{ q SQLQuerier }

func (s sqlQuerier) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := s.q.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, notPgxStdlib(err)
	}
	return res.RowsAffected()
}

func (s sqlQuerier) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	rows, err := s.q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, notPgxStdlib(err)
	}
	return sqlRows{rows}, nil
}

func (s sqlQuerier) QueryRow(ctx context.Context, query string, args ...any) Row {
	return sqlRow{s.q.QueryRowContext(ctx, query, args...)}
}

type sqlRow struct{ r *sql.Row }

func (r sqlRow) Scan(dest ...any) error {
	err := r.r.Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		return ErrNoRows
	}
	if err != nil {
		return notPgxStdlib(err)
	}
	return nil
}

type sqlRows struct{ *sql.Rows }

func (r sqlRows) Close() { _ = r.Rows.Close() }
