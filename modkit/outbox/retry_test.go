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
