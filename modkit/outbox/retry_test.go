package outbox_test

import (
	"slices"
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

func TestRetryPolicyBounds(t *testing.T) {
	// Property: for any base ≤ max and attempts ≥ 1, Delay follows
	// min(base·2^(attempts−1), max) and Backoff lies in [Delay/2, Delay].
	bases := []time.Duration{time.Nanosecond, time.Millisecond, time.Second, 7 * time.Second, time.Hour}
	for _, base := range bases {
		for _, mult := range []time.Duration{1, 3, 100, 1 << 20} {
			p := outbox.RetryPolicy{BaseDelay: base, MaxDelay: base * mult}
			prev := time.Duration(0)
			for attempts := 1; attempts <= 80; attempts++ {
				d := p.Delay(attempts)
				want := p.MaxDelay
				if attempts-1 < 62 && base <= p.MaxDelay>>(attempts-1) {
					want = min(base<<(attempts-1), p.MaxDelay)
				}
				if d != want {
					t.Fatalf("%+v Delay(%d) = %v, want %v", p, attempts, d, want)
				}
				if d < prev {
					t.Fatalf("%+v Delay not monotone at %d", p, attempts)
				}
				prev = d
				for range 50 {
					b := p.Backoff(attempts)
					if b < d/2 || b > d {
						t.Fatalf("%+v Backoff(%d) = %v outside [%v, %v]", p, attempts, b, d/2, d)
					}
				}
			}
		}
	}
	// Both ends of the jitter range are reachable (a distribution check, not
	// a timing one): with Delay 2ns the range is {1ns, 2ns}.
	p := outbox.RetryPolicy{BaseDelay: 2, MaxDelay: 2}
	var seen []time.Duration
	for range 200 {
		if b := p.Backoff(1); !slices.Contains(seen, b) {
			seen = append(seen, b)
		}
	}
	slices.Sort(seen)
	if !slices.Equal(seen, []time.Duration{1, 2}) {
		t.Fatalf("jitter values %v, want [1ns 2ns]", seen)
	}
}

// Delay and Backoff on a policy NewDispatcher has not checked: zero fields
// take their defaults (a zero policy gave no delay), and a policy it would
// refuse gives no delay rather than a panic.
func TestRetryPolicyUnchecked(t *testing.T) {
	var zero outbox.RetryPolicy
	if d := zero.Delay(1); d != time.Second {
		t.Fatalf("zero policy Delay(1) = %v, want the default base 1s", d)
	}
	if d := zero.Delay(1 << 30); d != 5*time.Minute {
		t.Fatalf("zero policy Delay(2^30) = %v, want the default cap 5m", d)
	}
	if b := zero.Backoff(1); b < 500*time.Millisecond || b > time.Second {
		t.Fatalf("zero policy Backoff(1) = %v, want it in [0.5s, 1s]", b)
	}
	negative := outbox.RetryPolicy{BaseDelay: -time.Second, MaxDelay: time.Second}
	if d, b := negative.Delay(3), negative.Backoff(3); d != 0 || b != 0 {
		t.Fatalf("a negative base: Delay %v, Backoff %v; want 0", d, b)
	}
	inverted := outbox.RetryPolicy{BaseDelay: time.Minute, MaxDelay: time.Second}
	if d := inverted.Delay(4); d != time.Minute {
		t.Fatalf("MaxDelay below BaseDelay: Delay(4) = %v, want BaseDelay", d)
	}
}
