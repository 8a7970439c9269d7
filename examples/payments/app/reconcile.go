package app

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// KillReport says which dispatcher process was killed, and when.
type KillReport struct {
	PID string
	// PaidBefore is what the rail had paid at the kill; InFlight the
	// victim's requests the rail was still handling once it was dead
	// (requests whose answers it never read, so it died holding their
	// leases).
	PaidBefore, InFlight int
}

// DeadInstruction is an instruction whose event is dead, with its history.
type DeadInstruction struct {
	Accepted
	LastError string
	History   []outbox.Attempt
}

// Summary is the reconciliation of a run.
type Summary struct {
	Elapsed     time.Duration
	Roles       Roles
	Accepted    int
	Delivered   int
	Dead        []DeadInstruction
	Skipped     int
	Kill        KillReport
	Dispatchers int
	Rail        RailStats
	// RailPayments counts the rail's payments of this run's instructions.
	RailPayments int
	// EarlierPaid counts the rail's payments of instructions that an
	// earlier run accepted and left undelivered (it was interrupted): this
	// run's dispatchers deliver them too, and each is checked against its
	// own run's ledger row. EarlierSkipped counts the dead heads of
	// earlier runs the operator skipped.
	EarlierPaid, EarlierSkipped int
	// LedgerTotals and RailTotals are the amounts per currency (minor
	// units) of the delivered instructions and of the rail's payments.
	LedgerTotals, RailTotals map[string]int64
	// OrderChecked counts the participants whose payments the rail saw
	// in their accepted order.
	OrderChecked, Participants int
	// LeaseExpired counts the history entries of this run's events that
	// closed a claim whose dispatcher died (the killed one's).
	LeaseExpired int
	// Redelivered counts delivered instructions that took more than one
	// attempt (503s, lost responses, the kill).
	Redelivered int
	// Mismatches lists every failed check; Reconciled is true when there
	// is none.
	Mismatches []string
	Reconciled bool
}

type reconcileInput struct {
	runID   uuid.UUID
	pool    *pgxpool.Pool // the report's: modkit_outbox_reader
	admin   *outbox.Admin
	rail    *Rail
	kill    KillReport
	skipped []uuid.UUID
	// leftover are the events of the topic an earlier run left pending,
	// leased or dead when this run started.
	leftover    map[uuid.UUID]bool
	dispatchers int
	invalid     int
	elapsed     time.Duration
	roles       *Roles
}

