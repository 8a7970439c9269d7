package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/lifecycle"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

const (
	batchSizeDefault     = 1000
	batchSizeMax         = 10000
	leaseDurationDefault = 30 * time.Second
	leaseDurationMin     = 100 * time.Millisecond
	leaseHeadroomMin     = 20 * time.Millisecond // the default at leaseDurationMin
	pollIntervalDefault  = time.Second
	concurrencyDefault   = 32
	sweepIntervalDefault = 30 * time.Second
	retentionDefault     = 7 * 24 * time.Hour
	wakeWindowDefault    = 50 * time.Millisecond
	wakeRecheckDefault   = time.Millisecond
)

// DispatcherConfig configures a Dispatcher. Zero fields take the defaults
// given with each; a zero DispatcherConfig is valid.
type DispatcherConfig struct {
	// WorkerID identifies this dispatcher in locked_by and in the
	// maintenance leases. Default: a random id.
	WorkerID uuid.UUID
	// Retry is the backoff after a failed publish.
	Retry RetryPolicy
	// MaxAttempts is the total number of delivery attempts per event, the
	// first included. Default 10. A claim whose lease ends without an
	// outcome counts as an attempt: a crashed dispatcher, but also a
	// database unavailable for longer than the lease (a frozen server, a
	// failover), which keeps a publish that succeeded from being recorded
	// (and, rarely, commits a claim whose answer the dispatcher could no
	// longer wait for: see LeaseHeadroom). A trial froze the server for 45 s with
	// MaxAttempts 2 and saw events delivered once yet dead-lettered: keep
	// MaxAttempts well above the outages you expect to ride out. But an event of
	// an ordering key whose predecessor was not delivered is not charged
	// for such claims (a claim that takes its chain over does not count it
	// again, and the sweep gives it the attempt back: migration 0031), so
	// of a chain only its head dies of them.
	MaxAttempts int
	// BatchSize is the most events one claim takes. Claims size themselves
	// below it: they start at 32 events (or BatchSize, if smaller), double
	// while they come back full and halve when they come back less than a
	// quarter full, and never take more than the topics' publishers can
	// start before the claim's publish deadline at their recent pace.
	// Default 1000, at most 10000.
	BatchSize int
	// LeaseDuration is how long a claim owns its events. Default 30s, at
	// least 100ms.
	LeaseDuration time.Duration
	// LeaseHeadroom is cut from the lease to get the publish deadline,
	// leaving time to record the outcome before the lease ends; it also
	// bounds how long the claimer waits for a claim (and the give-back of
	// one that returns after a stop), a maintenance election and a release
	// of held events may take. A claim not answered by then is not
	// cancelled: it goes on while its leases would be of use, and if it
	// leases events they are given back when it answers, without using an
	// attempt. (One such claim at a time; while it runs, a claim that runs
	// out of LeaseHeadroom is cancelled, and may still have leased its
	// events: they wait for that lease to end and are claimed again then,
	// as after a crash, using an attempt.) The maintenance
	// pass's sweep and purge are bounded by the leadership they run under
	// (two thirds of its term).
	// Default LeaseDuration/5, at most 5s. Must be at least 20ms and at
	// most LeaseDuration/2 (a headroom just below the lease would leave
	// publishes a few milliseconds).
	LeaseHeadroom time.Duration
	// PollInterval is how often the dispatcher looks for due events when
	// nothing wakes it (a notification, or a retry it scheduled itself
	// falling due). At most LeaseDuration/3, so that a live lease is
	// never taken for a crashed one. Default 1s (or LeaseDuration/3).
	PollInterval time.Duration
	// Concurrency bounds the publish calls in flight across all topics.
	// Default 32. Each topic has its own limit under it
	// (Publisher.Concurrency), and its last free slot is kept for topics
	// with no publish in flight: see Publisher.Concurrency.
	Concurrency int
	// PollOnly turns LISTEN/NOTIFY wake-ups off: the dispatcher only polls.
	// Use it behind PgBouncer in transaction pooling mode, where LISTEN does
	// not work, with Config.DisableNotify on the producers (PgBouncer logs
	// a warning for each notification no listener of its takes), unless the
	// listener has a direct connection (outboxpg's Driver.ListenOn); see
	// the README's Behind PgBouncer.
	PollOnly bool
	// WakeWindow: after a wake-up, and after any claim that found events,
	// the dispatcher keeps re-checking for this long, because producers
	// announce a burst with one NOTIFY per Config.NotifyInterval rather
	// than one per event. Keep it above the producers' NotifyInterval
	// (NewDispatcher warns when it is not above its own client's).
	// Default 50ms.
	WakeWindow time.Duration
	// WakeRecheck is the first re-check interval inside the wake window; it
	// doubles after each claim that finds nothing, up to 8×. Default 1ms.
	WakeRecheck time.Duration
	// SweepInterval is how often maintenance runs: for each of its topics
	// one dispatcher at a time (elected through a lease in the database)
	// dead-letters events whose attempts are used up, purges delivered
	// events past their retention and reads the depth gauges (which are
	// also kept fresh in between, within about a second of a change).
	// An election that fails (the database unreachable) is tried again
	// sooner, as failing claims are: after 50ms, doubling up to 5s (or
	// PollInterval, if longer), and never later than SweepInterval.
	// Default 30s.
	SweepInterval time.Duration
	// Retention keeps delivered events this long before maintenance purges
	// them, for the topics whose Publisher.Retention is zero. Purging ends
	// an event's dedupe window. Default 7 days; negative keeps them
	// forever. Only this dispatcher's topics are purged, each with its own
	// retention. A purge reads the settled index from the previous pass's
	// cutoff minus a margin of at least ten minutes on (migration 0025),
	// not the delivered events other topics keep longer; it reads from the
	// oldest event on the dispatcher's first pass and at least once an
	// hour (maintenance.go). An event may thus outlive its retention by up
	// to an hour when its outcome committed more than the margin after its
	// time stamp.
	Retention time.Duration
	// StopTimeout bounds a graceful stop: in-flight publishes get until
	// 80% of it, then their contexts are cancelled; at 85% those still
	// running are abandoned and their events given back; outcomes are
	// recorded until 95%. When the context given to Stop ends sooner (in
	// an fx app, fx's stop timeout: 15s unless fx.StopTimeout says
	// otherwise), the same stages are fitted into the time it leaves.
	// Default 30s.
	StopTimeout time.Duration
	// Logger for the dispatcher. Default: the Client's.
	Logger *slog.Logger
	// OnOutcome, if set, is called after each outcome is recorded (or
	// refused for a lost lease), by the goroutines that write outcomes,
	// one call at a time: keep it fast and never block in it. Useful for
	// tests and custom telemetry. "Recorded" means committed, and outcomes
	// commit asynchronously unless SynchronousCommit is set: a server crash
	// just after can roll one back, and its event is then published again
	// (and reported again). An outcome that could not be written before
	// its lease ended (the database unavailable) is not reported: the
	// dispatcher logs it, and its event is published again.
	OnOutcome func(d Delivery, o Outcome)
}

