package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/lifecycle"
)

// Dispatcher defaults.
const (
	PollIntervalDefault  = time.Second
	ConcurrencyDefault   = 32
	SweepIntervalDefault = 30 * time.Second
	RetentionDefault     = 7 * 24 * time.Hour
	// WakeWindowDefault: after a wake-up, and after any claim that found
	// events, the dispatcher keeps re-checking for this long, because
	// producers announce a burst with one NOTIFY per Config.NotifyInterval
	// rather than one per event. Keep it above the producers'
	// NotifyInterval.
	WakeWindowDefault = 50 * time.Millisecond
	// WakeRecheckDefault is the first re-check interval inside the wake
	// window; it doubles after each claim that finds nothing, up to 8×.
	WakeRecheckDefault = time.Millisecond
)

// DispatcherConfig configures a Dispatcher. Zero fields take defaults
// (WithDefaults); a zero DispatcherConfig is valid.
type DispatcherConfig struct {
	// Store configures the underlying Store: Schema, WorkerID, Retry
	// (BaseDelay, MaxDelay) and the error length limit.
	Store Config
	// BatchSize is the most events one claim takes. Default
	// BatchSizeDefault.
	BatchSize int
	// LeaseDuration is how long a claim owns its events. Default
	// LeaseDurationDefault.
	LeaseDuration time.Duration
	// LeaseHeadroom is cut from the lease to get the publish deadline,
	// leaving time to record the outcome before the lease ends. Default
	// LeaseDuration/5, at most 5s. Must be below LeaseDuration.
	LeaseHeadroom time.Duration
	// PollInterval is how often the dispatcher looks for due events when
	// nothing wakes it. Must be at most LeaseDuration/3 (seed 004). Default
	// PollIntervalDefault.
	PollInterval time.Duration
	// MaxAttempts is the total number of delivery attempts per event.
	// Default MaxAttemptsDefault.
	MaxAttempts int
	// Concurrency bounds the publish calls in flight. Default
	// ConcurrencyDefault. Plain Publish calls need no connection, but each
	// HandleTx call holds one of the pool's connections for its whole
	// transaction, and the dispatcher itself uses two or three more (claim,
	// outcomes, LISTEN). With transactional handlers, size the pool
	// (pgxpool's MaxConns defaults to max(4, CPUs)) to Concurrency plus
	// three, or lower Concurrency to what the pool allows; otherwise
	// handlers queue for connections inside their publish deadline.
	Concurrency int
	// PollOnly turns LISTEN/NOTIFY wake-ups off: the dispatcher only polls.
	// Use it behind PgBouncer in transaction pooling mode, where LISTEN does
	// not work.
	PollOnly bool
	// WakeWindow: see WakeWindowDefault.
	WakeWindow time.Duration
	// WakeRecheck: see WakeRecheckDefault.
	WakeRecheck time.Duration
	// SweepInterval is how often the dispatcher dead-letters exhausted
	// events (see Store.SweepExhausted) and purges delivered events older
	// than Retention. Default SweepIntervalDefault.
	SweepInterval time.Duration
	// Retention keeps delivered events this long before purging them.
	// Default RetentionDefault; negative keeps them forever.
	Retention time.Duration
	// StopTimeout bounds a graceful stop: in-flight publishes get until
	// 80% of it, then their contexts are cancelled and the events go back
	// to pending. Default lifecycle.StopTimeoutDefault.
	StopTimeout time.Duration
	// Logger for the dispatcher. Default slog.Default().
	Logger *slog.Logger
	// OnSettled, if set, is called after each outcome is recorded (or
	// refused for a lost lease), from the dispatcher's completer goroutine:
	// keep it fast and never block in it. Useful for tests and custom
	// telemetry.
	OnSettled func(m ClaimedMessage, st Settlement)
}

