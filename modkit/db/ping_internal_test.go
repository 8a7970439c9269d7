package db

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A server that cannot be reached is tried again until the context ends,
// and the error says so (Module's start hook).
func TestPingUntilUpTriesUntilTheContextEnds(t *testing.T) {
	p, err := open(context.Background(), Config{DSN: "postgres://nobody@127.0.0.1:1/none?connect_timeout=1"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	err = p.pingUntilUp(ctx)
	if err == nil || !strings.Contains(err.Error(), "still failing when the start's time was up") ||
		!strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("ping of a server nobody listens for: %v, want the last failure and that the time was up", err)
	}
}

// Errors name the server without the password, in a form that reads as
// what it is: a Unix socket's directory was printed as a host name
// ("postgres://u@/var/run/postgresql:5432/db").
func TestRedactDSN(t *testing.T) {
	for dsn, want := range map[string]string{
		"postgres://u:secret@/db?host=/var/run/postgresql":   "postgres://u@/db?host=/var/run/postgresql&port=5432",
		"postgres://u:secret@db.example:6543/x":              "postgres://u@db.example:6543/x",
		"host=::1 port=5433 user=u password=secret dbname=y": "postgres://u@[::1]:5433/y",
	} {
		cfg, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			t.Fatal(err)
		}
		if got := redactDSN(cfg); got != want {
			t.Errorf("redactDSN(%q) = %q, want %q", dsn, got, want)
		}
	}
}