func (c DispatcherConfig) withDefaults(logger *slog.Logger) DispatcherConfig {
	if c.WorkerID == uuid.Nil {
		c.WorkerID = uuid.New()
	}
	c.Retry = c.Retry.withDefaults()
	c.BatchSize = cmp.Or(c.BatchSize, batchSizeDefault)
	c.LeaseDuration = cmp.Or(c.LeaseDuration, leaseDurationDefault)
	c.LeaseHeadroom = cmp.Or(c.LeaseHeadroom, min(c.LeaseDuration/5, 5*time.Second))
	c.PollInterval = cmp.Or(c.PollInterval, min(pollIntervalDefault, c.LeaseDuration/3))
	c.MaxAttempts = cmp.Or(c.MaxAttempts, maxAttemptsDefault)
	c.Concurrency = cmp.Or(c.Concurrency, concurrencyDefault)
	c.WakeWindow = cmp.Or(c.WakeWindow, wakeWindowDefault)
	c.WakeRecheck = cmp.Or(c.WakeRecheck, wakeRecheckDefault)
	c.SweepInterval = cmp.Or(c.SweepInterval, sweepIntervalDefault)
	c.Retention = cmp.Or(c.Retention, retentionDefault)
	c.StopTimeout = cmp.Or(c.StopTimeout, lifecycle.StopTimeoutDefault)
	if c.Logger == nil {
		c.Logger = logger
	}
	return c
}

