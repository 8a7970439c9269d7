package db

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"
)

// otherDriver is a database/sql driver that is not pgx's: like lib/pq and
// bun's pgdriver it takes only database/sql's own argument types, and it
// never reaches a server (the refusal comes first).
type otherDriver struct{}

func (otherDriver) Open(string) (driver.Conn, error) { return otherConn{}, nil }

type otherConn struct{}

func (otherConn) Prepare(string) (driver.Stmt, error) { return otherStmt{}, nil }
func (otherConn) Close() error                        { return nil }
func (otherConn) Begin() (driver.Tx, error)           { return nil, errors.New("not supported") }

type otherStmt struct{}

func (otherStmt) Close() error                               { return nil }
func (otherStmt) NumInput() int                              { return -1 }
func (otherStmt) Exec([]driver.Value) (driver.Result, error) { return driver.RowsAffected(0), nil }
func (otherStmt) Query([]driver.Value) (driver.Rows, error)  { return nil, errors.New("not supported") }

func init() { sql.Register("modkit-db-test-other", otherDriver{}) }

// A handle on another driver than pgx's stdlib refuses the array arguments
// modkit passes (EnqueueBatch's) with "unsupported type []pgtype.UUID",
// which named neither the driver nor the fix; the error now says to use
// pgx's stdlib driver, from the Runner SQL returns and from the Querier
// AsQuerier returns for a *sql.DB or *sql.Tx (EnqueueBatch's path, which
// gave the bare refusal).
func TestSQLOnAnotherDriverSaysToUsePgxStdlib(t *testing.T) {
	handle, err := sql.Open("modkit-db-test-other", "")
	if err != nil {
		t.Fatal(err)
	}
	defer handle.Close()
	r := SQL(handle)
	arg := []pgtype.UUID{{Valid: true}}
	_, execErr := r.Exec(context.Background(), "SELECT $1", arg)
	_, queryErr := r.Query(context.Background(), "SELECT $1", arg)
	scanErr := r.QueryRow(context.Background(), "SELECT $1", arg).Scan(new(int))
	q, err := AsQuerier(handle)
	if err != nil {
		t.Fatal(err)
	}
	_, qExecErr := q.Exec(context.Background(), "SELECT $1", arg)
	_, qQueryErr := q.Query(context.Background(), "SELECT $1", arg)
	qScanErr := q.QueryRow(context.Background(), "SELECT $1", arg).Scan(new(int))
	for what, err := range map[string]error{"Exec": execErr, "Query": queryErr, "QueryRow": scanErr,
		"AsQuerier's Exec": qExecErr, "AsQuerier's Query": qQueryErr, "AsQuerier's QueryRow": qScanErr} {
		if err == nil || !strings.Contains(err.Error(), "unsupported type") || !strings.Contains(err.Error(), "github.com/jackc/pgx/v5/stdlib") {
			t.Errorf("%s with a pgx array on another driver: %v, want the driver's refusal and the fix", what, err)
		}
	}
}
