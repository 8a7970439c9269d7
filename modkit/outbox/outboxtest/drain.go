package outboxtest

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// Drain runs a dispatcher of c for pubs until none of their topics has an
// event left to deliver (pending or processing), stops it, and returns the
// deliveries that were published: those whose Publish (or HandleTx)
// returned nil, in the order they returned. Events that fail are retried
// after a millisecond or so, three attempts in all (not the app's
// DispatcherConfig.MaxAttempts: DrainWith takes it), then dead-lettered:
// check them with c.Admin(). Each event dead-lettered, with its error, and
// the dispatcher's warnings and errors (a publisher's panic, with its
// stack) go to t's log, which the test shows when it fails or runs with
// -v. Other topics' events are left alone.
//
// It looks again after each outcome its dispatcher records, and every
// 100ms besides, for events that another dispatcher (the module's
// own, in an fx test) or the sweeper settles. Such a dispatcher and
// Drain's share the topics' events: Drain's publishers take some of them
// from the app's, so a test of what the app's own publishers did should
// give Drain those publishers, or wait on what they do. It fails t if the dispatcher
// cannot start or the topics are not drained within WaitTimeout, naming
// some of the events left and their last errors. Two kinds of event keep a
// topic from draining: one held behind a dead event of its ordering key
// (unless the publisher sets SkipDeadHeads), which fails t as soon as
// every event left is such an event (Drain knows only its own publishers'
// SkipDeadHeads: give it the app's publisher when the app's own
// dispatcher is the one that skips), and a retry whose error asks for a
// later time (RetryAfter) than the test allows, which waits out
// WaitTimeout.
func Drain(t TB, c *outbox.Client, pubs ...outbox.Publisher) []outbox.Delivery {
	t.Helper()
	return DrainWith(t, c, DrainOptions{}, pubs...)
}

// Drain's retries, unless DrainOptions say otherwise.
const drainMaxAttempts = 3

var drainRetry = outbox.RetryPolicy{BaseDelay: time.Millisecond, MaxDelay: 10 * time.Millisecond}

// DrainOptions set the retries of DrainWith's dispatcher. The zero value
// is Drain's.
type DrainOptions struct {
	// MaxAttempts is how many attempts an event gets before it is
	// dead-lettered, as DispatcherConfig.MaxAttempts: give the app's to
	// test what its last attempt does. Zero: 3 (not the dispatcher's
	// default of 10).
	MaxAttempts int
	// Retry is the backoff between attempts, as DispatcherConfig.Retry,
	// whose zero fields take the outbox's defaults (1s and 5m). The zero
	// RetryPolicy: Drain's, a millisecond or so (BaseDelay 1ms, MaxDelay
	// 10ms). An app's own policy makes the drain wait its delays, and a
	// drain that needs longer than WaitTimeout fails.
	Retry outbox.RetryPolicy
}

