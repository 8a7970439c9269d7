package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/modkit-go/modkit/modkit/outbox"
)

const purgeExamples = `  modkit-outbox purge --topic shop/order_paid --older-than 72h --dry-run   # how many could go; deletes nothing
  modkit-outbox purge --topic shop/order_paid --older-than 72h
  modkit-outbox purge --topic shop/order_paid --topic shop/refunded --older-than 0s --yes

  modkit-outbox purge --sequences --dry-run   # ordering keys with no event left: how many rows could go
  modkit-outbox purge --sequences --yes --limit 100000

  # --sequences deletes the sequence rows of ordering keys that have no
  # event left, of any status (run it after purging delivered events): the
  # database keeps one for every key ever used. A key used again afterwards
  # starts again at sequence 1, on a new stream. Rows that an enqueue under
  # way holds are left for the next run.

  # The count (of --dry-run and of the confirmation) is an upper bound: the
  # topics' delivered events of any age, which stats counts too (it reads
  # the whole table); which of them are older than --older-than is not
  # counted apart. With --older-than 0s every one of them goes. --yes
  # without --dry-run counts nothing.
`

func runPurge(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "purge", "purge --topic NAMESPACE/TOPIC... --older-than DURATION [flags]\n  modkit-outbox purge --sequences [--limit N] [flags]",
		purgeExamples)
	var topicArgs listFlag
	f.Var(&topicArgs, "topic", "a topic to purge, `NAMESPACE/TOPIC` (repeat for several)")
	var olderThanFlag requiredDuration
	f.Var(&olderThanFlag, "older-than", "delete delivered events whose delivery is older than this `duration` (0s: all delivered)")
	olderThan := &olderThanFlag.d
	sequences := f.Bool("sequences", false, "delete the sequence rows of ordering keys that have no event left, instead of events")
	limit := f.Int("limit", 0, "--sequences: delete at most this many rows (0: all of them)")
	dryRun := f.Bool("dry-run", false, "count the delivered events of the topics (--sequences: the rows), at most what would be deleted, and delete nothing")
	yes := f.Bool("yes", false, "do not ask for confirmation (and do not count first)")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageErr("purge takes no arguments (got %q); name topics with --topic", pos)
	}
	if *sequences {
		if len(topicArgs) > 0 || olderThanFlag.set {
			return usageErr("purge --sequences takes no --topic nor --older-than: it deletes the rows of every ordering key " +
				"without events; purge the delivered events first, in a run of their own")
		}
		if *limit < 0 {
			return usageErr("--limit is %d; give the most rows to delete, or 0 for all of them", *limit)
		}
		return runPurgeSequences(ctx, e, f, *limit, *dryRun, *yes)
	}
	if f.setFlags()["limit"] {
		return usageErr("--limit is for purge --sequences; a purge of delivered events deletes all those older than --older-than")
	}
	if len(topicArgs) == 0 || !olderThanFlag.set {
		f.printUsage(e.stderr)
		return usageErr("purge needs --topic and --older-than")
	}
	if *olderThan < 0 {
		return usageErr("--older-than is %v; give how old a delivery must be to go, such as 72h (0s: all delivered)", *olderThan)
	}
	topics := make([]outbox.Topic, len(topicArgs))
	for i, v := range topicArgs {
		if topics[i], err = parseTopic(v); err != nil {
			return err
		}
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	names := strings.Join(topicArgs, ", ")
	if *dryRun || !*yes {
		bound, err := purgeBound(ctx, e, c.Admin(), topics, *dryRun)
		if err != nil {
			return err
		}
		question := fmt.Sprintf("Delete the delivered events of %s older than %v? At most %d go: the topics hold %d delivered "+
			"event(s) of any age, and how many are older than %v is not counted.", names, *olderThan, bound, bound, *olderThan)
		dry := fmt.Sprintf("at most %d delivered event(s) of %s would be deleted (those older than %v; %d is how many the topics "+
			"hold of any age, how many are older is not counted)", bound, names, *olderThan, bound)
		if *olderThan == 0 {
			question = fmt.Sprintf("Delete all %d delivered event(s) of %s (and any delivered meanwhile)?", bound, names)
			dry = fmt.Sprintf("all %d delivered event(s) of %s would be deleted (and any delivered meanwhile)", bound, names)
		}
		switch {
		case bound == 0:
			fmt.Fprintf(e.stdout, "no delivered event of %s; nothing to purge\n", names)
			return nil
		case *dryRun:
			fmt.Fprintf(e.stdout, "dry run: %s; nothing was changed\n", dry)
			return nil
		}
		if err := confirm(e, question+" Their dedupe keys can then be enqueued again."); err != nil {
			return err
		}
	}
	n, err := c.Admin().Purge(ctx, *olderThan, topics...)
	if errors.Is(err, outbox.ErrInvalidConfig) {
		return withCode(exitUsage, err)
	}
	if err != nil {
		return fmt.Errorf("%w (%d deleted before the error)", err, n)
	}
	fmt.Fprintf(e.stdout, "deleted %d delivered event(s)\n", n)
	return nil
}