// reconcile checks the run, as the report role: it reads the ledger (the
// instructions) and the outbox's statuses and histories, and compares
// them with what the rail paid.
func reconcile(ctx context.Context, in reconcileInput) (*Summary, error) {
	s := &Summary{Elapsed: in.elapsed, Roles: *in.roles, Kill: in.kill, Dispatchers: in.dispatchers,
		LedgerTotals: map[string]int64{}, RailTotals: map[string]int64{}}
	s.Roles.password, s.Roles.baseDSN, s.Roles.names = "", "", nil // names only
	bad := func(format string, args ...any) { s.Mismatches = append(s.Mismatches, fmt.Sprintf(format, args...)) }

	rows, err := in.pool.Query(ctx, `SELECT id, participant_id, seq, amount_minor, currency, destination, event_id
		FROM payments_instructions WHERE run_id = $1 ORDER BY participant_id, seq`, in.runID)
	if err != nil {
		return nil, fmt.Errorf("read the ledger: %w", err)
	}
	var ledger []Accepted
	for rows.Next() {
		var a Accepted
		if err := rows.Scan(&a.ID, &a.Participant, &a.Seq, &a.AmountMinor, &a.Currency, &a.Destination, &a.EventID); err != nil {
			rows.Close()
			return nil, err
		}
		ledger = append(ledger, a)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	s.Accepted = len(ledger)

	status, err := topicEvents(ctx, in.admin, outbox.StatusDelivered, outbox.StatusDead)
	if err != nil {
		return nil, err
	}

	paid := in.rail.Payments()
	railOrder := in.rail.Order()
	s.Rail = in.rail.Stats()
	ours := map[string]bool{}
	ourEvents := map[uuid.UUID]bool{}
	wantOrder := map[string][]int64{}
	participants := map[string]bool{}
	for _, a := range ledger {
		participants[a.Participant] = true
		key := a.ID.String()
		ours[key] = true
		ourEvents[a.EventID] = true
		e, ok := status[a.EventID]
		p, isPaid := paid[key]
		switch {
		case !ok:
			bad("instruction %s (%s #%d): its event %s is neither delivered nor dead", key, a.Participant, a.Seq, a.EventID)
		case e.Status == outbox.StatusDelivered:
			s.Delivered++
			s.LedgerTotals[a.Currency] += a.AmountMinor
			wantOrder[a.Participant] = append(wantOrder[a.Participant], a.Seq)
			hist, err := in.admin.History(ctx, a.EventID)
			if err != nil {
				return nil, err
			}
			for _, h := range hist {
				if h.Outcome == "lease_expired" {
					s.LeaseExpired++
				}
			}
			if e.Attempts > 1 {
				s.Redelivered++
			}
			if !isPaid {
				bad("instruction %s delivered but not paid by the rail", key)
			} else if p.Participant != a.Participant || p.Seq != a.Seq || p.AmountMinor != a.AmountMinor ||
				p.Currency != a.Currency || p.Destination != a.Destination {
				bad("instruction %s paid as %+v, accepted as %+v", key, p, a.Instruction)
			}
		case e.Status == outbox.StatusDead:
			hist, err := in.admin.History(ctx, a.EventID)
			if err != nil {
				return nil, err
			}
			d := DeadInstruction{Accepted: a, History: hist}
			if e.LastError != nil {
				d.LastError = *e.LastError
			}
			s.Dead = append(s.Dead, d)
			if isPaid {
				bad("instruction %s is dead but the rail paid it (%s)", key, p.Reference)
			}
			if ValidatePayment(Payment{AmountMinor: a.AmountMinor, Currency: a.Currency, Destination: a.Destination}) == nil {
				bad("instruction %s is valid but dead: %s", key, d.LastError)
			}
		}
	}
	s.Participants = len(participants)
	if len(s.Dead) != in.invalid {
		bad("%d instructions dead, want the %d invalid ones", len(s.Dead), in.invalid)
	}
	var others []string
	for key, p := range paid {
		if !ours[key] {
			others = append(others, key)
			continue
		}
		s.RailPayments++
		s.RailTotals[p.Currency] += p.AmountMinor
	}
	if err := reconcileEarlier(ctx, in, paid, others, s, bad); err != nil {
		return nil, err
	}
	var earlierHeads []uuid.UUID
	for _, head := range in.skipped {
		if ourEvents[head] {
			s.Skipped++
		} else {
			s.EarlierSkipped++
			earlierHeads = append(earlierHeads, head)
		}
	}
	if err := reconcileEarlierHeads(ctx, in, earlierHeads, bad); err != nil {
		return nil, err
	}
	if s.RailPayments != s.Delivered {
		bad("the rail made %d payments for %d delivered instructions", s.RailPayments, s.Delivered)
	}
	if !maps.Equal(s.LedgerTotals, s.RailTotals) {
		bad("ledger totals %v differ from the rail's %v", s.LedgerTotals, s.RailTotals)
	}
	for p := range participants {
		if slices.Equal(railOrder[p], wantOrder[p]) {
			s.OrderChecked++
		} else {
			bad("participant %s: rail paid seqs %v, accepted order %v", p, railOrder[p], wantOrder[p])
		}
	}
	for _, v := range s.Rail.OrderViolations {
		bad("rail order violation: %s", v)
	}
	if s.Rail.Rejected != 0 {
		bad("the rail rejected %d requests: an invalid payment was sent", s.Rail.Rejected)
	}
	if s.Rail.MaxInFlight > RailConcurrency {
		bad("the rail had %d requests of one dispatcher at once, over the cap of %d per dispatcher", s.Rail.MaxInFlight, RailConcurrency)
	}
	if s.Kill.PID == "" {
		bad("no dispatcher was killed")
	} else if s.LeaseExpired == 0 && s.Kill.InFlight > 0 {
		// With a payment in flight at the rail the victim held its lease
		// when it died. A kill that came only because two thirds were paid
		// (on a loaded machine the victim may have had nothing in flight)
		// need not leave a lease behind.
		bad("the killed dispatcher left no lease_expired entry in any event's history")
	}
	if s.Skipped != len(s.Dead) {
		bad("the operator skipped %d dead heads, want %d", s.Skipped, len(s.Dead))
	}
	s.Reconciled = len(s.Mismatches) == 0
	return s, nil
}

// reconcileEarlier checks the rail's payments of keys that are no
// instruction of this run: each must be an instruction an earlier run
// accepted (and left undelivered when it was interrupted; the outbox
// delivers it whichever run's dispatcher is running), paid as that run's
// ledger has it.
func reconcileEarlier(ctx context.Context, in reconcileInput, paid map[string]Payment, keys []string, s *Summary, bad func(string, ...any)) error {
	if len(keys) == 0 {
		return nil
	}
	ids := make([]uuid.UUID, 0, len(keys))
	for _, key := range keys {
		if id, err := uuid.Parse(key); err == nil {
			ids = append(ids, id)
		}
	}
	rows, err := in.pool.Query(ctx, `SELECT id::text, event_id, participant_id, seq, amount_minor, currency, destination
		FROM payments_instructions WHERE id = ANY($1) AND run_id <> $2`, ids, in.runID)
	if err != nil {
		return fmt.Errorf("read the ledger of earlier runs: %w", err)
	}
	earlier := map[string]Payment{}
	events := map[string]uuid.UUID{}
	for rows.Next() {
		var key string
		var event uuid.UUID
		var a Payment
		if err := rows.Scan(&key, &event, &a.Participant, &a.Seq, &a.AmountMinor, &a.Currency, &a.Destination); err != nil {
			rows.Close()
			return err
		}
		earlier[key], events[key] = a, event
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	slices.Sort(keys)
	for _, key := range keys {
		p := paid[key]
		a, ok := earlier[key]
		switch {
		case !ok:
			bad("the rail paid %s (%s), which is no accepted instruction of this run or an earlier one", key, p.Reference)
		case !in.leftover[events[key]]:
			bad("the rail paid %s (%s), an instruction of an earlier run that was not left undelivered: paid twice?", key, p.Reference)
		case p.Participant != a.Participant || p.Seq != a.Seq || p.AmountMinor != a.AmountMinor ||
			p.Currency != a.Currency || p.Destination != a.Destination:
			bad("instruction %s of an earlier run paid as %s #%d %s %s -> %s, accepted as %s #%d %s %s -> %s", key,
				p.Participant, p.Seq, money(p.AmountMinor), p.Currency, p.Destination,
				a.Participant, a.Seq, money(a.AmountMinor), a.Currency, a.Destination)
		default:
			s.EarlierPaid++
		}
	}
	return nil
}

// reconcileEarlierHeads checks the dead heads of earlier runs that the
// operator skipped: each must be an invalid instruction, as this run's dead
// ones must (a valid one left dead would never be paid).
func reconcileEarlierHeads(ctx context.Context, in reconcileInput, heads []uuid.UUID, bad func(string, ...any)) error {
	if len(heads) == 0 {
		return nil
	}
	rows, err := in.pool.Query(ctx, `SELECT id, amount_minor, currency, destination FROM payments_instructions
		WHERE event_id = ANY($1)`, heads)
	if err != nil {
		return fmt.Errorf("read the ledger of earlier runs: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id uuid.UUID
		var p Payment
		if err := rows.Scan(&id, &p.AmountMinor, &p.Currency, &p.Destination); err != nil {
			return err
		}
		if ValidatePayment(p) == nil {
			bad("instruction %s of an earlier run is valid but was dead, and skipped", id)
		}
	}
	return rows.Err()
}

// Print writes the reconciliation.
func (s *Summary) Print(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	p := func(format string, args ...any) { fmt.Fprintf(tw, format+"\n", args...) }
	p("")
	p("Payments reconciliation (%s)", s.Elapsed.Round(time.Millisecond))
	p("  roles\tapi=%s (producer), dispatchers=%s, operator=%s, report=%s (reader)",
		s.Roles.API, s.Roles.Dispatcher, s.Roles.Operator, s.Roles.Report)
	p("  accepted instructions\t%d over %d participants", s.Accepted, s.Participants)
	p("  delivered / dead\t%d / %d", s.Delivered, len(s.Dead))
	p("  dispatcher processes\t%d; pid %s SIGKILLed after %d payments, with requests in flight at the rail: %d",
		s.Dispatchers, s.Kill.PID, s.Kill.PaidBefore, s.Kill.InFlight)
	p("  after the kill\tlease_expired history entries (claims taken over): %d; instructions delivered after more than one attempt: %d",
		s.LeaseExpired, s.Redelivered)
	p("  rail requests\t%d: %d paid, %d answered again by idempotency key, %d x 503, %d responses lost (timeout), %d rejected",
		s.Rail.Requests, s.Rail.Paid, s.Rail.Replayed, s.Rail.Unavailable, s.Rail.LostResponses, s.Rail.Rejected)
	p("  rail concurrency\tat most %d requests of one dispatcher at once (cap %d per dispatcher)", s.Rail.MaxInFlight, RailConcurrency)
	p("  paid exactly once\t%d rail payments for %d delivered instructions", s.RailPayments, s.Delivered)
	p("  order per participant\t%d/%d participants paid in accepted order", s.OrderChecked, s.Participants)
	for _, c := range slices.Sorted(maps.Keys(s.LedgerTotals)) {
		p("  total %s\tledger %s, rail %s", c, money(s.LedgerTotals[c]), money(s.RailTotals[c]))
	}
	p("  dead instructions\t%d (operator skipped %d dead heads)", len(s.Dead), s.Skipped)
	if s.EarlierPaid+s.EarlierSkipped > 0 {
		p("  earlier runs\t%d instructions an interrupted run left undelivered paid now, each as its run accepted it; %d of their dead heads skipped",
			s.EarlierPaid, s.EarlierSkipped)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, d := range s.Dead {
		fmt.Fprintf(w, "    %s  %s #%d  %s %s -> %s\n      last error: %s\n", d.ID, d.Participant, d.Seq,
			money(d.AmountMinor), d.Currency, d.Destination, d.LastError)
		for _, h := range d.History {
			by := ""
			if h.Actor != "" {
				by = " by " + h.Actor
			}
			fmt.Fprintf(w, "      %d. %-9s attempt %d at %s%s: %s\n", h.No, h.Outcome, h.Attempt,
				h.FinishedAt.Format(time.TimeOnly), by, h.Detail)
		}
	}
	if s.Reconciled {
		_, err := fmt.Fprintln(w, "\nReconciliation OK")
		return err
	}
	_, err := fmt.Fprintf(w, "\nReconciliation FAILED:\n  %s\n", strings.Join(s.Mismatches, "\n  "))
	return err
}

func money(minor int64) string { return fmt.Sprintf("%d.%02d", minor/100, minor%100) }
