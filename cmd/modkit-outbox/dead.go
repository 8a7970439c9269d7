package main

import (
	"context"
	"errors"
	"fmt"
	"os/user"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

const deadExamples = `  modkit-outbox dead replay 0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b
  modkit-outbox dead replay --topic shop/order_paid --since 1h --dry-run
  modkit-outbox dead replay --topic shop/order_paid --yes --by "alice, after the billing fix"
  modkit-outbox dead purge 0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b --by "alice, poison payload"
  modkit-outbox dead skip-head --topic shop/order_paid --key acct-7 --dry-run
  modkit-outbox dead skip-head 0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b --yes --by "alice, refunded by hand"
  modkit-outbox dead letter --topic legacy/orphan --dry-run   # pending events no one will publish: dead, to replay or purge

dead letter takes pending events, and leased ones whose lease has ended (a
dispatcher died holding them), never those under a live lease.
`

// deadUsage is the usage line of dead: its four subcommands.
const deadUsage = `dead replay [ID...] [flags]
  modkit-outbox dead purge [ID...] [flags]
  modkit-outbox dead skip-head ID | --topic NAMESPACE/TOPIC --key KEY [flags]
  modkit-outbox dead letter [ID...] [flags]   (pending events made dead)`

// replayShowMax is how many of the events to replay or purge are listed
// before the confirmation.
const replayShowMax = 20

// deadAction is what dead replay, purge or letter does to the events it
// selects.
type deadAction struct {
	verb, done string // "replay", "replayed"
	// selects is the status of the events it acts on: dead, or pending
	// for letter.
	selects outbox.Status
	// alwaysAsk: confirm even a single event (without --yes).
	alwaysAsk bool
	question  string // the confirmation, with the count for %d
	// leftAlone says why events selected were not changed.
	leftAlone string
	run       func(ctx context.Context, a *outbox.Admin, by string, ids ...uuid.UUID) ([]uuid.UUID, error)
}

var deadActions = map[string]deadAction{
	"replay": {verb: "replay", done: "replayed", selects: outbox.StatusDead, question: "Replay %d dead event(s)?",
		leftAlone: "were no longer dead",
		run: func(ctx context.Context, a *outbox.Admin, by string, ids ...uuid.UUID) ([]uuid.UUID, error) {
			return a.ReplayDead(ctx, by, outbox.EventFilter{}, ids...)
		}},
	"purge": {verb: "purge", done: "purged", selects: outbox.StatusDead, alwaysAsk: true,
		question: "Delete %d dead event(s) for good? (their history stays)",
		leftAlone: "were no longer dead, or come after a dead event of their ordering key that was not purged with them " +
			"(purging them alone would let the key's later events overtake that one)",
		run: func(ctx context.Context, a *outbox.Admin, by string, ids ...uuid.UUID) ([]uuid.UUID, error) {
			return a.PurgeDead(ctx, by, outbox.EventFilter{}, ids...)
		}},
	"letter": {verb: "dead-letter", done: "dead-lettered", selects: outbox.StatusPending, alwaysAsk: true,
		question:  "Dead-letter %d pending event(s)? They will not be published unless replayed (dead replay).",
		leftAlone: "were no longer pending (a dispatcher leased or settled them meanwhile)",
		run: func(ctx context.Context, a *outbox.Admin, by string, ids ...uuid.UUID) ([]uuid.UUID, error) {
			return a.DeadLetter(ctx, by, outbox.EventFilter{}, ids...)
		}},
}

func runDead(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "dead", deadUsage, deadExamples)
	var ff filterFlags
	ff.register(f)
	limit := f.Int("limit", 1000, "replay, purge or letter by filter: at most this many events, oldest first (at most 10000)")
	key := f.String("key", "", "skip-head: the ordering key whose dead head to skip, with --topic NAMESPACE/TOPIC")
	all := f.Bool("all", false, "replay or purge: every dead event of the schema (letter: every pending one; up to --limit), which no id and no filter flag select")
	dryRun := f.Bool("dry-run", false, "show what would be replayed, purged, skipped or dead-lettered and change nothing")
	yes := f.Bool("yes", false, "do not ask for confirmation (replay asks when replaying more than one event, purge, skip-head and letter always)")
	by := f.String("by", defaultBy(), "who is acting, recorded in each event's history (its replayed, purged, skipped or dead_lettered entry)")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	action, isAction := deadActions[pos0(pos)]
	if !isAction && pos0(pos) != "skip-head" {
		f.printUsage(e.stderr)
		return usageErr("dead needs a subcommand: replay, purge, skip-head or letter")
	}
	set := f.setFlags()
	if pos[0] == "skip-head" {
		for _, name := range []string{"namespace", "tenant", "since", "until", "limit", "all"} {
			if set[name] {
				return usageErr("--%s is for dead replay, purge and letter; skip-head takes the dead head's event id, or --topic and --key", name)
			}
		}
		if strings.TrimSpace(*by) == "" {
			return usageErr("--by is empty; say who is skipping")
		}
		return runSkipHead(ctx, e, f, skipHeadArgs{ids: pos[1:], topic: ff.topic, key: *key, keySet: set["key"],
			by: *by, dryRun: *dryRun, yes: *yes})
	}
	if set["key"] {
		return usageErr("--key is for dead skip-head; %s selects events by id or by the filter flags", action.verb)
	}
	if strings.TrimSpace(*by) == "" {
		return usageErr("--by is empty; say who is acting")
	}
	var ids []uuid.UUID
	for _, s := range pos[1:] {
		id, err := uuid.Parse(s)
		if err != nil {
			return usageErr("%q is not an event id (a UUID)", s)
		}
		if !slices.Contains(ids, id) { // an id given twice is one event
			ids = append(ids, id)
		}
	}
	filter, err := ff.filter(time.Now())
	if err != nil {
		return err
	}
	if len(ids) > 0 && filter != (outbox.EventFilter{}) {
		return usageErr("give event ids or filter flags, not both")
	}
	// No id and no filter would select every dead (or pending) event: an
	// unset shell variable (dead purge $ID) must not purge them all.
	switch {
	case *all && (len(ids) > 0 || filter != (outbox.EventFilter{})):
		return usageErr("--all selects every %s event; give it without event ids or filter flags", action.selects)
	case !*all && len(ids) == 0 && filter == (outbox.EventFilter{}):
		return usageErr("dead %s needs event ids, filter flags (--topic, --namespace, --tenant, --since, --until), "+
			"or --all for every %s event", pos[0], action.selects)
	}
	if len(ids) > 0 && set["limit"] {
		return usageErr("--limit bounds a %s by filter; with event ids, every id given is %s", action.verb, action.done)
	}
	if *limit < 1 || *limit > 10000 {
		return usageErr("--limit is %d; use 1 to 10000", *limit)
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	a := c.Admin()
	if action.selects == outbox.StatusPending {
		// Asked before the events are listed (which an older schema, or a
		// login that may only read, allows): dead-lettering the nil id
		// changes nothing, and fails as the real one would.
		if _, err := a.DeadLetter(ctx, *by, outbox.EventFilter{}, uuid.Nil); err != nil {
			if errors.Is(err, outbox.ErrNotMigrated) {
				return fmt.Errorf("dead letter needs migration 0044 in schema %s: run modkit-outbox migrate up as its owner: %w", f.schema, err)
			}
			return err
		}
	}

	targets, more, err := deadTargets(ctx, e, a, action, ids, filter, *limit)
	if err != nil {
		return err
	}
	// Said first, so that neither the confirmation nor the result reads
	// as everything the filter matches.
	if more {
		fmt.Fprintf(e.stderr, "more %s events match than --limit %d: this %s takes the oldest %d; run it again, or raise --limit (at most 10000), for the rest\n",
			action.selects, *limit, action.verb, len(targets))
	}
	if len(targets) == 0 {
		fmt.Fprintf(e.stdout, "no %s event matches; nothing to %s\n", action.selects, action.verb)
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAMESPACE\tTOPIC\tATTEMPTS\tCREATED\tLAST ERROR")
	for _, ev := range targets[:min(len(targets), replayShowMax)] {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", ev.ID, ev.Namespace, ev.Topic, ev.Attempts, fmtTime(ev.CreatedAt), oneLine(ev.LastError, 60))
	}
	_ = tw.Flush()
	if len(targets) > replayShowMax {
		fmt.Fprintf(e.stdout, "… and %d more\n", len(targets)-replayShowMax)
	}
	if *dryRun {
		fmt.Fprintf(e.stdout, "dry run: %d %s event(s) would be %s; nothing was changed\n", len(targets), action.selects, action.done)
		return nil
	}
	if (len(targets) > 1 || action.alwaysAsk) && !*yes {
		if err := confirm(e, fmt.Sprintf(action.question, len(targets))); err != nil {
			return err
		}
	}
	targetIDs := make([]uuid.UUID, len(targets))
	for i, ev := range targets {
		targetIDs[i] = ev.ID
	}
	changed, err := action.run(ctx, a, *by, targetIDs...)
	if errors.Is(err, outbox.ErrInvalidConfig) {
		return withCode(exitUsage, err)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "%s %d event(s)\n", action.done, len(changed))
	if n := len(targets) - len(changed); n > 0 {
		fmt.Fprintf(e.stdout, "%d event(s) %s, and were left alone\n", n, action.leftAlone)
	}
	if action.verb == "replay" && len(changed) > 0 {
		warnUnserved(ctx, e, a, targets, changed)
	}
	return nil
}

// warnUnserved notes the topics of the events replayed that no running
// dispatcher serves (Admin.Unserved): their events wait, and every claim of
// every topic reads them. Nothing is said when that cannot be read.
func warnUnserved(ctx context.Context, e env, a *outbox.Admin, targets []outbox.Event, replayed []uuid.UUID) {
	unserved, err := a.Unserved(ctx)
	if err != nil || len(unserved) == 0 {
		return
	}
	done := make(map[uuid.UUID]bool, len(replayed)) // up to --limit (10,000) of each: no quadratic scan
	for _, id := range replayed {
		done[id] = true
	}
	var names []string
	for _, ev := range targets {
		t := outbox.Topic{Namespace: ev.Namespace, Topic: ev.Topic}
		if !done[ev.ID] || slices.Contains(names, t.String()) {
			continue
		}
		if slices.ContainsFunc(unserved, func(u outbox.TopicStats) bool { return u.Topic == t }) {
			names = append(names, t.String())
		}
	}
	if len(names) > 0 {
		fmt.Fprintf(e.stderr, "note: no running dispatcher serves %s: the events replayed wait, and every claim reads them "+
			"(start a dispatcher with a publisher for it, or dead-letter them again with dead letter)\n", strings.Join(names, ", "))
	}
}

// pos0 is the first positional argument, the subcommand ("" for none).
func pos0(pos []string) string {
	if len(pos) == 0 {
		return ""
	}
	return pos[0]
}

// deadTargets resolves the events to replay, purge or dead-letter (dead
// ones, or pending ones for letter): the ids given (each must exist; ones
// in another status are reported and skipped), or those the filter
// matches, oldest first, at most limit; more says that the filter matches
// more than limit.
func deadTargets(ctx context.Context, e env, a *outbox.Admin, action deadAction, ids []uuid.UUID, f outbox.EventFilter, limit int) (out []outbox.Event, more bool, err error) {
	if len(ids) > 0 {
		for _, id := range ids {
			ev, err := a.Get(ctx, id)
			if errors.Is(err, outbox.ErrNotFound) {
				return nil, false, withCode(exitNotFound, fmt.Errorf("no event %s in this schema (check --schema); nothing was %s", id, action.done))
			}
			if err != nil {
				return nil, false, err
			}
			switch {
			case ev.Status == action.selects || leaseEnded(action, ev):
				out = append(out, ev)
			case ev.Status == outbox.StatusProcessing && ev.LockedUntil != nil:
				fmt.Fprintf(e.stderr, "skipping %s: it is processing (leased until %s), not %s\n", id, fmtTime(*ev.LockedUntil), action.selects)
			default:
				fmt.Fprintf(e.stderr, "skipping %s: it is %s, not %s\n", id, ev.Status, action.selects)
			}
		}
		return out, false, nil
	}
	out, more, err = listAll(ctx, a, f, action.selects, limit, nil)
	if err != nil || action.selects != outbox.StatusPending {
		return out, more, err
	}
	// dead letter takes the events whose lease ended with the pending
	// ones, oldest first (the database checks each lease again).
	ended, moreEnded, err := listAll(ctx, a, f, outbox.StatusProcessing, limit, func(ev outbox.Event) bool { return leaseEnded(action, ev) })
	if err != nil {
		return nil, false, err
	}
	out = append(out, ended...)
	slices.SortStableFunc(out, func(x, y outbox.Event) int {
		if c := x.CreatedAt.Compare(y.CreatedAt); c != 0 {
			return c
		}
		return strings.Compare(x.ID.String(), y.ID.String())
	})
	if len(out) > limit {
		return out[:limit], true, nil
	}
	return out, more || moreEnded, nil
}

// leaseEnded says whether ev is a leased event whose lease has ended, which
// dead letter takes with the pending ones: a dispatcher that died holding
// it left it, and no sweep repairs it on a topic no dispatcher serves.
func leaseEnded(action deadAction, ev outbox.Event) bool {
	return action.selects == outbox.StatusPending && ev.Status == outbox.StatusProcessing && ev.LockedUntil != nil &&
		ev.LockedUntil.Before(time.Now())
}

// listAll lists the events of status f matches (those keep accepts, all
// when it is nil), oldest first, at most limit; more says that more match.
func listAll(ctx context.Context, a *outbox.Admin, f outbox.EventFilter, status outbox.Status, limit int,
	keep func(outbox.Event) bool) (out []outbox.Event, more bool, err error) {
	f.Status = status
	for {
		f.Limit = min(1000, limit-len(out))
		page, err := a.List(ctx, f)
		if errors.Is(err, outbox.ErrInvalidConfig) {
			return nil, false, withCode(exitUsage, err)
		}
		if err != nil {
			return nil, false, err
		}
		for _, ev := range page.Events {
			if keep == nil || keep(ev) {
				out = append(out, ev)
			}
		}
		if page.NextPage == "" {
			return out, false, nil
		}
		if len(out) >= limit {
			return out, true, nil
		}
		f.After = page.NextPage
	}
}

func defaultBy() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return "modkit-outbox (" + u.Username + ")"
	}
	return "modkit-outbox"
}
