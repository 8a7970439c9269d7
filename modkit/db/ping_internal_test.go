package db

import (
	"context"
	"strings"
	"testing"
	"time"
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
