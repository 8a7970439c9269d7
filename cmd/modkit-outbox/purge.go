package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/modkit-go/modkit/modkit/outbox"
)

const purgeExamples = `  modkit-outbox purge --topic shop/order_paid --older-than 72h
  modkit-outbox purge --topic shop/order_paid --topic shop/refunded --older-than 0s --yes
`

func runPurge(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "purge", "purge --topic NAMESPACE/TOPIC... --older-than DURATION [flags]", purgeExamples)
	var topicArgs listFlag
	f.Var(&topicArgs, "topic", "a topic to purge, `NAMESPACE/TOPIC` (repeat for several)")
	var olderThanFlag requiredDuration
	f.Var(&olderThanFlag, "older-than", "delete delivered events whose delivery is older than this `duration` (0s: all delivered)")
	olderThan := &olderThanFlag.d
	yes := f.Bool("yes", false, "do not ask for confirmation")
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
	if !*yes {
		q := fmt.Sprintf("Delete the delivered events of %s older than %v? Their dedupe keys can then be enqueued again.",
			strings.Join(topicArgs, ", "), *olderThan)
		if err := confirm(e, q); err != nil {
			return err
		}
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
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
