package app_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/examples/minichat/app"
	"github.com/modkit-go/modkit/examples/minichat/chat"
	"github.com/modkit-go/modkit/examples/minichat/events"
	minichatmigrations "github.com/modkit-go/modkit/examples/minichat/migrations"
	"github.com/modkit-go/modkit/examples/minichat/usage"
	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.DiscardHandler)

// The demo scenario, smaller, run twice on one database (as with a shared
// DATABASE_URL): each run bills every finalised turn exactly once, retries
// the injected failures, dead-letters only the probes, and reconciles its
// own rows whatever the earlier run left.
func TestScenarioReconciles(t *testing.T) {
	tdb := pgtest.NewDB(t)
	for run := range 2 {
		sum, err := app.Run(t.Context(), app.Options{
			DSN: tdb.DSN, Turns: 100, Users: 4, RaceEvery: 10, TransientFailureRate: 0.3, MalformedEvents: 2,
			Seed: uint64(run + 1), DrainTimeout: 30 * time.Second, Logger: quiet,
		})
		if err != nil {
			t.Fatalf("run %d: %v", run, err)
		}
		if !sum.Reconciled {
			t.Fatalf("run %d not reconciled: %q", run, sum.Mismatches)
		}
		o := sum.Outbox
		if sum.TurnsFinalised != 100 || o.UsageEvents != 100 || o.Delivered != 100 || o.ProbesDead != 2 || o.Dead != 0 {
			t.Fatalf("run %d: finalised %d, events %d, delivered %d, probes dead %d, usage dead %d; want 100, 100, 100, 2, 0",
				run, sum.TurnsFinalised, o.UsageEvents, o.Delivered, o.ProbesDead, o.Dead)
		}
		if sum.WatchdogRaces < 4 || sum.Chat.LostRaces < sum.WatchdogRaces {
			t.Fatalf("run %d: %d races, %d lost: every race must have a loser", run, sum.WatchdogRaces, sum.Chat.LostRaces)
		}
		if sum.Chat.DuplicateEnqueues != sum.WatchdogRaces {
			t.Fatalf("run %d: %d duplicate enqueues suppressed, want one per race (%d)", run, sum.Chat.DuplicateEnqueues, sum.WatchdogRaces)
		}
		if sum.Turns[chat.StateOrphaned] == 0 {
			t.Fatalf("run %d: the watchdog finalised no abandoned turn: %v", run, sum.Turns)
		}
		if o.Retried == 0 || sum.Collector.TransientFailures == 0 || sum.Collector.Rejected < 2 {
			t.Fatalf("run %d: no retries or rejections with a 30%% failure rate: %+v, outbox %+v", run, sum.Collector, o)
		}
		if sum.UsageTotals.CreditsMicro == 0 || sum.UsageTotals != sum.ChatTotals {
			t.Fatalf("run %d: usage totals: chat %v, collector %v", run, sum.ChatTotals, sum.UsageTotals)
		}
	}
}

// bundle is what the unit-level tests work with.
type bundle struct {
	prov   *db.Provider
	outbox *outbox.Client
	svc    *chat.Service
	chatID uuid.UUID
}

