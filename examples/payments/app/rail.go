package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"
)

// Headers the dispatcher sends with each payment.
const (
	// HeaderIdempotencyKey carries the instruction id: the rail pays a key
	// once and answers every later request with it with the first result.
	HeaderIdempotencyKey = "Idempotency-Key"
	// HeaderSequence is the instruction's place among its participant's
	// (1, 2, …), which the rail checks.
	HeaderSequence = "X-Participant-Seq"
	// HeaderDispatcher names the dispatcher process (its pid).
	HeaderDispatcher = "X-Dispatcher"
)

// Faults are the rail's injected faults, as fractions of requests.
type Faults struct {
	// Latency is the most a request waits before it is handled (uniform).
	Latency time.Duration
	// Unavailable answers 503 without paying.
	Unavailable float64
	// LostResponse pays and then never answers: the dispatcher's hard
	// timeout ends the request and it retries, and the retry must be
	// answered with the first result, not paid again.
	LostResponse float64
}

// Payment is what the rail paid: one per idempotency key.
type Payment struct {
	Reference     string `json:"reference"`
	InstructionID string `json:"instruction_id"`
	Participant   string `json:"participant_id"`
	Seq           int64  `json:"seq"`
	AmountMinor   int64  `json:"amount_minor"`
	Currency      string `json:"currency"`
	Destination   string `json:"destination"`
	Dispatcher    string `json:"-"`
}

// RailStats are the rail's counters.
type RailStats struct {
	Requests, Paid, Replayed, Unavailable, LostResponses, Rejected int
	// OrderViolations lists payments that arrived out of their
	// participant's order.
	OrderViolations []string
	// MaxInFlight is the most requests of one dispatcher (HeaderDispatcher)
	// handled at once. A paid request whose answer is lost stops counting
	// when it is paid.
	MaxInFlight int
}

// Rail is a payment rail: a real HTTP server on 127.0.0.1 that validates
// and pays instructions, at most once per idempotency key, and records the
// order of each participant's payments.
type Rail struct {
	srv    *http.Server
	ln     net.Listener
	faults Faults
	closed chan struct{}
	served chan error

	mu         sync.Mutex
	rnd        *rand.Rand
	byKey      map[string]Payment
	order      map[string][]int64 // participant -> seqs paid, in arrival order
	stats      RailStats
	inFlightBy map[string]int // dispatcher -> requests in flight
	changed    chan struct{}  // closed and replaced at every change
}

// StartRail starts a rail on a free port of 127.0.0.1.
func StartRail(faults Faults, seed uint64) (*Rail, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("rail: listen: %w", err)
	}
	r := &Rail{
		ln: ln, faults: faults, closed: make(chan struct{}), served: make(chan error, 1),
		rnd: rand.New(rand.NewPCG(seed, 0x7261696c)), byKey: map[string]Payment{}, order: map[string][]int64{},
		inFlightBy: map[string]int{}, changed: make(chan struct{}),
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /payments", r.handle)
	r.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { r.served <- r.srv.Serve(ln) }()
	return r, nil
}

// URL is the rail's base URL.
func (r *Rail) URL() string { return "http://" + r.ln.Addr().String() }

// Close stops the rail, ending the requests it holds.
func (r *Rail) Close() error {
	close(r.closed)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := r.srv.Shutdown(ctx)
	if serr := <-r.served; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}

// Payments returns what the rail paid, by idempotency key.
func (r *Rail) Payments() map[string]Payment {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]Payment, len(r.byKey))
	for k, p := range r.byKey {
		out[k] = p
	}
	return out
}

// Order returns, per participant, the sequence numbers the rail paid in
// the order it paid them.
func (r *Rail) Order() map[string][]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string][]int64, len(r.order))
	for k, v := range r.order {
		out[k] = slices.Clone(v)
	}
	return out
}

// Stats returns the rail's counters.
func (r *Rail) Stats() RailStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.stats
	s.OrderViolations = slices.Clone(s.OrderViolations)
	return s
}