// WithDefaults returns c with zero fields set to their defaults.
func (c DispatcherConfig) WithDefaults() DispatcherConfig {
	c.Store = c.Store.WithDefaults()
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	c.LeaseDuration = cmp.Or(c.LeaseDuration, LeaseDurationDefault)
	c.LeaseHeadroom = cmp.Or(c.LeaseHeadroom, min(c.LeaseDuration/5, 5*time.Second))
	c.PollInterval = cmp.Or(c.PollInterval, min(PollIntervalDefault, c.LeaseDuration/3))
	c.MaxAttempts = cmp.Or(c.MaxAttempts, MaxAttemptsDefault)
	c.Concurrency = cmp.Or(c.Concurrency, ConcurrencyDefault)
	c.WakeWindow = cmp.Or(c.WakeWindow, WakeWindowDefault)
	c.WakeRecheck = cmp.Or(c.WakeRecheck, WakeRecheckDefault)
	c.SweepInterval = cmp.Or(c.SweepInterval, SweepIntervalDefault)
	c.Retention = cmp.Or(c.Retention, RetentionDefault)
	c.StopTimeout = cmp.Or(c.StopTimeout, lifecycle.StopTimeoutDefault)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c DispatcherConfig) validate() error {
	claim := ClaimConfig{BatchSize: c.BatchSize, LeaseDuration: c.LeaseDuration, MaxAttempts: c.MaxAttempts, Topics: []Topic{{"x", "x"}}}
	if err := claim.validate(); err != nil {
		return err
	}
	switch {
	case c.LeaseHeadroom <= 0 || c.LeaseHeadroom >= c.LeaseDuration:
		return fmt.Errorf("outbox: LeaseHeadroom is %v; it must be positive and below LeaseDuration (%v)", c.LeaseHeadroom, c.LeaseDuration)
	case c.PollInterval <= 0 || c.PollInterval > c.LeaseDuration/3:
		return fmt.Errorf("outbox: PollInterval is %v; it must be positive and at most LeaseDuration/3 (%v), "+
			"so that live leases are not mistaken for crashed ones (seed 004)", c.PollInterval, c.LeaseDuration/3)
	case c.Concurrency < 1:
		return fmt.Errorf("outbox: Concurrency is %d; it must be at least 1", c.Concurrency)
	case c.WakeRecheck < 0, c.WakeWindow < 0, c.SweepInterval <= 0, c.StopTimeout <= 0:
		return errors.New("outbox: WakeRecheck and WakeWindow must not be negative, SweepInterval and StopTimeout must be positive")
	}
	return nil
}

// Dispatcher delivers due events to their publishers: the background worker
// of seed 004, run as a lifecycle task. It claims events of the registered
// topics in batches under a lease, publishes them with bounded concurrency,
// and records the outcomes in batches, each fenced by its lease token. See
// the package documentation for the guarantees.
type Dispatcher struct {
	cfg      DispatcherConfig
	pool     *pgxpool.Pool
	store    *Store
	pubs     *Publishers
	topics   []Topic
	keys     []string
	log      *slog.Logger
	task     *lifecycle.Task
	metrics  *metrics
	isWanted map[string]bool // notification payloads that concern us
}

