package app_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/examples/payments/app"
	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// TestMain doubles as the dispatcher process: Run starts this test binary
// again with the dispatcher's environment, and it dispatches instead of
// testing.
func TestMain(m *testing.M) {
	if os.Getenv(app.EnvDispatcherDSN) != "" {
		if err := app.RunDispatcherProcess(context.Background(), os.Stdin, os.Stdout, quiet); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	pgtest.Main(m)
}

var quiet = slog.New(slog.DiscardHandler)

// The demo's scenario, smaller: two dispatcher processes, one SIGKILLed
// with payments in flight; every valid instruction paid exactly once, in
// each participant's order, the invalid ones dead and unpaid with their
// history, and the ledger's totals equal to the rail's.
func TestScenarioReconcilesWithAKilledDispatcher(t *testing.T) {
	tdb := pgtest.NewDB(t)
	const n, invalid = 150, 3
	sum, err := app.Run(t.Context(), app.Options{
		DSN: tdb.DSN, Instructions: n, Participants: 6, Invalid: invalid, Dispatchers: 2,
		Faults: app.Faults{Latency: 10 * time.Millisecond, Unavailable: 0.1, LostResponse: 0.1},
		Seed:   7, Spawn: func() *exec.Cmd { return exec.Command(os.Args[0]) },
		DrainTimeout: time.Minute, Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := sum.Print(&out); err != nil {
		t.Fatal(err)
	}
	if !sum.Reconciled {
		t.Fatalf("not reconciled:\n%s", out.String())
	}
	if sum.Accepted != n || sum.Delivered != n-invalid || len(sum.Dead) != invalid || sum.RailPayments != n-invalid {
		t.Fatalf("accepted %d, delivered %d, dead %d, rail payments %d; want %d, %d, %d, %d",
			sum.Accepted, sum.Delivered, len(sum.Dead), sum.RailPayments, n, n-invalid, invalid, n-invalid)
	}
	// A victim killed with a payment in flight held a lease, which another
	// dispatcher must take over. (On a loaded machine the kill may come at
	// two thirds paid with nothing in flight, and leave no lease behind.)
	if sum.Kill.PID == "" || sum.Kill.InFlight > 0 && sum.LeaseExpired == 0 {
		t.Fatalf("kill %+v, lease_expired entries %d: the kill must be taken over", sum.Kill, sum.LeaseExpired)
	}
	// Every payment whose answer was lost was retried and answered with
	// its first result, not paid again.
	if sum.Rail.LostResponses == 0 || sum.Rail.Replayed < sum.Rail.LostResponses || sum.Rail.Paid != n-invalid {
		t.Fatalf("rail %+v: lost answers must come back as replays, with one payment per instruction", sum.Rail)
	}
	if sum.OrderChecked != 6 || len(sum.Rail.OrderViolations) != 0 {
		t.Fatalf("order checked for %d of 6 participants; violations %v", sum.OrderChecked, sum.Rail.OrderViolations)
	}
	for _, d := range sum.Dead {
		if !errors.Is(app.ValidatePayment(app.Payment{AmountMinor: d.AmountMinor, Currency: d.Currency, Destination: d.Destination}), app.ErrInvalidPayment) {
			t.Errorf("dead instruction %s is valid", d.ID)
		}
		// Besides its publish: released rows when it was leased with an
		// earlier instruction of its participant that failed (given back
		// unpublished), and a lease_expired row when the killed dispatcher
		// held it. Its one recorded publish failed permanently.
		var hist []outbox.Attempt
		for _, h := range d.History {
			if h.Outcome != "released" && h.Outcome != "lease_expired" {
				hist = append(hist, h)
			}
		}
		if len(hist) != 2 || hist[0].Outcome != "dead" || !strings.Contains(hist[0].Detail, "failed permanently") || hist[1].Outcome != "skipped" {
			t.Errorf("dead instruction %s: history %+v, want dead (failed permanently), then skipped", d.ID, d.History)
		}
	}
	if !strings.Contains(out.String(), "Reconciliation OK") {
		t.Fatalf("printed:\n%s", out.String())
	}
}

// earlierRun stands for a run that was interrupted: the example's tables
// (its roles dropped again), a participant of another run id, and the API
// and client to accept its instructions with, as the owner.
func earlierRun(t *testing.T, tdb *pgtest.DB, participant string) (api *app.API, runID uuid.UUID) {
	t.Helper()
	ctx, admin := t.Context(), tdb.Provider.Pool
	roles, err := app.Setup(ctx, admin, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if err := roles.Drop(ctx, admin); err != nil {
		t.Fatal(err)
	}
	client, err := outbox.New(outboxpg.New(admin), outbox.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	runID = uuid.New()
	if _, err := admin.Exec(ctx, "INSERT INTO payments_participants (id, run_id, name) VALUES ($1, $2, 'earlier')",
		participant, runID); err != nil {
		t.Fatal(err)
	}
	return app.NewAPI(admin, client), runID
}

// A run interrupted after accepting its instructions (Ctrl-C, a crash)
// leaves their events undelivered in a database that outlives it
// (DATABASE_URL). The next run's dispatchers deliver them, its operator
// skips their dead heads, and its reconciliation checks each payment
// against the earlier run's ledger row instead of failing on a payment
// that is "no instruction of this run".
func TestRunDeliversWhatAnInterruptedRunLeft(t *testing.T) {
	tdb := pgtest.NewDB(t)
	ctx, participant := t.Context(), "E01-interrupted"
	api, earlier := earlierRun(t, tdb, participant)
	const left = 5 // the second invalid: it dies and holds the three after it until the operator skips it
	for i := range left {
		in := app.Instruction{ID: uuid.New(), Participant: participant, AmountMinor: int64(100 + i), Currency: "EUR",
			Destination: "DE001234567890123456"}
		if i == 1 {
			in.AmountMinor = app.MaxAmountMinor + 1
		}
		if _, err := api.Accept(ctx, earlier, in); err != nil {
			t.Fatal(err)
		}
	}

	const n, invalid = 30, 1
	sum, err := app.Run(ctx, app.Options{
		DSN: tdb.DSN, Instructions: n, Participants: 3, Invalid: invalid, Dispatchers: 2,
		Seed: 7, Spawn: func() *exec.Cmd { return exec.Command(os.Args[0]) },
		DrainTimeout: time.Minute, Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := sum.Print(&out); err != nil {
		t.Fatal(err)
	}
	if !sum.Reconciled || sum.EarlierPaid != left-1 || sum.EarlierSkipped != 1 ||
		sum.RailPayments != n-invalid || sum.Skipped != invalid || sum.Rail.Paid != n-invalid+left-1 {
		t.Fatalf("reconciled %v, earlier paid %d and skipped %d, rail payments of this run %d, skipped %d, rail paid %d; "+
			"want true, %d, 1, %d, %d, %d:\n%s", sum.Reconciled, sum.EarlierPaid, sum.EarlierSkipped, sum.RailPayments,
			sum.Skipped, sum.Rail.Paid, left-1, n-invalid, invalid, n-invalid+left-1, out.String())
	}
	if !strings.Contains(out.String(), "earlier runs") {
		t.Fatalf("the report does not mention the earlier run's instructions:\n%s", out.String())
	}
}

// A valid instruction an earlier run left dead (its attempts used up, say)
// would never be paid; the next run's operator skips it as any dead head,
// and the reconciliation says so instead of passing.
func TestRunRefusesAValidInstructionAnEarlierRunLeftDead(t *testing.T) {
	tdb := pgtest.NewDB(t)
	ctx, admin, participant := t.Context(), tdb.Provider.Pool, "E01-valid-dead"
	api, earlier := earlierRun(t, tdb, participant)
	a, err := api.Accept(ctx, earlier, app.Instruction{ID: uuid.New(), Participant: participant,
		AmountMinor: 100, Currency: "EUR", Destination: "DE001234567890123456"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `UPDATE modkit_outbox_events SET status = 'dead', attempts = 30 WHERE id = $1`, a.EventID); err != nil {
		t.Fatal(err)
	}
	sum, err := app.Run(ctx, app.Options{
		DSN: tdb.DSN, Instructions: 20, Participants: 2, Invalid: 1, Dispatchers: 2,
		Seed: 7, Spawn: func() *exec.Cmd { return exec.Command(os.Args[0]) },
		DrainTimeout: time.Minute, Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("instruction %s of an earlier run is valid but was dead, and skipped", a.ID)
	if sum.Reconciled || sum.EarlierSkipped != 1 || !slices.Contains(sum.Mismatches, want) {
		t.Fatalf("reconciled %v, earlier heads skipped %d, mismatches %q; want not reconciled, 1, and %q",
			sum.Reconciled, sum.EarlierSkipped, sum.Mismatches, want)
	}
}

// An instruction accepted twice (a client retrying after a lost answer) is
// refused with ErrAlreadyAccepted, and the second call writes nothing: no
// ledger row, no sequence number taken.
func TestAcceptTwiceIsRefused(t *testing.T) {
	tdb := pgtest.NewDB(t)
	ctx, admin, participant := t.Context(), tdb.Provider.Pool, "E02-twice"
	api, earlier := earlierRun(t, tdb, participant)
	in := app.Instruction{ID: uuid.New(), Participant: participant, AmountMinor: 100, Currency: "EUR", Destination: "DE001234567890123456"}
	first, err := api.Accept(ctx, earlier, in)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := api.Accept(ctx, earlier, in); !errors.Is(err, app.ErrAlreadyAccepted) || !strings.Contains(err.Error(), first.EventID.String()) {
		t.Fatalf("the same instruction again: %v, want ErrAlreadyAccepted naming event %s", err, first.EventID)
	}
	var rows, nextSeq int64
	if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments_instructions WHERE id = $1),
		(SELECT next_seq FROM payments_participants WHERE id = $2)`, in.ID, participant).Scan(&rows, &nextSeq); err != nil {
		t.Fatal(err)
	}
	if rows != 1 || nextSeq != first.Seq+1 {
		t.Fatalf("after the refused repeat: %d ledger rows, next sequence %d; want 1 and %d", rows, nextSeq, first.Seq+1)
	}
}

// Each job's login role may do its job only: the API may not read events,
// the dispatcher and the operator may not read the ledger, the report may
// not write it.
func TestRolesAreLeastPrivilege(t *testing.T) {
	tdb := pgtest.NewDB(t)
	admin := tdb.Provider.Pool
	roles, err := app.Setup(t.Context(), admin, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	connect := func(role string) *pgxpool.Pool {
		t.Helper()
		dsn, err := roles.DSN(role)
		if err != nil {
			t.Fatal(err)
		}
		pool, err := pgxpool.New(t.Context(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		return pool
	}
	api, dispatcher, operator, report := connect(roles.API), connect(roles.Dispatcher), connect(roles.Operator), connect(roles.Report)
	t.Cleanup(func() {
		api.Close()
		dispatcher.Close()
		operator.Close()
		report.Close()
		if err := roles.Drop(context.Background(), admin); err != nil {
			t.Error(err)
		}
	})
	for _, c := range []struct {
		what string
		pool *pgxpool.Pool
		sql  string
	}{
		{"api reads events", api, "SELECT payload FROM modkit_outbox_events"},
		{"api reads the ledger", api, "SELECT amount_minor FROM payments_instructions"},
		{"dispatcher reads the ledger", dispatcher, "SELECT amount_minor FROM payments_instructions"},
		{"dispatcher reads events", dispatcher, "SELECT payload FROM modkit_outbox_events"},
		{"operator reads the ledger", operator, "SELECT amount_minor FROM payments_instructions"},
		{"operator marks events", operator, "UPDATE modkit_outbox_events SET status = 'delivered'"},
		{"report writes the ledger", report, "UPDATE payments_instructions SET amount_minor = 0"},
		{"report marks events", report, "UPDATE modkit_outbox_events SET status = 'delivered'"},
	} {
		_, err := c.pool.Exec(t.Context(), c.sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("%s: %v, want permission denied (42501)", c.what, err)
		}
	}
	if _, err := report.Exec(t.Context(), "SELECT count(*) FROM payments_instructions"); err != nil {
		t.Errorf("report reads the ledger: %v", err)
	}
}

// The rail pays an idempotency key once and answers a repeat with the
// first result; it refuses what breaks its rules.
func TestRailPaysAKeyOnce(t *testing.T) {
	rail, err := app.StartRail(app.Faults{}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rail.Close(); err != nil {
			t.Error(err)
		}
	})
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	p := app.Payment{InstructionID: uuid.NewString(), Participant: "P1", Seq: 1, AmountMinor: 1234, Currency: "EUR",
		Destination: "DE12345678901234567890"}
	post := func(p app.Payment) (int, app.Payment) {
		t.Helper()
		body, _ := json.Marshal(p)
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, rail.URL()+"/payments", bytes.NewReader(body))
		req.Header.Set(app.HeaderIdempotencyKey, p.InstructionID)
		req.Header.Set(app.HeaderSequence, fmt.Sprint(p.Seq))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var got app.Payment
		if resp.StatusCode == http.StatusOK {
			if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
				t.Fatal(err)
			}
		}
		return resp.StatusCode, got
	}
	code1, first := post(p)
	code2, again := post(p)
	if code1 != 200 || code2 != 200 || first.Reference == "" || again != first {
		t.Fatalf("first %d %+v, again %d %+v: want the same answer twice", code1, first, code2, again)
	}
	bad := p
	bad.InstructionID, bad.Seq, bad.Currency = uuid.NewString(), 2, "XAU"
	if code, _ := post(bad); code != http.StatusUnprocessableEntity {
		t.Fatalf("invalid currency: %d, want 422", code)
	}
	st := rail.Stats()
	if len(rail.Payments()) != 1 || st.Paid != 1 || st.Replayed != 1 || st.Rejected != 1 {
		t.Fatalf("payments %d, stats %+v; want one payment, one replay, one rejection", len(rail.Payments()), st)
	}
}

// The publisher checks a payment before sending it: an invalid one is a
// permanent failure, and the rail never sees it.
func TestPublisherRefusesAnInvalidPaymentBeforeSending(t *testing.T) {
	rail, err := app.StartRail(app.Faults{}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rail.Close() })
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	pub := app.RailPublisher(rail.URL(), client)
	if pub.Concurrency != app.RailConcurrency {
		t.Fatalf("concurrency %d, want the rail cap %d", pub.Concurrency, app.RailConcurrency)
	}
	for _, p := range []app.Payment{
		{AmountMinor: 0, Currency: "EUR", Destination: "DE12345678901234567890"},
		{AmountMinor: app.MaxAmountMinor + 1, Currency: "EUR", Destination: "DE12345678901234567890"},
		{AmountMinor: 100, Currency: "BTC", Destination: "DE12345678901234567890"},
		{AmountMinor: 100, Currency: "EUR", Destination: "x"},
	} {
		p.InstructionID, p.Participant, p.Seq = uuid.NewString(), "P1", 1
		payload, _ := json.Marshal(p)
		err := pub.Publish(t.Context(), outbox.Delivery{ID: uuid.New(), Payload: payload,
			Headers: map[string]string{app.HeaderIdempotencyKey: p.InstructionID}})
		if !outbox.IsPermanent(err) || !errors.Is(err, app.ErrInvalidPayment) {
			t.Fatalf("%+v: %v, want a permanent ErrInvalidPayment", p, err)
		}
	}
	if st := rail.Stats(); st.Requests != 0 {
		t.Fatalf("the rail got %d requests, want none", st.Requests)
	}
	// A valid one is sent and paid; a 503 would be retried, not permanent.
	p := app.Payment{InstructionID: uuid.NewString(), Participant: "P1", Seq: 1, AmountMinor: 100, Currency: "EUR",
		Destination: "DE12345678901234567890"}
	payload, _ := json.Marshal(p)
	if err := pub.Publish(t.Context(), outbox.Delivery{ID: uuid.New(), Payload: payload,
		Headers: map[string]string{app.HeaderIdempotencyKey: p.InstructionID}}); err != nil {
		t.Fatal(err)
	}
	if len(rail.Payments()) != 1 {
		t.Fatalf("payments %v, want one", rail.Payments())
	}
}

// lostAnswerRail starts a rail that drops every answer, and returns it, a
// publisher to it, a valid payment and its delivery.
func lostAnswerRail(t *testing.T) (*app.Rail, outbox.Publisher, app.Payment, outbox.Delivery) {
	t.Helper()
	rail, err := app.StartRail(app.Faults{LostResponse: 1}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rail.Close() })
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	pub := app.RailPublisher(rail.URL(), client)
	p := app.Payment{InstructionID: uuid.NewString(), Participant: "P1", Seq: 1, AmountMinor: 100, Currency: "EUR",
		Destination: "DE12345678901234567890"}
	payload, _ := json.Marshal(p)
	d := outbox.Delivery{ID: uuid.New(), Payload: payload, Headers: map[string]string{app.HeaderIdempotencyKey: p.InstructionID}}
	return rail, pub, p, d
}

// A payment whose answer is lost: the publish fails at its hard timeout
// (retryable, not permanent), and the retry is answered with the first
// result instead of paying again.
func TestLostAnswerIsRetriedWithoutASecondPayment(t *testing.T) {
	rail, pub, p, d := lostAnswerRail(t)
	// t.Context() has no deadline: DeadlineExceeded is the hard timeout's.
	err := pub.Publish(t.Context(), d)
	if err == nil || outbox.IsPermanent(err) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("first publish: %v, want a retryable timeout", err)
	}
	if err := pub.Publish(t.Context(), d); err != nil {
		t.Fatalf("retry: %v", err)
	}
	st := rail.Stats()
	if st.Paid != 1 || st.Replayed != 1 || st.LostResponses != 1 {
		t.Fatalf("rail %+v: want one payment, its answer lost once, then replayed", st)
	}
	// A payment of a participant that arrives after a later one is flagged.
	late := p
	late.InstructionID, late.Seq = uuid.NewString(), 0
	payload, _ := json.Marshal(late)
	_ = pub.Publish(t.Context(), outbox.Delivery{ID: uuid.New(), Payload: payload,
		Headers: map[string]string{app.HeaderIdempotencyKey: late.InstructionID}})
	if v := rail.Stats().OrderViolations; len(v) != 1 {
		t.Fatalf("order violations %q, want the late seq flagged", v)
	}
}

// A paid request whose answer the rail drops stops counting as in flight
// when it is paid. Its sender frees its slot when it gives up, which the
// rail sees only some time later: counting the held request until then
// made the concurrency check fail runs in which no dispatcher was over its
// cap.
func TestLostAnswerIsNotInFlight(t *testing.T) {
	rail, pub, _, d := lostAnswerRail(t)
	published := make(chan error, 1)
	go func() { published <- pub.Publish(t.Context(), d) }()
	inFlight := -1
	if err := rail.WaitFor(t.Context(), func(paid int, by map[string]int) bool {
		inFlight = 0
		for _, n := range by {
			inFlight += n
		}
		return paid == 1
	}); err != nil {
		t.Fatal(err)
	}
	if err := <-published; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("publish: %v, want the hard timeout", err)
	}
	if inFlight != 0 {
		t.Fatalf("%d requests in flight once the payment whose answer is lost was made, want 0", inFlight)
	}
}

// The rail's MaxInFlight is per dispatcher, the unit of the cap: two
// requests of one dispatcher and one of another at once are 2, not 3. A
// total let a dispatcher over its cap pass while another was idle or dead.
func TestRailCountsInFlightPerDispatcher(t *testing.T) {
	rail, err := app.StartRail(app.Faults{Latency: time.Hour}, 1) // held until their senders give up
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rail.Close() })
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	ctx, cancel := context.WithCancel(t.Context())
	sent := make(chan error, 3)
	for i, dispatcher := range []string{"A", "A", "B"} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rail.URL()+"/payments", strings.NewReader("{}"))
		req.Header.Set(app.HeaderDispatcher, dispatcher)
		req.Header.Set(app.HeaderSequence, fmt.Sprint(i+1))
		go func() {
			resp, err := client.Do(req)
			if err == nil {
				resp.Body.Close()
			}
			sent <- err
		}()
	}
	if err := rail.WaitFor(t.Context(), func(_ int, by map[string]int) bool { return by["A"] == 2 && by["B"] == 1 }); err != nil {
		t.Fatal(err)
	}
	cancel()
	for range 3 {
		<-sent
	}
	if got := rail.Stats().MaxInFlight; got != 2 {
		t.Fatalf("MaxInFlight %d, want 2 (of dispatcher A)", got)
	}
}

// A rail that pays nothing (every request answered 503) never brings the
// kill about: the run still ends when every instruction has settled, dead,
// and its reconciliation fails, saying that no dispatcher was killed,
// instead of waiting for the kill for ever.
func TestRunEndsWhenTheRailPaysNothing(t *testing.T) {
	tdb := pgtest.NewDB(t)
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second) // a guard against the hang, far above the run
	defer cancel()
	sum, err := app.Run(ctx, app.Options{
		DSN: tdb.DSN, Instructions: 3, Participants: 3, Invalid: -1, Dispatchers: 2,
		Faults: app.Faults{Unavailable: 1}, Seed: 7, Spawn: func() *exec.Cmd { return exec.Command(os.Args[0]) },
		DrainTimeout: time.Minute, Logger: quiet,
	})
	if err != nil {
		t.Fatalf("run: %v, want a reconciliation that fails", err)
	}
	if sum.Reconciled || sum.Delivered != 0 || len(sum.Dead) != 3 || !slices.Contains(sum.Mismatches, "no dispatcher was killed") {
		t.Fatalf("reconciled %v, delivered %d, dead %d, mismatches %q; want not reconciled, 0, 3, and no dispatcher killed",
			sum.Reconciled, sum.Delivered, len(sum.Dead), sum.Mismatches)
	}
}

// An operator that cannot skip dead heads (here, its role may not call the
// outbox's functions) leaves an invalid instruction's participant blocked:
// the run ends at its drain timeout, and the error says why the operator
// failed rather than only that heads were not skipped.
func TestDrainTimeoutNamesTheOperatorsError(t *testing.T) {
	tdb := pgtest.NewDB(t)
	if _, err := tdb.Provider.Pool.Exec(t.Context(),
		"REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM "+outboxpg.RoleOperator); err != nil {
		t.Fatal(err)
	}
	_, err := app.Run(t.Context(), app.Options{
		DSN: tdb.DSN, Instructions: 20, Participants: 2, Invalid: 1, Dispatchers: 2,
		Seed: 7, Spawn: func() *exec.Cmd { return exec.Command(os.Args[0]) },
		DrainTimeout: 3 * time.Second, Logger: quiet,
	})
	if !errors.Is(err, app.ErrNotDrained) || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("run: %v; want ErrNotDrained naming the operator's permission error", err)
	}
}

// A role's DSN is the administrative one with the role's user and password:
// the rest of it (TLS above all) is kept, in either DSN form. It was
// rebuilt from host, port and database with sslmode=disable, so a
// DATABASE_URL that requires TLS could not be used.
func TestRoleDSNKeepsTheBaseSettings(t *testing.T) {
	tdb := pgtest.NewDB(t)
	for _, base := range []string{
		"postgres://admin:secret@db.example:6543/ledger?sslmode=require&application_name=payments",
		"host=db.example port=6543 dbname=ledger user=admin password=secret sslmode=require application_name=payments",
	} {
		roles, err := app.Setup(t.Context(), tdb.Provider.Pool, base) // the base DSN is only kept, not used
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = roles.Drop(context.Background(), tdb.Provider.Pool) })
		dsn, err := roles.DSN(roles.API)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Host != "db.example" || cfg.Port != 6543 || cfg.Database != "ledger" || cfg.User != roles.API ||
			cfg.Password == "" || cfg.Password == "secret" || cfg.TLSConfig == nil || cfg.RuntimeParams["application_name"] != "payments" {
			t.Errorf("%s: the API role's DSN is %s@%s:%d/%s, TLS %v, params %v; want the base's settings as %s",
				base, cfg.User, cfg.Host, cfg.Port, cfg.Database, cfg.TLSConfig != nil, cfg.RuntimeParams, roles.API)
		}
	}
}
