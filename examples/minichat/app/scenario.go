package app

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/examples/minichat/chat"
	"github.com/modkit-go/modkit/examples/minichat/events"
	"github.com/modkit-go/modkit/examples/minichat/usage"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// scenario is one demo run: its tenants, its instruments, and the modules
// the fx app provided.
type scenario struct {
	opts    Options
	tenants []uuid.UUID
	track   *tracker
	lat     *latencies
	started atomic.Int64 // turns started
	races   atomic.Int64 // explicit watchdog races run

	svc       *chat.Service
	collector *usage.Collector
	prov      *db.Provider
	outbox    *outbox.Client
}

func newScenario(opts Options) *scenario {
	tenants := []uuid.UUID{uuid.New(), uuid.New()} // fresh: the run reconciles only its own rows
	return &scenario{opts: opts, tenants: tenants, track: newTracker(tenants), lat: newLatencies()}
}

// drive runs the users, enqueues the malformed probes, waits until the run
// has settled and reconciles it.
func (sc *scenario) drive(ctx context.Context) (Summary, error) {
	start := time.Now()
	stopProgress := sc.reportProgress(start)
	defer stopProgress()

	if err := sc.runUsers(ctx); err != nil {
		return Summary{}, err
	}
	if err := sc.enqueueProbes(ctx); err != nil {
		return Summary{}, err
	}
	if err := sc.waitSettled(ctx); err != nil {
		return Summary{}, err
	}
	sum, err := sc.reconcile(ctx)
	if err != nil {
		return Summary{}, err
	}
	sum.Elapsed = time.Since(start)
	return sum, nil
}

// reportProgress calls Options.Progress every second until the returned
// function is called.
func (sc *scenario) reportProgress(start time.Time) (stop func()) {
	if sc.opts.Progress == nil {
		return func() {}
	}
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				sc.opts.Progress(sc.progress(start))
			}
		}
	}()
	return func() { close(done); <-exited }
}

func (sc *scenario) progress(start time.Time) Progress {
	p := Progress{Elapsed: time.Since(start), TurnsStarted: sc.started.Load(), TurnsGoal: int64(sc.opts.Turns)}
	for _, n := range sc.svc.Stats().Finalised {
		p.TurnsFinal += n
	}
	p.Delivered, p.Retried, p.Dead = sc.track.counts()
	return p
}

// user is one simulated chat user.
type user struct {
	tenant, id uuid.UUID
	index      int
	turns      int
}

