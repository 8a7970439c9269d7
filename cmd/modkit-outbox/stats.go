package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

const statsExamples = `  modkit-outbox stats
  modkit-outbox stats --json | jq '.total.dead'
  modkit-outbox stats --backlog    # a table that keeps many delivered events
  modkit-outbox stats --json | jq '.blocked_keys[] | select(.waiting == 0)'   # dead heads with nothing behind them yet

  # The table lists, one line each, the ordering keys with a dead head and
  # events after it (WAITING: the key's pending and leased events after its
  # earliest dead head, which they wait for), and counts those with none
  # yet: their head holds back only the key's events still to come. Under
  # a publisher with SkipDeadHeads nothing waits (the events after a dead
  # head go on without it), and a key has a dead head after each run of
  # events that went on (HEADS; the line shows the earliest). The JSON
  # lists every dead head read, a key once for each, with its "waiting".
`

type statsJSON struct {
	Topics      []topicStatsJSON `json:"topics"`
	Total       topicStatsJSON   `json:"total"`
	BlockedKeys []blockedKeyJSON `json:"blocked_keys"`
	// MoreBlockedKeys: there are more dead heads than the --blocked-keys
	// read.
	MoreBlockedKeys bool `json:"more_blocked_keys,omitempty"`
	// Unserved: the topics whose due events no running dispatcher serves
	// (Admin.Unserved); absent when that cannot be told (a schema before
	// migration 0034, a role refused its function).
	Unserved *[]topicStatsJSON `json:"unserved,omitempty"`
}

type blockedKeyJSON struct {
	Namespace    string `json:"namespace"`
	Topic        string `json:"topic"`
	OrderingKey  string `json:"ordering_key"`
	Head         string `json:"head"`
	HeadSequence int64  `json:"head_sequence"`
	Waiting      int64  `json:"waiting"` // 0: nothing waits behind the dead head yet; the key's next event will
	DeadSince    string `json:"dead_since"`
	LastError    string `json:"last_error,omitempty"`
}

// blockedKeysMax bounds --blocked-keys (Admin.BlockedKeys' own bound).
const blockedKeysMax = 10000

type topicStatsJSON struct {
	Namespace           string  `json:"namespace,omitempty"`
	Topic               string  `json:"topic,omitempty"`
	Pending             int64   `json:"pending"`
	Processing          int64   `json:"processing"`
	Delivered           *int64  `json:"delivered,omitempty"` // absent with --backlog
	Dead                int64   `json:"dead"`
	OldestDueAgeSeconds float64 `json:"oldest_due_age_seconds"`
}

func topicStatsToJSON(s outbox.TopicStats, backlog bool) topicStatsJSON {
	out := topicStatsJSON{Namespace: s.Namespace, Topic: s.Topic.Topic, Pending: s.Pending, Processing: s.Processing,
		Dead: s.Dead, OldestDueAgeSeconds: secondsJSON(s.OldestDueAge)}
	if !backlog {
		out.Delivered = &s.Delivered
	}
	return out
}

// secondsJSON is d in seconds rounded to milliseconds, for the JSON:
// d.Seconds() prints float noise (5.7004850000000005), and a whole number
// of milliseconds divided by 1000 prints at most three decimals.
func secondsJSON(d time.Duration) float64 {
	return float64(d.Round(time.Millisecond).Milliseconds()) / 1000
}

