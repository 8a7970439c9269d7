package app

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/examples/minichat/chat"
	"github.com/modkit-go/modkit/examples/minichat/events"
	"github.com/modkit-go/modkit/examples/minichat/usage"
)

// Totals are summed usage, on one side of the reconciliation.
type Totals struct {
	Records      int64 // finalised turns, or usage records
	InputTokens  int64
	OutputTokens int64
	CacheRead    int64
	CacheWrite   int64
	Reasoning    int64
	CreditsMicro int64
}

// String formats the totals on one line.
func (t Totals) String() string {
	return fmt.Sprintf("%d records, tokens in %d / out %d / cache r %d w %d / reasoning %d, %d µcr",
		t.Records, t.InputTokens, t.OutputTokens, t.CacheRead, t.CacheWrite, t.Reasoning, t.CreditsMicro)
}

// Outbox counts the run's usage_snapshot events at the end.
type Outbox struct {
	// Enqueued = UsageEvents + Probes.
	Enqueued, UsageEvents, Probes int64
	// Delivered and Dead are usage events (not probes); ProbesDead are the
	// dead probes, ProbesDelivered the probes that were (wrongly) accepted.
	Delivered, Dead, ProbesDead, ProbesDelivered int64
	// Retried counts events delivered on a later attempt than the first.
	Retried int64
	// Unsettled are still pending or processing.
	Unsettled int64
	// TurnsWithoutEvent are finalised turns with no event under their
	// dedupe key.
	TurnsWithoutEvent int64
}

// Summary is the outcome of a run. Everything read from the database is
// restricted to the run's tenants.
type Summary struct {
	// Elapsed is the scenario's duration, from the first turn to the end
	// of the reconciliation.
	Elapsed time.Duration
	// Turns counts the run's turns by state, running included.
	Turns map[string]int64
	// TurnsFinalised are the run's turns in a terminal state.
	TurnsFinalised int64
	// WatchdogRaces is how many turns the scenario finalised from the
	// normal path and the watchdog at once.
	WatchdogRaces int64
	// Chat are the chat service's counters: LostRaces are the
	// finalisations that wrote no event, DuplicateEnqueues the re-sent
	// events already enqueued.
	Chat chat.Stats
	// Collector are the usage collector's counters.
	Collector usage.Stats
	// FailedAttempts counts delivery attempts that failed and were
	// rescheduled, as reported to DispatcherConfig.OnOutcome.
	FailedAttempts int64
	// Outbox counts the run's events by kind and status.
	Outbox Outbox
	// ChatTotals sums the finalised turns; UsageTotals the collector's
	// records. They must be equal.
	ChatTotals, UsageTotals Totals
	// TurnsMismatched are finalised turns whose usage record is missing or
	// differs from the turn (or records without a finalised turn).
	TurnsMismatched int64
	// QuotaUsedMicro and QuotaReservedMicro are summed over the run's
	// users: used must equal the chat side's credits, reserved must be 0.
	QuotaUsedMicro, QuotaReservedMicro int64
	// LatencyP50 and LatencyP99 are commit-to-publish latencies over
	// LatencySamples turns.
	LatencyP50, LatencyP99 time.Duration
	LatencySamples         int
	// Reconciled is true when every check held.
	Reconciled bool
	// Mismatches describes each check that did not hold.
	Mismatches []string
}

// reconcile reads both sides and checks that every finalised turn of the
// run was billed exactly once and that only the probes are dead.
func (sc *scenario) reconcile(ctx context.Context) (Summary, error) {
	s := Summary{WatchdogRaces: sc.races.Load(), Chat: sc.svc.Stats(), Collector: sc.collector.Stats()}
	_, s.FailedAttempts, _ = sc.track.counts()
	s.LatencyP50, s.LatencyP99, s.LatencySamples = sc.lat.percentiles()
	if err := readSummary(ctx, sc.prov.Pool, sc.tenants, &s); err != nil {
		return s, fmt.Errorf("minichat: reconcile: %w", err)
	}
	s.check(int64(sc.opts.Turns), int64(sc.opts.MalformedEvents))
	return s, nil
}

