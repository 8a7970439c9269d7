package outbox_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox"
)

func TestClaimBatch(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, pool, 5)
	// Another service's event and a not-yet-due event must not be claimed.
	foreign := outbox.Message{Namespace: "billing", Topic: "invoice", Payload: []byte(`{}`)}
	foreignRes, _ := outbox.Enqueue(ctx, pool, foreign)
	later := enqueueN(t, pool, 1)[0]
	pool.Exec(ctx, "UPDATE modkit_outbox_events SET next_attempt_at = now() + interval '1 hour' WHERE id = $1", later)

	got := mustClaim(t, s, claimCfg(3))
	if len(got) != 3 {
		t.Fatalf("claimed %d, want 3 (batch size)", len(got))
	}
	for i, m := range got {
		if m.ID != ids[i] {
			t.Fatalf("claim order: got %s at %d, want %s (created_at, id order)", m.ID, i, ids[i])
		}
		e := get(t, s, m.ID)
		if e.Status != outbox.StatusProcessing || e.Attempts != 1 || m.Attempts != 1 || e.LockedBy == nil ||
			*e.LockedBy != s.WorkerID() || e.LockedUntil == nil || !e.LockedUntil.Equal(m.LeaseExpiresAt) ||
			m.LeaseToken == uuid.Nil || !e.UpdatedAt.Before(*e.LockedUntil) || m.MaxAttempts != 3 {
			t.Fatalf("claimed row: %+v / %+v", e, m)
		}
		if lease := e.LockedUntil.Sub(e.UpdatedAt); lease != 30*time.Second {
			t.Fatalf("lease %v, want exactly the configured 30s by the database clock", lease)
		}
	}
	rest := mustClaim(t, s, claimCfg(10))
	if len(rest) != 2 || rest[0].ID != ids[3] || rest[1].ID != ids[4] {
		t.Fatalf("second claim: %+v", rest)
	}
	if again := mustClaim(t, s, claimCfg(10)); len(again) != 0 {
		t.Fatalf("leased events claimed again: %+v", again)
	}
	if e := get(t, s, foreignRes.ID); e.Status != outbox.StatusPending {
		t.Fatal("claimed another topic's event")
	}
	if e := get(t, s, later); e.Status != outbox.StatusPending {
		t.Fatal("claimed an event before its next_attempt_at")
	}
	// Bad configs are rejected before any SQL.
	for _, cfg := range []outbox.ClaimConfig{
		{Topics: nil},
		{BatchSize: -1, Topics: []outbox.Topic{testTopic}},
		{BatchSize: outbox.BatchSizeMax + 1, Topics: []outbox.Topic{testTopic}},
		{LeaseDuration: time.Millisecond, Topics: []outbox.Topic{testTopic}},
		{MaxAttempts: -1, Topics: []outbox.Topic{testTopic}},
		{Topics: []outbox.Topic{{Namespace: "BAD", Topic: "x"}}},
	} {
		if _, err := s.ClaimBatch(ctx, cfg); err == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
	if _, err := s.ClaimBatch(ctx, outbox.ClaimConfig{}); !errors.Is(err, outbox.ErrNoTopics) {
		t.Errorf("no topics: %v", err)
	}
}

func TestAck(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	enqueueN(t, tdb.Provider.Pool, 1)
	m := mustClaim(t, s, claimCfg(1))[0]
	if err := s.Ack(ctx, m); err != nil {
		t.Fatal(err)
	}
	e := get(t, s, m.ID)
	if e.Status != outbox.StatusDelivered || e.LockedBy != nil || e.LockedUntil != nil {
		t.Fatalf("acked row: %+v", e)
	}
	// Delivered is terminal: not claimable, and a second ack is refused.
	if got := mustClaim(t, s, claimCfg(1)); len(got) != 0 {
		t.Fatal("delivered event claimed again")
	}
	if err := s.Ack(ctx, m); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("second ack: %v", err)
	}
	if _, err := s.Nack(ctx, m, errors.New("late")); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("nack after ack: %v", err)
	}
	if e2 := get(t, s, m.ID); e2.Status != outbox.StatusDelivered || !e2.UpdatedAt.Equal(e.UpdatedAt) {
		t.Fatalf("stale ack/nack changed a delivered row: %+v", e2)
	}
}

