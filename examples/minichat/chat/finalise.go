package chat

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/uptrace/bun"

	"github.com/modkit-go/modkit/examples/minichat/events"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// Outcome is how a turn ended, as reported by the model runner (or decided
// by the watchdog).
type Outcome struct {
	// State is one of TerminalStates.
	State string
	// Incomplete marks a completed turn whose response was cut short (max
	// tokens, content filter); it is billed like a complete one.
	Incomplete bool
	// EffectiveModel is the model that actually answered (a fallback may
	// differ from the selected one). Empty means the selected model.
	EffectiveModel string
	// Usage is what the model consumed.
	Usage events.Usage
	// ToolCalls counts the tools the model called.
	ToolCalls events.ToolCalls
}

// Finalised says what a Finalise call did.
type Finalised struct {
	// Won is true if this call finalised the turn; false if another
	// finaliser had already done so, in which case nothing was changed.
	Won bool
	// Event is the usage event's enqueue result (zero unless Won).
	Event outbox.Enqueued
}

// charge is what a turn costs, decided from its outcome.
type charge struct {
	effectiveModel string
	billingOutcome string // charged, charged_partial, not_charged
	creditsMicro   int64
}

// Billing outcomes.
const (
	billingCharged        = "charged"
	billingChargedPartial = "charged_partial"
	billingNotCharged     = "not_charged"
)

// settlementMethod is how a turn's reservation was settled: against the
// actual usage, or released because nothing is charged.
func settlementMethod(billingOutcome string) string {
	if billingOutcome == billingNotCharged {
		return "released"
	}
	return "actual"
}

// Finalise ends a running turn exactly once. In one transaction it
//
//  1. moves the turn from running to o.State with a compare-and-set
//     UPDATE … WHERE id = $1 AND state = 'running' RETURNING …;
//  2. settles the quota: the reservation is released and the actual
//     charge is added to the used credits;
//  3. enqueues the turn's usage_snapshot event with the outbox client's
//     Enqueue on the same bun transaction.
//
// If the compare-and-set matches no row, another finaliser (the watchdog,
// or the normal path) got there first: Finalise returns Won false and
// changes nothing, so no second event is ever written. by says who is
// finalising (ByRunner or ByWatchdog).
func (s *Service) Finalise(ctx context.Context, turnID uuid.UUID, o Outcome, by string) (Finalised, error) {
	if !slices.Contains(TerminalStates, o.State) {
		return Finalised{}, fmt.Errorf("%w: state %q", ErrBadOutcome, o.State)
	}
	// What the usage event may not carry is refused here, before anything
	// commits: the collector would dead-letter such an event, and the turn
	// would be settled but never billed.
	if u := o.Usage; min(u.InputTokens, u.OutputTokens, u.CacheReadTokens, u.CacheWriteTokens, u.ReasoningTokens) < 0 {
		return Finalised{}, fmt.Errorf("%w: negative token count %+v", ErrBadOutcome, u)
	}
	if _, ok := prices[o.EffectiveModel]; o.EffectiveModel != "" && !ok {
		return Finalised{}, fmt.Errorf("%w: effective model %q", ErrUnknownModel, o.EffectiveModel)
	}
	var out Finalised
	// READ COMMITTED whatever the server's default: the compare-and-set
	// below relies on it (under REPEATABLE READ the loser of a race gets a
	// serialization failure instead of matching no row).
	err := s.db.RunInTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, func(ctx context.Context, tx bun.Tx) error {
		var err error
		out, err = s.finaliseInTx(ctx, tx, turnID, o, by)
		return err
	})
	if err != nil {
		return Finalised{}, fmt.Errorf("chat: finalise turn %s: %w", turnID, err)
	}
	s.count(turnID, o.State, by, out)
	return out, nil
}

// count updates the counters and tells the OnCommitted hook.
func (s *Service) count(turnID uuid.UUID, state, by string, out Finalised) {
	if !out.Won {
		s.lostRaces.Add(1)
		s.log.Debug("turn already final; nothing to do", "turn_id", turnID, "by", by)
		return
	}
	if s.cfg.OnCommitted != nil {
		s.cfg.OnCommitted(turnID, time.Now())
	}
	s.finalised[state].Add(1)
}