func (c DispatcherConfig) validate() error {
	switch {
	case c.BatchSize < 1 || c.BatchSize > batchSizeMax:
		return configError("DispatcherConfig.BatchSize is %d; it must be between 1 and %d", c.BatchSize, batchSizeMax)
	case c.LeaseDuration < leaseDurationMin:
		return configError("DispatcherConfig.LeaseDuration is %v; it must be at least %v", c.LeaseDuration, leaseDurationMin)
	case c.MaxAttempts < 1:
		return configError("DispatcherConfig.MaxAttempts is %d; it must be at least 1", c.MaxAttempts)
	case c.LeaseHeadroom < leaseHeadroomMin || c.LeaseHeadroom > c.LeaseDuration/2:
		return configError("DispatcherConfig.LeaseHeadroom is %v; it must be at least %v (it also bounds how long each claim may take) "+
			"and at most half of LeaseDuration (%v), which leaves a publish at least as long as the headroom",
			c.LeaseHeadroom, leaseHeadroomMin, c.LeaseDuration/2)
	case c.PollInterval <= 0 || c.PollInterval > c.LeaseDuration/3:
		return configError("DispatcherConfig.PollInterval is %v; it must be positive and at most LeaseDuration/3 (%v), "+
			"so that live leases are not mistaken for crashed ones", c.PollInterval, c.LeaseDuration/3)
	case c.Concurrency < 1:
		return configError("DispatcherConfig.Concurrency is %d; it must be at least 1", c.Concurrency)
	case c.WakeRecheck < 0, c.WakeWindow < 0:
		return configError("DispatcherConfig.WakeRecheck and WakeWindow must not be negative")
	case c.SweepInterval <= 0:
		return configError("DispatcherConfig.SweepInterval is %v; it must be positive", c.SweepInterval)
	case c.StopTimeout <= 0:
		return configError("DispatcherConfig.StopTimeout is %v; it must be positive", c.StopTimeout)
	}
	return c.Retry.validate()
}

// Dispatcher delivers due events of its publishers' topics, as a lifecycle
// task: a claimer leases events in batches, a worker pool publishes them
// with a concurrency limit per topic, a completer records the outcomes in
// batches (each fenced by its lease token), a notifier wakes the claimer on
// NOTIFY, and maintenance (sweep, purge, gauges) runs on one elected
// dispatcher per topic. See the package documentation for the guarantees.
type Dispatcher struct {
	c    *Client
	cfg  DispatcherConfig
	reg  *registry
	log  *slog.Logger
	task *lifecycle.Task

	metrics  *metrics
	hardStop atomic.Bool // publishes were cancelled by a stop
	// due is the current run's queue of claimer wake-ups (nil when
	// stopped), for the maintenance pass's releases of held events.
	due atomic.Pointer[dueTimes]
	// sawOrdered: this dispatcher has claimed events with an ordering key,
	// so it repairs held ones once per PollInterval (see claimer).
	sawOrdered atomic.Bool
	// listenerDownSince: since when (UnixNano) the notification listener
	// has not been listening, once an attempt to listen again failed; 0
	// while it listens (see notifier).
	listenerDownSince atomic.Int64
	// listenerDeafSince: since when (UnixNano) the listener has heard
	// nothing, not even its driver's check (driver.ErrListenDeaf); 0 once
	// it hears a notification (see notifier).
	listenerDeafSince atomic.Int64
	// maintErrAt: since when (UnixNano) maintenance has failed (an
	// election, a step of a pass, or a pass out of time); 0 once a pass
	// finishes cleanly or another dispatcher leads its topics.
	maintErrAt atomic.Int64

	// recordMu makes the outcome writers record (metrics, OnOutcome,
	// logs) one outcome at a time.
	recordMu sync.Mutex

	// lateClaim is set while a claim the claimer stopped waiting for is
	// still running (see claim); lateClaims counts the goroutines that run
	// such claims, which a run waits for before it ends.
	lateClaim  atomic.Bool
	lateClaims sync.WaitGroup

	mu         sync.Mutex
	pool       *workerPool // of the current run; nil when stopped
	claimErr   error       // the last claim's error, nil after a success
	claimErrAt time.Time
	// outcomeErrAt is when outcome writes began failing (Unix
	// nanoseconds); 0 after one that succeeded. Atomic: every outcome
	// write sets it, and takes no lock for it.
	outcomeErrAt atomic.Int64
	// unrecordedAtStop counts the outcomes a run's stop gave up recording
	// (the database did not answer before the stop's time ran out).
	unrecordedAtStop atomic.Int64
	// givenBackAtStop and abandonedAtStop count the events a run's stop
	// gave back unpublished, and those of them whose publish was still
	// running, for the stop's summary.
	givenBackAtStop, abandonedAtStop atomic.Int64
	// onMaintenance, if set, is called after each maintenance pass with
	// the roles held and whether the pass finished before its deadline
	// (tests).
	onMaintenance func(held []string, finished bool)
	// onClaimRound, when set, is called after each round of claims that
	// worked, with the topics that claimed (tests).
	onClaimRound func(topics []string)
	// onDueWake, when set, is called when the claimer wakes for a retry
	// that fell due (tests).
	onDueWake func()
	// purgeMarks are the purge watermarks of the topics this dispatcher
	// maintains ("namespace:topic"), read and written by its maintenance
	// goroutine only (maintenance.go).
	purgeMarks map[string]purgeMark
	// skew is the claimer's estimate of the database clock's lead over
	// this process's (see clockSkew); the claimer's goroutine alone uses
	// it.
	skew clockSkew
}