// purgeBound counts the delivered events of topics, of any age: at most
// what a purge of them deletes (Admin.Stats, which reads the whole table;
// nothing the outbox's roles may run counts them by age). With table, it
// prints the count of each topic first.
func purgeBound(ctx context.Context, e env, a *outbox.Admin, topics []outbox.Topic, table bool) (int64, error) {
	st, err := a.Stats(ctx)
	if err != nil {
		return 0, err
	}
	delivered := map[outbox.Topic]int64{}
	for _, s := range st.Topics {
		delivered[s.Topic] = s.Delivered
	}
	var total int64
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAMESPACE\tTOPIC\tDELIVERED (ANY AGE)")
	seen := map[outbox.Topic]bool{}
	for _, t := range topics {
		if seen[t] { // a topic given twice is purged once
			continue
		}
		seen[t] = true
		total += delivered[t]
		fmt.Fprintf(tw, "%s\t%s\t%d\n", t.Namespace, t.Topic, delivered[t])
	}
	if table {
		if err := tw.Flush(); err != nil {
			return 0, err
		}
	}
	return total, nil
}

// runPurgeSequences is purge --sequences: it deletes the sequence rows of
// ordering keys without events (Admin.PruneSequences), at most limit (0:
// all), after counting them unless yes.
func runPurgeSequences(ctx context.Context, e env, f *cmdFlags, limit int, dryRun, yes bool) error {
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	notMigrated := func(err error) error {
		if errors.Is(err, outbox.ErrNotMigrated) {
			return fmt.Errorf("purge --sequences needs migration 0045 in schema %s: run modkit-outbox migrate up as its owner: %w", f.schema, err)
		}
		return err
	}
	if dryRun || !yes {
		n, err := c.Admin().PrunableSequences(ctx)
		if err != nil {
			return notMigrated(err)
		}
		upTo := ""
		if limit > 0 && int64(limit) < n {
			upTo = fmt.Sprintf(" (--limit: %d of them)", limit)
			n = int64(limit)
		}
		switch {
		case n == 0:
			fmt.Fprintln(e.stdout, "no ordering key without events; nothing to purge")
			return nil
		case dryRun:
			fmt.Fprintf(e.stdout, "dry run: the sequence rows of %d ordering key(s) without events would be deleted%s; nothing was changed\n", n, upTo)
			return nil
		}
		if err := confirm(e, fmt.Sprintf("Delete the sequence rows of %d ordering key(s) that have no event left%s? "+
			"A key used again starts again at sequence 1, on a new stream.", n, upTo)); err != nil {
			return err
		}
	}
	n, err := c.Admin().PruneSequences(ctx, limit)
	if err != nil {
		return fmt.Errorf("%w (%d deleted before the error)", notMigrated(err), n)
	}
	fmt.Fprintf(e.stdout, "deleted the sequence rows of %d ordering key(s) without events\n", n)
	return nil
}