// DrainWith is Drain with the retries of opts: the app's MaxAttempts and
// RetryPolicy, say, to test an event that is dead-lettered after the
// app's number of attempts.
func DrainWith(t TB, c *outbox.Client, opts DrainOptions, pubs ...outbox.Publisher) []outbox.Delivery {
	t.Helper()
	checkClient(t, c)
	if opts.MaxAttempts < 0 {
		fatal(t, "drain: DrainOptions.MaxAttempts is %d; give the app's DispatcherConfig.MaxAttempts (1 or more), or 0 for %d",
			opts.MaxAttempts, drainMaxAttempts)
	}
	if opts.MaxAttempts == 0 {
		opts.MaxAttempts = drainMaxAttempts
	}
	if opts.Retry == (outbox.RetryPolicy{}) {
		opts.Retry = drainRetry
	}
	for i, p := range pubs {
		checkTopic(t, fmt.Sprintf("drain: publisher %d (%s): topic", i, cmp.Or(p.Name, "unnamed")), p.Topic)
	}
	ctx := context.Background()
	var (
		mu        sync.Mutex
		published []outbox.Delivery
	)
	record := func(d outbox.Delivery) {
		mu.Lock()
		published = append(published, d)
		mu.Unlock()
	}
	wrapped := make([]outbox.Publisher, len(pubs))
	topics := map[outbox.Topic]bool{}
	for i, p := range pubs {
		topics[p.Topic] = true
		if publish := p.Publish; publish != nil {
			p.Publish = func(ctx context.Context, d outbox.Delivery) error {
				err := publish(ctx, d)
				if err == nil {
					record(d)
				}
				return err
			}
		}
		if handle := p.HandleTx; handle != nil {
			p.HandleTx = func(ctx context.Context, tx pgx.Tx, d outbox.Delivery) error {
				err := handle(ctx, tx, d)
				if err == nil {
					record(d)
				}
				return err
			}
		}
		wrapped[i] = p
	}
	outcome := make(chan struct{}, 1)
	// The dispatcher's warnings and errors (a publisher's panic with its
	// stack, say) go to the test's log, shown when it fails or with -v,
	// and the last few into the message of a start that fails.
	warnings := &lastLines{logf: t.Logf}
	d, err := c.NewDispatcher(outbox.DispatcherConfig{
		PollInterval:  10 * time.Millisecond,
		Retry:         opts.Retry,
		MaxAttempts:   opts.MaxAttempts,
		SweepInterval: 100 * time.Millisecond,
		Logger:        slog.New(slog.NewTextHandler(warnings, &slog.HandlerOptions{Level: slog.LevelWarn})),
		OnOutcome: func(d outbox.Delivery, o outbox.Outcome) {
			if o.Status == outbox.StatusDead {
				warnings.log(fmt.Sprintf("event %s of %s/%s dead-lettered after attempt %d: %s", d.ID, d.Namespace, d.Topic,
					d.Attempt, o.Error))
			}
			select {
			case outcome <- struct{}{}:
			default:
			}
		},
	}, wrapped...)
	if err != nil {
		fatal(t, "drain: %v", err)
	}
	// A dispatcher whose claims keep failing never becomes ready: bounded
	// like the drain, with what its log said.
	sctx, cancel := context.WithTimeout(ctx, WaitTimeout)
	err = d.Start(sctx)
	cancel()
	if err != nil {
		fatal(t, "drain: start the dispatcher (within WaitTimeout, %v): %v%s", WaitTimeout, err, warnings.String())
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			err := d.Stop(ctx)
			// A publish abandoned at its deadline may return, and be
			// logged, after the test has ended, when t.Logf panics.
			warnings.endLog()
			if err != nil {
				t.Logf("outboxtest: drain: stop the dispatcher: %v", err)
			}
		}
	}
	defer stop()
	skipDead := map[outbox.Topic]bool{}
	for _, p := range pubs {
		if p.SkipDeadHeads {
			skipDead[p.Topic] = true
		}
	}
	timeout := time.NewTimer(WaitTimeout)
	defer timeout.Stop()
	recheck := time.NewTicker(drainRecheck)
	defer recheck.Stop()
	stuckBefore := false // at the last recheck, with no outcome since
	for {
		left, err := undelivered(ctx, c, topics)
		if err != nil {
			fatal(t, "drain: %v", err)
		}
		if left == 0 {
			break
		}
		select {
		case <-outcome:
			stuckBefore = false
		case <-recheck.C:
			// Every event left waits behind a dead event of its key, twice
			// in a row with no outcome between: waiting out WaitTimeout
			// cannot change that.
			stuck := behindDeadHeads(ctx, c, topics, skipDead) >= left
			if stuck && stuckBefore {
				fatal(t, "drain: the %d event(s) left of %d topic(s) all wait behind dead events of their ordering keys, "+
					"which this Drain cannot deliver%s", left, len(topics), leftOver(ctx, c, topics))
			}
			stuckBefore = stuck
		case <-timeout.C:
			left, _ = undelivered(ctx, c, topics)
			fatal(t, "drain: %d event(s) of %d topic(s) still pending or processing after %v%s", left, len(topics), WaitTimeout,
				leftOver(ctx, c, topics))
		}
	}
	stop()
	mu.Lock()
	defer mu.Unlock()
	return published
}

// lastLines keeps the last few lines written to it: the warnings of
// Drain's dispatcher, for a failure message.
type lastLines struct {
	mu    sync.Mutex
	lines []string
	logf  func(format string, args ...any) // each line written, until endLog
}

// log passes line to logf, until endLog.
func (l *lastLines) log(line string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.logf != nil {
		l.logf("outboxtest: drain: %s", line)
	}
}

// endLog stops passing lines to logf: Drain has stopped its dispatcher.
func (l *lastLines) endLog() {
	l.mu.Lock()
	l.logf = nil
	l.mu.Unlock()
}

// lastLinesKept bounds lastLines.
const lastLinesKept = 5