// NewDispatcher builds a Dispatcher for the registered publishers. It does
// no I/O; Start (or Run) does.
func NewDispatcher(pool *pgxpool.Pool, pubs *Publishers, cfg DispatcherConfig) (*Dispatcher, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if pubs == nil || len(pubs.byTopic) == 0 {
		return nil, errors.New("outbox: NewDispatcher needs at least one registered publisher")
	}
	store, err := NewStore(pool, cfg.Store)
	if err != nil {
		return nil, err
	}
	d := &Dispatcher{cfg: cfg, pool: pool, store: store, pubs: pubs, topics: pubs.Topics(), isWanted: map[string]bool{}}
	d.keys = topicKeys(d.topics)
	for _, k := range d.keys {
		d.isWanted[k] = true
	}
	d.log = cfg.Logger.With("component", "outbox-dispatcher", "worker_id", store.WorkerID().String())
	if d.metrics, err = newMetrics(d); err != nil {
		return nil, err
	}
	d.task, err = lifecycle.New(lifecycle.Config{
		Name: "outbox-dispatcher", AwaitReady: true, StopTimeout: cfg.StopTimeout, Logger: cfg.Logger,
	}, d.Run)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// Store returns the dispatcher's Store (for admin calls).
func (d *Dispatcher) Store() *Store { return d.store }

// Config returns the configuration in force, defaults filled in.
func (d *Dispatcher) Config() DispatcherConfig { return d.cfg }

// Task is the lifecycle task that runs the dispatcher.
func (d *Dispatcher) Task() *lifecycle.Task { return d.task }

// Start runs the dispatcher in the background and returns once it is ready
// (its first claim succeeded), or with the error that stopped it first.
func (d *Dispatcher) Start(ctx context.Context) error { return d.task.Start(ctx) }

// Stop stops claiming, lets in-flight publishes finish (see
// DispatcherConfig.StopTimeout), gives unstarted events back and records
// every outcome before returning.
func (d *Dispatcher) Stop(ctx context.Context) error {
	_, err := d.task.Stop(ctx)
	return err
}

// claimed is one event on its way through the dispatcher.
type claimed struct {
	msg      ClaimedMessage
	deadline time.Time // publish deadline by the local clock (lease end minus headroom)
}

type outcome struct {
	res      Result
	deadline time.Time
	started  time.Time
	elapsed  time.Duration
}

// Run is the dispatcher's body, as a lifecycle.RunFunc: it calls ready
// after its first successful claim and returns when ctx is cancelled and
// everything in flight is settled. It returns an error only if the outbox
// table cannot be used at all (for example migrations were not run).
func (d *Dispatcher) Run(ctx context.Context, ready func()) error {
	// The claim loop may also end on its own (a fatal error): cancelling
	// ctx then shuts the other goroutines down the same way a stop does.
	ctx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()
	queue := make(chan claimed, d.cfg.BatchSize)
	results := make(chan outcome, d.cfg.Concurrency+d.cfg.BatchSize)
	roomFreed := make(chan struct{}, 1)
	wake := make(chan struct{}, 1)

	// Publishes run on a context of their own: a stop lets them finish
	// until 80% of the stop timeout, then cancels them; recording the last
	// outcomes may go on until 90%.
	pubCtx, cancelPublishes := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelPublishes()
	flushCtx, cancelFlush := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelFlush()
	stopHard := context.AfterFunc(ctx, func() {
		t1 := time.AfterFunc(d.cfg.StopTimeout*4/5, cancelPublishes)
		t2 := time.AfterFunc(d.cfg.StopTimeout*9/10, cancelFlush)
		context.AfterFunc(flushCtx, func() { t1.Stop(); t2.Stop() })
	})
	defer stopHard()

	var workers, helpers sync.WaitGroup
	completerDone := make(chan struct{})
	go func() { defer close(completerDone); d.completer(flushCtx, results) }()
	for range d.cfg.Concurrency {
		workers.Add(1)
		go func() { defer workers.Done(); d.worker(ctx, pubCtx, queue, results, roomFreed) }()
	}
	if !d.cfg.PollOnly {
		helpers.Add(1)
		go func() { defer helpers.Done(); d.listen(ctx, wake) }()
	}
	helpers.Add(1)
	go func() { defer helpers.Done(); d.maintain(ctx) }()

	err := d.claimLoop(ctx, ready, queue, roomFreed, wake)
	cancelRun()

	// Shut down. What is still queued was never started: it goes back at
	// once, so another replica can take it while the publishes in flight
	// finish.
	close(queue)
	for c := range queue {
		results <- outcome{res: Result{Message: c.msg, Release: true}, deadline: c.deadline}
	}
	workers.Wait()
	close(results)
	<-completerDone
	helpers.Wait()
	return err
}

// claim runs one claim on a context that a stop does not cut short: a claim
// cancelled mid-flight may have committed, stranding its events until their
// lease expires, whereas a finished one can be released at once.
func (d *Dispatcher) claim(ctx context.Context, cfg ClaimConfig) ([]ClaimedMessage, error) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.LeaseHeadroom)
	defer cancel()
	return d.store.claim(cctx, cfg, d.keys)
}