func (s *Service) finaliseInTx(ctx context.Context, tx bun.Tx, turnID uuid.UUID, o Outcome, by string) (Finalised, error) {
	selected, err := selectedModel(ctx, tx, turnID)
	if err != nil {
		return Finalised{}, err
	}
	c := priceOutcome(o, selected)
	turn, won, err := markFinal(ctx, tx, turnID, o, c, by)
	if err != nil || !won {
		return Finalised{}, err
	}
	if err := settleQuota(ctx, tx, turn); err != nil {
		return Finalised{}, err
	}
	ev, err := s.enqueueUsage(ctx, tx, turn)
	if err != nil {
		return Finalised{}, err
	}
	if ev.AlreadyEnqueued {
		// This finalisation won the turn, so no event of it can exist:
		// one that does would bill something else than what the turn now
		// records. Roll back rather than commit a turn and an event that
		// disagree.
		return Finalised{}, fmt.Errorf("usage event of turn %s already enqueued (event %s), though this finalisation won the turn",
			turn.ID, ev.ID)
	}
	return Finalised{Won: true, Event: ev}, nil
}

// enqueueUsage enqueues the turn's usage event through tx: it becomes
// visible to the dispatcher when tx commits, and vanishes if it rolls back.
func (s *Service) enqueueUsage(ctx context.Context, tx bun.Tx, turn *Turn) (outbox.Enqueued, error) {
	msg, err := usageMessage(turn)
	if err != nil {
		return outbox.Enqueued{}, err
	}
	ev, err := s.outbox.Enqueue(ctx, db.SQL(tx), msg) // db.SQL makes the bun.Tx a db.Runner
	if err != nil {
		return outbox.Enqueued{}, fmt.Errorf("enqueue usage event: %w", err)
	}
	return ev, nil
}

func selectedModel(ctx context.Context, tx bun.Tx, turnID uuid.UUID) (string, error) {
	var model string
	err := tx.NewSelect().Model((*Turn)(nil)).Column("selected_model").Where("id = ?", turnID).Scan(ctx, &model)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return "", fmt.Errorf("%w: %s", ErrUnknownTurn, turnID)
	case err != nil:
		return "", fmt.Errorf("load turn: %w", err)
	}
	return model, nil
}

// priceOutcome decides the billing outcome, settlement method and charge.
// Completed turns (incomplete ones too) and cancelled ones pay for what
// they used; failed and orphaned turns are not charged.
func priceOutcome(o Outcome, selectedModel string) charge {
	c := charge{effectiveModel: cmp.Or(o.EffectiveModel, selectedModel)}
	switch o.State {
	case StateCompleted:
		c.billingOutcome, c.creditsMicro = billingCharged, Credits(c.effectiveModel, o.Usage)
	case StateCancelled:
		c.billingOutcome, c.creditsMicro = billingChargedPartial, Credits(c.effectiveModel, o.Usage)
	default:
		c.billingOutcome = billingNotCharged
	}
	return c
}

// markFinal is the compare-and-set: it finalises the turn only if it is
// still running, and reports whether it did. A concurrent finaliser blocks
// on the row lock, then re-checks state = 'running' against the committed
// row and matches nothing.
func markFinal(ctx context.Context, tx bun.Tx, turnID uuid.UUID, o Outcome, c charge, by string) (*Turn, bool, error) {
	var turn Turn
	err := tx.NewUpdate().Model(&turn).
		Set("state = ?", o.State).
		Set("incomplete = ?", o.Incomplete).
		Set("effective_model = ?", c.effectiveModel).
		Set("input_tokens = ?", o.Usage.InputTokens).
		Set("output_tokens = ?", o.Usage.OutputTokens).
		Set("cache_read_tokens = ?", o.Usage.CacheReadTokens).
		Set("cache_write_tokens = ?", o.Usage.CacheWriteTokens).
		Set("reasoning_tokens = ?", o.Usage.ReasoningTokens).
		Set("tool_calls = ?", o.ToolCalls.Total).
		Set("web_search_calls = ?", o.ToolCalls.WebSearch).
		Set("code_exec_calls = ?", o.ToolCalls.CodeExec).
		Set("credits_micro = ?", c.creditsMicro).
		Set("billing_outcome = ?", c.billingOutcome).
		Set("finalised_by = ?", by).
		Set("finalised_at = now()").
		Where("id = ? AND state = ?", turnID, StateRunning).
		Returning("*").
		Scan(ctx)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil, false, nil // already final: someone else won
	case err != nil:
		return nil, false, fmt.Errorf("finalise turn: %w", err)
	}
	return &turn, true, nil
}

// settleQuota releases the turn's reservation and books its charge.
func settleQuota(ctx context.Context, tx bun.Tx, t *Turn) error {
	_, err := tx.NewUpdate().Model((*Quota)(nil)).
		Set("credits_reserved_micro = credits_reserved_micro - ?", t.ReservedMicro).
		Set("credits_used_micro = credits_used_micro + ?", t.CreditsMicro).
		Where("tenant_id = ? AND user_id = ?", t.TenantID, t.UserID).
		Exec(ctx)
	if err != nil {
		return fmt.Errorf("settle quota: %w", err)
	}
	return nil
}