// WaitFor blocks until cond, called under the rail's lock with the number
// of payments and the requests in flight per dispatcher, holds, or ctx ends.
func (r *Rail) WaitFor(ctx context.Context, cond func(paid int, inFlightBy map[string]int) bool) error {
	for {
		r.mu.Lock()
		ok, ch := cond(len(r.byKey), r.inFlightBy), r.changed
		r.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// leaveLocked ends a request's time in flight; r.mu is held.
func (r *Rail) leaveLocked(dispatcher string) {
	r.inFlightBy[dispatcher]--
	r.notifyLocked()
}

// notifyLocked wakes WaitFor; r.mu is held.
func (r *Rail) notifyLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *Rail) handle(w http.ResponseWriter, req *http.Request) {
	dispatcher := req.Header.Get(HeaderDispatcher)
	r.mu.Lock()
	r.stats.Requests++
	r.inFlightBy[dispatcher]++
	r.stats.MaxInFlight = max(r.stats.MaxInFlight, r.inFlightBy[dispatcher])
	latency := time.Duration(0)
	if r.faults.Latency > 0 {
		latency = time.Duration(r.rnd.Int64N(int64(r.faults.Latency)))
	}
	roll := r.rnd.Float64()
	r.notifyLocked()
	r.mu.Unlock()
	held := false // a lost answer's request leaves the count when it is paid
	defer func() {
		if !held {
			r.mu.Lock()
			r.leaveLocked(dispatcher)
			r.mu.Unlock()
		}
	}()

	// Latency, then nothing happens for a request its sender gave up on.
	select {
	case <-time.After(latency):
	case <-req.Context().Done():
		return
	case <-r.closed:
		return
	}
	var p Payment
	if err := json.NewDecoder(http.MaxBytesReader(w, req.Body, 1<<16)).Decode(&p); err != nil {
		r.reject(w, "malformed body: "+err.Error())
		return
	}
	key := req.Header.Get(HeaderIdempotencyKey)
	seq, err := strconv.ParseInt(req.Header.Get(HeaderSequence), 10, 64)
	if key == "" || err != nil || key != p.InstructionID || seq != p.Seq {
		r.reject(w, "missing or inconsistent idempotency key or sequence")
		return
	}
	if err := ValidatePayment(p); err != nil {
		r.reject(w, err.Error())
		return
	}
	if roll < r.faults.Unavailable {
		r.mu.Lock()
		r.stats.Unavailable++
		r.mu.Unlock()
		http.Error(w, "rail unavailable, try again", http.StatusServiceUnavailable)
		return
	}

	r.mu.Lock()
	first, seen := r.byKey[key]
	if seen {
		r.stats.Replayed++
	} else {
		p.Reference = fmt.Sprintf("RAIL-%06d", len(r.byKey)+1)
		p.Dispatcher = dispatcher
		paid := r.order[p.Participant]
		if n := len(paid); n > 0 && paid[n-1] >= p.Seq {
			r.stats.OrderViolations = append(r.stats.OrderViolations,
				fmt.Sprintf("%s: seq %d paid after seq %d", p.Participant, p.Seq, paid[n-1]))
		}
		r.order[p.Participant] = append(paid, p.Seq)
		r.byKey[key] = p
		r.stats.Paid++
		first = p
	}
	lost := !seen && roll < r.faults.Unavailable+r.faults.LostResponse
	if lost {
		r.stats.LostResponses++
		// The rail is done with it; it only keeps the connection open. Its
		// sender frees its slot when it gives up, which the rail notices
		// only later: counted until then, it would overlap the sender's
		// next request.
		r.leaveLocked(dispatcher)
		held = true
	}
	r.notifyLocked()
	r.mu.Unlock()

	if held {
		// Paid, but the answer never comes: hold the request until its
		// sender gives up.
		select {
		case <-req.Context().Done():
		case <-r.closed:
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(first)
}

func (r *Rail) reject(w http.ResponseWriter, why string) {
	r.mu.Lock()
	r.stats.Rejected++
	r.mu.Unlock()
	http.Error(w, why, http.StatusUnprocessableEntity)
}
