package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

const eventsExamples = `  modkit-outbox events list --status dead
  modkit-outbox events list --topic shop/order_paid --since 2h --json
  modkit-outbox events list --status pending --limit 100 --after CURSOR   # the next page
  modkit-outbox events list --status dead --all --json > dead.json
  modkit-outbox events show 0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b --payload   # the row and its attempts history
`

func runEvents(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "events", "events list [flags] | events show ID [flags]", eventsExamples)
	var ff filterFlags
	ff.register(f)
	status := f.String("status", "", "list: only events in this status (pending, processing, delivered, dead)")
	limit := f.Int("limit", 50, "list: events per page (at most 1000)")
	after := f.String("after", "", "list: the cursor printed after the previous page")
	all := f.Bool("all", false, "list: follow the pages to the end")
	asJSON := f.Bool("json", false, "print JSON instead of a table")
	payload := f.Bool("payload", false, "include the payloads (they may hold personal data); show, and list with --json")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) == 0 {
		f.printUsage(e.stderr)
		return usageErr("events needs list or show")
	}
	switch pos[0] {
	case "list":
		if len(pos) != 1 {
			return usageErr("events list takes no arguments (got %q)", pos[1:])
		}
		if *payload && !*asJSON {
			return usageErr("--payload with events list needs --json: the table has no payload column (events show ID --payload prints one)")
		}
		filter, err := ff.filter(time.Now())
		if err != nil {
			return err
		}
		filter.Status, filter.Limit, filter.After = outbox.Status(*status), *limit, *after
		// Checked here, so that the error names the flag rather than the
		// EventFilter field the library's own check would name.
		switch filter.Status {
		case "", outbox.StatusPending, outbox.StatusProcessing, outbox.StatusDelivered, outbox.StatusDead:
		default:
			return usageErr("--status %q is not a status; use one of pending, processing, delivered, dead", *status)
		}
		if *limit < 1 || *limit > 1000 {
			return usageErr("--limit is %d; use 1 to 1000", *limit)
		}
		c, pool, err := f.client(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		withPayload, _, err := payloadsReadable(ctx, e, c.Admin(), *payload)
		if err != nil {
			return err
		}
		return listEvents(ctx, e, c.Admin(), filter, *all, *asJSON, withPayload)
	case "show":
		if len(pos) != 2 {
			return usageErr("events show needs one event id")
		}
		if err := f.refuse([]string{"namespace", "topic", "tenant", "since", "until", "status", "limit", "after", "all"},
			"is for events list; events show takes one event id"); err != nil {
			return err
		}
		id, err := uuid.Parse(pos[1])
		if err != nil {
			return usageErr("%q is not an event id (a UUID)", pos[1])
		}
		c, pool, err := f.client(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		withPayload, hidden, err := payloadsReadable(ctx, e, c.Admin(), *payload)
		if err != nil {
			return err
		}
		return showEvent(ctx, e, c.Admin(), id, *asJSON, withPayload, hidden)
	}
	return usageErr("events %q: use list or show", pos[0])
}

type pageJSON struct {
	Events   []EventJSON `json:"events"`
	NextPage string      `json:"next_page,omitempty"`
}

func listEvents(ctx context.Context, e env, a *outbox.Admin, f outbox.EventFilter, all, asJSON, withPayload bool) error {
	out := pageJSON{Events: []EventJSON{}}
	var events []outbox.Event
	for {
		page, err := a.List(ctx, f)
		if errors.Is(err, outbox.ErrInvalidCursor) { // the pages followed have the library's own cursors: --after's
			return usageErr("--after %q is not a cursor of events list: pass the one a previous events list printed "+
				"(after \"more events: add --after\", or its --json's next_page), unchanged", f.After)
		}
		if errors.Is(err, outbox.ErrInvalidConfig) {
			return withCode(exitUsage, err)
		}
		if err != nil {
			return err
		}
		events = append(events, page.Events...)
		out.NextPage = page.NextPage
		if !all || page.NextPage == "" {
			break
		}
		f.After = page.NextPage
	}
	if asJSON {
		for _, ev := range events {
			out.Events = append(out.Events, toJSON(ev, withPayload))
		}
		return writeJSON(e.stdout, out)
	}
	// The KEY and SEQ columns (an event's ordering key and its place in
	// the key) show only when a listed event has a key, so that the
	// common table of events without keys stays as narrow as it was.
	keyed := slices.ContainsFunc(events, func(ev outbox.Event) bool { return ev.OrderingKey != "" })
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	if keyed {
		fmt.Fprintln(tw, "ID\tNAMESPACE\tTOPIC\tKEY\tSEQ\tSTATUS\tATTEMPTS\tCREATED\tLAST ERROR")
	} else {
		fmt.Fprintln(tw, "ID\tNAMESPACE\tTOPIC\tSTATUS\tATTEMPTS\tCREATED\tLAST ERROR")
	}
	for _, ev := range events {
		key := ""
		switch {
		case keyed && ev.OrderingKey != "":
			key = fmt.Sprintf("%s\t%d\t", ev.OrderingKey, ev.Sequence)
		case keyed:
			key = "-\t-\t"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s%s\t%d\t%s\t%s\n", ev.ID, ev.Namespace, ev.Topic, key, ev.Status, ev.Attempts,
			fmtTime(ev.CreatedAt), oneLine(ev.LastError, 60))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if out.NextPage != "" {
		fmt.Fprintf(e.stderr, "more events: add --after %s (or --all)\n", out.NextPage)
	}
	return nil
}

// eventView is what events show prints: the row and its history. The
// JSON of a purged event has its id, "purged" and its history only: no
// row, so none of the row's fields (not zero values standing in for them).
type eventView struct {
	*EventJSON
	// ID is the event's id, row or not (it hides the row's own).
	ID string `json:"id"`
	// Purged: the event's row is gone (purged after delivery); its
	// history is kept.
	Purged  bool          `json:"purged,omitempty"`
	History []attemptJSON `json:"history"`
}

// attemptJSON is one entry of an event's history (outbox.Attempt).
type attemptJSON struct {
	No         int        `json:"no"`
	Outcome    string     `json:"outcome"`
	Attempt    int        `json:"attempt"`
	Worker     *string    `json:"worker"`
	LeaseToken *string    `json:"lease_token"`
	ClaimedAt  *time.Time `json:"claimed_at"`
	FinishedAt time.Time  `json:"finished_at"`
	Detail     string     `json:"detail"`
	Actor      string     `json:"actor"`
}

func loadEventView(ctx context.Context, a *outbox.Admin, id uuid.UUID, withPayload bool) (eventView, error) {
	ev, err := a.Get(ctx, id)
	purged := errors.Is(err, outbox.ErrNotFound)
	if err != nil && !purged {
		return eventView{}, err
	}
	history, err := a.History(ctx, id)
	if err != nil {
		return eventView{}, err
	}
	if purged && len(history) == 0 {
		return eventView{}, withCode(exitNotFound, fmt.Errorf("no event %s in this schema (check --schema)", id))
	}
	v := eventView{ID: id.String(), Purged: purged, History: make([]attemptJSON, len(history))}
	if !purged {
		row := toJSON(ev, withPayload)
		v.EventJSON = &row
	}
	for i, h := range history {
		v.History[i] = attemptJSON{No: h.No, Outcome: h.Outcome, Attempt: h.Attempt, Worker: uuidString(h.Worker),
			LeaseToken: uuidString(h.LeaseToken), FinishedAt: h.FinishedAt.UTC(), Detail: h.Detail, Actor: h.Actor}
		if h.ClaimedAt != nil {
			t := h.ClaimedAt.UTC()
			v.History[i].ClaimedAt = &t
		}
	}
	return v, nil
}

// payloadsReadable says whether to print payloads: when they were asked
// for and the database role may read them. When it may not, it says so on
// stderr (the reader role's reads return no payload, which would otherwise
// print as an empty one) and returns why, for the text output.
func payloadsReadable(ctx context.Context, e env, a *outbox.Admin, asked bool) (ok bool, hidden string, err error) {
	if !asked {
		return false, "", nil
	}
	r, err := a.Rights(ctx)
	if err != nil {
		return false, "", err
	}
	if r.Known && !r.ReadPayloads {
		hidden = fmt.Sprintf("database role %s may not read payloads (grant it modkit_outbox_operator)", r.User)
		fmt.Fprintf(e.stderr, "payloads hidden: %s\n", hidden)
		return false, hidden, nil
	}
	return true, "", nil
}

// showEvent prints an event and its history; hidden, when not empty, says
// why the payload asked for is not printed.
func showEvent(ctx context.Context, e env, a *outbox.Admin, id uuid.UUID, asJSON, withPayload bool, hidden string) error {
	v, err := loadEventView(ctx, a, id, withPayload)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(e.stdout, v)
	}
	if v.Purged {
		fmt.Fprintf(e.stdout, "id %s: purged (the event's row is gone; its history is kept)\n", v.ID)
		return printHistory(e, v.History)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	str := func(p *string) string {
		if p == nil {
			return "-"
		}
		return *p
	}
	fmt.Fprintf(tw, "id\t%s\n", v.ID)
	fmt.Fprintf(tw, "topic\t%s/%s\n", v.Namespace, v.Topic)
	if v.OrderingKey != "" {
		fmt.Fprintf(tw, "ordering key\t%s (event %d of the key)\n", v.OrderingKey, v.Sequence)
	}
	fmt.Fprintf(tw, "status\t%s\n", v.Status)
	fmt.Fprintf(tw, "attempts\t%d\n", v.Attempts)
	fmt.Fprintf(tw, "tenant\t%s\n", str(v.TenantID))
	fmt.Fprintf(tw, "dedupe key\t%s\n", str(v.DedupeKey))
	fmt.Fprintf(tw, "created\t%s\n", fmtTime(v.CreatedAt))
	fmt.Fprintf(tw, "updated\t%s\n", fmtTime(v.UpdatedAt))
	next := "-" // dead, delivered or leased: no attempt is due
	if v.NextAttemptAt != nil {
		next = fmtTime(*v.NextAttemptAt)
	}
	fmt.Fprintf(tw, "next attempt\t%s\n", next)
	if v.LockedBy != nil {
		fmt.Fprintf(tw, "leased to\t%s until %s\n", *v.LockedBy, fmtTime(*v.LockedUntil))
	}
	fmt.Fprintf(tw, "last error\t%s\n", str(v.LastError))
	switch {
	case withPayload:
		fmt.Fprintf(tw, "payload\t%s\n", v.Payload)
	case hidden != "":
		fmt.Fprintf(tw, "payload\t(hidden: %s)\n", hidden)
	default:
		fmt.Fprintf(tw, "payload\t(hidden; add --payload)\n")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(e.stdout)
	return printHistory(e, v.History)
}

// printHistory prints an event's history as a table.
func printHistory(e env, history []attemptJSON) error {
	if len(history) == 0 {
		fmt.Fprintln(e.stdout, "history: no attempt finished yet")
		return nil
	}
	fmt.Fprintln(e.stdout, "history:")
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NO\tOUTCOME\tATTEMPT\tWORKER\tCLAIMED\tFINISHED\tDETAIL\tACTOR")
	for _, h := range history {
		attempt, claimed := "-", "-"
		if h.Attempt > 0 {
			attempt = fmt.Sprint(h.Attempt)
		}
		if h.ClaimedAt != nil {
			claimed = fmtTime(*h.ClaimedAt)
		}
		worker := "-"
		if h.Worker != nil {
			worker = *h.Worker
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", h.No, h.Outcome, attempt, worker, claimed, fmtTime(h.FinishedAt),
			orDash(oneLine(&h.Detail, 60)), orDash(h.Actor))
	}
	return tw.Flush()
}

func uuidString(u *uuid.UUID) *string {
	if u == nil {
		return nil
	}
	s := u.String()
	return &s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
