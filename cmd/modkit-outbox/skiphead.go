package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// skipHeadArgs is what dead skip-head was given.
type skipHeadArgs struct {
	ids        []string // the positional arguments: the head's event id
	topic, key string   // or the ordering key, NAMESPACE/TOPIC and KEY
	keySet     bool     // --key was given (perhaps empty)
	by         string
	dryRun     bool
	yes        bool
}

// blockedKeysSearched is how many blocked keys skip-head searches for the
// one it was given (Admin.BlockedKeys' most).
const blockedKeysSearched = 10000

// runSkipHead lets the later events of an ordering key go on without its
// dead head (Admin.SkipHead), after showing the head and confirming.
func runSkipHead(ctx context.Context, e env, f *cmdFlags, a skipHeadArgs) error {
	var (
		id    uuid.UUID
		topic outbox.Topic
	)
	switch {
	case len(a.ids) > 1:
		return usageErr("skip-head takes one event id (got %d); skip the heads of several keys one at a time", len(a.ids))
	case len(a.ids) == 1:
		if a.topic != "" || a.keySet {
			return usageErr("give the dead head's event id, or --topic and --key, not both")
		}
		var err error
		if id, err = uuid.Parse(a.ids[0]); err != nil {
			return usageErr("%q is not an event id (a UUID)", a.ids[0])
		}
	default:
		if a.topic == "" || !a.keySet {
			f.printUsage(e.stderr)
			return usageErr("skip-head needs the dead head's event id, or --topic NAMESPACE/TOPIC and --key KEY (modkit-outbox stats lists both)")
		}
		var err error
		if topic, err = parseTopic(a.topic); err != nil {
			return err
		}
		if strings.TrimSpace(a.key) == "" {
			return usageErr("--key is blank; give the ordering key as modkit-outbox stats shows it")
		}
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	adm := c.Admin()

	blocked, err := adm.BlockedKeys(ctx, blockedKeysSearched)
	if err != nil {
		return err
	}
	var head outbox.BlockedKey
	if len(a.ids) == 1 { // by the id given, even the nil UUID (not "no id": it looks up no key)
		head, err = headByID(ctx, adm, blocked, id)
	} else {
		head, err = headByKey(e, blocked, topic, a.key)
	}
	if err != nil {
		return err
	}

	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAMESPACE\tTOPIC\tKEY\tHEAD\tSEQ\tWAITING\tDEAD FOR\tLAST ERROR")
	lastError := head.LastError
	fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", head.Topic.Namespace, head.Topic.Topic, head.OrderingKey, head.Head,
		head.HeadSequence, waitingText(head.Waiting), fmtAge(time.Since(head.DeadSince)), oneLine(&lastError, 60))
	if err := tw.Flush(); err != nil {
		return err
	}
	what := fmt.Sprintf("the dead head %s of %s/%s key %q", head.Head, head.Topic.Namespace, head.Topic.Topic, head.OrderingKey)
	if a.dryRun {
		fmt.Fprintf(e.stdout, "dry run: %s would be skipped; nothing was changed\n", what)
		return nil
	}
	if !a.yes {
		q := fmt.Sprintf("Skip %s? The key's later events will be published without it; replayed afterwards, it is delivered out of order.", what)
		if err := confirm(e, q); err != nil {
			return err
		}
	}
	err = adm.SkipHead(ctx, a.by, head.Head)
	switch {
	case errors.Is(err, outbox.ErrInvalidConfig):
		return withCode(exitUsage, err)
	case errors.Is(err, outbox.ErrNotFound):
		return withCode(exitNotFound, fmt.Errorf("%s was not skipped: it no longer holds its key back (replayed, purged or skipped meanwhile); nothing was changed", head.Head))
	case err != nil:
		return err
	}
	fmt.Fprintf(e.stdout, "skipped %s: the key's later events go on without it\n", what)
	fmt.Fprintf(e.stdout, "it stays dead: modkit-outbox dead replay %s delivers it, out of order\n", head.Head)
	return nil
}