// setup migrates Mini Chat's tables into a fresh database and opens a chat
// for a user with a generous quota.
func setup(t *testing.T) bundle {
	t.Helper()
	tdb := pgtest.NewDB(t)
	ctx := t.Context()
	if err := app.Migrate(ctx, tdb.DSN, quiet); err != nil {
		t.Fatal(err)
	}
	client, err := outbox.New(outboxpg.New(tdb.Provider.Pool), outbox.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	svc := chat.NewService(tdb.Provider.Bun, client, chat.Config{}, quiet)
	tenant, user := uuid.New(), uuid.New()
	if err := svc.SetQuota(ctx, tenant, user, 1<<40); err != nil {
		t.Fatal(err)
	}
	chatID, err := svc.NewChat(ctx, tenant, user)
	if err != nil {
		t.Fatal(err)
	}
	return bundle{prov: tdb.Provider, outbox: client, svc: svc, chatID: chatID}
}

func (b bundle) startTurn(t *testing.T, model string) *chat.Turn {
	t.Helper()
	turn, err := b.svc.StartTurn(t.Context(), b.chatID, "req-"+uuid.NewString(), model, 10_000)
	if err != nil {
		t.Fatal(err)
	}
	return turn
}

func (b bundle) queryInt(t *testing.T, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := b.prov.Pool.QueryRow(t.Context(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// The watchdog and the normal path finalise the same turn at the same
// moment, 50 times: exactly one wins each race, each turn has exactly one
// event (describing the winner's outcome), and each reservation is settled
// once.
func TestWatchdogRaceYieldsOneEventPerTurn(t *testing.T) {
	b := setup(t)
	const turns = 50
	winners := map[string]int{}
	for i := range turns {
		turn := b.startTurn(t, "mini-fast")
		outcomes := map[string]chat.Outcome{
			chat.ByRunner:   {State: chat.StateCompleted, Usage: events.Usage{InputTokens: int64(100 + i), OutputTokens: 40}},
			chat.ByWatchdog: {State: chat.StateOrphaned},
		}
		results := map[string]chat.Finalised{}
		var mu sync.Mutex
		var wg sync.WaitGroup
		gate := make(chan struct{})
		for by, o := range outcomes {
			wg.Go(func() {
				<-gate
				res, err := b.svc.Finalise(t.Context(), turn.ID, o, by)
				if err != nil {
					t.Error(err)
				}
				mu.Lock()
				results[by] = res
				mu.Unlock()
			})
		}
		close(gate)
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		if results[chat.ByRunner].Won == results[chat.ByWatchdog].Won {
			t.Fatalf("turn %d: runner won %v, watchdog won %v; exactly one must win",
				i, results[chat.ByRunner].Won, results[chat.ByWatchdog].Won)
		}
		for by, res := range results {
			if res.Won {
				winners[by]++
			}
		}
	}
	t.Logf("winners: %v", winners)

	if n := b.queryInt(t, `SELECT count(*) FROM modkit_outbox_events`); n != turns {
		t.Fatalf("%d events for %d turns", n, turns)
	}
	// Each turn has one event under its dedupe key, and it describes the
	// outcome that won.
	if n := b.queryInt(t, `SELECT count(*) FROM minichat_turns t JOIN modkit_outbox_events e
		ON e.dedupe_key = t.tenant_id::text || '/' || t.id::text || '/' || t.request_id
		WHERE e.tenant_id = t.tenant_id AND e.payload->>'terminal_state' = t.state
		AND (e.payload->>'credits_micro')::bigint = t.credits_micro`); n != turns {
		t.Fatalf("%d of %d turns have an event matching their final state", n, turns)
	}
	reserved := b.queryInt(t, `SELECT sum(credits_reserved_micro) FROM minichat_quotas`)
	used := b.queryInt(t, `SELECT sum(credits_used_micro) FROM minichat_quotas`)
	charged := b.queryInt(t, `SELECT sum(credits_micro) FROM minichat_turns`)
	if reserved != 0 || used != charged {
		t.Fatalf("quota reserved %d, used %d, turns charged %d: a reservation was settled twice or not at all", reserved, used, charged)
	}
	if st := b.svc.Stats(); st.LostRaces != turns || st.DuplicateEnqueues != 0 {
		t.Fatalf("stats %+v; want %d lost races and no duplicate enqueue", st, turns)
	}
}

// The event carries everything a billing consumer needs, under the
// canonical dedupe key and the turn's tenant.
func TestUsageEventPayload(t *testing.T) {
	b := setup(t)
	turn := b.startTurn(t, "mini-large")
	o := chat.Outcome{State: chat.StateCompleted, Incomplete: true, EffectiveModel: "mini-fast",
		Usage:     events.Usage{InputTokens: 10, OutputTokens: 20, CacheReadTokens: 30, CacheWriteTokens: 40, ReasoningTokens: 50},
		ToolCalls: events.ToolCalls{Total: 3, WebSearch: 2, CodeExec: 1}}
	res, err := b.svc.Finalise(t.Context(), turn.ID, o, chat.ByRunner)
	if err != nil || !res.Won {
		t.Fatalf("finalise: %+v, %v", res, err)
	}
	var key string
	var tenant uuid.UUID
	var payload []byte
	if err := b.prov.Pool.QueryRow(t.Context(), `SELECT dedupe_key, tenant_id, payload FROM modkit_outbox_events WHERE id = $1`,
		res.Event.ID).Scan(&key, &tenant, &payload); err != nil {
		t.Fatal(err)
	}
	if want := turn.TenantID.String() + "/" + turn.ID.String() + "/" + turn.RequestID; key != want || tenant != turn.TenantID {
		t.Fatalf("dedupe key %q, tenant %s; want %q, %s", key, tenant, want, turn.TenantID)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(payload, &fields); err != nil {
		t.Fatal(err)
	}
	want := []string{"billing_outcome", "chat_id", "credits_micro", "effective_model", "incomplete", "policy_version",
		"request_id", "requester_type", "selected_model", "settlement_method", "tenant_id", "terminal_state", "timestamp",
		"tool_calls", "turn_id", "usage", "user_id"}
	if got := slices.Sorted(maps.Keys(fields)); !slices.Equal(got, want) {
		t.Fatalf("payload fields %v; want %v", got, want)
	}
	var snap events.UsageSnapshot
	if err := json.Unmarshal(payload, &snap); err != nil {
		t.Fatal(err)
	}
	if err := snap.Validate(); err != nil {
		t.Fatal(err)
	}
	wantCredits := chat.Credits("mini-fast", o.Usage) // billed on the model that answered
	if snap.Usage != o.Usage || snap.CreditsMicro != wantCredits || snap.EffectiveModel != "mini-fast" ||
		snap.SelectedModel != "mini-large" || snap.ToolCalls != o.ToolCalls || snap.BillingOutcome != "charged" ||
		snap.RequesterType != events.RequesterUser || snap.Timestamp.IsZero() {
		t.Fatalf("payload %+v", snap)
	}
	var ts string
	if err := json.Unmarshal(fields["timestamp"], &ts); err != nil {
		t.Fatal(err)
	}
	if _, err := time.Parse(time.RFC3339, ts); err != nil {
		t.Fatalf("timestamp %q is not RFC 3339: %v", ts, err)
	}

	// Sending it again is suppressed by the dedupe key, and the event is
	// rebuilt identically from the turn row.
	again, err := b.svc.ResendUsage(t.Context(), turn.ID)
	if err != nil || !again.AlreadyEnqueued || again.ID != res.Event.ID {
		t.Fatalf("resend: %+v, %v; want the original event %s, already enqueued", again, err, res.Event.ID)
	}
	if n := b.queryInt(t, `SELECT count(*) FROM modkit_outbox_events`); n != 1 {
		t.Fatalf("%d events after a resend, want 1", n)
	}

	// Once the event is purged, a resend writes it again, identical: the
	// event is rebuilt from the turn row alone.
	if _, err := b.prov.Pool.Exec(t.Context(), `DELETE FROM modkit_outbox_events`); err != nil {
		t.Fatal(err)
	}
	fresh, err := b.svc.ResendUsage(t.Context(), turn.ID)
	if err != nil || fresh.AlreadyEnqueued {
		t.Fatalf("resend after purge: %+v, %v; want a new event", fresh, err)
	}
	if n := b.queryInt(t, `SELECT count(*) FROM modkit_outbox_events WHERE id = $1 AND payload = $2::jsonb`,
		fresh.ID, string(payload)); n != 1 {
		t.Fatal("the re-sent payload differs from the original")
	}
}

// Mini Chat's migrations go down and up again cleanly.
func TestMigrationsRoundTrip(t *testing.T) {
	tdb := pgtest.NewDB(t)
	ctx := t.Context()
	if err := app.Migrate(ctx, tdb.DSN, quiet); err != nil {
		t.Fatal(err)
	}
	m, err := db.NewMigrator(tdb.Provider.Pool, db.MigratorConfig{FS: minichatmigrations.FS, Table: minichatmigrations.Table, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	all := len(m.Migrations())
	if down, err := m.Down(ctx, all); err != nil || len(down) != all {
		t.Fatalf("down: %d of %d reverted, %v", len(down), all, err)
	}
	if up, err := m.Up(ctx); err != nil || len(up) != all {
		t.Fatalf("up: %d of %d applied, %v", len(up), all, err)
	}
}

// The collector counts each turn once however often its event arrives:
// the same delivery handled twice, then every event redelivered by a
// dispatcher after being forced back to pending.
func TestCollectorIsIdempotentUnderRedelivery(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	const turns = 20
	for i := range turns {
		turn := b.startTurn(t, "mini-large")
		o := chat.Outcome{State: chat.StateCompleted, Usage: events.Usage{InputTokens: int64(10 * i), OutputTokens: 7, ReasoningTokens: 3}}
		if _, err := b.svc.Finalise(ctx, turn.ID, o, chat.ByRunner); err != nil {
			t.Fatal(err)
		}
	}
	collector := usage.NewCollector(usage.Config{}, quiet)
	totals := func() [3]int64 {
		return [3]int64{
			b.queryInt(t, `SELECT count(*) FROM minichat_usage_records`),
			b.queryInt(t, `SELECT coalesce(sum(credits_micro), 0) FROM minichat_usage_records`),
			b.queryInt(t, `SELECT coalesce(sum(input_tokens + output_tokens + reasoning_tokens), 0) FROM minichat_usage_records`),
		}
	}
	want := [3]int64{
		turns,
		b.queryInt(t, `SELECT sum(credits_micro) FROM minichat_turns`),
		b.queryInt(t, `SELECT sum(input_tokens + output_tokens + reasoning_tokens) FROM minichat_turns`),
	}

	// 1. The same deliveries, handled twice each, as a dispatcher would
	// hand them over.
	page, err := b.outbox.Admin().List(ctx, outbox.EventFilter{Namespace: events.Namespace, Topic: events.TopicUsageSnapshot})
	if err != nil || len(page.Events) != turns {
		t.Fatalf("listed %d events, %v; want %d", len(page.Events), err, turns)
	}
	for range 2 {
		for _, e := range page.Events {
			d := outbox.Delivery{ID: e.ID, Namespace: e.Namespace, Topic: e.Topic, TenantID: e.TenantID, DedupeKey: e.DedupeKey,
				Payload: e.Payload, Attempt: 1, CreatedAt: e.CreatedAt}
			if err := db.InTx(ctx, b.prov.Pool, func(ctx context.Context, tx pgx.Tx) error { return collector.Handle(ctx, tx, d) }); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := totals(); got != want {
		t.Fatalf("after handling every event twice: records/credits/tokens %v, want %v", got, want)
	}

	// 2. Everything forced back to pending, as after lost acks, and
	// redelivered by a dispatcher.
	if _, err := b.prov.Pool.Exec(ctx, `UPDATE modkit_outbox_events
		SET status = 'pending', attempts = 0, next_attempt_at = now(), locked_by = NULL, locked_until = NULL, lease_token = NULL`); err != nil {
		t.Fatal(err)
	}
	deliver(t, b.outbox, collector, turns)
	if got := totals(); got != want {
		t.Fatalf("after redelivery: records/credits/tokens %v, want %v", got, want)
	}
	if st := collector.Stats(); st.Recorded != turns || st.Redeliveries != 2*turns {
		t.Fatalf("collector stats %+v; want %d recorded and %d redeliveries ignored", st, turns, 2*turns)
	}
	if n := b.queryInt(t, `SELECT count(*) FROM modkit_outbox_events WHERE status = 'delivered'`); n != turns {
		t.Fatalf("%d of %d events delivered", n, turns)
	}
}

// deliver runs a dispatcher with the collector until n events were
// delivered.
func deliver(t *testing.T, client *outbox.Client, collector *usage.Collector, n int) {
	t.Helper()
	delivered := make(chan struct{}, n)
	d, err := client.NewDispatcher(outbox.DispatcherConfig{
		Logger: quiet, PollInterval: 50 * time.Millisecond,
		OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
			if o.Status == outbox.StatusDelivered && !o.LeaseLost {
				select {
				case delivered <- struct{}{}:
				default:
				}
			}
		},
	}, collector.Publisher())
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := d.Stop(context.WithoutCancel(t.Context())); err != nil {
			t.Error(err)
		}
	}()
	guard := time.NewTimer(30 * time.Second)
	defer guard.Stop()
	for i := range n {
		select {
		case <-delivered:
		case <-guard.C:
			t.Fatalf("only %d of %d events delivered", i, n)
		}
	}
}

// What a usage event may not carry is refused before anything commits: a
// request id too long for the event's dedupe key (or empty), a negative
// token count, an unknown effective model. Such turns were finalised and
// settled, and their events dead-lettered, so they were never billed; a
// turn whose key could not be enqueued could never be finalised, and held
// back the watchdog's passes (oldest first, stopping at the first error).
// The watchdog now goes on past a turn it cannot finalise.
func TestBadTurnInputIsRefusedBeforeItCommits(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	for _, id := range []string{"", strings.Repeat("r", chat.RequestIDMaxLen+1)} {
		if _, err := b.svc.StartTurn(ctx, b.chatID, id, "mini-fast", 10_000); !errors.Is(err, chat.ErrBadRequest) {
			t.Fatalf("request id of %d bytes: %v, want ErrBadRequest", len(id), err)
		}
	}
	if _, err := b.svc.StartTurn(ctx, b.chatID, strings.Repeat("r", chat.RequestIDMaxLen), "mini-fast", 10_000); err != nil {
		t.Fatalf("the longest request id: %v", err)
	}
	turn := b.startTurn(t, "mini-fast")
	for name, o := range map[string]chat.Outcome{
		"negative tokens": {State: chat.StateCompleted, Usage: events.Usage{InputTokens: -1}},
		"unknown model":   {State: chat.StateCompleted, EffectiveModel: "mini-fst"},
	} {
		if _, err := b.svc.Finalise(ctx, turn.ID, o, chat.ByRunner); !errors.Is(err, chat.ErrBadOutcome) && !errors.Is(err, chat.ErrUnknownModel) {
			t.Fatalf("%s: %v, want ErrBadOutcome or ErrUnknownModel", name, err)
		}
	}
	if n := b.queryInt(t, `SELECT count(*) FROM minichat_turns WHERE state <> 'running'`); n != 0 {
		t.Fatalf("%d turns finalised by refused outcomes", n)
	}

	// A turn the watchdog cannot finalise (its request id, written behind
	// the service's back, is too long for the dedupe key) does not stop it
	// finalising the others.
	if _, err := b.prov.Pool.Exec(ctx, `UPDATE minichat_turns SET request_id = repeat('x', 600), started_at = now() - interval '1 hour'
		WHERE id = $1`, turn.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := b.prov.Pool.Exec(ctx, `UPDATE minichat_turns SET started_at = now() - interval '1 minute' WHERE id <> $1`, turn.ID); err != nil {
		t.Fatal(err)
	}
	n, err := b.svc.FinaliseOrphans(ctx, time.Second, 10)
	if err == nil || n != 1 {
		t.Fatalf("watchdog pass: %d finalised, %v; want the other turn finalised and the bad one's error", n, err)
	}
}
