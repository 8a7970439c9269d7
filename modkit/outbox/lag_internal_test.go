package outbox

import (
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// TestClaimSkew: each claim reads the database clock's lead over this
// process's from the lease it set (its end minus LeaseDuration is the
// database's clock at the claim's start), plus the time until the claim's
// statement started; the estimate is the smallest of the recent readings,
// and delivery.lag takes it off created_at.
func TestClaimSkew(t *testing.T) {
	local := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC) // this process's clock at a claim's start
	lease := 30 * time.Second
	d := &Dispatcher{c: &Client{}, cfg: DispatcherConfig{LeaseDuration: lease}}
	claim := func(skew, delay time.Duration) []driver.Claimed {
		dbAtStatement := local.Add(skew + delay)
		return []driver.Claimed{{CreatedAt: dbAtStatement.Add(-20 * time.Millisecond), LockedTill: dbAtStatement.Add(lease)}}
	}
	const skew = 5 * time.Second // the database's clock ahead
	for _, step := range []struct {
		delay, want time.Duration // the claim's delay until its statement, and the estimate after it
	}{
		{3 * time.Millisecond, skew + 3*time.Millisecond},
		{time.Millisecond, skew + time.Millisecond},
		{40 * time.Millisecond, skew + time.Millisecond}, // a wait for a connection does not inflate the estimate
	} {
		got, ok := d.claimSkew(claim(skew, step.delay), local)
		if !ok || got != step.want {
			t.Fatalf("after a claim delayed %v: skew %v (%v), want %v", step.delay, got, ok, step.want)
		}
	}
	// The reading of 1ms leaves the window after clockSkewReadings more
	// claims, so a change between the clocks is followed.
	for range clockSkewReadings {
		d.claimSkew(claim(-3*time.Second, 2*time.Millisecond), local)
	}
	if got, _ := d.claimSkew(claim(-3*time.Second, 2*time.Millisecond), local); got != -3*time.Second+2*time.Millisecond {
		t.Fatalf("after the database's clock moved 3s behind: skew %v, want %v", got, -3*time.Second+2*time.Millisecond)
	}

	// No estimate without an event, without a lease end, or under a test
	// clock (which sets leases but not created_at).
	if _, ok := d.claimSkew(nil, local); ok {
		t.Fatal("a skew from a claim of no event")
	}
	if _, ok := d.claimSkew([]driver.Claimed{{CreatedAt: local}}, local); ok {
		t.Fatal("a skew from a claim without a lease end")
	}
	d.c.cfg.Now = func() time.Time { return local.Add(time.Hour) }
	if _, ok := d.claimSkew(claim(skew, 0), local); ok {
		t.Fatal("a skew under a test clock")
	}
}
