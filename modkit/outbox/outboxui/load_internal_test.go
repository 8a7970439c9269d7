package outboxui

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// fakeSeries is a series read that counts its calls and returns a series
// whose Total.Delivered is the call's number.
type fakeSeries struct {
	calls   atomic.Int64
	started chan struct{} // receives a value as each read starts, when set
	release chan struct{} // each read waits for a value, when set
	err     error
}

func (f *fakeSeries) read(ctx context.Context) (outbox.Series, error) {
	n := f.calls.Add(1)
	if f.started != nil {
		f.started <- struct{}{}
	}
	if f.release != nil {
		<-f.release
	}
	if err := ctx.Err(); err != nil {
		return outbox.Series{}, err
	}
	var s outbox.Series
	s.Total.Delivered = n
	return s, f.err
}

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// The overview's series is read at most once every seriesTTL: page loads
// meanwhile get the one read, and the next load after it reads again.
func TestSeriesIsKeptForItsTTL(t *testing.T) {
	f := &fakeSeries{}
	clock := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	c := &readCache[outbox.Series]{read: f.read, now: clock.now, ttl: seriesTTL}
	get := func() int64 {
		t.Helper()
		s, err := c.get(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return s.Total.Delivered
	}
	if got := get(); got != 1 {
		t.Fatalf("first load: read %d, want 1", got)
	}
	clock.add(seriesTTL - time.Millisecond)
	if got := get(); got != 1 || f.calls.Load() != 1 {
		t.Fatalf("load within the TTL: series of read %d after %d reads, want the first read's", got, f.calls.Load())
	}
	clock.add(time.Millisecond)
	if got := get(); got != 2 {
		t.Fatalf("load at the TTL: series of read %d, want a second read", got)
	}
	c.forget()
	if got := get(); got != 3 {
		t.Fatalf("load after forget: series of read %d, want a third read", got)
	}
}

// Page loads that want the series at the same time share one read; a read
// that fails is not kept.
func TestSeriesReadIsShared(t *testing.T) {
	const loads = 8
	// started has room for every load's read, so that reads which should
	// not happen fail the test rather than hang it.
	f := &fakeSeries{started: make(chan struct{}, loads), release: make(chan struct{})}
	clock := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	c := &readCache[outbox.Series]{read: f.read, now: clock.now, ttl: seriesTTL}
	var wg sync.WaitGroup
	got := make([]int64, loads)
	errs := make([]error, loads)
	wg.Add(1)
	go func() {
		defer wg.Done()
		s, err := c.get(context.Background())
		got[0], errs[0] = s.Total.Delivered, err
	}()
	<-f.started // the first load's read is under way
	for i := 1; i < loads; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := c.get(context.Background())
			got[i], errs[i] = s.Total.Delivered, err
		}()
	}
	close(f.release)
	wg.Wait()
	for i := range loads {
		if errs[i] != nil || got[i] != 1 {
			t.Errorf("load %d: series of read %d, error %v; want the one read's", i, got[i], errs[i])
		}
	}
	if n := f.calls.Load(); n != 1 {
		t.Errorf("%d loads read the series %d times, want once", loads, n)
	}

	// A failed read: the next load reads again.
	clock.add(seriesTTL)
	f.started, f.release, f.err = nil, nil, errors.New("the database said no")
	if _, err := c.get(context.Background()); !errors.Is(err, f.err) {
		t.Fatalf("failed read: error %v, want %v", err, f.err)
	}
	f.err = nil
	if s, err := c.get(context.Background()); err != nil || s.Total.Delivered != 3 {
		t.Fatalf("load after a failed read: series of read %d, error %v; want a third read", s.Total.Delivered, err)
	}
}

// The read outlasts the visitor who started it (others may wait for it),
// a visitor who leaves while waiting for another's read stops waiting, and
// a read that began before forget is not kept.
func TestSeriesReadOutlastsItsVisitor(t *testing.T) {
	f := &fakeSeries{started: make(chan struct{}, 1), release: make(chan struct{})}
	clock := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	c := &readCache[outbox.Series]{read: f.read, now: clock.now, ttl: seriesTTL}
	first, leave := context.WithCancel(context.Background())
	type result struct {
		s   outbox.Series
		err error
	}
	done := make(chan result, 1)
	go func() {
		s, err := c.get(first)
		done <- result{s, err}
	}()
	<-f.started
	leave() // the first visitor leaves during the read

	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.get(gone); !errors.Is(err, context.Canceled) {
		t.Fatalf("a waiting visitor who left: error %v, want context.Canceled", err)
	}
	c.forget() // a purge during the read
	f.release <- struct{}{}
	if r := <-done; r.err != nil || r.s.Total.Delivered != 1 {
		t.Fatalf("the read its visitor left: series of read %d, error %v; want it read", r.s.Total.Delivered, r.err)
	}
	f.started, f.release = nil, nil
	if s, err := c.get(context.Background()); err != nil || s.Total.Delivered != 2 {
		t.Fatalf("load after a read that began before forget: series of read %d, error %v; want a second read", s.Total.Delivered, err)
	}
}

// At most maxConcurrentReads page loads read at once: the next waits for
// a turn, and gets 503 if its visitor leaves first.
func TestPageLoadsWaitForATurn(t *testing.T) {
	h := &handler{reads: make(chan struct{}, maxConcurrentReads)}
	var served atomic.Int64
	page := h.limitReads(func(w http.ResponseWriter, r *http.Request) { served.Add(1) })
	for range maxConcurrentReads {
		h.reads <- struct{}{} // the turns are taken
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rec := httptest.NewRecorder()
	page(rec, httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx))
	if rec.Code != http.StatusServiceUnavailable || served.Load() != 0 {
		t.Fatalf("a visitor who left while waiting: status %d, %d served; want 503 and none", rec.Code, served.Load())
	}

	done := make(chan int)
	go func() {
		rec := httptest.NewRecorder()
		page(rec, httptest.NewRequest(http.MethodGet, "/", nil))
		done <- rec.Code
	}()
	<-h.reads // a turn comes free
	if code := <-done; code != http.StatusOK || served.Load() != 1 {
		t.Fatalf("a load given a turn: status %d, %d served; want 200 and one", code, served.Load())
	}
	if n := len(h.reads); n != maxConcurrentReads-1 {
		t.Fatalf("%d turns taken after the load, want its turn given back (%d)", n, maxConcurrentReads-1)
	}
}