// headByID returns the blocked key whose dead head is id, or an error that
// says why id holds no key back. A head beyond the keys searched is
// returned as found in the event itself (its Waiting unknown, -1); SkipHead
// decides.
func headByID(ctx context.Context, adm *outbox.Admin, blocked []outbox.BlockedKey, id uuid.UUID) (outbox.BlockedKey, error) {
	for _, b := range blocked {
		if b.Head == id {
			return b, nil
		}
	}
	ev, err := adm.Get(ctx, id)
	if errors.Is(err, outbox.ErrNotFound) {
		return outbox.BlockedKey{}, withCode(exitNotFound, fmt.Errorf("no event %s in this schema (check --schema); nothing was skipped", id))
	}
	if err != nil {
		return outbox.BlockedKey{}, err
	}
	switch {
	case ev.Status != outbox.StatusDead:
		return outbox.BlockedKey{}, withCode(exitNotFound, fmt.Errorf("%s is %s, not dead: only a dead head holds its ordering key back; nothing was skipped", id, ev.Status))
	case ev.OrderingKey == "":
		return outbox.BlockedKey{}, withCode(exitNotFound, fmt.Errorf("%s has no ordering key, so it holds nothing back (modkit-outbox dead replay delivers it); nothing was skipped", id))
	case len(blocked) < blockedKeysSearched:
		return outbox.BlockedKey{}, whyNotHead(ctx, adm, blocked, ev)
	}
	return outbox.BlockedKey{Topic: outbox.Topic{Namespace: ev.Namespace, Topic: ev.Topic}, OrderingKey: ev.OrderingKey,
		Head: ev.ID, HeadSequence: ev.Sequence, Waiting: -1, LastError: deref(ev.LastError), DeadSince: ev.UpdatedAt}, nil
}

// whyNotHead returns the error that says why ev, a dead event with an
// ordering key that heads none of blocked (every blocked key), is not a
// head skip-head can skip: it was skipped already (its history says so),
// or an event of its key before it holds the key back, as Admin.SkipHead
// decides: the key's dead head, named when blocked lists it, or else an
// earlier event still pending or processing.
func whyNotHead(ctx context.Context, adm *outbox.Admin, blocked []outbox.BlockedKey, ev outbox.Event) error {
	history, err := adm.History(ctx, ev.ID)
	if err != nil {
		return err
	}
	if slices.ContainsFunc(history, func(h outbox.Attempt) bool { return h.Outcome == "skipped" }) {
		return withCode(exitNotFound, fmt.Errorf("%s no longer holds its key %q back: it was skipped already; nothing was skipped", ev.ID, ev.OrderingKey))
	}
	topic := outbox.Topic{Namespace: ev.Namespace, Topic: ev.Topic}
	for _, b := range blocked {
		if b.Topic == topic && b.OrderingKey == ev.OrderingKey && b.HeadSequence < ev.Sequence {
			return withCode(exitNotFound, fmt.Errorf("%s is not the dead head of key %q: the dead event %s before it (event %d of the key) "+
				"holds the key back and must be skipped first (modkit-outbox dead skip-head %s), or replayed; nothing was skipped",
				ev.ID, ev.OrderingKey, b.Head, b.HeadSequence, b.Head))
		}
	}
	return withCode(exitNotFound, fmt.Errorf("%s is not the dead head of key %q: an earlier event of the key is still pending or processing; "+
		"it becomes the head once those are delivered (modkit-outbox events list --topic %s/%s lists the key's events); nothing was skipped",
		ev.ID, ev.OrderingKey, ev.Namespace, ev.Topic))
}

// headByKey returns the dead head of topic's ordering key: the earliest of
// its dead events that are not skipped.
func headByKey(e env, blocked []outbox.BlockedKey, topic outbox.Topic, key string) (outbox.BlockedKey, error) {
	var found []outbox.BlockedKey
	for _, b := range blocked {
		if b.Topic == topic && b.OrderingKey == key {
			found = append(found, b)
		}
	}
	if len(found) == 0 {
		msg := fmt.Sprintf("no dead event holds back key %q of %s/%s (modkit-outbox stats lists the blocked keys; check --schema); nothing was skipped",
			key, topic.Namespace, topic.Topic)
		if len(blocked) == blockedKeysSearched {
			msg += fmt.Sprintf("; only the %d longest blocked keys were searched: pass the head's event id instead", blockedKeysSearched)
		}
		return outbox.BlockedKey{}, withCode(exitNotFound, errors.New(msg))
	}
	head := found[0]
	for _, b := range found[1:] {
		if b.HeadSequence < head.HeadSequence {
			head = b
		}
	}
	if len(found) > 1 {
		fmt.Fprintf(e.stderr, "key %q has %d dead events not skipped; this skips the earliest (sequence %d)\n", key, len(found), head.HeadSequence)
	}
	return head, nil
}

// waitingText prints a count of waiting events, "?" when unknown.
func waitingText(n int64) string {
	if n < 0 {
		return "?"
	}
	return fmt.Sprint(n)
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