func runStats(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "stats", "stats [flags]", statsExamples)
	asJSON := f.Bool("json", false, "print JSON instead of a table")
	backlog := f.Bool("backlog", false, "count pending, processing and dead events only, from their indexes, without reading the delivered events kept (no DELIVERED column; no \"delivered\" in the JSON; on a schema before migration 0027 it reads the whole table)")
	shown := f.Int("blocked-keys", 100, "read at most this many dead heads of ordering keys, longest dead first (at most 10000; "+
		"a key has several under a publisher with SkipDeadHeads): the table lists by key those with events waiting behind "+
		"the head and counts the others, the JSON lists every head read")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageErr("stats takes no arguments (got %q)", pos)
	}
	if *shown < 1 || *shown > blockedKeysMax {
		return usageErr("--blocked-keys is %d; use 1 to %d", *shown, blockedKeysMax)
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	count := c.Admin().Stats
	if *backlog {
		count = c.Admin().Backlog
	}
	st, err := count(ctx)
	if err != nil {
		return err
	}
	// One more than shown, to tell whether there are more.
	blocked, err := c.Admin().BlockedKeys(ctx, min(*shown+1, blockedKeysMax))
	if err != nil {
		return err
	}
	more := len(blocked) > *shown
	blocked = blocked[:min(len(blocked), *shown)]
	// Which topics nobody serves is a warning beside the counts: when it
	// cannot be read (a schema before migration 0034, a role refused the
	// function), the counts are printed without it.
	unserved, err := c.Admin().Unserved(ctx)
	known := err == nil
	if err != nil && !errors.Is(err, outbox.ErrNotMigrated) {
		fmt.Fprintf(e.stderr, "warning: could not tell which topics a dispatcher serves: %v\n", err)
	}
	if *asJSON {
		out := statsJSON{Topics: []topicStatsJSON{}, Total: topicStatsToJSON(st.Total, *backlog), BlockedKeys: []blockedKeyJSON{},
			MoreBlockedKeys: more}
		if known {
			list := []topicStatsJSON{}
			for _, t := range unserved {
				list = append(list, topicStatsToJSON(t, true))
			}
			out.Unserved = &list
		}
		for _, t := range st.Topics {
			out.Topics = append(out.Topics, topicStatsToJSON(t, *backlog))
		}
		for _, b := range blocked {
			out.BlockedKeys = append(out.BlockedKeys, blockedKeyJSON{Namespace: b.Topic.Namespace, Topic: b.Topic.Topic,
				OrderingKey: b.OrderingKey, Head: b.Head.String(), HeadSequence: b.HeadSequence, Waiting: b.Waiting,
				DeadSince: b.DeadSince.UTC().Format(time.RFC3339), LastError: b.LastError})
		}
		return writeJSON(e.stdout, out)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	if *backlog {
		fmt.Fprintln(tw, "NAMESPACE\tTOPIC\tPENDING\tPROCESSING\tDEAD\tOLDEST DUE")
	} else {
		fmt.Fprintln(tw, "NAMESPACE\tTOPIC\tPENDING\tPROCESSING\tDELIVERED\tDEAD\tOLDEST DUE")
	}
	row := func(ns, topic string, s outbox.TopicStats) {
		if *backlog {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\n", ns, topic, s.Pending, s.Processing, s.Dead, fmtAge(s.OldestDueAge))
			return
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%s\n", ns, topic, s.Pending, s.Processing, s.Delivered, s.Dead, fmtAge(s.OldestDueAge))
	}
	for _, t := range st.Topics {
		row(t.Namespace, t.Topic.Topic, t)
	}
	row("TOTAL", "", st.Total)
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(unserved) > 0 {
		fmt.Fprintf(e.stdout, "\nTOPICS NO RUNNING DISPATCHER SERVES (their events wait: is a publisher registered for each, in a service that runs?)\n")
		tw = tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAMESPACE\tTOPIC\tPENDING\tPROCESSING\tOLDEST DUE")
		for _, t := range unserved {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", t.Namespace, t.Topic.Topic, t.Pending, t.Processing, fmtAge(t.OldestDueAge))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	// Admin.BlockedKeys returns dead heads: under a publisher with
	// SkipDeadHeads a key gets one each time an event of it dies and the
	// key goes on without it, so the table goes by key, each with its earliest
	// head (the one its later events wait for, when they wait) and how many
	// it has. A key whose earliest head has nothing behind it holds nothing
	// back yet (often a key's only event): counted, not listed among the
	// keys that hold events back, which it would crowd out.
	keys := byKey(blocked)
	var holding []blockedKeyRow
	for _, k := range keys {
		if k.Waiting > 0 {
			holding = append(holding, k)
		}
	}
	if len(holding) > 0 {
		fmt.Fprintf(e.stdout, "\nORDERING KEYS WITH A DEAD HEAD (a dead head holds back the later events of its key, WAITING, until it "+
			"is replayed with \"dead replay HEAD\" or skipped with \"dead skip-head HEAD\"; under a publisher with SkipDeadHeads "+
			"nothing waits, and a key may have several dead heads, HEADS, of which HEAD is the earliest)\n")
		tw = tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAMESPACE\tTOPIC\tKEY\tHEAD\tSEQ\tHEADS\tWAITING\tDEAD FOR")
		for _, k := range holding {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%s\n", k.Topic.Namespace, k.Topic.Topic, k.OrderingKey, k.Head, k.HeadSequence,
				k.Heads, k.Waiting, fmtAge(time.Since(k.DeadSince)))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if idle := len(keys) - len(holding); idle > 0 {
		what := "\n%d ordering key(s) have"
		if len(holding) > 0 {
			what = "%d more ordering key(s), not listed, have"
		}
		fmt.Fprintf(e.stdout, what+" a dead head with no event waiting behind it, which holds back only the key's events "+
			"still to come (none under a publisher with SkipDeadHeads; stats --json lists them, with \"waiting\": 0)\n", idle)
	}
	if more {
		fmt.Fprintf(e.stdout, "… more dead heads than the %d read, of %d key(s): other keys may have one, and these more than "+
			"counted; --blocked-keys reads more (at most %d)\n", *shown, len(keys), blockedKeysMax)
	}
	return nil
}

// blockedKeyRow is one ordering key of stats' table: its earliest dead
// head among those read, and how many dead heads of it were read.
type blockedKeyRow struct {
	outbox.BlockedKey
	Heads int
}

// byKey groups dead heads (Admin.BlockedKeys, longest dead first) by
// ordering key, in the order each key first appears. A key's row is its
// dead head earliest in the key, whose Waiting counts every pending or
// leased event after it: all the key's events that may wait.
func byKey(heads []outbox.BlockedKey) []blockedKeyRow {
	type key struct {
		topic outbox.Topic
		key   string
	}
	at := map[key]int{}
	var out []blockedKeyRow
	for _, h := range heads {
		k := key{h.Topic, h.OrderingKey}
		i, ok := at[k]
		if !ok {
			at[k] = len(out)
			out = append(out, blockedKeyRow{BlockedKey: h, Heads: 1})
			continue
		}
		out[i].Heads++
		if h.HeadSequence < out[i].HeadSequence {
			out[i].BlockedKey = h
		}
	}
	return out
}