// Seed 003's race: A claims, A's lease expires, B reclaims, A acks → lease
// lost and nothing changes; B acks → delivered.
func TestFencingStaleWorker(t *testing.T) {
	a, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	b, err := outbox.NewStore(tdb.NewPool(t), outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	enqueueN(t, pool, 1)
	ma := mustClaim(t, a, claimCfg(1))[0]

	expireLease(t, pool, ma.ID)
	// Expired but not yet reclaimed: A's lease is gone already.
	if err := a.Ack(ctx, ma); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("ack on an expired lease: %v", err)
	}

	mb := mustClaim(t, b, claimCfg(1))
	if len(mb) != 1 || mb[0].ID != ma.ID || mb[0].Attempts != 2 || mb[0].LeaseToken == ma.LeaseToken {
		t.Fatalf("B's reclaim: %+v", mb)
	}
	before := get(t, a, ma.ID)
	if err := a.Ack(ctx, ma); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("stale A ack: %v", err)
	}
	if _, err := a.Nack(ctx, ma, errors.New("stale")); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("stale A nack: %v", err)
	}
	if err := a.Release(ctx, []outbox.ClaimedMessage{ma}); err != nil {
		t.Fatalf("stale release must be a silent no-op: %v", err)
	}
	// Same worker id but an old token is just as stale: the token fences,
	// not the worker id.
	forged := ma
	forged.LeaseToken = uuid.New()
	if err := b.Ack(ctx, forged); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("ack with a wrong token: %v", err)
	}
	if after := get(t, a, ma.ID); after.Status != outbox.StatusProcessing || *after.LockedBy != b.WorkerID() ||
		!after.UpdatedAt.Equal(before.UpdatedAt) || after.Attempts != 2 {
		t.Fatalf("stale worker changed the row: %+v", after)
	}
	if err := b.Ack(ctx, mb[0]); err != nil {
		t.Fatalf("B ack: %v", err)
	}
	if e := get(t, a, ma.ID); e.Status != outbox.StatusDelivered {
		t.Fatalf("after B ack: %+v", e)
	}
}

// Seed 004 §6: publish failures reschedule with increasing next_attempt_at
// and record last_error; the row is dead after max_attempts.
func TestNackBackoffAndDeadLetter(t *testing.T) {
	policy := outbox.RetryPolicy{BaseDelay: 10 * time.Second, MaxDelay: time.Hour}
	s, tdb := newStore(t, outbox.Config{Retry: policy})
	pool := tdb.Provider.Pool
	enqueueN(t, pool, 1)
	cfg := claimCfg(1)
	cfg.MaxAttempts = 4
	var lastDelay time.Duration
	for attempt := 1; attempt <= 4; attempt++ {
		got := mustClaim(t, s, cfg)
		if len(got) != 1 || got[0].Attempts != attempt {
			t.Fatalf("attempt %d: claimed %+v", attempt, got)
		}
		st, err := s.Nack(ctx, got[0], fmt.Errorf("downstream said no (%d)", attempt))
		if err != nil {
			t.Fatal(err)
		}
		e := get(t, s, got[0].ID)
		if !strings.Contains(*e.LastError, fmt.Sprintf("downstream said no (%d)", attempt)) || e.LockedBy != nil {
			t.Fatalf("attempt %d: row %+v", attempt, e)
		}
		if attempt == 4 {
			if st.Status != outbox.StatusDead || e.Status != outbox.StatusDead {
				t.Fatalf("after the last attempt: %+v / %+v", st, e)
			}
			break
		}
		// next_attempt_at - updated_at is the jittered delay, both from the
		// same statement's database clock.
		delay := e.NextAttemptAt.Sub(e.UpdatedAt)
		want := policy.Delay(attempt)
		if e.Status != outbox.StatusPending || st.Status != outbox.StatusPending || delay < want/2-time.Millisecond || delay > want {
			t.Fatalf("attempt %d: status %s, delay %v, want pending within [%v, %v]", attempt, e.Status, delay, want/2, want)
		}
		if attempt > 1 && delay <= lastDelay/2 {
			t.Fatalf("delay did not grow: %v after %v", delay, lastDelay)
		}
		lastDelay = delay
		if again := mustClaim(t, s, cfg); len(again) != 0 {
			t.Fatal("retried event claimed before its next_attempt_at")
		}
		makeDue(t, pool, got[0].ID)
	}
	if got := mustClaim(t, s, cfg); len(got) != 0 {
		t.Fatal("dead event claimed")
	}
}

func TestPermanentFailureDeadLettersAtOnce(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	enqueueN(t, tdb.Provider.Pool, 1)
	m := mustClaim(t, s, claimCfg(1))[0]
	st, err := s.Nack(ctx, m, fmt.Errorf("consumer: %w", outbox.Permanent(errors.New("schema v9 unknown"))))
	if err != nil || st.Status != outbox.StatusDead {
		t.Fatalf("%+v %v", st, err)
	}
	e := get(t, s, m.ID)
	if e.Status != outbox.StatusDead || e.Attempts != 1 || !strings.Contains(*e.LastError, "schema v9 unknown") {
		t.Fatalf("row: %+v", e)
	}
	if outbox.Permanent(nil) != nil || outbox.IsPermanent(errors.New("x")) {
		t.Fatal("Permanent(nil) must be nil; plain errors are not permanent")
	}
}

