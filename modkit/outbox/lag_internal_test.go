package outbox

import (
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// TestEnqueuedLocally: created_at, set by the database's clock, is moved by
// the difference between that clock and this process's, read from the
// lease a claim set (its end minus LeaseDuration is the database's clock at
// the claim's start), so that delivery.lag does not carry the skew.
func TestEnqueuedLocally(t *testing.T) {
	local := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC) // this process's clock at the claim's start
	lease := 30 * time.Second
	for _, skew := range []time.Duration{0, 5 * time.Second, -3 * time.Second, 1500 * time.Microsecond} {
		dbAtClaim := local.Add(skew)
		createdAt := dbAtClaim.Add(-20 * time.Millisecond) // enqueued 20 ms before the claim, by the database's clock
		got := enqueuedLocally(createdAt, dbAtClaim.Add(lease), lease, local)
		if want := local.Add(-20 * time.Millisecond); !got.Equal(want) {
			t.Errorf("database clock %v ahead: enqueued at %v by this process's clock, want %v", skew, got, want)
		}
	}

	// Without a lease end, or under a test clock (which sets leases but
	// not created_at), created_at is taken as it is.
	created := local.Add(-time.Second)
	c := driver.Claimed{CreatedAt: created, LockedTill: local.Add(time.Hour + lease)}
	d := &Dispatcher{c: &Client{}, cfg: DispatcherConfig{LeaseDuration: lease}}
	if got := d.enqueuedLocally(c, local); !got.Equal(created.Add(-time.Hour)) {
		t.Fatalf("database clock an hour ahead: %v, want %v", got, created.Add(-time.Hour))
	}
	if got := d.enqueuedLocally(driver.Claimed{CreatedAt: created}, local); !got.Equal(created) {
		t.Fatalf("no lease end: %v, want created_at %v", got, created)
	}
	d.c.cfg.Now = func() time.Time { return local.Add(time.Hour) }
	if got := d.enqueuedLocally(c, local); !got.Equal(created) {
		t.Fatalf("test clock: %v, want created_at %v", got, created)
	}
}