// NewDispatcher builds a Dispatcher for pubs, one Publisher per topic. It
// does no I/O; Start (or the fx Module) runs it. Several dispatchers may
// serve one database, in one process or many; each claims only its own
// topics.
func (c *Client) NewDispatcher(cfg DispatcherConfig, pubs ...Publisher) (*Dispatcher, error) {
	cfg = cfg.withDefaults(c.cfg.Logger)
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if len(pubs) == 0 {
		return nil, configError("NewDispatcher needs at least one Publisher (a service that only enqueues needs no dispatcher)")
	}
	reg, err := newRegistry(pubs)
	if err != nil {
		return nil, err
	}
	for _, p := range reg.byKey {
		if p.Concurrency > cfg.Concurrency {
			return nil, configError("publisher %s for %s: Concurrency %d is above the dispatcher's Concurrency %d",
				p.name(), p.Topic, p.Concurrency, cfg.Concurrency)
		}
	}
	d := &Dispatcher{c: c, cfg: cfg, reg: reg}
	d.log = cfg.Logger.With("component", "outbox-dispatcher", "worker_id", cfg.WorkerID.String())
	d.warnSmallPool()
	if !cfg.PollOnly && !c.cfg.DisableNotify && cfg.WakeWindow <= c.cfg.NotifyInterval {
		// Events of a burst enqueued after its NOTIFY would wait for the
		// poll. Only this client's setting is known here; producers in
		// other processes have their own.
		d.log.Warn(fmt.Sprintf("DispatcherConfig.WakeWindow (%v) is not above this client's Config.NotifyInterval (%v): events "+
			"enqueued in a burst after its NOTIFY may wait for the poll (PollInterval %v); raise WakeWindow above the producers' NotifyInterval",
			cfg.WakeWindow, c.cfg.NotifyInterval, cfg.PollInterval))
	}
	if d.metrics, err = newMetrics(d); err != nil {
		return nil, err
	}
	d.task, err = lifecycle.New(lifecycle.Config{
		Name: "outbox-dispatcher", AwaitReady: true, StopTimeout: cfg.StopTimeout, Logger: cfg.Logger,
		NotReadyCause: d.lastClaimErr,
	}, d.run)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// poolHeadroom is the pool connections a dispatcher's claims, outcome
// writes and listener want beside its HandleTx transactions.
const poolHeadroom = 3

// warnSmallPool logs a warning when the publishers with HandleTx can run
// more transactions at once than the pool has connections for: each holds
// one for its whole call, and the calls that wait for one may run out of
// their deadline, failing attempts for no fault of the handler's.
func (d *Dispatcher) warnSmallPool() {
	sizer, ok := d.c.store.(driver.PoolSizer)
	if !ok {
		return
	}
	inTx := 0
	var names []string
	for _, k := range d.reg.keys {
		if p := d.reg.byKey[k]; p.HandleTx != nil {
			inTx += d.laneLimit(p)
			names = append(names, p.name())
		}
	}
	if inTx == 0 {
		return
	}
	need := min(inTx, d.cfg.Concurrency) + poolHeadroom
	if size := sizer.PoolSize(); size < need {
		d.log.Warn(fmt.Sprintf("publishers with HandleTx may run %d transactions at once, each holding a pool connection, and the "+
			"pool opens at most %d: raise the pool's MaxConns to %d (pool_max_conns in the DSN, or db.Config), or lower the "+
			"dispatcher's or the publishers' Concurrency; otherwise calls wait for a connection and may run out of their deadline",
			need-poolHeadroom, size, need), "publishers", names)
	}
}

// laneLimit is a topic's concurrency limit.
func (d *Dispatcher) laneLimit(p *Publisher) int {
	if p.Concurrency > 0 {
		return p.Concurrency
	}
	limit := d.cfg.Concurrency
	if len(d.reg.topics) > 1 {
		limit = max(1, d.cfg.Concurrency/2)
	}
	// Each HandleTx call holds a pool connection: by default, the topics
	// with HandleTx share what the pool has beside what the dispatcher
	// itself uses (at least one call each).
	if sizer, ok := d.c.store.(driver.PoolSizer); ok && p.HandleTx != nil {
		inTx := 0
		for _, k := range d.reg.keys {
			if d.reg.byKey[k].HandleTx != nil {
				inTx++
			}
		}
		limit = min(limit, max(1, (sizer.PoolSize()-poolHeadroom)/inTx))
	}
	return limit
}

// retention is a topic's retention.
func (d *Dispatcher) retention(p *Publisher) time.Duration {
	return cmp.Or(p.Retention, d.cfg.Retention)
}

// abandonGrace is how long after its deadline a publish is abandoned: time
// for a publisher that honours its context to return, while leaving most
// of the headroom to give the event back under its lease.
func (d *Dispatcher) abandonGrace() time.Duration {
	return min(d.cfg.LeaseHeadroom/4, time.Second)
}

// lastClaimErr is the error of the last claim while claims fail (nil after
// a success), for Start's error when it gives up waiting.
func (d *Dispatcher) lastClaimErr() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.claimErr == nil {
		return nil
	}
	if poolerConflict(d.claimErr) {
		return fmt.Errorf("the last claim failed: %w (%s)", d.claimErr, poolerHint)
	}
	return fmt.Errorf("the last claim failed: %w", d.claimErr)
}

