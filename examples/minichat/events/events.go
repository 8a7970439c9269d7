// Package events is the contract between Mini Chat's producer (the chat
// module) and its consumers: the usage_snapshot event.
package events

import (
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// Namespace and topic of the usage event.
const (
	Namespace          = "mini-chat"
	TopicUsageSnapshot = "usage_snapshot"
)

// Requester types: who caused the usage.
const (
	RequesterUser   = "user"   // a user's request
	RequesterSystem = "system" // the system, e.g. the watchdog finalising an abandoned turn
)

// UsageTopic is the (namespace, topic) pair the usage collector publishes.
var UsageTopic = outbox.Topic{Namespace: Namespace, Topic: TopicUsageSnapshot}

// Usage is the token usage of one turn (the payload's "usage" object).
type Usage struct {
	InputTokens      int64 `json:"input_tokens"`
	OutputTokens     int64 `json:"output_tokens"`
	CacheReadTokens  int64 `json:"cache_read_tokens"`
	CacheWriteTokens int64 `json:"cache_write_tokens"`
	ReasoningTokens  int64 `json:"reasoning_tokens"`
}

// ToolCalls counts the tool calls a turn made, by tool.
type ToolCalls struct {
	Total     int `json:"total"`
	WebSearch int `json:"web_search"`
	CodeExec  int `json:"code_exec"`
}

// UsageSnapshot is the payload of a usage_snapshot event: what a billing
// consumer needs to charge for one finalised turn.
type UsageSnapshot struct {
	TenantID  uuid.UUID `json:"tenant_id"`
	UserID    uuid.UUID `json:"user_id"`
	ChatID    uuid.UUID `json:"chat_id"`
	TurnID    uuid.UUID `json:"turn_id"`
	RequestID string    `json:"request_id"` // the client's idempotency key of the turn
	// SelectedModel is the model the user asked for; EffectiveModel the one
	// that answered (a fallback may differ), on which credits are computed.
	SelectedModel  string `json:"selected_model"`
	EffectiveModel string `json:"effective_model"`
	// TerminalState is completed, failed, cancelled or orphaned.
	TerminalState string `json:"terminal_state"`
	// Incomplete marks a completed turn whose response was cut short.
	Incomplete bool `json:"incomplete"`
	// BillingOutcome is charged, charged_partial (cancelled) or not_charged
	// (failed, orphaned).
	BillingOutcome string `json:"billing_outcome"`
	Usage          Usage  `json:"usage"`
	// CreditsMicro is the charge in micro-credits.
	CreditsMicro int64 `json:"credits_micro"`
	// SettlementMethod says how the quota reservation was settled: actual
	// (charged per usage) or released (given back).
	SettlementMethod string    `json:"settlement_method"`
	PolicyVersion    string    `json:"policy_version"` // the billing policy applied
	ToolCalls        ToolCalls `json:"tool_calls"`
	// Timestamp is when the turn was finalised (RFC 3339 in JSON).
	Timestamp time.Time `json:"timestamp"`
	// RequesterType is RequesterUser, or RequesterSystem when the watchdog
	// finalised the turn.
	RequesterType string `json:"requester_type"`
}

// ErrMalformed marks a usage event that can never be processed.
var ErrMalformed = errors.New("malformed usage_snapshot")

// Validate reports what a consumer cannot work with: missing ids, states
// or timestamp, negative counts.
func (u *UsageSnapshot) Validate() error {
	switch {
	case u.TenantID == uuid.Nil, u.UserID == uuid.Nil, u.ChatID == uuid.Nil, u.TurnID == uuid.Nil:
		return fmt.Errorf("%w: tenant_id, user_id, chat_id and turn_id are required", ErrMalformed)
	case u.RequestID == "":
		return fmt.Errorf("%w: request_id is required", ErrMalformed)
	case u.SelectedModel == "" || u.EffectiveModel == "":
		return fmt.Errorf("%w: selected_model and effective_model are required", ErrMalformed)
	case u.TerminalState == "" || u.BillingOutcome == "" || u.SettlementMethod == "":
		return fmt.Errorf("%w: terminal_state, billing_outcome and settlement_method are required", ErrMalformed)
	case u.Timestamp.IsZero():
		return fmt.Errorf("%w: timestamp is required", ErrMalformed)
	case u.CreditsMicro < 0 || min(u.Usage.InputTokens, u.Usage.OutputTokens, u.Usage.CacheReadTokens,
		u.Usage.CacheWriteTokens, u.Usage.ReasoningTokens) < 0:
		return fmt.Errorf("%w: negative credits or token count", ErrMalformed)
	}
	return nil
}

// DedupeKey is the event's dedupe key, {tenant_id}/{turn_id}/{request_id}
// (the tenant in its hyphenated form). The outbox checks that it starts
// with the event's tenant id; consumers are idempotent on the same tuple.
func DedupeKey(tenant, turn uuid.UUID, requestID string) string {
	return tenant.String() + "/" + turn.String() + "/" + requestID
}
