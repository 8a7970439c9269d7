package outboxui

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// What a visitor's page loads may cost the database. The dashboard's read
// pages are open to anyone who reaches it, and two of its reads grow with
// the traffic: the overview's series sorts every delivery of the last hour
// for its percentiles (seconds at a million deliveries an hour), and the
// events page without a status reads the whole table. So the overview's
// series is read at most once every seriesTTL, by one request for all the
// page loads that want it meanwhile, and at most maxConcurrentReads page
// loads read the database at once; the others wait for their turn.
const (
	seriesTTL = 10 * time.Second
	// maxConcurrentReads is how many page loads read the database at once.
	maxConcurrentReads = 4
)

// readCache keeps what read returns for ttl, and shares one read among the
// requests that want it at the same time (the overview's series; the
// rights of the dashboard's database login).
type readCache[T any] struct {
	read func(context.Context) (T, error)
	now  func() time.Time
	ttl  time.Duration
	// keepFailed keeps a failed read as the zero T for ttl (its error goes
	// to the requests that waited for it only), so that a database that
	// is down costs one read a ttl rather than one a request.
	keepFailed bool

	mu    sync.Mutex
	value T
	at    time.Time  // when value was read; zero: nothing kept
	fl    *flight[T] // the read under way, if any
	// forgets counts the calls of forget: a read that began before one
	// is returned to those waiting for it but not kept.
	forgets uint64
}

// flight is one read, which every request that wants the value while it
// runs waits for.
type flight[T any] struct {
	done  chan struct{} // closed when value and err are set
	value T
	err   error
}

// readTimeout bounds a cache's read, which is not cancelled when the
// visitor who started it leaves: others may wait for it.
const readTimeout = time.Minute

// get returns the value read less than ttl ago, or reads it: at most one
// read runs at a time, and a request that comes during one waits for it
// (or for its own end).
func (c *readCache[T]) get(ctx context.Context) (T, error) {
	c.mu.Lock()
	if !c.at.IsZero() && c.now().Sub(c.at) < c.ttl {
		v := c.value
		c.mu.Unlock()
		return v, nil
	}
	if f := c.fl; f != nil {
		c.mu.Unlock()
		select {
		case <-f.done:
			return f.value, f.err
		case <-ctx.Done():
			var zero T
			return zero, ctx.Err()
		}
	}
	f := &flight[T]{done: make(chan struct{})}
	c.fl = f
	forgets := c.forgets
	c.mu.Unlock()

	// Others may be waiting for this read: it outlasts this visitor's
	// request, but not readTimeout.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), readTimeout)
	f.value, f.err = c.read(rctx)
	cancel()
	if f.err != nil {
		var zero T
		f.value = zero
	}

	c.mu.Lock()
	c.fl = nil
	if (f.err == nil || c.keepFailed) && forgets == c.forgets {
		c.value, c.at = f.value, c.now()
	}
	c.mu.Unlock()
	close(f.done)
	return f.value, f.err
}

// forget drops the value kept, so that the next request reads it again
// (the series after a purge, which removes deliveries from it). A read
// under way is not kept either.
func (c *readCache[T]) forget() {
	c.mu.Lock()
	c.at = time.Time{}
	c.forgets++
	c.mu.Unlock()
}

// limitReads lets at most maxConcurrentReads of the page loads through fn
// at once. A page load waits for its turn; one whose visitor leaves while
// it waits gets 503 Service Unavailable (which nobody sees).
func (h *handler) limitReads(fn http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		select {
		case h.reads <- struct{}{}:
		case <-r.Context().Done():
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		defer func() { <-h.reads }()
		fn(w, r)
	}
}