// Config returns the configuration in force, defaults filled in.
func (d *Dispatcher) Config() DispatcherConfig { return d.cfg }

// Task is the lifecycle task that runs the dispatcher, for wiring into a
// lifecycle of your own (the fx Module does it for you).
func (d *Dispatcher) Task() *lifecycle.Task { return d.task }

// Start runs the dispatcher in the background and returns once it is ready
// (its first claim succeeded), or with the error that stopped it first.
// Before it is ready, an error that retrying cannot cure stops it: a
// schema not migrated, missing privileges, a database that does not exist,
// a login the server refuses (a password being rotated included: start
// again once it works). A server that cannot be reached is retried until
// ctx ends (give ctx a deadline); the error then includes the last claim's.
// Once ready, every database error is retried. Starting a running
// dispatcher is an error; a stopped one can be started again.
func (d *Dispatcher) Start(ctx context.Context) error { return d.task.Start(ctx) }

// Stop stops claiming, gives queued events back, lets in-flight publishes
// finish (see DispatcherConfig.StopTimeout, whose stages are fitted into
// ctx's deadline when that comes sooner) and records every outcome before
// returning. When the database does not answer in that time, Stop returns
// an error saying how many outcomes were not recorded: their events are
// published again once their leases end (so, at least once). Stopping a
// stopped dispatcher does nothing.
func (d *Dispatcher) Stop(ctx context.Context) error {
	_, err := d.task.Stop(ctx)
	return err
}