func readSummary(ctx context.Context, pool *pgxpool.Pool, tenants []uuid.UUID, s *Summary) error {
	var err error
	if s.Turns, err = turnsByState(ctx, pool, tenants); err != nil {
		return err
	}
	for state, n := range s.Turns {
		if state != chat.StateRunning {
			s.TurnsFinalised += n
		}
	}
	const sums = `SELECT count(*), coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0),
	coalesce(sum(cache_read_tokens), 0), coalesce(sum(cache_write_tokens), 0), coalesce(sum(reasoning_tokens), 0),
	coalesce(sum(credits_micro), 0) FROM `
	scanTotals := func(t *Totals, from string) error {
		err := pool.QueryRow(ctx, sums+from, tenants).
			Scan(&t.Records, &t.InputTokens, &t.OutputTokens, &t.CacheRead, &t.CacheWrite, &t.Reasoning, &t.CreditsMicro)
		if err != nil {
			return fmt.Errorf("totals of %s: %w", strings.Fields(from)[0], err)
		}
		return nil
	}
	if err := scanTotals(&s.ChatTotals, `minichat_turns WHERE tenant_id = ANY($1) AND state <> 'running'`); err != nil {
		return err
	}
	if err := scanTotals(&s.UsageTotals, `minichat_usage_records WHERE tenant_id = ANY($1)`); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, mismatchSQL, tenants).Scan(&s.TurnsMismatched); err != nil {
		return fmt.Errorf("per-turn comparison: %w", err)
	}
	if err := pool.QueryRow(ctx, `SELECT coalesce(sum(credits_used_micro), 0), coalesce(sum(credits_reserved_micro), 0)
	FROM minichat_quotas WHERE tenant_id = ANY($1)`, tenants).Scan(&s.QuotaUsedMicro, &s.QuotaReservedMicro); err != nil {
		return fmt.Errorf("quota totals: %w", err)
	}
	return readOutbox(ctx, pool, tenants, &s.Outbox)
}

func turnsByState(ctx context.Context, pool *pgxpool.Pool, tenants []uuid.UUID) (map[string]int64, error) {
	rows, err := pool.Query(ctx, `SELECT state, count(*) FROM minichat_turns WHERE tenant_id = ANY($1) GROUP BY state`, tenants)
	if err != nil {
		return nil, fmt.Errorf("turns by state: %w", err)
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var state string
		var n int64
		if err := rows.Scan(&state, &n); err != nil {
			return nil, fmt.Errorf("turns by state: %w", err)
		}
		out[state] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("turns by state: %w", err)
	}
	return out, nil
}

// mismatchSQL counts finalised turns and usage records that do not pair up
// one to one with equal usage, billed to the turn's user and chat.
const mismatchSQL = `SELECT count(*)
FROM (SELECT * FROM minichat_turns WHERE tenant_id = ANY($1) AND state <> 'running') t
FULL JOIN (SELECT * FROM minichat_usage_records WHERE tenant_id = ANY($1)) u
	ON u.tenant_id = t.tenant_id AND u.turn_id = t.id AND u.request_id = t.request_id
WHERE t.id IS NULL OR u.turn_id IS NULL
	OR (t.user_id, t.chat_id, t.input_tokens, t.output_tokens, t.cache_read_tokens, t.cache_write_tokens, t.reasoning_tokens,
		t.credits_micro, t.state, t.billing_outcome)
	IS DISTINCT FROM (u.user_id, u.chat_id, u.input_tokens, u.output_tokens, u.cache_read_tokens, u.cache_write_tokens,
		u.reasoning_tokens, u.credits_micro, u.terminal_state, u.billing_outcome)`

func readOutbox(ctx context.Context, pool *pgxpool.Pool, tenants []uuid.UUID, o *Outbox) error {
	err := pool.QueryRow(ctx, `WITH ev AS (
	SELECT status, attempts, strpos(dedupe_key, $4) > 0 AS probe FROM modkit_outbox_events
	WHERE namespace = $2 AND topic = $3 AND tenant_id = ANY($1))
SELECT count(*), count(*) FILTER (WHERE NOT probe), count(*) FILTER (WHERE probe),
	count(*) FILTER (WHERE NOT probe AND status = 'delivered'), count(*) FILTER (WHERE NOT probe AND status = 'dead'),
	count(*) FILTER (WHERE probe AND status = 'dead'), count(*) FILTER (WHERE probe AND status = 'delivered'),
	count(*) FILTER (WHERE NOT probe AND status = 'delivered' AND attempts > 1),
	count(*) FILTER (WHERE status IN ('pending', 'processing')),
	(SELECT count(*) FROM minichat_turns t WHERE t.tenant_id = ANY($1) AND t.state <> 'running'
		AND NOT EXISTS (SELECT FROM modkit_outbox_events e WHERE e.namespace = $2 AND e.topic = $3
			AND e.dedupe_key = t.tenant_id::text || '/' || t.id::text || '/' || t.request_id))
FROM ev`, tenants, events.Namespace, events.TopicUsageSnapshot, probeSegment).
		Scan(&o.Enqueued, &o.UsageEvents, &o.Probes, &o.Delivered, &o.Dead, &o.ProbesDead, &o.ProbesDelivered,
			&o.Retried, &o.Unsettled, &o.TurnsWithoutEvent)
	if err != nil {
		return fmt.Errorf("outbox counts: %w", err)
	}
	return nil
}