// usageMessage builds the usage_snapshot event of a finalised turn from
// its row alone, so that the same turn always yields the same event.
func usageMessage(t *Turn) (outbox.Message, error) {
	snap := events.UsageSnapshot{
		TenantID: t.TenantID, UserID: t.UserID, ChatID: t.ChatID, TurnID: t.ID, RequestID: t.RequestID,
		SelectedModel: t.SelectedModel, EffectiveModel: deref(t.EffectiveModel),
		TerminalState: t.State, Incomplete: t.Incomplete, BillingOutcome: deref(t.BillingOutcome),
		Usage: events.Usage{InputTokens: t.InputTokens, OutputTokens: t.OutputTokens, CacheReadTokens: t.CacheReadTokens,
			CacheWriteTokens: t.CacheWriteTokens, ReasoningTokens: t.ReasoningTokens},
		CreditsMicro: t.CreditsMicro, SettlementMethod: settlementMethod(deref(t.BillingOutcome)), PolicyVersion: PolicyVersion,
		ToolCalls:     events.ToolCalls{Total: t.ToolCalls, WebSearch: t.WebSearchCalls, CodeExec: t.CodeExecCalls},
		RequesterType: events.RequesterUser,
	}
	if t.FinalisedAt != nil {
		snap.Timestamp = t.FinalisedAt.UTC()
	}
	if deref(t.FinalisedBy) == ByWatchdog {
		snap.RequesterType = events.RequesterSystem
	}
	payload, err := json.Marshal(snap)
	if err != nil {
		return outbox.Message{}, fmt.Errorf("encode usage event: %w", err)
	}
	return outbox.Message{
		Namespace: events.Namespace, Topic: events.TopicUsageSnapshot,
		TenantID:  outbox.Tenant(t.TenantID),
		DedupeKey: outbox.Key(events.DedupeKey(t.TenantID, t.ID, t.RequestID)),
		Payload:   payload,
	}, nil
}

// ResendUsage enqueues a finalised turn's usage event again, as a
// reconciler might when it suspects an event was lost. While the original
// event is in the outbox its dedupe key makes this a no-op: the result has
// AlreadyEnqueued set and names the original. (After the outbox purged a
// delivered event, a new one is written; the collector, idempotent on
// (tenant, turn, request), ignores it.) It fails with ErrTurnRunning for a
// turn that is not final.
func (s *Service) ResendUsage(ctx context.Context, turnID uuid.UUID) (outbox.Enqueued, error) {
	var ev outbox.Enqueued
	err := s.db.RunInTx(ctx, nil, func(ctx context.Context, tx bun.Tx) error {
		var turn Turn
		err := tx.NewSelect().Model(&turn).Where("id = ?", turnID).Scan(ctx)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			return fmt.Errorf("%w: %s", ErrUnknownTurn, turnID)
		case err != nil:
			return fmt.Errorf("load turn: %w", err)
		case turn.State == StateRunning:
			return fmt.Errorf("%w: %s", ErrTurnRunning, turnID)
		}
		ev, err = s.enqueueUsage(ctx, tx, &turn)
		return err
	})
	if err != nil {
		return outbox.Enqueued{}, fmt.Errorf("chat: resend usage of turn %s: %w", turnID, err)
	}
	if ev.AlreadyEnqueued {
		s.duplicateEnqueue.Add(1)
	}
	return ev, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// FinaliseOrphans finalises, as orphaned, every turn still running that
// started more than olderThan ago (by the database clock), at most limit
// of them per call, oldest first. It returns how many this call finalised;
// the others were finalised concurrently by someone else.
func (s *Service) FinaliseOrphans(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	var ids []uuid.UUID
	err := s.db.NewSelect().Model((*Turn)(nil)).Column("id").
		Where("state = ?", StateRunning).
		Where("started_at <= now() - ? * interval '1 microsecond'", olderThan.Microseconds()).
		Order("started_at").Limit(int64(limit)).
		Scan(ctx, &ids)
	if err != nil {
		return 0, fmt.Errorf("chat: find orphaned turns: %w", err)
	}
	n := 0
	var errs []error
	for _, id := range ids {
		// One turn that cannot be finalised does not hold back the others
		// (they are taken oldest first, so it would come first each time).
		res, err := s.Finalise(ctx, id, Outcome{State: StateOrphaned}, ByWatchdog)
		if err != nil {
			if ctx.Err() != nil {
				return n, err
			}
			errs = append(errs, err)
			continue
		}
		if res.Won {
			n++
		}
	}
	return n, errors.Join(errs...)
}