// claimLoop claims while it knows of due work and the queue has room, then
// waits for room, a wake-up, a re-check or the poll timer. A wake-up opens a
// wake window (WakeWindow) in which it re-checks at short, growing
// intervals; each claim that finds events extends the window.
func (d *Dispatcher) claimLoop(ctx context.Context, ready func(), queue chan claimed, roomFreed, wake <-chan struct{}) error {
	cfg := ClaimConfig{BatchSize: d.cfg.BatchSize, LeaseDuration: d.cfg.LeaseDuration, MaxAttempts: d.cfg.MaxAttempts}
	threshold := max(1, cap(queue)/2)
	poll := time.NewTimer(d.cfg.PollInterval)
	defer poll.Stop()
	recheck := time.NewTimer(time.Hour)
	recheck.Stop()
	defer recheck.Stop()
	var hotUntil time.Time // end of the wake window
	recheckIn := d.cfg.WakeRecheck
	isReady, wantClaim, errDelay := false, true, time.Duration(0)
	for {
		if room := cap(queue) - len(queue); wantClaim && room >= threshold {
			cfg.BatchSize = room
			claimStart := time.Now()
			got, err := d.claim(ctx, cfg)
			switch {
			case ctx.Err() != nil:
				if len(got) > 0 {
					_ = d.store.Release(context.WithoutCancel(ctx), got)
				}
				return nil
			case err != nil:
				if !isReady && isFatal(err) {
					return fmt.Errorf("outbox dispatcher cannot claim: %w (did the migrations run? see modkit/db.Migrator)", err)
				}
				errDelay = min(max(2*errDelay, 50*time.Millisecond), max(d.cfg.PollInterval, 5*time.Second))
				d.log.Warn("claim failed; retrying", "error", err, "retry_in", errDelay)
				d.metrics.claimErrors.Add(ctx, 1)
				if !sleepCtx(ctx, errDelay) {
					return nil
				}
				continue
			}
			errDelay = 0
			if !isReady {
				isReady = true
				ready()
				d.log.Info("dispatcher ready", "topics", d.keys, "batch_size", d.cfg.BatchSize,
					"lease", d.cfg.LeaseDuration, "poll_interval", d.cfg.PollInterval, "poll_only", d.cfg.PollOnly)
			}
			deadline := claimStart.Add(d.cfg.LeaseDuration - d.cfg.LeaseHeadroom)
			for _, m := range got {
				queue <- claimed{msg: m, deadline: deadline} // room was checked; only this loop sends
			}
			now := time.Now()
			if len(got) > 0 {
				hotUntil, recheckIn = now.Add(d.cfg.WakeWindow), d.cfg.WakeRecheck
			} else {
				recheckIn = min(2*recheckIn, 8*d.cfg.WakeRecheck)
			}
			// A full batch suggests more is due: claim again once there is
			// room. Otherwise wait for news, re-checking inside the window.
			if wantClaim = len(got) == cfg.BatchSize; !wantClaim {
				resetTimer(poll, d.cfg.PollInterval)
				if now.Before(hotUntil) {
					resetTimer(recheck, recheckIn)
				}
			}
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-roomFreed: // matters when waiting for room
		case <-wake:
			wantClaim = true
			hotUntil, recheckIn = time.Now().Add(d.cfg.WakeWindow), d.cfg.WakeRecheck
		case <-recheck.C:
			wantClaim = true
		case <-poll.C:
			wantClaim = true
		}
	}
}

func (d *Dispatcher) worker(ctx, pubCtx context.Context, queue <-chan claimed, results chan<- outcome, roomFreed chan<- struct{}) {
	for {
		// A stopping dispatcher starts no new publishes.
		if ctx.Err() != nil {
			return
		}
		var c claimed
		var ok bool
		select {
		case c, ok = <-queue:
			if !ok {
				return
			}
		case <-ctx.Done():
			return
		}
		select {
		case roomFreed <- struct{}{}:
		default:
		}
		if ctx.Err() != nil || time.Until(c.deadline) <= 0 {
			// Stopping, or the lease is nearly over: give it back unpublished.
			results <- outcome{res: Result{Message: c.msg, Release: true}, deadline: c.deadline}
			continue
		}
		results <- d.publish(pubCtx, c)
	}
}