// The gap in seed 004: a worker that crashes on the last allowed attempt
// leaves the row processing with attempts = max_attempts, which the claim
// never picks up. SweepExhausted dead-letters it, saying why.
func TestCrashOnLastAttemptIsSwept(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	pool := tdb.Provider.Pool
	ids := enqueueN(t, pool, 2)
	cfg := claimCfg(1)
	cfg.MaxAttempts = 1
	m := mustClaim(t, s, cfg)[0] // the "crashed" worker never settles it
	expireLease(t, pool, m.ID)
	if got := mustClaim(t, s, cfg); len(got) != 1 || got[0].ID != ids[1] {
		t.Fatalf("claim after the crash: %+v (the exhausted row must be skipped)", got)
	}
	swept, err := s.SweepExhausted(ctx, cfg.MaxAttempts, cfg.Topics)
	if err != nil || len(swept) != 1 || swept[0] != m.ID {
		t.Fatalf("sweep: %v %v", swept, err)
	}
	e := get(t, s, m.ID)
	if e.Status != outbox.StatusDead || e.LockedBy != nil || !strings.Contains(*e.LastError, "expired on the final attempt") {
		t.Fatalf("swept row: %+v", e)
	}
	// The live lease of ids[1] is not touched.
	if e := get(t, s, ids[1]); e.Status != outbox.StatusProcessing {
		t.Fatalf("sweep touched a live lease: %+v", e)
	}
	if again, _ := s.SweepExhausted(ctx, cfg.MaxAttempts, cfg.Topics); len(again) != 0 {
		t.Fatalf("second sweep: %v", again)
	}
}

func TestRelease(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	enqueueN(t, tdb.Provider.Pool, 2)
	got := mustClaim(t, s, claimCfg(2))
	if err := s.Release(ctx, got); err != nil {
		t.Fatal(err)
	}
	for _, m := range got {
		if e := get(t, s, m.ID); e.Status != outbox.StatusPending || e.Attempts != 0 || e.LockedBy != nil {
			t.Fatalf("released row: %+v", e)
		}
	}
	if again := mustClaim(t, s, claimCfg(2)); len(again) != 2 || again[0].Attempts != 1 {
		t.Fatalf("released events not claimable at once: %+v", again)
	}
}

func TestCompleteMixedOutcomes(t *testing.T) {
	s, tdb := newStore(t, outbox.Config{})
	enqueueN(t, tdb.Provider.Pool, 4)
	got := mustClaim(t, s, claimCfg(4))
	stale := got[3]
	stale.LeaseToken = uuid.New()
	out, err := s.Complete(ctx, []outbox.Result{
		{Message: got[0]},
		{Message: got[1], Err: errors.New("timeout")},
		{Message: got[2], Err: outbox.Permanent(errors.New("bad"))},
		{Message: stale},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []outbox.Status{outbox.StatusDelivered, outbox.StatusPending, outbox.StatusDead}
	for i, w := range want {
		if out[i].LeaseLost || out[i].Status != w || get(t, s, got[i].ID).Status != w {
			t.Fatalf("result %d: %+v, want %s", i, out[i], w)
		}
	}
	if !out[3].LeaseLost || get(t, s, got[3].ID).Status != outbox.StatusProcessing {
		t.Fatalf("wrong token must be lease-lost and change nothing: %+v", out[3])
	}
}

// Seed 004 §6: several claimers never double-claim.
func TestConcurrentClaimersNeverShareAnEvent(t *testing.T) {
	_, tdb := newStore(t, outbox.Config{})
	ids := enqueueN(t, tdb.Provider.Pool, 600)
	const workers = 4
	var mu sync.Mutex
	seen := map[uuid.UUID]uuid.UUID{}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		s, err := outbox.NewStore(tdb.NewPool(t), outbox.Config{})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				got, err := s.ClaimBatch(ctx, claimCfg(7))
				if err != nil {
					errs <- err
					return
				}
				if len(got) == 0 {
					return
				}
				mu.Lock()
				for _, m := range got {
					if prev, dup := seen[m.ID]; dup {
						mu.Unlock()
						errs <- fmt.Errorf("event %s claimed by %s and %s", m.ID, prev, s.WorkerID())
						return
					}
					seen[m.ID] = s.WorkerID()
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(seen) != len(ids) {
		t.Fatalf("claimed %d distinct events of %d", len(seen), len(ids))
	}
	for _, id := range ids {
		if _, ok := seen[id]; !ok {
			t.Fatalf("event %s never claimed", id)
		}
	}
}

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

// Claims and outcomes commit asynchronously by default, but only their own
// implicit transaction: the pooled session keeps its setting.
func TestAsyncCommitStaysInTheStatement(t *testing.T) {
	tdb := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s, err := outbox.NewStore(pool, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	// The test cluster may run with synchronous_commit off; the session
	// asks for on, and must still have it afterwards.
	if _, err := pool.Exec(ctx, "SET synchronous_commit = on"); err != nil {
		t.Fatal(err)
	}
	enqueueN(t, pool, 3)
	got := mustClaim(t, s, claimCfg(10))
	if len(got) != 3 {
		t.Fatalf("claimed %d", len(got))
	}
	if err := s.Ack(ctx, got[0]); err != nil {
		t.Fatal(err)
	}
	var setting string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if setting != "on" {
		t.Fatalf("synchronous_commit is %q on the session after a claim and an ack", setting)
	}
}
