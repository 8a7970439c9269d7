// Package chat is Mini Chat's chat module: chats, turns and per-user credit
// quotas, stored with bun. A turn reserves quota when it starts and is
// finalised exactly once (see Service.Finalise); finalisation settles the
// quota and enqueues the turn's usage_snapshot event in the same
// transaction.
package chat

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/uptrace/bun"

	"github.com/modkit-go/modkit/examples/minichat/events"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// Turn states. Running is the only non-terminal one.
const (
	StateRunning   = "running"
	StateCompleted = "completed" // including incomplete responses
	StateFailed    = "failed"
	StateCancelled = "cancelled" // the user aborted the turn
	StateOrphaned  = "orphaned"  // abandoned, finalised by the watchdog
)

// TerminalStates lists the states a turn can be finalised to.
var TerminalStates = []string{StateCompleted, StateFailed, StateCancelled, StateOrphaned}

// Who finalised a turn (the finalised_by column).
const (
	ByRunner   = "runner"   // the normal path: the model runner reported the outcome
	ByWatchdog = "watchdog" // the orphan watchdog
)

// PolicyVersion is the billing policy the credits are computed under.
const PolicyVersion = "2026-11-01"

// Errors of the chat service.
var (
	ErrQuotaExceeded = errors.New("chat: credit quota exceeded")
	ErrBadOutcome    = errors.New("chat: invalid turn outcome")
	ErrUnknownTurn   = errors.New("chat: no such turn")
	ErrUnknownModel  = errors.New("chat: unknown model")
	ErrTurnRunning   = errors.New("chat: turn not finalised yet")
	ErrBadRequest    = errors.New("chat: invalid request")
)

// RequestIDMaxLen caps a turn's request id: its usage event's dedupe key,
// tenant/turn/request, must fit the outbox's 512 bytes.
const RequestIDMaxLen = 512 - 2*36 - 2

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// Quota is a user's credit quota, in micro-credits. A running turn holds a
// reservation; finalisation moves it to used (the actual charge).
type Quota struct {
	bun.BaseModel `bun:"table:minichat_quotas"`

	TenantID             uuid.UUID `bun:"tenant_id,pk,type:uuid"`
	UserID               uuid.UUID `bun:"user_id,pk,type:uuid"`
	CreditsLimitMicro    int64     `bun:"credits_limit_micro"`
	CreditsReservedMicro int64     `bun:"credits_reserved_micro"`
	CreditsUsedMicro     int64     `bun:"credits_used_micro"`
}

// Chat is one conversation of a user.
type Chat struct {
	bun.BaseModel `bun:"table:minichat_chats"`

	ID        uuid.UUID `bun:"id,pk,type:uuid"`
	TenantID  uuid.UUID `bun:"tenant_id,type:uuid"`
	UserID    uuid.UUID `bun:"user_id,type:uuid"`
	CreatedAt time.Time `bun:"created_at,nullzero,default:now()"`
}

// Turn is one request/response exchange in a chat. The usage and billing
// columns are set when it is finalised.
type Turn struct {
	bun.BaseModel `bun:"table:minichat_turns"`

	ID               uuid.UUID  `bun:"id,pk,type:uuid"`
	ChatID           uuid.UUID  `bun:"chat_id,type:uuid"`
	TenantID         uuid.UUID  `bun:"tenant_id,type:uuid"`
	UserID           uuid.UUID  `bun:"user_id,type:uuid"`
	RequestID        string     `bun:"request_id"`
	SelectedModel    string     `bun:"selected_model"`
	EffectiveModel   *string    `bun:"effective_model"`
	State            string     `bun:"state"`          // StateRunning, then one of TerminalStates
	Incomplete       bool       `bun:"incomplete"`     // a completed turn whose response was cut short
	ReservedMicro    int64      `bun:"reserved_micro"` // the quota reserved when it started
	InputTokens      int64      `bun:"input_tokens"`
	OutputTokens     int64      `bun:"output_tokens"`
	CacheReadTokens  int64      `bun:"cache_read_tokens"`
	CacheWriteTokens int64      `bun:"cache_write_tokens"`
	ReasoningTokens  int64      `bun:"reasoning_tokens"`
	ToolCalls        int        `bun:"tool_calls"` // in total
	WebSearchCalls   int        `bun:"web_search_calls"`
	CodeExecCalls    int        `bun:"code_exec_calls"`
	CreditsMicro     int64      `bun:"credits_micro"`   // the charge
	BillingOutcome   *string    `bun:"billing_outcome"` // see events.UsageSnapshot.BillingOutcome
	FinalisedBy      *string    `bun:"finalised_by"`    // ByRunner or ByWatchdog
	StartedAt        time.Time  `bun:"started_at,nullzero,default:now()"`
	FinalisedAt      *time.Time `bun:"finalised_at"`
}

// price is micro-credits per token.
type price struct{ input, output, cacheRead, cacheWrite, reasoning int64 }

var prices = map[string]price{
	"mini-fast":  {input: 1, output: 4, cacheRead: 0, cacheWrite: 1, reasoning: 4},
	"mini-large": {input: 5, output: 20, cacheRead: 1, cacheWrite: 6, reasoning: 20},
}

// Credits is the charge, in micro-credits, for usage on model.
func Credits(model string, u events.Usage) int64 {
	p := prices[model]
	return u.InputTokens*p.input + u.OutputTokens*p.output + u.CacheReadTokens*p.cacheRead +
		u.CacheWriteTokens*p.cacheWrite + u.ReasoningTokens*p.reasoning
}

