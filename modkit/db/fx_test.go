package db_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"go.uber.org/fx"
	"go.uber.org/fx/fxevent"
	"go.uber.org/fx/fxtest"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
)

func TestFxModule(t *testing.T) {
	tdb := pgtest.NewDB(t)
	var prov *db.Provider
	app := fxtest.New(t,
		fx.Supply(db.Config{DSN: tdb.DSN}),
		db.Module,
		fx.Populate(&prov),
	)
	app.RequireStart()
	var one int
	if err := prov.Bun.NewRaw("SELECT 1").Scan(context.Background(), &one); err != nil || one != 1 {
		t.Fatalf("bun on the provider's pool: %d, %v", one, err)
	}
	if prov.Pool.Stat().TotalConns() == 0 {
		t.Fatal("bun query did not go through the pgx pool")
	}
	app.RequireStop()
	if err := prov.Ping(context.Background()); err == nil || !strings.Contains(err.Error(), "the Provider was closed") {
		t.Fatalf("ping after the app stopped: %v, want it to say the Provider was closed", err)
	}
}

// An app whose database refuses its connection fails to start, and its
// pool is closed: fx runs no stop hook for a start hook that failed, so the
// pool (and its background goroutines) outlived the app. (A server that
// cannot be reached is tried again until the start's context ends, and fx
// reports that end without waiting for the hook: ping_internal_test.go.)
func TestFxModuleClosesThePoolWhenThePingFails(t *testing.T) {
	base := pgtest.NewDB(t).DSN
	dsn := base + " dbname=modkit_no_such_database" // key=value: later keys win
	if u, err := url.Parse(base); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/modkit_no_such_database"
		dsn = u.String()
	}
	var prov *db.Provider
	app := fx.New(
		fx.Supply(db.Config{DSN: dsn}),
		db.Module,
		fx.Populate(&prov),
		fx.NopLogger,
	)
	if err := app.Start(context.Background()); err == nil {
		t.Fatal("the app started without its database")
	}
	if prov.Pool.Stat().TotalConns() != 0 {
		t.Fatal("connections left open")
	}
	if err := prov.Pool.Ping(context.Background()); err == nil || !strings.Contains(err.Error(), "closed pool") {
		t.Fatalf("ping after the failed start: %v, want the pool closed", err)
	}
}

// A database that is not reachable yet when the app starts (a container
// started beside it) is waited for within the start's time: the start
// used to fail at the first refused connection. A server that answers
// with a refusal (no such database) fails the start at once.
func TestFxModuleWaitsForTheDatabase(t *testing.T) {
	tdb := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	network, addr := "tcp", net.JoinHostPort(cfg.ConnConfig.Host, fmt.Sprint(cfg.ConnConfig.Port))
	if strings.HasPrefix(cfg.ConnConfig.Host, "/") {
		network, addr = "unix", fmt.Sprintf("%s/.s.PGSQL.%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	}
	// A listener that hangs up on its first three connections, as a
	// server not up yet would refuse them, then forwards to the server.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	var refused atomic.Int32
	wg.Go(func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			if refused.Load() < 3 {
				refused.Add(1)
				client.Close()
				continue
			}
			server, err := net.Dial(network, addr)
			if err != nil {
				client.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, client, server)
			mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(server, client); server.Close() })
			wg.Go(func() { _, _ = io.Copy(client, server); client.Close() })
		}
	})
	dsn := fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", url.UserPassword(cfg.ConnConfig.User, cfg.ConnConfig.Password),
		ln.Addr(), cfg.ConnConfig.Database)
	startCtx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a guard: the start ends when the server answers
	defer cancel()
	var prov *db.Provider
	app := fx.New(fx.Supply(db.Config{DSN: dsn}), db.Module, fx.Populate(&prov), fx.NopLogger)
	if err := app.Start(startCtx); err != nil {
		t.Fatalf("start beside a server that refused three connections first: %v", err)
	}
	if err := prov.Pool.Ping(startCtx); err != nil {
		t.Fatal(err)
	}
	if err := app.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := refused.Load(); n != 3 {
		t.Fatalf("the listener hung up on %d connections, want 3", n)
	}

	// No such database: the server's answer will not change.
	app = fx.New(fx.Supply(db.Config{DSN: fmt.Sprintf("postgres://%s@%s/modkit_no_such_database?sslmode=disable",
		url.UserPassword(cfg.ConnConfig.User, cfg.ConnConfig.Password), ln.Addr())}), db.Module, fx.Invoke(func(*db.Provider) {}), fx.NopLogger)
	err = app.Start(startCtx)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "3D000" || strings.Contains(err.Error(), "still failing") {
		t.Fatalf("start on a missing database: %v, want its 3D000 at once", err)
	}
}

func TestOpenErrors(t *testing.T) {
	if _, err := db.Open(context.Background(), db.Config{}); err != db.ErrNoDSN {
		t.Fatalf("empty DSN: %v", err)
	}
	if _, err := db.Open(context.Background(), db.Config{DSN: "postgres://x@127.0.0.1:1/x", MaxConns: -1}); err == nil {
		t.Fatal("negative MaxConns accepted")
	}
}

// stopEvents passes on the error of each OnStop hook fx ran.
type stopEvents chan error

func (s stopEvents) LogEvent(e fxevent.Event) {
	if e, ok := e.(*fxevent.OnStopExecuted); ok {
		s <- e.Err
	}
}

// The stop hook returns when fx's stop timeout is up, saying why, even
// while a component still holds a connection: pgxpool's Close waits for
// every connection in use, so the hook used to wait for it, and fx
// reported its own timeout without naming the cause. The pool closes once
// the connection comes back.
func TestFxModuleStopIsBoundedWhileAConnectionIsHeld(t *testing.T) {
	tdb := pgtest.NewDB(t)
	stopped := make(stopEvents, 4)
	var prov *db.Provider
	app := fx.New(
		fx.Supply(db.Config{DSN: tdb.DSN}),
		db.Module,
		fx.Populate(&prov),
		fx.WithLogger(func() fxevent.Logger { return stopped }),
	)
	ctx := context.Background()
	if err := app.Start(ctx); err != nil {
		t.Fatal(err)
	}
	conn, err := prov.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stopCtx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := app.Stop(stopCtx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("stop with a connection held: %v, want the stop's timeout", err)
	}
	// The hook has returned, or returns, by the stop's deadline, with the
	// connection still held. (Without the bound it returned only once the
	// connection came back; the wait below is a guard against that hang.)
	select {
	case err = <-stopped:
	case <-time.After(time.Minute):
		conn.Release()
		t.Fatal("the stop hook did not return while a connection was held")
	}
	conn.Release()
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "1 connection(s) still in use") {
		t.Fatalf("the stop hook's error: %v, want one that says a connection is still in use", err)
	}
	// The pool closes once the connection is back. (Close waits for the
	// close under way: a sync.Once.)
	prov.Close()
	if n := prov.Pool.Stat().TotalConns(); n != 0 {
		t.Fatalf("%d connections left in the pool after it closed", n)
	}
}
