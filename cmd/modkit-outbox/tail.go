package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

const tailExamples = `  modkit-outbox tail
  modkit-outbox tail --topic shop/order_paid --since 10m
  modkit-outbox tail --json | jq -c 'select(.status == "dead")'
`

// tailOverlap is how far back each poll reads again: outcomes are stamped
// when their transaction starts, so one committing late can appear behind
// ones already printed.
const tailOverlap = 5 * time.Second

func runTail(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "tail", "tail [flags]", tailExamples)
	var ff filterFlags
	ff.registerTopic(f)
	since := f.Duration("since", 0, "start with the outcomes of this long ago")
	interval := f.Duration("interval", time.Second, "how often to poll")
	asJSON := f.Bool("json", false, "print one JSON object per line")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageErr("tail takes no arguments (got %q)", pos)
	}
	if *interval < 100*time.Millisecond {
		return usageErr("--interval %v is too short; use at least 100ms", *interval)
	}
	if *since < 0 {
		return usageErr("--since %v is negative; give how long ago to start, such as 10m", *since)
	}
	filter, err := ff.filter(time.Now())
	if err != nil {
		return err
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if !*asJSON {
		fmt.Fprintln(e.stderr, "following delivered and dead events; Ctrl-C stops")
	}
	// Outcome times come from the database's clock, so the start does too:
	// a local clock ahead of it would skip the first outcomes, one behind
	// it would print old ones.
	var now time.Time
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
		return err
	}
	t := &tailer{a: c.Admin(), e: e, filter: filter, json: *asJSON, seen: map[uuid.UUID]time.Time{},
		from: now.Add(-*since)}
	ticker := time.NewTicker(*interval)
	defer ticker.Stop()
	for {
		if err := t.poll(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

type tailer struct {
	a      *outbox.Admin
	e      env
	filter outbox.EventFilter
	json   bool
	from   time.Time
	seen   map[uuid.UUID]time.Time // printed ids, with the updated_at of the outcome printed, within the overlap
}

func (t *tailer) poll(ctx context.Context) error {
	// Each poll reads again from tailOverlap before the last outcome
	// printed, page by page after an (outcome time, id) cursor, so that
	// however many outcomes share one timestamp none is skipped; the ids
	// seen are not printed twice (unless with a later outcome).
	q := outbox.SettledQuery{Since: t.from.Add(-tailOverlap), Limit: tailPage}
	for {
		page, err := t.a.SettledPage(ctx, q)
		if err != nil {
			return err
		}
		for _, ev := range page.Events {
			// The same outcome read again has the same time; a later one
			// of the same event (dead, replayed, then delivered within the
			// overlap) is new and printed.
			if at, ok := t.seen[ev.ID]; ok && at.Equal(ev.UpdatedAt) {
				continue
			}
			t.seen[ev.ID] = ev.UpdatedAt
			if ev.UpdatedAt.After(t.from) {
				t.from = ev.UpdatedAt
			}
			if (t.filter.Namespace != "" && ev.Namespace != t.filter.Namespace) || (t.filter.Topic != "" && ev.Topic != t.filter.Topic) {
				continue
			}
			if err := t.print(ev); err != nil {
				return err
			}
		}
		if page.NextPage == "" {
			break
		}
		q.After = page.NextPage
	}
	for id, at := range t.seen {
		if at.Before(t.from.Add(-2 * tailOverlap)) {
			delete(t.seen, id)
		}
	}
	return nil
}

// tailPage is how many outcomes one read of SettledPage returns, at most.
const tailPage = 1000

func (t *tailer) print(ev outbox.Event) error {
	if t.json {
		b, err := json.Marshal(toJSON(ev, false))
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(t.e.stdout, "%s\n", b)
		return err
	}
	_, err := fmt.Fprintf(t.e.stdout, "%s  %-9s  %s/%s  %s  attempts=%d  %s\n", fmtTime(ev.UpdatedAt), ev.Status,
		ev.Namespace, ev.Topic, ev.ID, ev.Attempts, oneLine(ev.LastError, 80))
	return err
}