func (l *lastLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	lines := strings.Split(strings.TrimRight(string(p), "\n"), "\n")
	if l.logf != nil {
		for _, line := range lines {
			l.logf("outboxtest: drain: dispatcher: %s", line)
		}
	}
	l.lines = append(l.lines, lines...)
	if n := len(l.lines); n > lastLinesKept {
		l.lines = slices.Delete(l.lines, 0, n-lastLinesKept)
	}
	return len(p), nil
}

// String returns the lines kept, each on a line of its own after a
// heading, or "" when there are none.
func (l *lastLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.lines) == 0 {
		return ""
	}
	return "\nthe dispatcher's last warnings:\n  " + strings.Join(l.lines, "\n  ")
}

// drainRecheck is how often Drain looks at the backlog besides after its
// own dispatcher's outcomes.
const drainRecheck = 100 * time.Millisecond

// leftOverShown bounds the events a failed Drain names.
const leftOverShown = 5

// leftOver names some of the topics' pending and processing events with
// their last errors, and the ordering keys of the topics a dead event
// holds back, for a Drain that timed out (its dispatcher's log goes
// nowhere, so this is where a publisher's error shows).
func leftOver(ctx context.Context, c *outbox.Client, topics map[outbox.Topic]bool) string {
	return leftEvents(ctx, c, topics) + blockedKeys(ctx, c, topics)
}

// blockedKeys says which ordering keys of topics a dead event holds back:
// their later events wait for ever, which a Drain cannot change.
func blockedKeys(ctx context.Context, c *outbox.Client, topics map[outbox.Topic]bool) string {
	blocked, err := c.Admin().BlockedKeys(ctx, 0)
	if err != nil {
		return fmt.Sprintf("\n(listing the blocked ordering keys failed: %v)", err)
	}
	var b strings.Builder
	for _, k := range blocked {
		if topics[k.Topic] && k.Waiting > 0 {
			fmt.Fprintf(&b, "\n  ordering key %q of %s: its %d later event(s) wait behind the dead event %s (event %d of the key, "+
				"last error: %s); only a replay, a skip (Admin.SkipHead) or Publisher.SkipDeadHeads lets them go",
				k.OrderingKey, k.Topic, k.Waiting, k.Head, k.HeadSequence, k.LastError)
		}
	}
	return b.String()
}

// behindDeadHeads counts the events of topics that wait behind a dead
// event of their ordering key, but for the topics whose publishers skip
// dead heads (skipDead); -1 when they cannot be listed.
func behindDeadHeads(ctx context.Context, c *outbox.Client, topics, skipDead map[outbox.Topic]bool) int64 {
	blocked, err := c.Admin().BlockedKeys(ctx, 10000)
	if err != nil {
		return -1
	}
	var n int64
	for _, k := range blocked {
		if topics[k.Topic] && !skipDead[k.Topic] {
			n += k.Waiting
		}
	}
	return n
}

// leftEvents names some of the topics' pending and processing events with
// their last errors.
func leftEvents(ctx context.Context, c *outbox.Client, topics map[outbox.Topic]bool) string {
	var b strings.Builder
	shown := 0
	for topic := range topics {
		for _, status := range []outbox.Status{outbox.StatusPending, outbox.StatusProcessing} {
			page, err := c.Admin().List(ctx, outbox.EventFilter{Namespace: topic.Namespace, Topic: topic.Topic, Status: status,
				Limit: leftOverShown - shown})
			if err != nil {
				return fmt.Sprintf("\n(listing them failed: %v)", err)
			}
			for _, e := range page.Events {
				last := "none"
				if e.LastError != nil {
					last = *e.LastError
				}
				key := ""
				if e.OrderingKey != "" {
					key = fmt.Sprintf(" (event %d of ordering key %q)", e.Sequence, e.OrderingKey)
				}
				fmt.Fprintf(&b, "\n  %s %s%s, %s, attempt %d, last error: %s", e.ID, topic, key, e.Status, e.Attempts, last)
				if shown++; shown == leftOverShown {
					return b.String()
				}
			}
		}
	}
	return b.String()
}

// undelivered counts the topics' pending and processing events (from
// Admin.Backlog, which reads no delivered event).
func undelivered(ctx context.Context, c *outbox.Client, topics map[outbox.Topic]bool) (int64, error) {
	stats, err := c.Admin().Backlog(ctx)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, s := range stats.Topics {
		if topics[s.Topic] {
			n += s.Pending + s.Processing
		}
	}
	return n, nil
}