// publish runs one publisher call, isolating panics.
func (d *Dispatcher) publish(pubCtx context.Context, c claimed) outcome {
	m := c.msg
	out := outcome{res: Result{Message: m}, deadline: c.deadline, started: time.Now()}
	p, ok := d.pubs.lookup(Topic{m.Namespace, m.Topic})
	if !ok { // cannot happen: only registered topics are claimed
		out.res.Release = true
		return out
	}
	ctx, cancel := context.WithDeadline(pubCtx, c.deadline)
	defer cancel()
	if p.HandleTx != nil {
		out.res.Err = d.callSafely(p, m, func() error { return d.handleTx(ctx, p, m) })
	} else {
		out.res.Err = d.callSafely(p, m, func() error { return p.Publish(ctx, m) })
	}
	out.elapsed = time.Since(out.started)
	if out.res.Err != nil && !errors.Is(out.res.Err, errAckedInTx) && pubCtx.Err() != nil {
		// Cut short by a hard stop: the outcome is unknown, so the event
		// goes back without using up an attempt.
		out.res.Release = true
	}
	return out
}

func (d *Dispatcher) callSafely(p Publisher, m ClaimedMessage, call func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("publisher %s panicked: %v", p.name(), r)
			d.log.Error("publisher panicked; the event will be retried", "publisher", p.name(),
				"namespace", m.Namespace, "topic", m.Topic, "event_id", m.ID, "attempt", m.Attempts,
				"panic", SanitizeError(err, d.cfg.Store.ErrorMaxLen), "stack", string(debug.Stack()))
		}
	}()
	return call()
}

// errAckedInTx marks a transactional handler's success: the event is
// already delivered and needs no batched ack.
var errAckedInTx = errors.New("acked in the handler's transaction")

// handleTx runs a transactional handler and the fenced ack in one
// transaction. A lost lease rolls the handler's writes back.
func (d *Dispatcher) handleTx(ctx context.Context, p Publisher, m ClaimedMessage) error {
	err := db.InTx(ctx, d.pool, func(ctx context.Context, tx pgx.Tx) error {
		if err := p.HandleTx(ctx, tx, m); err != nil {
			return err
		}
		return d.store.AckTx(ctx, tx, m)
	})
	if err == nil {
		return errAckedInTx
	}
	return err
}

// completer records outcomes in batches: it waits for one, takes whatever
// else is ready, and settles them all in one statement.
func (d *Dispatcher) completer(ctx context.Context, results <-chan outcome) {
	const maxBatch = 1000
	batch := make([]outcome, 0, maxBatch)
	for first := range results {
		batch = append(batch[:0], first)
	drain:
		for len(batch) < maxBatch {
			select {
			case o, ok := <-results:
				if !ok {
					break drain
				}
				batch = append(batch, o)
			default:
				break drain
			}
		}
		d.settle(ctx, batch)
	}
}

func (d *Dispatcher) settle(ctx context.Context, batch []outcome) {
	results := make([]Result, 0, len(batch))
	kept := batch[:0:0]
	for _, o := range batch {
		if errors.Is(o.res.Err, errAckedInTx) {
			d.record(o, Settlement{ID: o.res.Message.ID, Status: StatusDelivered})
			continue
		}
		if errors.Is(o.res.Err, ErrLeaseLost) { // a transactional handler lost its lease
			d.record(o, Settlement{ID: o.res.Message.ID, LeaseLost: true})
			continue
		}
		results = append(results, o.res)
		kept = append(kept, o)
	}
	if len(results) == 0 {
		return
	}
	// Keep trying while the leases can still be honoured; after that the
	// events will simply be reclaimed and delivered again.
	latest := slices.MaxFunc(kept, func(a, b outcome) int { return a.deadline.Compare(b.deadline) }).deadline
	ctx, cancel := context.WithDeadline(ctx, latest.Add(d.cfg.LeaseHeadroom))
	defer cancel()
	for delay := 20 * time.Millisecond; ; delay = min(2*delay, time.Second) {
		settled, err := d.store.Complete(ctx, results)
		if err == nil {
			for i, st := range settled {
				d.record(kept[i], st)
			}
			return
		}
		if ctx.Err() != nil {
			d.log.Warn("could not record outcomes before the leases ended; the events will be delivered again",
				"count", len(results), "error", err)
			return
		}
		d.log.Warn("recording outcomes failed; retrying", "count", len(results), "error", err, "retry_in", delay)
		if !sleepCtx(ctx, delay) {
			return
		}
	}
}

