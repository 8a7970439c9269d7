package db_test

import (
	"context"
	"strings"
	"testing"

	"go.uber.org/fx"
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
	if err := prov.Pool.Ping(context.Background()); err == nil {
		t.Fatal("pool still open after the app stopped")
	}
}

// An app whose database cannot be reached fails to start, and its pool is
// closed: fx runs no stop hook for a start hook that failed, so the pool
// (and its background goroutines) outlived the app.
func TestFxModuleClosesThePoolWhenThePingFails(t *testing.T) {
	var prov *db.Provider
	app := fx.New(
		fx.Supply(db.Config{DSN: "postgres://nobody@127.0.0.1:1/none?connect_timeout=1"}),
		db.Module,
		fx.Populate(&prov),
		fx.NopLogger,
	)
	if err := app.Start(context.Background()); err == nil {
		t.Fatal("the app started without a database")
	}
	if prov.Pool.Stat().TotalConns() != 0 {
		t.Fatal("connections left open")
	}
	if err := prov.Pool.Ping(context.Background()); err == nil || !strings.Contains(err.Error(), "closed pool") {
		t.Fatalf("ping after the failed start: %v, want the pool closed", err)
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
