package outbox

import (
	"math/rand/v2"
	"time"
)

const (
	baseDelayDefault   = time.Second
	maxDelayDefault    = 5 * time.Minute
	maxAttemptsDefault = 10
)

// RetryPolicy computes when a failed event is tried again, with exponential
// backoff and equal jitter:
//
//	delay  = min(BaseDelay * 2^(attempts-1), MaxDelay)
//	wait   = uniform random in [delay/2, delay]
//
// where attempts counts delivery attempts so far, including the one that
// just failed.
type RetryPolicy struct {
	// BaseDelay is the delay before jitter after the first failure.
	// Default 1s.
	BaseDelay time.Duration
	// MaxDelay bounds the delay before jitter. Default 5m.
	MaxDelay time.Duration
}

func (p RetryPolicy) withDefaults() RetryPolicy {
	if p.BaseDelay == 0 {
		p.BaseDelay = baseDelayDefault
	}
	if p.MaxDelay == 0 {
		p.MaxDelay = maxDelayDefault
	}
	return p
}

func (p RetryPolicy) validate() error {
	if p.BaseDelay <= 0 {
		return configError("RetryPolicy.BaseDelay is %v; it must be positive", p.BaseDelay)
	}
	if p.MaxDelay < p.BaseDelay {
		return configError("RetryPolicy.MaxDelay (%v) must be at least BaseDelay (%v)", p.MaxDelay, p.BaseDelay)
	}
	return nil
}

// Delay is the un-jittered delay after the given number of attempts. Zero
// fields take their defaults, as in a DispatcherConfig; a BaseDelay below
// zero gives no delay, and a MaxDelay below BaseDelay is taken as BaseDelay
// (NewDispatcher refuses both).
func (p RetryPolicy) Delay(attempts int) time.Duration {
	p = p.withDefaults()
	if p.BaseDelay <= 0 {
		return 0
	}
	p.MaxDelay = max(p.MaxDelay, p.BaseDelay)
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
	if d <= 0 {
		return 0
	}
	half := d / 2
	return half + rand.N(d-half+1)
}