func (d *Dispatcher) record(o outcome, st Settlement) {
	d.metrics.observe(o, st)
	if d.cfg.OnSettled != nil {
		defer d.cfg.OnSettled(o.res.Message, st)
	}
	quiet := !st.LeaseLost && (o.res.Release || st.Status == StatusDelivered)
	if quiet && !d.log.Enabled(context.Background(), slog.LevelDebug) {
		return // the hot path: nothing to log, no attributes to build
	}
	m := o.res.Message
	attrs := []any{"namespace", m.Namespace, "topic", m.Topic, "event_id", m.ID, "attempt", m.Attempts}
	switch {
	case st.LeaseLost:
		d.log.Warn("lease lost before the outcome was recorded (it expired, and the event may already be reclaimed); outcome dropped, not nacked",
			append(attrs, "publish_error", SanitizeError(o.res.Err, d.cfg.Store.ErrorMaxLen))...)
	case o.res.Release:
		d.log.Debug("event released", attrs...)
	case st.Status == StatusDelivered:
		d.log.Debug("event delivered", attrs...)
	case st.Status == StatusDead:
		d.log.Error("event dead-lettered", append(attrs, "error", st.LastError)...)
	default:
		d.log.Warn("publish failed; will retry", append(attrs, "error", st.LastError, "retry_in", st.RetryIn)...)
	}
}

// maintain runs the periodic sweeps and refreshes the gauges.
func (d *Dispatcher) maintain(ctx context.Context) {
	t := time.NewTicker(d.cfg.SweepInterval)
	defer t.Stop()
	for {
		d.sweep(ctx) // at once too: a previous process may have left exhausted rows
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (d *Dispatcher) sweep(ctx context.Context) {
	if ids, err := d.store.SweepExhausted(ctx, d.cfg.MaxAttempts, d.topics); err != nil {
		if ctx.Err() == nil {
			d.log.Warn("sweep of exhausted events failed", "error", err)
		}
	} else if len(ids) > 0 {
		d.metrics.dead.Add(ctx, int64(len(ids)))
		d.log.Error("dead-lettered events whose attempts were used up (crashed or overran on the last attempt)",
			"count", len(ids), "event_ids", ids)
	}
	if d.cfg.Retention >= 0 {
		if n, err := d.store.PurgeDelivered(ctx, d.cfg.Retention, 0); err != nil {
			if ctx.Err() == nil {
				d.log.Warn("purge of delivered events failed", "error", err)
			}
		} else if n > 0 {
			d.log.Info("purged delivered events", "count", n, "retention", d.cfg.Retention)
		}
	}
	d.metrics.refreshDepth(ctx)
}

// listen wakes the claim loop on NOTIFY. A lost connection is re-opened
// with backoff; the first wake after a reconnect covers what was missed.
// Polling goes on meanwhile, so a dead listener only costs latency.
func (d *Dispatcher) listen(ctx context.Context, wake chan<- struct{}) {
	signal := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	for delay := time.Duration(0); ; {
		if delay > 0 && !sleepCtx(ctx, delay) {
			return
		}
		err := d.listenOnce(ctx, signal)
		if ctx.Err() != nil {
			return
		}
		delay = min(max(2*delay, 100*time.Millisecond), 5*time.Second)
		d.metrics.listenerReconnects.Add(ctx, 1)
		d.log.Warn("notification listener lost; polling continues, reconnecting", "error", err, "retry_in", delay)
	}
}

func (d *Dispatcher) listenOnce(ctx context.Context, signal func()) error {
	conn, err := pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
		return err
	}
	signal() // anything enqueued while we were not listening
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if d.isWanted[n.Payload] {
			signal()
		}
	}
}

// isFatal tells errors that retrying will not fix (missing table, bad SQL,
// permissions) from transient ones (connection lost, server restarting).
func isFatal(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code[:2] {
	case "42": // syntax error or access rule violation (undefined table, insufficient privilege)
		return true
	}
	return false
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
