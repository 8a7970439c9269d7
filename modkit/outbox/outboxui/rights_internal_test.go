package outboxui

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// What the login may do is read at most once every rightsTTL; a failed
// read is kept as nothing known for as long (a database that is down
// costs one read, and one warning, a rightsTTL). A read goes on when the
// visitor who started it leaves (others may wait for it).
func TestRightsAreKeptForTheirTTL(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	calls := 0
	var fail error
	c := &readCache[outbox.Rights]{now: clock.now, ttl: rightsTTL, keepFailed: true, read: func(ctx context.Context) (outbox.Rights, error) {
		calls++
		if err := ctx.Err(); err != nil {
			return outbox.Rights{}, err
		}
		return outbox.Rights{User: "ui", Known: true, ReadPayloads: calls%2 == 1}, fail
	}}
	get := func(ctx context.Context) outbox.Rights {
		t.Helper()
		r, _ := c.get(ctx)
		return r
	}
	if r := get(context.Background()); !r.Known || !r.ReadPayloads || calls != 1 {
		t.Fatalf("first read: %+v after %d reads", r, calls)
	}
	clock.add(rightsTTL - time.Second)
	if r := get(context.Background()); !r.ReadPayloads || calls != 1 {
		t.Fatalf("within rightsTTL: %+v after %d reads, want the first read's", r, calls)
	}
	clock.add(time.Second)
	if r := get(context.Background()); !r.Known || r.ReadPayloads || calls != 2 {
		t.Fatalf("after rightsTTL: %+v after %d reads, want a new read", r, calls)
	}

	clock.add(rightsTTL)
	fail = errors.New("connection refused")
	if r, err := c.get(context.Background()); err == nil || r.Known || calls != 3 {
		t.Fatalf("a failed read: %+v, %v after %d reads; want the error and nothing known", r, err, calls)
	}
	if r, err := c.get(context.Background()); err != nil || r.Known || calls != 3 {
		t.Fatalf("after a failed read: %+v, %v after %d reads; want nothing known, kept", r, err, calls)
	}

	clock.add(rightsTTL)
	fail = nil
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if r := get(gone); !r.Known || calls != 4 {
		t.Fatalf("a read whose visitor left: %+v after %d reads, want it read all the same", r, calls)
	}
	if r := get(context.Background()); !r.Known || calls != 4 {
		t.Fatalf("after it: %+v after %d reads, want the read kept", r, calls)
	}
}