// run is the dispatcher's body, as a lifecycle.RunFunc: it calls ready
// after its first successful claim and returns when ctx is cancelled and
// everything in flight is settled or abandoned. It returns an error only if
// the outbox table cannot be used at all (for example the migrations were
// not run).
func (d *Dispatcher) run(ctx context.Context, ready func()) error {
	// The stop's clock starts when Stop cancels ctx, not when the claimer
	// notices: a claim in flight may take a while to return (see outlastStop).
	var stopAt atomic.Pointer[time.Time]
	stopNow := func() { now := time.Now(); stopAt.CompareAndSwap(nil, &now) }
	defer context.AfterFunc(ctx, stopNow)()
	ctx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()
	d.hardStop.Store(false)
	d.unrecordedAtStop.Store(0)
	d.givenBackAtStop.Store(0)
	d.abandonedAtStop.Store(0)
	results := make(chan result, d.cfg.Concurrency+2*d.cfg.BatchSize)
	wake := make(chan struct{}, 1)

	// Publishes run on a context of their own: a stop lets them finish
	// until 80% of the stop timeout, then cancels them; at 85% those still
	// running are abandoned; recording the last outcomes may go on until
	// 95%.
	pubCtx, cancelPublishes := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelPublishes()
	flushCtx, cancelFlush := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancelFlush(nil)

	defer d.metrics.register()()
	pool := newWorkerPool(d, pubCtx, results)
	d.mu.Lock()
	d.pool, d.claimErr = pool, nil
	d.outcomeErrAt.Store(0)
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		d.pool = nil
		d.mu.Unlock()
	}()

	completerDone := make(chan struct{})
	due := newDueTimes()
	d.due.Store(due)
	defer d.due.Store(nil)
	go func() { defer close(completerDone); d.completer(flushCtx, results, due) }()
	var helpers sync.WaitGroup
	if !d.cfg.PollOnly {
		helpers.Add(1)
		go func() { defer helpers.Done(); d.notifier(ctx, wake) }()
	}
	helpers.Add(2)
	go func() { defer helpers.Done(); d.maintenance(ctx) }()
	go func() { defer helpers.Done(); d.metrics.refreshGauges(ctx, d.c.store) }()

	err := d.claimer(ctx, ready, pool, wake, due)
	cancelRun()
	stopNow() // the claimer may also have ended on its own
	stopStarted := *stopAt.Load()

	// Shut down. What is still queued was never started: it goes back at
	// once, so another replica can take it while the publishes in flight
	// finish. The stages fit in StopTimeout, or in the time the Stop's
	// context leaves, if that is shorter (fx's stop timeout, 15s by
	// default, for the fx Module).
	budget := d.cfg.StopTimeout
	if deadline, ok := lifecycle.StopDeadline(ctx); ok {
		budget = max(min(budget, deadline.Sub(stopStarted)), 0)
	}
	at := func(fraction int) time.Time {
		return stopStarted.Add(budget / 100 * time.Duration(fraction))
	}
	// Armed first: a completer stuck on an unreachable database gives up
	// at 95%, so results waiting to reach it are not held up longer.
	flushTimer := time.AfterFunc(time.Until(at(95)), func() { cancelFlush(errStopRanOut) })
	defer flushTimer.Stop()
	pool.stop()
	if !waitUntil(pool, at(80)) {
		d.hardStop.Store(true)
		cancelPublishes()
		if !waitUntil(pool, at(85)) {
			d.log.Error("publishes still running at 85% of the stop timeout; abandoning them and giving their events back")
			pool.abandonAll()
		}
	}
	pool.close()
	close(results)
	<-completerDone
	helpers.Wait()
	d.lateClaims.Wait() // bounded as the stop bounds statements (see claim)
	if n := d.givenBackAtStop.Load(); n > 0 {
		d.log.Info("stopped: events given back unpublished, for this or another dispatcher to publish", "given_back", n,
			"of_them_abandoned", d.abandonedAtStop.Load(), "stop_took", time.Since(stopStarted).Round(time.Millisecond))
	}
	if n := d.unrecordedAtStop.Load(); n > 0 && err == nil {
		err = fmt.Errorf("outbox dispatcher stopped with %d outcome(s) not recorded: the database did not answer before the stop's time ran out; "+
			"their events will be published again when their leases end", n)
	}
	return err
}

// errStopRanOut ends the completer's context when a stop runs out of time
// to record outcomes (at 95% of it).
var errStopRanOut = errors.New("outbox: the stop's time ran out")

// stopBound bounds a statement that runs after the stop began (ctx, the
// run's context, has ended): at most limit, and no later than 80% of the
// time the stop has left, so that a database that does not answer cannot
// keep the run past the stop's deadline.
func (d *Dispatcher) stopBound(ctx context.Context, limit time.Duration) time.Duration {
	if deadline, ok := lifecycle.StopDeadline(ctx); ok {
		return min(limit, max(time.Until(deadline)/5*4, 0))
	}
	return limit
}

// outlastStop returns a context for a statement that should finish rather
// than be cancelled by a stop (ctx's end) that comes while it runs: it
// ends after limit, and once ctx has ended no later than stopBound allows
// from then, so that a database that does not answer cannot keep the run
// past the stop's deadline.
func (d *Dispatcher) outlastStop(ctx context.Context, limit time.Duration) (context.Context, context.CancelFunc) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), limit)
	stopWatch := context.AfterFunc(ctx, func() {
		t := time.NewTimer(d.stopBound(ctx, limit))
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-sctx.Done():
		}
	})
	return sctx, func() {
		stopWatch()
		cancel()
	}
}

