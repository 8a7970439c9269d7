package db_test

import (
	"context"
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

func TestOpenErrors(t *testing.T) {
	if _, err := db.Open(context.Background(), db.Config{}); err != db.ErrNoDSN {
		t.Fatalf("empty DSN: %v", err)
	}
	if _, err := db.Open(context.Background(), db.Config{DSN: "postgres://x@127.0.0.1:1/x", MaxConns: -1}); err == nil {
		t.Fatal("negative MaxConns accepted")
	}
}
