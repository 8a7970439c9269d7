package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

const eventsExamples = `  modkit-outbox events list --status dead
  modkit-outbox events list --topic shop/order_paid --since 2h --json
  modkit-outbox events list --status pending --limit 100 --after CURSOR   # the next page
  modkit-outbox events list --status dead --all --json > dead.json
  modkit-outbox events show 0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b --payload
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
	payload := f.Bool("payload", false, "include the payloads (they may hold personal data)")
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
		filter, err := ff.filter(time.Now())
		if err != nil {
			return err
		}
		filter.Status, filter.Limit, filter.After = outbox.Status(*status), *limit, *after
		if *limit < 1 || *limit > 1000 {
			return usageErr("--limit is %d; use 1 to 1000", *limit)
		}
		c, pool, err := f.client(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		return listEvents(ctx, e, c.Admin(), filter, *all, *asJSON, *payload)
	case "show":
		if len(pos) != 2 {
			return usageErr("events show needs one event id")
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
		return showEvent(ctx, e, c.Admin(), id, *asJSON, *payload)
	}
	return usageErr("events %q: use list or show", pos[0])
}

type pageJSON struct {
	Events   []eventJSON `json:"events"`
	NextPage string      `json:"next_page,omitempty"`
}

func listEvents(ctx context.Context, e env, a *outbox.Admin, f outbox.EventFilter, all, asJSON, withPayload bool) error {
	out := pageJSON{Events: []eventJSON{}}
	var events []outbox.Event
	for {
		page, err := a.List(ctx, f)
		if errors.Is(err, outbox.ErrInvalidConfig) || errors.Is(err, outbox.ErrInvalidCursor) {
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
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAMESPACE\tTOPIC\tSTATUS\tATTEMPTS\tCREATED\tLAST ERROR")
	for _, ev := range events {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\n", ev.ID, ev.Namespace, ev.Topic, ev.Status, ev.Attempts,
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

// eventView is what events show prints: the row, and (once the attempts
// ledger exists) its history, loaded in loadEventView.
type eventView struct {
	eventJSON
}

func loadEventView(ctx context.Context, a *outbox.Admin, id uuid.UUID, withPayload bool) (eventView, error) {
	ev, err := a.Get(ctx, id)
	if errors.Is(err, outbox.ErrNotFound) {
		return eventView{}, withCode(exitNotFound, fmt.Errorf("no event %s in this schema (check --schema)", id))
	}
	if err != nil {
		return eventView{}, err
	}
	return eventView{eventJSON: toJSON(ev, withPayload)}, nil
}

func showEvent(ctx context.Context, e env, a *outbox.Admin, id uuid.UUID, asJSON, withPayload bool) error {
	v, err := loadEventView(ctx, a, id, withPayload)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(e.stdout, v)
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
	fmt.Fprintf(tw, "status\t%s\n", v.Status)
	fmt.Fprintf(tw, "attempts\t%d\n", v.Attempts)
	fmt.Fprintf(tw, "tenant\t%s\n", str(v.TenantID))
	fmt.Fprintf(tw, "dedupe key\t%s\n", str(v.DedupeKey))
	fmt.Fprintf(tw, "created\t%s\n", fmtTime(v.CreatedAt))
	fmt.Fprintf(tw, "updated\t%s\n", fmtTime(v.UpdatedAt))
	fmt.Fprintf(tw, "next attempt\t%s\n", fmtTime(v.NextAttemptAt))
	if v.LockedBy != nil {
		fmt.Fprintf(tw, "leased to\t%s until %s\n", *v.LockedBy, fmtTime(*v.LockedUntil))
	}
	fmt.Fprintf(tw, "last error\t%s\n", str(v.LastError))
	if withPayload {
		fmt.Fprintf(tw, "payload\t%s\n", v.Payload)
	} else {
		fmt.Fprintf(tw, "payload\t(hidden; add --payload)\n")
	}
	return tw.Flush()
}