// Stats counts what the service did since it was created.
type Stats struct {
	// Finalised counts the finalisations this service won, by terminal
	// state.
	Finalised map[string]int64
	// LostRaces counts finalisations that found the turn already final
	// (the compare-and-set matched nothing): they wrote no event.
	LostRaces int64
	// DuplicateEnqueues counts ResendUsage enqueues that the outbox
	// answered with AlreadyEnqueued: the dedupe key already had a row, so
	// nothing was written. (A Finalise that wins its turn and finds its
	// event already enqueued fails and rolls back instead.)
	DuplicateEnqueues int64
}

// Service runs chats and turns. It is safe for concurrent use.
type Service struct {
	db     *bun.DB
	outbox *outbox.Client
	cfg    Config
	log    *slog.Logger

	finalised                   map[string]*atomic.Int64 // by terminal state; the map itself is never written after NewService
	lostRaces, duplicateEnqueue atomic.Int64
}

// NewService returns a chat service on db that enqueues its usage events
// through ob, which must be bound to the same database. Only
// cfg.OnCommitted matters to the service itself; the rest configures the
// watchdog (see NewWatchdog).
func NewService(db *bun.DB, ob *outbox.Client, cfg Config, log *slog.Logger) *Service {
	if log == nil {
		log = slog.Default()
	}
	s := &Service{db: db, outbox: ob, cfg: cfg.withDefaults(), log: log.With("module", "chat"),
		finalised: map[string]*atomic.Int64{}}
	for _, st := range TerminalStates {
		s.finalised[st] = new(atomic.Int64)
	}
	return s
}

// Stats returns a snapshot of the counters.
func (s *Service) Stats() Stats {
	st := Stats{Finalised: map[string]int64{}, LostRaces: s.lostRaces.Load(), DuplicateEnqueues: s.duplicateEnqueue.Load()}
	for state, n := range s.finalised {
		st.Finalised[state] = n.Load()
	}
	return st
}

// SetQuota creates a user's quota, or replaces its limit.
func (s *Service) SetQuota(ctx context.Context, tenant, user uuid.UUID, limitMicro int64) error {
	q := &Quota{TenantID: tenant, UserID: user, CreditsLimitMicro: limitMicro}
	_, err := s.db.NewInsert().Model(q).On("CONFLICT (tenant_id, user_id) DO UPDATE").
		Set("credits_limit_micro = EXCLUDED.credits_limit_micro").Exec(ctx)
	if err != nil {
		return fmt.Errorf("chat: set quota: %w", err)
	}
	return nil
}

// NewChat opens a chat for a user.
func (s *Service) NewChat(ctx context.Context, tenant, user uuid.UUID) (uuid.UUID, error) {
	c := &Chat{ID: uuid.New(), TenantID: tenant, UserID: user}
	if _, err := s.db.NewInsert().Model(c).Exec(ctx); err != nil {
		return uuid.Nil, fmt.Errorf("chat: new chat: %w", err)
	}
	return c.ID, nil
}

// StartTurn reserves reserveMicro credits of the chat owner's quota and
// records a running turn, in one transaction. It fails with
// ErrQuotaExceeded, changing nothing, if the quota cannot cover the
// reservation.
func (s *Service) StartTurn(ctx context.Context, chatID uuid.UUID, requestID, model string, reserveMicro int64) (*Turn, error) {
	if _, ok := prices[model]; !ok {
		return nil, fmt.Errorf("%w: %q", ErrUnknownModel, model)
	}
	// The request id ends the usage event's dedupe key, which the outbox
	// caps at 512 bytes: a turn whose key cannot be enqueued could never
	// be finalised.
	if requestID == "" || len(requestID) > RequestIDMaxLen || !utf8.ValidString(requestID) || strings.ContainsRune(requestID, 0) {
		return nil, fmt.Errorf("%w: request id %q: 1 to %d bytes of UTF-8 without NUL", ErrBadRequest, truncate(requestID, 40), RequestIDMaxLen)
	}
	var turn *Turn
	// READ COMMITTED whatever the server's default, as Finalise: the
	// reservation updates the user's quota row, which the watchdog may be
	// settling at the same moment (under REPEATABLE READ that is a
	// serialization failure, not a wait).
	err := s.db.RunInTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, func(ctx context.Context, tx bun.Tx) error {
		var c Chat
		if err := tx.NewSelect().Model(&c).Where("id = ?", chatID).Scan(ctx); err != nil {
			return fmt.Errorf("load chat %s: %w", chatID, err)
		}
		if err := reserve(ctx, tx, c.TenantID, c.UserID, reserveMicro); err != nil {
			return err
		}
		turn = &Turn{ID: uuid.New(), ChatID: chatID, TenantID: c.TenantID, UserID: c.UserID, RequestID: requestID,
			SelectedModel: model, State: StateRunning, ReservedMicro: reserveMicro}
		if _, err := tx.NewInsert().Model(turn).Exec(ctx); err != nil {
			return fmt.Errorf("insert turn: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("chat: start turn: %w", err)
	}
	return turn, nil
}

// reserve takes amount from the user's available quota, or fails with
// ErrQuotaExceeded.
func reserve(ctx context.Context, tx bun.Tx, tenant, user uuid.UUID, amount int64) error {
	res, err := tx.NewUpdate().Model((*Quota)(nil)).
		Set("credits_reserved_micro = credits_reserved_micro + ?", amount).
		Where("tenant_id = ? AND user_id = ?", tenant, user).
		Where("credits_limit_micro - credits_used_micro - credits_reserved_micro >= ?", amount).
		Exec(ctx)
	if err != nil {
		return fmt.Errorf("reserve quota: %w", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("reserve quota: %w", err)
	} else if n == 0 {
		return ErrQuotaExceeded
	}
	return nil
}