func waitUntil(pool *workerPool, deadline time.Time) bool {
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	return pool.wait(ctx)
}

// Health is a dispatcher's state as an operator or a readiness probe sees
// it.
type Health struct {
	// Running: the dispatcher is ready (its first claim of this run
	// succeeded, which is also when Start returns) and not stopping.
	// Readiness probes check this.
	Running bool
	// Starting: Start was called but no claim has succeeded yet (the
	// database is slow or unreachable; Problems says so once a claim
	// failed).
	Starting bool
	// Degraded: something keeps events from flowing normally (a paused
	// topic, a topic whose last publishes all failed, failing claims or
	// outcome writes, a notification listener that cannot listen, failing
	// maintenance); Problems says what. It is
	// also set while starting, once a claim failed: the failing claims
	// are what keeps the dispatcher from being ready (State still says
	// "starting" then).
	Degraded bool
	// Problems are human sentences, one per problem, naming the topic or
	// the failing operation. They quote no error text, which may hold SQL
	// or the database's address, so that they may be shown to anyone who
	// can see the health (outboxui.HealthHandler serves them to probes).
	Problems []string
	// ClaimError is the error of the last claim, while claims fail (nil
	// otherwise), for logs and for those allowed to see the database's
	// error text; the dispatcher also logs each ("claim failed; retrying").
	ClaimError error
	// Abandoned counts publish calls abandoned past their deadline that
	// have not returned yet (their goroutines are still running), while
	// the dispatcher runs; once it has stopped it reads 0, though such
	// calls may still be running.
	Abandoned int
}

// State sums h up in one word: "starting" while Start waits for the first
// claim to succeed (Degraded or not: failing claims are why it is not ready
// yet, and Problems says so); otherwise "degraded" when Degraded, else
// "running" or "stopped".
func (h Health) State() string {
	switch {
	case h.Starting:
		return "starting"
	case h.Degraded:
		return "degraded"
	case h.Running:
		return "running"
	}
	return "stopped"
}

// Health reports whether the dispatcher is ready (its first claim
// succeeded) and whether it is degraded: a topic has publishes that
// outlived their deadline (the publisher ignores its context), a topic's
// last three or more publishes in this process all failed (its broker or
// endpoint is down, say; Permanent errors, the event's fault, do not
// count), until one delivers or ten minutes pass without a failure, claims are
// failing, outcome writes are (until one succeeds), the notification
// listener cannot listen or hears nothing (its check, a notification sent
// from the pool, did not come back: behind PgBouncer in transaction mode,
// say; until it hears one), or maintenance is failing (until a pass works: a
// failed election is retried within seconds, with the claims' backoff, so
// this clears soon after the database answers again; a failed step of a
// pass waits for the next SweepInterval). In an fx app, take
// the *Dispatcher from the graph (it is nil when no publisher is
// registered) to read it, show it on the outboxui dashboard
// (Options.Dispatchers) or serve it to probes (outboxui.HealthHandler). On
// a nil *Dispatcher it returns the zero Health (not running, not degraded)
// rather than panicking.
func (d *Dispatcher) Health() Health {
	if d == nil {
		return Health{}
	}
	d.mu.Lock()
	pool, claimErr, claimErrAt := d.pool, d.claimErr, d.claimErrAt
	d.mu.Unlock()
	status := d.task.Status()
	h := Health{Running: pool != nil && status == lifecycle.Running, Starting: pool != nil && status == lifecycle.Starting}
	if pool == nil {
		return h
	}
	lanes, abandoned := pool.state()
	h.Abandoned = abandoned
	for _, l := range lanes {
		switch {
		case l.paused:
			h.Problems = append(h.Problems, fmt.Sprintf("topic %s paused: %d publishes outlived their deadline and have not returned "+
				"(the publisher ignores its context); its events wait in the database", l.topic, l.abandoned))
		case l.abandoned > 0:
			h.Problems = append(h.Problems, fmt.Sprintf("topic %s: %d publishes outlived their deadline and have not returned "+
				"(the publisher ignores its context)", l.topic, l.abandoned))
		}
		if l.failed >= failingAfter && time.Since(l.failedLast) < failingFor {
			h.Problems = append(h.Problems, fmt.Sprintf("topic %s: its last %d publishes failed, from %s to %s, and none delivered since "+
				"(the errors are in the dispatcher's log and the events' history); its events are retried, then dead-lettered",
				l.topic, l.failed, l.failedFirst.UTC().Format(time.RFC3339), l.failedLast.UTC().Format(time.RFC3339)))
		}
	}
	if claimErr != nil {
		h.ClaimError = claimErr
		h.Problems = append(h.Problems, fmt.Sprintf("claims failing since %s (the error is in Health.ClaimError and the dispatcher's log)",
			claimErrAt.Format(time.RFC3339)))
	}
	if at := d.listenerDownSince.Load(); at != 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("notification listener down since %s (the error is in the dispatcher's log): "+
			"events wait for the poll, every PollInterval (%v)", time.Unix(0, at).Format(time.RFC3339), d.cfg.PollInterval))
	}
	if at := d.listenerDeafSince.Load(); at != 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("notification listener deaf since %s: its check, a notification sent from the pool, "+
			"did not come back (behind PgBouncer in transaction mode LISTEN does not work: give the listener a direct connection with "+
			"outboxpg's Driver.ListenOn, or set PollOnly); events wait for the poll, every PollInterval (%v)",
			time.Unix(0, at).Format(time.RFC3339), d.cfg.PollInterval))
	}
	if at := d.maintErrAt.Load(); at != 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("maintenance failing since %s (the errors are in the dispatcher's log): "+
			"exhausted events are not dead-lettered, delivered events not purged, and the depth gauges lag", time.Unix(0, at).Format(time.RFC3339)))
	}
	if at := d.outcomeErrAt.Load(); at != 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("recording outcomes failing since %s (the error is in the dispatcher's log): "+
			"published events are not marked delivered, and are published again when their leases end", time.Unix(0, at).Format(time.RFC3339)))
	}
	h.Degraded = len(h.Problems) > 0
	return h
}

