package db

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jackc/puddle/v2"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"
)

// Config says how to open the database.
type Config struct {
	// DSN is a libpq connection string or postgres:// URL. Required.
	DSN string
	// MaxConns caps the pool. Zero keeps pgx's default (the larger of 4 and
	// the number of CPUs), or the pool_max_conns parameter of the DSN.
	MaxConns int32
}

// ErrNoDSN is returned by Open when Config.DSN is empty.
var ErrNoDSN = errors.New("modkit/db: no DSN: set Config.DSN (for example from DATABASE_URL)")

// Provider owns the process's PostgreSQL connections: one pgx pool, and a
// database/sql handle and a bun.DB that both draw from that same pool, so pgx
// and bun code share connections, limits and settings.
type Provider struct {
	// Pool is the pgx pool every other handle is built on.
	Pool *pgxpool.Pool
	// SQL is a database/sql handle backed by Pool.
	SQL *sql.DB
	// Bun is a bun.DB (PostgreSQL dialect) backed by SQL.
	Bun *bun.DB

	closeOnce sync.Once
}

// Open connects to the database in cfg.DSN and checks the connection with a
// ping. Close the Provider when done.
func Open(ctx context.Context, cfg Config) (*Provider, error) {
	p, err := open(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := p.Ping(ctx); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// open builds the Provider without connecting: pgxpool connects lazily.
func open(ctx context.Context, cfg Config) (*Provider, error) {
	if cfg.DSN == "" {
		return nil, ErrNoDSN
	}
	poolCfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("modkit/db: parse DSN: %w", err)
	}
	if cfg.MaxConns < 0 {
		return nil, fmt.Errorf("modkit/db: Config.MaxConns is %d; it must be zero (default) or positive", cfg.MaxConns)
	}
	if cfg.MaxConns > 0 {
		poolCfg.MaxConns = cfg.MaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, fmt.Errorf("modkit/db: open pool: %w", err)
	}
	return FromPool(pool), nil
}

// Ping checks that the database answers.
func (p *Provider) Ping(ctx context.Context) error {
	if err := p.Pool.Ping(ctx); err != nil {
		if errors.Is(err, puddle.ErrClosedPool) {
			return fmt.Errorf("modkit/db: ping: the Provider was closed (Close, or the fx app stopped): %w", err)
		}
		return fmt.Errorf("modkit/db: connect to %s: %w (check Config.DSN, for example DATABASE_URL, and that the server accepts connections)",
			redactDSN(p.Pool.Config()), err)
	}
	return nil
}

// pingUntilUp pings until the server answers, ctx ends, or the server
// refuses the connection for good (see Module).
func (p *Provider) pingUntilUp(ctx context.Context) error {
	wait := 50 * time.Millisecond
	for {
		err := p.Ping(ctx)
		if err == nil || !transient(err) || ctx.Err() != nil {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w; still failing when the start's time was up", err)
		case <-t.C:
		}
		wait = min(2*wait, time.Second)
	}
}

// transient reports whether a failed connection may succeed later: the
// server was not reached (refused, reset, timed out), is starting up or
// shutting down (57P03), or has no connection slot free (53300). A server
// that answered with another error (no such database, login refused) will
// answer the same.
func transient(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "57P03" || pgErr.Code == "53300"
	}
	return true
}

// FromPool builds a Provider around an existing pool. Closing the Provider
// closes the pool.
func FromPool(pool *pgxpool.Pool) *Provider {
	sqlDB := stdlib.OpenDBFromPool(pool)
	return &Provider{Pool: pool, SQL: sqlDB, Bun: bun.NewDB(sqlDB, pgdialect.New())}
}

// Close closes the bun and database/sql handles and then the pool. It is safe
// to call more than once.
func (p *Provider) Close() {
	p.closeOnce.Do(func() {
		_ = p.Bun.Close() // closes p.SQL too; it holds no connections of its own.
		p.Pool.Close()
	})
}

// closeWithin is Close bounded by ctx: pgxpool's Close waits for every
// connection in use to be returned, which a component that still holds
// one (a transaction not ended, an Acquire not released) never does. When
// ctx ends first it says so; the pool goes on closing, and closes once the
// connections come back.
func (p *Provider) closeWithin(ctx context.Context) error {
	closed := make(chan struct{})
	go func() {
		p.Close()
		close(closed)
	}()
	select {
	case <-closed:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("db: the pool was not closed when the stop's time was up (%w): %d connection(s) still in use; "+
			"a component still holds one (a transaction not committed or rolled back, an Acquire not released, "+
			"rows not closed): stop it before the database, or give the stop more time", ctx.Err(), p.Pool.Stat().AcquiredConns())
	}
}

func redactDSN(cfg *pgxpool.Config) string {
	c := cfg.ConnConfig
	if strings.HasPrefix(c.Host, "/") { // a Unix socket's directory
		return fmt.Sprintf("postgres://%s@/%s?host=%s&port=%d", c.User, c.Database, c.Host, c.Port)
	}
	return fmt.Sprintf("postgres://%s@%s/%s", c.User, net.JoinHostPort(c.Host, strconv.Itoa(int(c.Port))), c.Database)
}
