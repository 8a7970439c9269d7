package db

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// SQL makes a database/sql or bun handle a Runner: *sql.Tx, *sql.DB,
// *sql.Conn, bun.Tx, *bun.Tx, *bun.DB, bun.Conn, or any of them held in a
// bun.IDB. SQL written for a Runner uses PostgreSQL's $1, $2, … placeholders;
// bun handles are unwrapped to the database/sql handle they embed, so bun's
// own ? formatting never touches it.
//
// The handle must be on pgx's database/sql driver (github.com/jackc/pgx/v5/stdlib),
// as Provider's SQL and Bun are: modkit passes pgx's array types as
// arguments (outbox EnqueueBatch, for example) and tells errors apart by
// pgx's *pgconn.PgError, which other drivers (lib/pq, bun's pgdriver)
// neither take nor return.
//
// The result serves modkit calls (outbox Enqueue, for example). Used
// directly, its Query rows implement what database/sql can: FieldDescriptions
// carries column names only, and RawValues, Conn and TypeMap are nil.
func SQL(q SQLQuerier) Runner {
	inner, err := unwrapSQL(q)
	return sqlRunner{q: inner, err: err}
}

// sqlRunner is SQL's result; err, when set, is returned by every call.
type sqlRunner struct {
	q   SQLQuerier
	err error
}

func (s sqlRunner) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	if s.err != nil {
		return pgconn.CommandTag{}, s.err
	}
	res, err := s.q.ExecContext(ctx, query, args...)
	if err != nil {
		return pgconn.CommandTag{}, notPgxStdlib(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	// database/sql does not say which command ran; the tag carries the count.
	return pgconn.NewCommandTag("SQL " + strconv.FormatInt(n, 10)), nil
}

func (s sqlRunner) Query(ctx context.Context, query string, args ...any) (pgx.Rows, error) {
	if s.err != nil {
		return nil, s.err
	}
	rows, err := s.q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, notPgxStdlib(err)
	}
	return &sqlPgxRows{rows: rows}, nil
}

// notPgxStdlib adds to err, when it is a driver's refusal of an argument's
// type, that the handle must be on pgx's stdlib driver: pgx's driver takes
// every argument modkit passes, while lib/pq and bun's pgdriver refuse
// pgx's array types ("unsupported type []pgtype.UUID") with an error that
// names neither the driver nor the fix.
func notPgxStdlib(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) || !strings.Contains(err.Error(), "unsupported type") {
		return err
	}
	return fmt.Errorf("%w (modkit/db.SQL: the handle's driver cannot take this argument: open it with pgx's "+
		"database/sql driver, github.com/jackc/pgx/v5/stdlib, as db.Provider's SQL and Bun are; lib/pq and bun's "+
		"pgdriver are not supported)", err)
}

func (s sqlRunner) QueryRow(ctx context.Context, query string, args ...any) pgx.Row {
	if s.err != nil {
		return errRow{s.err}
	}
	return sqlRow{s.q.QueryRowContext(ctx, query, args...)}
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// sqlPgxRows presents *sql.Rows as pgx.Rows.
type sqlPgxRows struct {
	rows *sql.Rows
	err  error // a Values or Scan failure, reported by Err too
}

func (r *sqlPgxRows) Close() { _ = r.rows.Close() }

func (r *sqlPgxRows) Err() error {
	if r.err != nil {
		return r.err
	}
	return r.rows.Err()
}

func (r *sqlPgxRows) CommandTag() pgconn.CommandTag { return pgconn.CommandTag{} }

func (r *sqlPgxRows) FieldDescriptions() []pgconn.FieldDescription {
	cols, err := r.rows.Columns()
	if err != nil {
		return nil
	}
	fds := make([]pgconn.FieldDescription, len(cols))
	for i, c := range cols {
		fds[i].Name = c
	}
	return fds
}

func (r *sqlPgxRows) Next() bool { return r.err == nil && r.rows.Next() }

func (r *sqlPgxRows) Scan(dest ...any) error {
	if err := r.rows.Scan(dest...); err != nil {
		r.err = err
		return err
	}
	return nil
}

func (r *sqlPgxRows) Values() ([]any, error) {
	cols, err := r.rows.Columns()
	if err != nil {
		return nil, err
	}
	vals := make([]any, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	if err := r.Scan(ptrs...); err != nil {
		return nil, err
	}
	return vals, nil
}

func (r *sqlPgxRows) RawValues() [][]byte { return nil }

func (r *sqlPgxRows) Conn() *pgx.Conn { return nil }

func (r *sqlPgxRows) TypeMap() *pgtype.Map { return nil }
