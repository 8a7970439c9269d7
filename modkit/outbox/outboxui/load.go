package outboxui

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
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
	// seriesReadTimeout bounds a read of the series, which is not
	// cancelled when the visitor who started it leaves: others may wait
	// for it.
	seriesReadTimeout = time.Minute
	// maxConcurrentReads is how many page loads read the database at once.
	maxConcurrentReads = 4
)

// seriesCache keeps the overview's series for seriesTTL, and shares one
// read among the page loads that want it at the same time.
type seriesCache struct {
	read func(context.Context) (outbox.Series, error)
	now  func() time.Time

	mu     sync.Mutex
	series outbox.Series
	at     time.Time     // when series was read; zero: nothing kept
	flight *seriesFlight // the read under way, if any
	// forgets counts the calls of forget: a read that began before one
	// is returned to those waiting for it but not kept.
	forgets uint64
}

// seriesFlight is one read of the series, which every page load that
// wants the series while it runs waits for.
type seriesFlight struct {
	done   chan struct{} // closed when series and err are set
	series outbox.Series
	err    error
}

// get returns the series read less than seriesTTL ago, or reads it: at
// most one read runs at a time, and a page load that comes during one
// waits for it (or for its own end). A failed read is not kept.
func (c *seriesCache) get(ctx context.Context) (outbox.Series, error) {
	c.mu.Lock()
	if !c.at.IsZero() && c.now().Sub(c.at) < seriesTTL {
		s := c.series
		c.mu.Unlock()
		return s, nil
	}
	if f := c.flight; f != nil {
		c.mu.Unlock()
		select {
		case <-f.done:
			return f.series, f.err
		case <-ctx.Done():
			return outbox.Series{}, ctx.Err()
		}
	}
	f := &seriesFlight{done: make(chan struct{})}
	c.flight = f
	forgets := c.forgets
	c.mu.Unlock()

	// Others may be waiting for this read: it outlasts this visitor's
	// request, but not seriesReadTimeout.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), seriesReadTimeout)
	f.series, f.err = c.read(rctx)
	cancel()

	c.mu.Lock()
	c.flight = nil
	if f.err == nil && forgets == c.forgets {
		c.series, c.at = f.series, c.now()
	}
	c.mu.Unlock()
	close(f.done)
	return f.series, f.err
}

// forget drops the series kept, so that the next page load reads it again
// (after a purge, which removes deliveries from it). A read under way is
// not kept either.
func (c *seriesCache) forget() {
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
