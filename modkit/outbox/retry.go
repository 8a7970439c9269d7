package outbox

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// Retry defaults.
const (
	BaseDelayDefault   = time.Second
	MaxDelayDefault    = 5 * time.Minute
	MaxAttemptsDefault = 10
)

// RetryPolicy computes when a failed event is tried again, with seed 004's
// exponential backoff and equal jitter:
//
//	delay  = min(BaseDelay * 2^(attempts-1), MaxDelay)
//	wait   = uniform random in [delay/2, delay]
//
// where attempts counts delivery attempts so far, including the one that
// just failed.
type RetryPolicy struct {
	// BaseDelay is the delay before jitter after the first failure.
	// Default BaseDelayDefault.
	BaseDelay time.Duration
	// MaxDelay bounds the delay before jitter. Default MaxDelayDefault.
	MaxDelay time.Duration
}

// WithDefaults fills zero fields with the defaults.
func (p RetryPolicy) WithDefaults() RetryPolicy {
	if p.BaseDelay == 0 {
		p.BaseDelay = BaseDelayDefault
	}
	if p.MaxDelay == 0 {
		p.MaxDelay = MaxDelayDefault
	}
	return p
}

func (p RetryPolicy) validate() error {
	if p.BaseDelay <= 0 {
		return fmt.Errorf("outbox: RetryPolicy.BaseDelay is %v; it must be positive", p.BaseDelay)
	}
	if p.MaxDelay < p.BaseDelay {
		return fmt.Errorf("outbox: RetryPolicy.MaxDelay (%v) must be at least BaseDelay (%v)", p.MaxDelay, p.BaseDelay)
	}
	return nil
}

// Delay is the un-jittered delay after the given number of attempts.
func (p RetryPolicy) Delay(attempts int) time.Duration {
	if attempts < 1 {
		attempts = 1
	}
	d := p.BaseDelay
	for i := 1; i < attempts; i++ {
		if d > p.MaxDelay-d { // doubling would pass MaxDelay (and might overflow)
			return p.MaxDelay
		}
		d *= 2
	}
	return min(d, p.MaxDelay)
}

// Backoff is the jittered wait after the given number of attempts: uniform in
// [Delay(attempts)/2, Delay(attempts)].
func (p RetryPolicy) Backoff(attempts int) time.Duration {
	d := p.Delay(attempts)
	half := d / 2
	return half + rand.N(d-half+1)
}