// check records every reconciliation rule that does not hold.
func (s *Summary) check(turns, probes int64) {
	c := func(ok bool, format string, args ...any) {
		if !ok {
			s.Mismatches = append(s.Mismatches, fmt.Sprintf(format, args...))
		}
	}
	o := s.Outbox
	c(s.TurnsFinalised == turns, "%d of %d turns finalised", s.TurnsFinalised, turns)
	c(s.Chat.LostRaces >= s.WatchdogRaces, "%d watchdog races but only %d finalisations lost one", s.WatchdogRaces, s.Chat.LostRaces)
	c(s.ChatTotals == s.UsageTotals, "usage totals differ: chat %v; collector %v", s.ChatTotals, s.UsageTotals)
	c(s.TurnsMismatched == 0, "%d turns and usage records do not pair up", s.TurnsMismatched)
	c(s.QuotaUsedMicro == s.ChatTotals.CreditsMicro, "quota used %d µcr, turns charged %d µcr", s.QuotaUsedMicro, s.ChatTotals.CreditsMicro)
	c(s.QuotaReservedMicro == 0, "%d µcr still reserved", s.QuotaReservedMicro)
	c(o.UsageEvents == s.TurnsFinalised && o.TurnsWithoutEvent == 0, "%d usage events for %d finalised turns (%d turns without one)",
		o.UsageEvents, s.TurnsFinalised, o.TurnsWithoutEvent)
	c(o.Delivered == o.UsageEvents && o.Dead == 0, "%d of %d usage events delivered, %d dead", o.Delivered, o.UsageEvents, o.Dead)
	c(o.Probes == probes && o.ProbesDead == probes, "%d probes enqueued, %d dead (%d wanted)", o.Probes, o.ProbesDead, probes)
	c(o.Unsettled == 0, "%d events not settled", o.Unsettled)
	s.Reconciled = len(s.Mismatches) == 0
}

// Print writes the summary for a human.
func (s Summary) Print(w io.Writer) error {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	var states []string
	for _, st := range chat.TerminalStates {
		states = append(states, fmt.Sprintf("%s %d", st, s.Turns[st]))
	}
	o := s.Outbox
	p("")
	p("Mini Chat summary (%v)", s.Elapsed.Round(time.Millisecond))
	p("  turns finalised       %d (%s)", s.TurnsFinalised, strings.Join(states, ", "))
	p("  watchdog races        %d turns finalised by the runner and the watchdog at once: one winner each", s.WatchdogRaces)
	p("  events enqueued       %d (%d usage snapshots, one per turn, + %d malformed probes)", o.Enqueued, o.UsageEvents, o.Probes)
	p("  delivered             %d usage snapshots", o.Delivered)
	p("  retried               %d events delivered after a failed attempt (%d failed attempts, %d injected)",
		o.Retried, s.FailedAttempts, s.Collector.TransientFailures)
	p("  dead                  %d (malformed probes, rejected permanently; %d usage snapshots dead)", o.ProbesDead, o.Dead)
	p("  duplicates suppressed %d (%d finalisations lost the compare-and-set, %d re-sent events already enqueued, %d redeliveries ignored)",
		s.Chat.LostRaces+s.Chat.DuplicateEnqueues+s.Collector.Redeliveries, s.Chat.LostRaces, s.Chat.DuplicateEnqueues,
		s.Collector.Redeliveries)
	p("  usage, chat side      %v", s.ChatTotals)
	p("  usage, collector      %v", s.UsageTotals)
	p("  quota                 used %d µcr, still reserved %d µcr", s.QuotaUsedMicro, s.QuotaReservedMicro)
	p("  commit→publish        p50 %v, p99 %v (%d events)", s.LatencyP50.Round(10*time.Microsecond),
		s.LatencyP99.Round(10*time.Microsecond), s.LatencySamples)
	if s.Reconciled {
		p("  reconciliation        OK: every finalised turn billed exactly once, totals equal, only the probes dead")
	} else {
		p("  reconciliation        FAILED")
		for _, m := range s.Mismatches {
			p("    - %s", m)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}