// runUsers gives every user a quota and a chat, and runs their turns
// concurrently.
func (sc *scenario) runUsers(ctx context.Context) error {
	users := make([]user, sc.opts.Users)
	for i := range users {
		users[i] = user{tenant: sc.tenants[i%len(sc.tenants)], id: uuid.New(), index: i, turns: sc.opts.Turns / sc.opts.Users}
		if i < sc.opts.Turns%sc.opts.Users {
			users[i].turns++
		}
		if err := sc.svc.SetQuota(ctx, users[i].tenant, users[i].id, 1_000_000_000_000); err != nil {
			return err
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, len(users))
	for i := range users {
		wg.Go(func() { errs[i] = sc.runUser(ctx, users[i]) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

var models = []string{"mini-fast", "mini-fast", "mini-large"}

// reserveMicro is what every simulated turn reserves up front.
const reserveMicro = 200_000

// runUser drives a user's turns one after another: start (reserving
// quota), let the model "generate", then finalise — or, for some, race the
// watchdog, or vanish and leave the turn to the watchdog.
func (sc *scenario) runUser(ctx context.Context, u user) error {
	rng := rand.New(rand.NewPCG(sc.opts.Seed, uint64(u.index)+1))
	chatID, err := sc.svc.NewChat(ctx, u.tenant, u.id)
	if err != nil {
		return err
	}
	for i := range u.turns {
		model := models[rng.IntN(len(models))]
		turn, err := sc.svc.StartTurn(ctx, chatID, fmt.Sprintf("req-%d-%d", u.index, i), model, reserveMicro)
		if err != nil {
			return err
		}
		sc.started.Add(1)
		if err := generate(ctx, rng); err != nil {
			return err
		}
		o := simulatedOutcome(rng, model)
		switch {
		case (u.index == 0 && i == 0) || (i+1)%sc.opts.RaceEvery == 0:
			sc.races.Add(1)
			err = raceWatchdog(ctx, sc.svc, turn.ID, o)
			if err == nil {
				err = resend(ctx, sc.svc, turn.ID)
			}
		case o.State == chat.StateOrphaned:
			// The runner vanished: only the watchdog will finalise it.
		default:
			_, err = sc.svc.Finalise(ctx, turn.ID, o, chat.ByRunner)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// generate stands for the model producing its answer: a few milliseconds.
func generate(ctx context.Context, rng *rand.Rand) error {
	t := time.NewTimer(time.Duration(2+rng.IntN(10)) * time.Millisecond)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// raceWatchdog finalises a turn from the normal path and, as orphaned, from
// the watchdog at the same moment. Exactly one wins; the other's
// compare-and-set matches nothing and writes no event.
func raceWatchdog(ctx context.Context, svc *chat.Service, turnID uuid.UUID, o chat.Outcome) error {
	if o.State == chat.StateOrphaned {
		o.State = chat.StateCompleted
	}
	gate := make(chan struct{})
	var wg sync.WaitGroup
	var errRunner, errWatchdog error
	wg.Go(func() { <-gate; _, errRunner = svc.Finalise(ctx, turnID, o, chat.ByRunner) })
	wg.Go(func() {
		<-gate
		_, errWatchdog = svc.Finalise(ctx, turnID, chat.Outcome{State: chat.StateOrphaned}, chat.ByWatchdog)
	})
	close(gate)
	wg.Wait()
	return errors.Join(errRunner, errWatchdog)
}

// resend re-enqueues a finalised turn's usage event, as a reconciler
// unsure about a race might: the dedupe key must suppress it.
func resend(ctx context.Context, svc *chat.Service, turnID uuid.UUID) error {
	ev, err := svc.ResendUsage(ctx, turnID)
	if err != nil {
		return err
	}
	if !ev.AlreadyEnqueued {
		return fmt.Errorf("minichat: turn %s: resending its usage event wrote a new one, so its finalisation wrote none", turnID)
	}
	return nil
}

// simulatedOutcome picks how a turn ends and what it used.
func simulatedOutcome(rng *rand.Rand, model string) chat.Outcome {
	u := events.Usage{
		InputTokens:      int64(200 + rng.IntN(4000)),
		OutputTokens:     int64(50 + rng.IntN(1500)),
		CacheReadTokens:  int64(rng.IntN(2000)),
		CacheWriteTokens: int64(rng.IntN(500)),
	}
	if model == "mini-large" {
		u.ReasoningTokens = int64(rng.IntN(3000))
	}
	tools := events.ToolCalls{WebSearch: rng.IntN(3), CodeExec: rng.IntN(2)}
	tools.Total = tools.WebSearch + tools.CodeExec
	o := chat.Outcome{State: chat.StateCompleted, Usage: u, ToolCalls: tools}
	switch r := rng.IntN(100); {
	case r < 65:
		if model == "mini-large" && rng.IntN(5) == 0 {
			o.EffectiveModel = "mini-fast" // fallback
		}
	case r < 73:
		o.Incomplete = true // cut short, billed as completed
	case r < 82:
		o.State, o.Usage.OutputTokens = chat.StateFailed, 0
	case r < 91:
		o.State, o.Usage.OutputTokens = chat.StateCancelled, o.Usage.OutputTokens/3
	default:
		o.State = chat.StateOrphaned
	}
	return o
}

// probeSegment marks the dedupe keys of the malformed probes.
const probeSegment = "/probe/"

// enqueueProbes enqueues usage events whose payload lacks every required
// field, as a buggy producer might write them. The collector must reject
// them permanently, so they end dead; the reconciliation counts them apart.
func (sc *scenario) enqueueProbes(ctx context.Context) error {
	tenant := sc.tenants[0]
	for i := range sc.opts.MalformedEvents {
		_, err := sc.outbox.Enqueue(ctx, sc.prov.Pool, outbox.Message{
			Namespace: events.Namespace, Topic: events.TopicUsageSnapshot, TenantID: outbox.Tenant(tenant),
			DedupeKey: outbox.Key(fmt.Sprintf("%s%s%d", tenant, probeSegment, i)),
			Payload:   []byte(`{"probe": "malformed", "credits_micro": -1}`),
		})
		if err != nil {
			return fmt.Errorf("minichat: enqueue malformed probe: %w", err)
		}
	}
	return nil
}

// waitSettled polls the database until the run is settled: no turn of the
// run's tenants is still running (the watchdog finalises the abandoned
// ones), every finalised turn's event and every probe is in the outbox,
// and none of them is pending or processing. Options.DrainTimeout bounds
// the wait.
func (sc *scenario) waitSettled(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, sc.opts.DrainTimeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	want := int64(sc.opts.MalformedEvents)
	var last settledState
	for read := 0; ; read++ {
		st, err := sc.settledState(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			return err
		// Settled: nothing running or undelivered, and the same counts
		// twice in a row. Whether the counts agree (an event for each
		// final turn, and the probes) is the reconciliation's to say:
		// waiting for them to agree would turn a lost event into a
		// timeout, and the run's verdict into "could not run".
		case err == nil && st.running == 0 && st.unsettled == 0 && read > 0 && st == last:
			return nil
		case err == nil:
			last = st
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("minichat: run not settled: %d turns running, %d events of %d turns and %d probes, %d unsettled: %w",
				last.running, last.events, last.final, want, last.unsettled, ctx.Err())
		case <-tick.C:
		}
	}
}

type settledState struct{ running, final, events, unsettled int64 }

func (sc *scenario) settledState(ctx context.Context) (settledState, error) {
	var st settledState
	err := sc.prov.Pool.QueryRow(ctx, `SELECT
	(SELECT count(*) FILTER (WHERE state = 'running') FROM minichat_turns WHERE tenant_id = ANY($1)),
	(SELECT count(*) FILTER (WHERE state <> 'running') FROM minichat_turns WHERE tenant_id = ANY($1)),
	(SELECT count(*) FROM modkit_outbox_events WHERE namespace = $2 AND topic = $3 AND tenant_id = ANY($1)),
	(SELECT count(*) FROM modkit_outbox_events WHERE namespace = $2 AND topic = $3 AND tenant_id = ANY($1)
		AND status IN ('pending', 'processing'))`,
		sc.tenants, events.Namespace, events.TopicUsageSnapshot).Scan(&st.running, &st.final, &st.events, &st.unsettled)
	if err != nil {
		return st, fmt.Errorf("minichat: check progress: %w", err)
	}
	return st, nil
}