// abandonedPublish reports a publish given up on at its deadline, or at
// the end of a stop's time (atStop).
func (d *Dispatcher) abandonedPublish(c claimed, p *Publisher, paused, atStop bool) {
	d.metrics.abandoned.Add(context.Background(), 1, d.metrics.topicAttrs(c.d.Namespace, c.d.Topic))
	attrs := []any{"publisher", p.name(), "namespace", c.d.Namespace, "topic", c.d.Topic, "event_id", c.d.ID, "attempt", c.d.Attempt}
	switch {
	case atStop:
		d.log.Warn("publish still running when the stop ran out of time (the publisher ignores its context); "+
			"abandoned, the event goes back without using an attempt", attrs...)
		return
	case paused:
		d.log.Error("topic paused: its publisher ignores its context and every slot of the topic is held by an abandoned publish; "+
			"other topics go on, this one resumes when they return", attrs...)
		return
	}
	d.log.Warn("publish outlived its deadline and was abandoned; the attempt counts as failed (retried with backoff, "+
		"dead after the last)", attrs...)
}

// abandonedReturned reports an abandoned publish that finally returned.
func (d *Dispatcher) abandonedReturned(c claimed, r result) {
	attrs := []any{"namespace", c.d.Namespace, "topic", c.d.Topic, "event_id", c.d.ID, "elapsed", r.elapsed}
	if r.err != nil {
		attrs = append(attrs, "publish_error", SanitizeError(r.err, d.c.cfg.ErrorMaxLen))
	}
	d.log.Warn("an abandoned publish returned; its result is ignored (its attempt was recorded as failed, "+
		"or the event given back at a stop, and the event is published again)", attrs...)
}

// setOutcomeFailing records whether the last outcome write failed.
func (d *Dispatcher) setOutcomeFailing(failing bool) {
	switch {
	case failing:
		d.outcomeErrAt.CompareAndSwap(0, time.Now().UnixNano())
	case d.outcomeErrAt.Load() != 0: // a read, not a write, on the usual path
		d.outcomeErrAt.Store(0)
	}
}

func (d *Dispatcher) setClaimErr(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err == nil || d.claimErr == nil {
		d.claimErrAt = time.Now()
	}
	d.claimErr = err
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func resetTimer(t *time.Timer, d time.Duration) {
	t.Stop()
	select {
	case <-t.C:
	default:
	}
	t.Reset(d)
}
