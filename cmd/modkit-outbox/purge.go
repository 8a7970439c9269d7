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

  # The count (of --dry-run and of the confirmation) is an upper bound: the
  # topics' delivered events of any age, which stats counts too (it reads
  # the whole table); which of them are older than --older-than is not
  # counted apart. With --older-than 0s every one of them goes. --yes
  # without --dry-run counts nothing.
`

func runPurge(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "purge", "purge --topic NAMESPACE/TOPIC... --older-than DURATION [flags]", purgeExamples)
	var topicArgs listFlag
	f.Var(&topicArgs, "topic", "a topic to purge, `NAMESPACE/TOPIC` (repeat for several)")
	var olderThanFlag requiredDuration
	f.Var(&olderThanFlag, "older-than", "delete delivered events whose delivery is older than this `duration` (0s: all delivered)")
	olderThan := &olderThanFlag.d
	dryRun := f.Bool("dry-run", false, "count the delivered events of the topics, at most what would be deleted, and delete nothing")
	yes := f.Bool("yes", false, "do not ask for confirmation (and do not count first)")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageErr("purge takes no arguments (got %q); name topics with --topic", pos)
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
