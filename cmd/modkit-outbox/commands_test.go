package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// TestStatsTable checks the table against its golden text. Pending events
// are retried an hour ahead so that no age depends on the test's speed (and
// no topic is listed as served by none: none has a due event).
func TestStatsTable(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 5)
	f.settle(t, orders, 2, driver.Delivered, 0)
	f.settle(t, orders, 1, driver.Dead, 0)
	f.settle(t, orders, 2, driver.Retry, time.Hour)
	f.enqueue(t, mails, 1)
	f.settle(t, mails, 1, driver.Dead, 0)

	got := cli(t, f.dsn, "stats").must(t, exitOK).stdout
	const golden = `NAMESPACE  TOPIC         PENDING  PROCESSING  DELIVERED  DEAD  OLDEST DUE
crm        welcome_mail  0        0           0          1     -
shop       order_paid    2        0           2          1     -
TOTAL                    2        0           2          2     -
`
	if got != golden {
		t.Fatalf("stats table:\n%s\nwant:\n%s", got, golden)
	}

	var st statsJSON
	out := cli(t, f.dsn, "stats", "--json").must(t, exitOK).stdout
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	if len(st.Topics) != 2 || st.Total.Dead != 2 || st.Topics[1].Delivered == nil || *st.Topics[1].Delivered != 2 || st.Topics[1].Pending != 2 {
		t.Fatalf("stats --json: %+v", st)
	}
	if st.Unserved == nil || len(*st.Unserved) != 0 {
		t.Fatalf("stats --json: unserved %+v; want an empty list (no topic has a due event)", st.Unserved)
	}

	// --backlog: the same counts without the delivered ones; a topic with
	// delivered events only would not be listed.
	got = cli(t, f.dsn, "stats", "--backlog").must(t, exitOK).stdout
	const goldenBacklog = `NAMESPACE  TOPIC         PENDING  PROCESSING  DEAD  OLDEST DUE
crm        welcome_mail  0        0           1     -
shop       order_paid    2        0           1     -
TOTAL                    2        0           2     -
`
	if got != goldenBacklog {
		t.Fatalf("stats --backlog table:\n%s\nwant:\n%s", got, goldenBacklog)
	}
	out = cli(t, f.dsn, "stats", "--backlog", "--json").must(t, exitOK).stdout
	if strings.Contains(out, `"delivered"`) {
		t.Fatalf("stats --backlog --json has delivered counts:\n%s", out)
	}
	st = statsJSON{}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("stats --backlog --json: %v\n%s", err, out)
	}
	if len(st.Topics) != 2 || st.Total.Dead != 2 || st.Topics[1].Pending != 2 || st.Topics[1].Delivered != nil {
		t.Fatalf("stats --backlog --json: %+v", st)
	}
}

// TestStatsJSONAges: stats --json prints the oldest due age in seconds
// rounded to milliseconds, without float noise, in every list it has
// (topics, total, unserved).
func TestStatsJSONAges(t *testing.T) {
	for _, c := range []struct {
		age  time.Duration
		want string
	}{
		{5700485000 * time.Nanosecond, `"oldest_due_age_seconds":5.7}`},
		{1500*time.Millisecond + 499*time.Microsecond, `"oldest_due_age_seconds":1.5}`},
		{90061001234567 * time.Nanosecond, `"oldest_due_age_seconds":90061.001}`},
		{0, `"oldest_due_age_seconds":0}`},
	} {
		b, err := json.Marshal(topicStatsToJSON(outbox.TopicStats{OldestDueAge: c.age}, true))
		if err != nil || !strings.HasSuffix(string(b), c.want) {
			t.Errorf("the JSON of an oldest due age of %v: %s %v, want it to end with %s", c.age, b, err, c.want)
		}
	}

	f := newFixture(t)
	f.enqueue(t, orders, 1) // due now: an age of a fraction of a second, in microseconds
	out := cli(t, f.dsn, "stats", "--json").must(t, exitOK).stdout
	ages := regexp.MustCompile(`"oldest_due_age_seconds": ([^,\n]*)`).FindAllStringSubmatch(out, -1)
	if len(ages) != 3 { // the topic, the total, and the topic as unserved
		t.Fatalf("stats --json: %d oldest due ages, want 3:\n%s", len(ages), out)
	}
	for _, a := range ages {
		if !regexp.MustCompile(`^\d+(\.\d{1,3})?$`).MatchString(a[1]) {
			t.Errorf("stats --json: oldest_due_age_seconds %s, want seconds with at most three decimals", a[1])
		}
	}
}

// TestStatsUnserved: a topic with a due event and no dispatcher is listed
// after the table, and in the JSON; a topic a dispatcher leads is not.
func TestStatsUnserved(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 1)
	f.enqueue(t, mails, 1)
	if _, err := f.store.Elect(bg, driver.ElectParams{Roles: []string{"maintenance:crm:welcome_mail"}, Holder: uuid.New(), TTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	out := cli(t, f.dsn, "stats").must(t, exitOK).stdout
	section := regexp.MustCompile(`(?s)TOPICS NO RUNNING DISPATCHER SERVES.*`).FindString(out)
	if !regexp.MustCompile(`(?m)^shop +order_paid +1 +0 `).MatchString(section) || strings.Contains(section, "welcome_mail") {
		t.Fatalf("stats: want shop/order_paid, and not crm/welcome_mail, listed as served by none:\n%s", out)
	}
	var st statsJSON
	if err := json.Unmarshal([]byte(cli(t, f.dsn, "stats", "--json").must(t, exitOK).stdout), &st); err != nil {
		t.Fatal(err)
	}
	if st.Unserved == nil || len(*st.Unserved) != 1 || (*st.Unserved)[0].Topic != "order_paid" || (*st.Unserved)[0].Pending != 1 {
		t.Fatalf("stats --json: unserved %+v; want shop/order_paid with 1 pending", st.Unserved)
	}
}

// TestStatsWhenUnservedIsRefused: a role refused the function that tells
// which topics are served (grants changed by hand) still gets the counts,
// with a warning on stderr, and the JSON has no "unserved" field.
func TestStatsWhenUnservedIsRefused(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 1)
	reader, _ := f.login(t, "modkit_outbox_reader")
	if _, err := f.pool.Exec(bg, "REVOKE EXECUTE ON FUNCTION public.modkit_outbox_served_topics(timestamptz) FROM modkit_outbox_reader"); err != nil {
		t.Fatal(err)
	}
	r := cli(t, reader, "stats").must(t, exitOK)
	if !strings.Contains(r.stderr, "warning: could not tell which topics a dispatcher serves") || !strings.Contains(r.stderr, "42501") {
		t.Fatalf("stats as a role refused the function: stderr\n%s", r.stderr)
	}
	if !regexp.MustCompile(`(?m)^shop +order_paid +1 +0 `).MatchString(r.stdout) || strings.Contains(r.stdout, "NO RUNNING DISPATCHER") {
		t.Fatalf("stats as a role refused the function: want the counts without the unserved section:\n%s", r.stdout)
	}
	r = cli(t, reader, "stats", "--json").must(t, exitOK)
	var st statsJSON
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil {
		t.Fatal(err)
	}
	if st.Unserved != nil || len(st.Topics) != 1 || st.Topics[0].Pending != 1 || strings.Contains(r.stdout, `"unserved"`) {
		t.Fatalf("stats --json as a role refused the function: %s", r.stdout)
	}
}

// TestStatsBlockedKeysUnderSkipDeadHeads: under a publisher with
// SkipDeadHeads a key goes on past each of its dead events, each then a
// dead head (Admin.BlockedKeys lists each); the table lists the key once,
// with its earliest head and how many it has, counts keys rather than dead
// events, and says that under SkipDeadHeads nothing waits. The JSON lists
// every head, as before. (It listed acct-k three times, and a trial's
// "45 ordering key(s) have a dead head" counted 45 dead events of 26 keys.)
func TestStatsBlockedKeysUnderSkipDeadHeads(t *testing.T) {
	f := newFixture(t)
	ids := f.enqueueKey(t, orders, "acct-k", 6)
	for i, kind := range []driver.OutcomeKind{driver.Dead, driver.Delivered, driver.Dead, driver.Delivered, driver.Dead} {
		if got := f.settleSkippingDead(t, orders, 1, kind); len(got) != 1 || got[0] != ids[i] {
			t.Fatalf("settled %v, want the key's event %d %s", got, i+1, ids[i])
		}
	}
	// Two keys whose dead heads hold nothing back: acct-l's two (nothing
	// after the second) and acct-m's only event.
	l := f.enqueueKey(t, mails, "acct-l", 3)
	for i, kind := range []driver.OutcomeKind{driver.Dead, driver.Delivered, driver.Dead} {
		if got := f.settleSkippingDead(t, mails, 1, kind); len(got) != 1 || got[0] != l[i] {
			t.Fatalf("settled %v, want acct-l's event %d %s", got, i+1, l[i])
		}
	}
	f.enqueueKey(t, mails, "acct-m", 1)
	if got := f.settle(t, mails, 1, driver.Dead, 0); len(got) != 1 {
		t.Fatalf("settled %v, want acct-m's event", got)
	}
	if heads := f.blockedHeads(t); len(heads) != 6 {
		t.Fatalf("dead heads %v, want acct-k's three, acct-l's two and acct-m's one", heads)
	}
	lines := func(out, part string) int {
		n := 0
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, part) {
				n++
			}
		}
		return n
	}
	out := cli(t, f.dsn, "stats").must(t, exitOK).stdout
	row := regexp.MustCompile(`(?m)^shop +order_paid +acct-k +` + ids[0].String() + ` +1 +3 +1 +\S+$`)
	if lines(out, "acct-k") != 1 || !row.MatchString(out) || !strings.Contains(out, "under a publisher with SkipDeadHeads nothing waits") ||
		!strings.Contains(out, "\n2 more ordering key(s), not listed, have a dead head") || strings.Contains(out, "more dead heads") {
		t.Fatalf("stats with a key of three dead heads (one line: its first, seq 1, 3 heads, 1 waiting) and two keys "+
			"of idle heads, counted as two:\n%s", out)
	}
	var st statsJSON
	if err := json.Unmarshal([]byte(cli(t, f.dsn, "stats", "--json").must(t, exitOK).stdout), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.BlockedKeys) != 6 || st.MoreBlockedKeys {
		t.Fatalf("stats --json lists %d dead heads (more: %v), want all 6", len(st.BlockedKeys), st.MoreBlockedKeys)
	}

	// Three dead heads read of six, all acct-k's: one key, and more.
	out = cli(t, f.dsn, "stats", "--blocked-keys", "3").must(t, exitOK).stdout
	if lines(out, "acct-k") != 1 || !row.MatchString(out) || strings.Contains(out, "acct-l") || strings.Contains(out, "ordering key(s)") ||
		!strings.Contains(out, "more dead heads than the 3 read, of 1 key(s)") {
		t.Fatalf("stats --blocked-keys 3 of six dead heads:\n%s", out)
	}
	// Six of six: no more.
	if out := cli(t, f.dsn, "stats", "--blocked-keys", "6").must(t, exitOK).stdout; strings.Contains(out, "more dead heads") ||
		!strings.Contains(out, "2 more ordering key(s), not listed") {
		t.Fatalf("stats --blocked-keys 6 of six dead heads:\n%s", out)
	}
}

// TestStatsBlockedKeys: an ordering key whose head is dead is listed after
// the table, and in the JSON.
func TestStatsBlockedKeys(t *testing.T) {
	f := newFixture(t)
	// A key whose only event is dead: its head holds nothing back yet, and
	// the table counts it rather than listing it.
	f.enqueueKey(t, orders, "acct-9", 1)
	idle := f.settle(t, orders, 1, driver.Dead, 0)
	out := cli(t, f.dsn, "stats").must(t, exitOK).stdout
	if strings.Contains(out, "ORDERING KEYS WITH A DEAD HEAD") || strings.Contains(out, "acct-9") ||
		!strings.Contains(out, "\n1 ordering key(s) have a dead head with no event waiting behind it") {
		t.Fatalf("stats with a dead head that holds nothing back:\n%s", out)
	}

	f.enqueueKey(t, orders, "acct-7", 3)
	head := f.settle(t, orders, 3, driver.Dead, 0) // only the head is claimable
	if len(head) != 1 {
		t.Fatalf("claimed %d events of one key, want its head alone", len(head))
	}
	out = cli(t, f.dsn, "stats").must(t, exitOK).stdout
	if !strings.Contains(out, "ORDERING KEYS WITH A DEAD HEAD") || !strings.Contains(out, "acct-7") || !strings.Contains(out, head[0].String()) ||
		strings.Contains(out, "acct-9") || !strings.Contains(out, "1 more ordering key(s), not listed, have a dead head with no event waiting") {
		t.Fatalf("stats with a blocked key (acct-7) and a dead head holding nothing back (acct-9):\n%s", out)
	}
	var st statsJSON
	if err := json.Unmarshal([]byte(cli(t, f.dsn, "stats", "--json").must(t, exitOK).stdout), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.BlockedKeys) != 2 || st.BlockedKeys[0].OrderingKey != "acct-9" || st.BlockedKeys[0].Waiting != 0 ||
		st.BlockedKeys[0].Head != idle[0].String() || st.BlockedKeys[1].OrderingKey != "acct-7" || st.BlockedKeys[1].Waiting != 2 ||
		st.BlockedKeys[1].HeadSequence != 1 || st.MoreBlockedKeys || strings.Contains(out, "more dead heads") {
		t.Fatalf("stats --json blocked keys (both, longest dead first): %+v", st)
	}

	// More dead heads than read: stats says so.
	f.enqueueKey(t, orders, "acct-8", 2)
	if head := f.settle(t, orders, 1, driver.Dead, 0); len(head) != 1 {
		t.Fatalf("claimed %d events, want acct-8's head", len(head))
	}
	out = cli(t, f.dsn, "stats", "--blocked-keys", "2").must(t, exitOK).stdout
	if !strings.Contains(out, "acct-7") || strings.Contains(out, "acct-8") || !strings.Contains(out, "more dead heads than the 2 read, of 2 key(s)") {
		t.Fatalf("stats --blocked-keys 2 of three keys with a dead head:\n%s", out)
	}
	st = statsJSON{}
	if err := json.Unmarshal([]byte(cli(t, f.dsn, "stats", "--json", "--blocked-keys", "2").must(t, exitOK).stdout), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.BlockedKeys) != 2 || !st.MoreBlockedKeys {
		t.Fatalf("stats --json --blocked-keys 2 of three keys with a dead head: %+v", st)
	}
	if out := cli(t, f.dsn, "stats", "--blocked-keys", "3").must(t, exitOK).stdout; !strings.Contains(out, "acct-7") || !strings.Contains(out, "acct-8") ||
		strings.Contains(out, "acct-9") || strings.Contains(out, "more dead heads") || !strings.Contains(out, "1 more ordering key(s), not listed") {
		t.Fatalf("stats --blocked-keys 3 of three keys with a dead head:\n%s", out)
	}
}

// TestEventsList parses the JSON output through its filters and pages.
func TestEventsList(t *testing.T) {
	f := newFixture(t)
	ids := f.enqueue(t, orders, 3)
	f.settle(t, orders, 1, driver.Dead, 0)
	f.enqueue(t, mails, 2)

	list := func(args ...string) pageJSON {
		t.Helper()
		out := cli(t, f.dsn, append([]string{"events", "list", "--json"}, args...)...).must(t, exitOK).stdout
		var p pageJSON
		if err := json.Unmarshal([]byte(out), &p); err != nil {
			t.Fatalf("events list %v: %v\n%s", args, err, out)
		}
		return p
	}
	if p := list(); len(p.Events) != 5 || p.NextPage != "" || p.Events[0].ID != ids[0].String() || p.Events[0].Payload != nil {
		t.Fatalf("all events: %+v", p)
	}
	if p := list("--status", "dead"); len(p.Events) != 1 || p.Events[0].ID != ids[0].String() ||
		p.Events[0].LastError == nil || !strings.Contains(*p.Events[0].LastError, "consumer said no") {
		t.Fatalf("dead events: %+v", p)
	}
	if p := list("--topic", "crm/welcome_mail"); len(p.Events) != 2 || p.Events[0].Namespace != "crm" {
		t.Fatalf("crm/welcome_mail: %+v", p)
	}
	if p := list("--topic", "order_paid", "--status", "pending"); len(p.Events) != 2 {
		t.Fatalf("pending order_paid: %+v", p)
	}
	if p := list("--since", "1h", "--until", "0s"); len(p.Events) != 5 {
		t.Fatalf("the last hour: %+v", p)
	}
	// Pages of two, by cursor, cover everything once.
	var seen []string
	args := []string{"--limit", "2"}
	for pages := 0; ; pages++ {
		p := list(args...)
		for _, e := range p.Events {
			seen = append(seen, e.ID)
		}
		if p.NextPage == "" {
			if pages != 2 {
				t.Fatalf("%d pages of two for five events", pages+1)
			}
			break
		}
		args = []string{"--limit", "2", "--after", p.NextPage}
	}
	if len(seen) != 5 || seen[0] != ids[0].String() {
		t.Fatalf("paged ids: %v", seen)
	}
	if p := list("--limit", "2", "--all", "--payload"); len(p.Events) != 5 || !strings.Contains(string(p.Events[0].Payload), "s3cr3t") {
		t.Fatalf("--all --payload: %+v", p)
	}

	table := cli(t, f.dsn, "events", "list", "--status", "dead").must(t, exitOK).stdout
	lines := strings.Split(strings.TrimSpace(table), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[1], ids[0].String()) ||
		!strings.Contains(lines[1], "boom: consumer said no") {
		t.Fatalf("table:\n%s", table)
	}
	r := cli(t, f.dsn, "events", "list", "--limit", "1").must(t, exitOK)
	if !strings.Contains(r.stderr, "--after ") {
		t.Fatalf("no hint at the next page on stderr: %q", r.stderr)
	}
}

// TestInvertedTimeRange: a --since that is not before --until (which
// would match nothing, silently) is refused naming both flags, by events
// list and by dead replay and purge, which change nothing then.
func TestInvertedTimeRange(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 1)
	dead := f.settle(t, orders, 1, driver.Dead, 0)[0]
	for _, args := range [][]string{
		{"events", "list", "--since", "2h", "--until", "3h"},
		{"events", "list", "--since", "1h", "--until", "2000-01-01T00:00:00Z"},
		{"events", "list", "--since", "2026-01-02T15:04:05Z", "--until", "2026-01-02T15:04:05Z"},
		{"dead", "replay", "--since", "10m", "--until", "1h", "--topic", "shop/order_paid", "--yes"},
		{"dead", "purge", "--since", "10m", "--until", "1h", "--yes"},
	} {
		r := cli(t, f.dsn, args...)
		if r.code != exitUsage || !strings.Contains(r.stderr, "--since "+args[3]+" (") || !strings.Contains(r.stderr, "is not before --until "+args[5]+" (") {
			t.Errorf("%q: exit %d, want %d naming --since and --until:\n%s", args, r.code, exitUsage, r.stderr)
		}
	}
	if s := f.status(t, dead); s != outbox.StatusDead {
		t.Fatalf("after refused time ranges the dead event is %s", s)
	}
	if r := cli(t, f.dsn, "events", "list", "--since", "3h", "--until", "0s").must(t, exitOK); !strings.Contains(r.stdout, dead.String()) {
		t.Fatalf("events list --since 3h --until 0s:\n%s", r.stdout)
	}
}

func TestEventsShow(t *testing.T) {
	f := newFixture(t)
	id := f.enqueue(t, orders, 1)[0]
	out := cli(t, f.dsn, "events", "show", id.String()).must(t, exitOK).stdout
	if !strings.Contains(out, "shop/order_paid") || !strings.Contains(out, "pending") || strings.Contains(out, "s3cr3t") ||
		!strings.Contains(out, "hidden") {
		t.Fatalf("show:\n%s", out)
	}
	var v eventView
	out = cli(t, f.dsn, "events", "show", "--json", id.String(), "--payload").must(t, exitOK).stdout
	if err := json.Unmarshal([]byte(out), &v); err != nil || v.ID != id.String() || !strings.Contains(string(v.Payload), "s3cr3t") {
		t.Fatalf("show --json --payload: %v\n%s", err, out)
	}
	if !strings.Contains(out, `"history": []`) || !strings.Contains(cli(t, f.dsn, "events", "show", id.String()).stdout, "history: no attempt finished yet") {
		t.Fatalf("a new event's history is not shown empty:\n%s", out)
	}
	cli(t, f.dsn, "events", "show", "0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b").must(t, exitNotFound)
}

// TestEventsNextAttempt: only a pending event has a next attempt. events
// show prints "-" for a dead, delivered or leased one, and the JSON of
// show and list has null (the row keeps the time its last attempt was
// due, which reads as an attempt to come).
func TestEventsNextAttempt(t *testing.T) {
	f := newFixture(t)
	ids := f.enqueue(t, orders, 4)
	dead := f.settle(t, orders, 1, driver.Dead, 0)[0]
	delivered := f.settle(t, orders, 1, driver.Delivered, 0)[0]
	retry := f.settle(t, orders, 1, driver.Retry, time.Hour)[0]
	if _, err := f.store.Claim(bg, driver.ClaimParams{Topics: []string{orders.Namespace + ":" + orders.Topic}, Limit: 1,
		MaxAttempts: 5, Worker: uuid.New(), Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	leased := ids[3]
	if s := f.status(t, leased); s != outbox.StatusProcessing {
		t.Fatalf("the last event is %s, want it leased", s)
	}
	ev, err := f.client.Admin().Get(bg, retry)
	if err != nil {
		t.Fatal(err)
	}
	due := ev.NextAttemptAt.UTC()

	nextLine := func(id uuid.UUID) string {
		t.Helper()
		out := cli(t, f.dsn, "events", "show", id.String()).must(t, exitOK).stdout
		for _, line := range strings.Split(out, "\n") {
			if rest, ok := strings.CutPrefix(line, "next attempt"); ok {
				return strings.TrimSpace(rest)
			}
		}
		t.Fatalf("events show %s has no next attempt line:\n%s", id, out)
		return ""
	}
	for id, want := range map[uuid.UUID]string{dead: "-", delivered: "-", leased: "-", retry: fmtTime(due)} {
		if got := nextLine(id); got != want {
			t.Errorf("events show of the %s event: next attempt %q, want %q", f.status(t, id), got, want)
		}
	}
	out := cli(t, f.dsn, "events", "list", "--json").must(t, exitOK).stdout
	var p pageJSON
	if err := json.Unmarshal([]byte(out), &p); err != nil || len(p.Events) != 4 {
		t.Fatalf("events list --json: %v\n%s", err, out)
	}
	for _, e := range p.Events {
		pending := e.Status == outbox.StatusPending
		if (e.NextAttemptAt != nil) != pending || (pending && !e.NextAttemptAt.Equal(due)) {
			t.Errorf("events list --json: the %s event's next_attempt_at is %v", e.Status, e.NextAttemptAt)
		}
		var v eventView
		show := cli(t, f.dsn, "events", "show", "--json", e.ID).must(t, exitOK).stdout
		if err := json.Unmarshal([]byte(show), &v); err != nil || (v.NextAttemptAt != nil) != pending ||
			(!pending && !strings.Contains(show, `"next_attempt_at": null`)) {
			t.Errorf("events show --json of the %s event: %v\n%s", e.Status, err, show)
		}
	}
}

// TestEventsOrderingKey: events list and events show print an event's
// ordering key and its place in the key, as text and as JSON, so that an
// operator can tell which events wait behind a key's dead head; events
// without a key print neither (no KEY column when no listed event has a
// key; no fields in the JSON).
func TestEventsOrderingKey(t *testing.T) {
	f := newFixture(t)
	keyed := f.enqueueKey(t, orders, "A", 3)
	if head := f.settle(t, orders, 3, driver.Dead, 0); len(head) != 1 || head[0] != keyed[0] {
		t.Fatalf("claimed %v of one key, want its head %s alone", head, keyed[0])
	}
	plain := f.enqueue(t, mails, 1)[0]

	table := cli(t, f.dsn, "events", "list").must(t, exitOK).stdout
	lines := strings.Split(strings.TrimSpace(table), "\n")
	fields := func(i int) string { return strings.Join(strings.Fields(lines[i]), " ") }
	if len(lines) != 5 || fields(0) != "ID NAMESPACE TOPIC KEY SEQ STATUS ATTEMPTS CREATED LAST ERROR" {
		t.Fatalf("events list of keyed events, want KEY and SEQ columns:\n%s", table)
	}
	for i, want := range []string{
		keyed[0].String() + " shop order_paid A 1 dead 1 ",
		keyed[1].String() + " shop order_paid A 2 pending 0 ",
		keyed[2].String() + " shop order_paid A 3 pending 0 ",
		plain.String() + " crm welcome_mail - - pending 0 ",
	} {
		if !strings.HasPrefix(fields(i+1), want) {
			t.Errorf("events list line %d: %q, want it to start with %q", i+1, fields(i+1), want)
		}
	}
	table = cli(t, f.dsn, "events", "list", "--topic", "crm/welcome_mail").must(t, exitOK).stdout
	if h, _, _ := strings.Cut(table, "\n"); strings.Join(strings.Fields(h), " ") != "ID NAMESPACE TOPIC STATUS ATTEMPTS CREATED LAST ERROR" {
		t.Fatalf("events list without a keyed event, want no KEY column:\n%s", table)
	}

	out := cli(t, f.dsn, "events", "list", "--json").must(t, exitOK).stdout
	var p pageJSON
	if err := json.Unmarshal([]byte(out), &p); err != nil || len(p.Events) != 4 {
		t.Fatalf("events list --json: %v\n%s", err, out)
	}
	for i, ev := range p.Events[:3] {
		if ev.OrderingKey != "A" || ev.Sequence != int64(i+1) {
			t.Errorf("events list --json: event %s has key %q sequence %d, want A and %d", ev.ID, ev.OrderingKey, ev.Sequence, i+1)
		}
	}
	out = cli(t, f.dsn, "events", "list", "--json", "--topic", "crm/welcome_mail").must(t, exitOK).stdout
	if strings.Contains(out, `"ordering_key"`) || strings.Contains(out, `"sequence"`) {
		t.Fatalf("events list --json of an event without a key has key fields:\n%s", out)
	}

	out = cli(t, f.dsn, "events", "show", keyed[2].String()).must(t, exitOK).stdout
	if !regexp.MustCompile(`(?m)^ordering key +A \(event 3 of the key\)$`).MatchString(out) {
		t.Fatalf("events show of a keyed event, want its key and place:\n%s", out)
	}
	if out := cli(t, f.dsn, "events", "show", plain.String()).must(t, exitOK).stdout; strings.Contains(out, "ordering key") {
		t.Fatalf("events show of an event without a key prints one:\n%s", out)
	}
	out = cli(t, f.dsn, "events", "show", "--json", keyed[2].String()).must(t, exitOK).stdout
	var v eventView
	if err := json.Unmarshal([]byte(out), &v); err != nil || v.OrderingKey != "A" || v.Sequence != 3 {
		t.Fatalf("events show --json of a keyed event: %v\n%s", err, out)
	}
	out = cli(t, f.dsn, "events", "show", "--json", plain.String()).must(t, exitOK).stdout
	if strings.Contains(out, `"ordering_key"`) || strings.Contains(out, `"sequence"`) {
		t.Fatalf("events show --json of an event without a key has key fields:\n%s", out)
	}
}

// TestEventsShowHistory: events show prints the attempts ledger, as a
// table and as JSON.
func TestEventsShowHistory(t *testing.T) {
	f := newFixture(t)
	id := f.enqueue(t, orders, 1)[0]
	f.settle(t, orders, 1, driver.Retry, 0)
	f.settle(t, orders, 1, driver.Dead, 0)
	cli(t, f.dsn, "dead", "replay", "--by", "history test", id.String()).must(t, exitOK)

	var v eventView
	out := cli(t, f.dsn, "events", "show", "--json", id.String()).must(t, exitOK).stdout
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("show --json: %v\n%s", err, out)
	}
	if len(v.History) != 3 {
		t.Fatalf("history: %+v, want retry, dead, replayed", v.History)
	}
	for i, want := range []struct {
		outcome string
		attempt int
		claim   bool
	}{{"retry", 1, true}, {"dead", 2, true}, {"replayed", 0, false}} {
		h := v.History[i]
		if h.No != i+1 || h.Outcome != want.outcome || h.Attempt != want.attempt || (h.Worker != nil) != want.claim ||
			(h.ClaimedAt != nil) != want.claim || h.FinishedAt.IsZero() {
			t.Errorf("history entry %d: %+v, want %+v", i+1, h, want)
		}
	}
	if d := v.History[0].Detail; !strings.Contains(d, "consumer said no") {
		t.Errorf("the retry's detail %q", d)
	}
	if h := v.History[2]; !strings.Contains(h.Detail, "history test") || h.Actor == "" {
		t.Errorf("the replay entry names neither who asked nor the database user: %+v", h)
	}

	out = cli(t, f.dsn, "events", "show", id.String()).must(t, exitOK).stdout
	_, table, ok := strings.Cut(out, "history:\n")
	lines := strings.Split(strings.TrimSpace(table), "\n")
	if !ok || len(lines) != 4 || strings.Join(strings.Fields(lines[0]), " ") != "NO OUTCOME ATTEMPT WORKER CLAIMED FINISHED DETAIL ACTOR" {
		t.Fatalf("history table:\n%s", out)
	}
	for i, prefix := range []string{"1 retry 1 " + *v.History[0].Worker, "2 dead 2 " + *v.History[1].Worker, "3 replayed - - -"} {
		if got := strings.Join(strings.Fields(lines[i+1]), " "); !strings.HasPrefix(got, prefix) {
			t.Errorf("history line %d: %q, want it to start with %q", i+1, got, prefix)
		}
	}
	if !strings.Contains(lines[3], "replayed by history test") || !strings.HasSuffix(strings.TrimSpace(lines[3]), v.History[2].Actor) {
		t.Errorf("the replay line: %q", lines[3])
	}

	// Delivered and purged: the row is gone, the history stays and shows.
	f.settle(t, orders, 1, driver.Delivered, 0)
	if n, err := f.client.Admin().Purge(bg, 0, orders); err != nil || n != 1 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	out = cli(t, f.dsn, "events", "show", "--json", id.String()).must(t, exitOK).stdout
	v = eventView{}
	if err := json.Unmarshal([]byte(out), &v); err != nil || !v.Purged || v.ID != id.String() || len(v.History) != 5 || v.History[4].Outcome != "purged" {
		t.Fatalf("show of a purged event: %+v %v\n%s", v, err, out)
	}
	for _, field := range []string{`"status"`, `"namespace"`, `"attempts"`, `"created_at"`} {
		if strings.Contains(out, field) { // no row: zero values would pass for its fields
			t.Errorf("show --json of a purged event has %s:\n%s", field, out)
		}
	}
	if out := cli(t, f.dsn, "events", "show", id.String()).must(t, exitOK).stdout; !strings.Contains(out, "purged") {
		t.Fatalf("show of a purged event:\n%s", out)
	}
	cli(t, f.dsn, "events", "show", uuid.NewString()).must(t, exitNotFound)
}

// TestDeadReplay: a dry run changes nothing, more than one event needs a
// confirmation, and replayed events are delivered by a dispatcher.
func TestDeadReplay(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 3)
	dead := f.settle(t, orders, 3, driver.Dead, 0)
	f.enqueue(t, mails, 1)
	deadMail := f.settle(t, mails, 1, driver.Dead, 0)[0]

	r := cli(t, f.dsn, "dead", "replay", "--topic", "shop/order_paid", "--dry-run").must(t, exitOK)
	if !strings.Contains(r.stdout, "dry run: 3 dead event(s) would be replayed") {
		t.Fatalf("dry run:\n%s", r.stdout)
	}
	for _, id := range append(dead, deadMail) {
		if s := f.status(t, id); s != outbox.StatusDead {
			t.Fatalf("after a dry run %s is %s", id, s)
		}
	}
	// More than one without --yes, and no terminal to ask on: refused.
	r = cli(t, f.dsn, "dead", "replay", "--topic", "shop/order_paid").must(t, exitAborted)
	if !strings.Contains(r.stderr, "--yes") {
		t.Fatalf("refusal does not say what to do: %s", r.stderr)
	}
	if s := f.status(t, dead[0]); s != outbox.StatusDead {
		t.Fatalf("after a refused replay %s is %s", dead[0], s)
	}
	r = cli(t, f.dsn, "dead", "replay", "--topic", "shop/order_paid", "--yes", "--by", "test operator").must(t, exitOK)
	if !strings.Contains(r.stdout, "replayed 3 event(s)") {
		t.Fatalf("replay:\n%s", r.stdout)
	}
	if s := f.status(t, deadMail); s != outbox.StatusDead {
		t.Fatalf("the filter replayed another topic's event: %s", s)
	}
	// One id needs no confirmation, also when it is given twice.
	r = cli(t, f.dsn, "dead", "replay", deadMail.String(), deadMail.String()).must(t, exitOK)
	if !strings.Contains(r.stdout, "replayed 1 event(s)") || strings.Contains(r.stdout, "no longer dead") {
		t.Fatalf("replaying one id given twice:\n%s", r.stdout)
	}
	ev, err := f.client.Admin().Get(bg, dead[0])
	if err != nil || ev.Status != outbox.StatusPending {
		t.Fatalf("replayed event: %+v %v", ev, err)
	}
	if h, err := f.client.Admin().History(bg, dead[0]); err != nil || len(h) == 0 || h[len(h)-1].Detail != "replayed by test operator" {
		t.Fatalf("history of the replayed event: %+v %v", h, err)
	}
	f.deliverAll(t, orders, 3)
	for _, id := range dead {
		if s := f.status(t, id); s != outbox.StatusDelivered {
			t.Fatalf("replayed %s ended %s, want delivered", id, s)
		}
	}
	r = cli(t, f.dsn, "dead", "replay", dead[0].String()).must(t, exitOK)
	if !strings.Contains(r.stderr, "not dead") || !strings.Contains(r.stdout, "nothing to replay") {
		t.Fatalf("replaying a delivered event: %+v", r)
	}
	cli(t, f.dsn, "dead", "replay", "0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b").must(t, exitNotFound)
}

// TestDeadFilterFlags: a filter given empty or twice is refused and
// changes nothing (an empty --topic would match every topic); a selection
// cut by --limit says that more match.
func TestDeadFilterFlags(t *testing.T) {
	f := newFixture(t)
	dead := f.enqueue(t, orders, 3) // oldest first, as the filter selects them
	f.settle(t, orders, 3, driver.Dead, 0)
	f.enqueue(t, mails, 1)
	deadMail := f.settle(t, mails, 1, driver.Dead, 0)[0]
	for _, args := range [][]string{
		{"dead", "purge", "--topic", "", "--yes"},
		{"dead", "purge", "--namespace", " ", "--yes"},
		{"dead", "replay", "--tenant", "", "--yes"},
		{"dead", "purge", "--topic", "shop/order_paid", "--topic", "crm/welcome_mail", "--yes"},
		{"events", "list", "--since", ""},
		{"tail", "--topic", ""},
	} {
		r := cli(t, f.dsn, args...)
		if r.code != exitUsage || !(strings.Contains(r.stderr, "is empty") || strings.Contains(r.stderr, "given twice")) {
			t.Errorf("%q: exit %d, want %d saying the filter is empty or given twice:\n%s", args, r.code, exitUsage, r.stderr)
		}
	}
	// A name the outbox would refuse is refused naming the flag, not the
	// library's EventFilter field or its topic pattern (purge), and not
	// looked up (skip-head).
	for _, args := range [][]string{
		{"events", "list", "--topic", "Shop/order_paid"},
		{"events", "list", "--topic", "shop/Order"},
		{"dead", "replay", "--namespace", "Shop", "--yes"},
		{"purge", "--yes", "--topic", "Shop/order_paid", "--older-than", "1h"},
		{"purge", "--yes", "--topic", "shop/order_paid", "--topic", "shop/Order", "--older-than", "1h"},
		{"dead", "skip-head", "--topic", "Shop/order_paid", "--key", "acct-7", "--yes"},
	} {
		if r := cli(t, f.dsn, args...); r.code != exitUsage || !strings.Contains(r.stderr, args[2]+":") ||
			strings.Contains(r.stderr, "EventFilter") || strings.Contains(r.stderr, "must match") {
			t.Errorf("%q: exit %d, want %d naming %s:\n%s", args, r.code, exitUsage, args[2], r.stderr)
		}
	}
	// The nil tenant, which no event has, likewise.
	for _, args := range [][]string{
		{"events", "list", "--tenant", uuid.Nil.String()},
		{"dead", "purge", "--tenant", uuid.Nil.String(), "--yes"},
	} {
		if r := cli(t, f.dsn, args...); r.code != exitUsage || !strings.Contains(r.stderr, "--tenant is the nil UUID") ||
			strings.Contains(r.stderr, "EventFilter") {
			t.Errorf("%q: exit %d, want %d naming --tenant:\n%s", args, r.code, exitUsage, r.stderr)
		}
	}
	// A status or cursor the outbox would refuse is refused naming the
	// flag and what it takes, not the library's EventFilter or EventPage.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"events", "list", "--status", "bogus"}, `--status "bogus" is not a status; use one of pending, processing, delivered, dead`},
		{[]string{"events", "list", "--after", "junk"}, `--after "junk" is not a cursor of events list: pass the one a previous events list printed`},
	} {
		if r := cli(t, f.dsn, c.args...); r.code != exitUsage || !strings.Contains(r.stderr, c.want) || strings.Contains(r.stderr, "Event") {
			t.Errorf("%q: exit %d, want %d with %q:\n%s", c.args, r.code, exitUsage, c.want, r.stderr)
		}
	}
	// No id and no filter (an unset shell variable: dead purge $ID) would
	// select every dead event: refused unless --all says so, and --all
	// goes with nothing else.
	for _, args := range [][]string{
		{"dead", "purge", "--yes"},
		{"dead", "replay", "--yes"},
		{"dead", "purge", "--all", "--topic", "shop/order_paid", "--yes"},
		{"dead", "replay", "--all", deadMail.String(), "--yes"},
		{"dead", "skip-head", "--all", deadMail.String(), "--yes"},
	} {
		if r := cli(t, f.dsn, args...); r.code != exitUsage || !strings.Contains(r.stderr, "--all") {
			t.Errorf("%q: exit %d, want %d naming --all:\n%s", args, r.code, exitUsage, r.stderr)
		}
	}
	for _, id := range append(dead, deadMail) {
		if s := f.status(t, id); s != outbox.StatusDead {
			t.Fatalf("after refused command lines %s is %s", id, s)
		}
	}
	if r := cli(t, f.dsn, "dead", "purge", "--all", "--dry-run").must(t, exitOK); !strings.Contains(r.stdout, "dry run: 4 dead event(s) would be purged") {
		t.Fatalf("dead purge --all --dry-run:\n%s", r.stdout)
	}

	r := cli(t, f.dsn, "dead", "replay", "--topic", "shop/order_paid", "--limit", "2", "--dry-run").must(t, exitOK)
	if !strings.Contains(r.stderr, "more dead events match than --limit 2") || !strings.Contains(r.stdout, "2 dead event(s) would be replayed") {
		t.Fatalf("dry run cut by --limit:\n%s\n%s", r.stdout, r.stderr)
	}
	r = cli(t, f.dsn, "dead", "replay", "--topic", "shop/order_paid", "--limit", "2", "--yes").must(t, exitOK)
	if !strings.Contains(r.stderr, "run it again") || !strings.Contains(r.stdout, "replayed 2 event(s)") {
		t.Fatalf("replay cut by --limit:\n%s\n%s", r.stdout, r.stderr)
	}
	if s := f.status(t, dead[2]); s != outbox.StatusDead {
		t.Fatalf("the newest dead event, past --limit, is %s", s)
	}
	r = cli(t, f.dsn, "dead", "replay", "--topic", "shop/order_paid", "--limit", "1", "--yes").must(t, exitOK)
	if strings.Contains(r.stderr, "more dead events match") || !strings.Contains(r.stdout, "replayed 1 event(s)") {
		t.Fatalf("replay of as many as --limit:\n%s\n%s", r.stdout, r.stderr)
	}
}

// TestDeadPurge: a dry run changes nothing; a purge asks even for one
// event, deletes the dead events only, and leaves their history with who
// asked.
func TestDeadPurge(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 2)
	dead := f.settle(t, orders, 2, driver.Dead, 0)
	f.enqueue(t, mails, 1)
	deadMail := f.settle(t, mails, 1, driver.Dead, 0)[0]

	r := cli(t, f.dsn, "dead", "purge", "--topic", "shop/order_paid", "--dry-run").must(t, exitOK)
	if !strings.Contains(r.stdout, "dry run: 2 dead event(s) would be purged") {
		t.Fatalf("dry run:\n%s", r.stdout)
	}
	// Even one event, without --yes and no terminal to ask on: refused.
	r = cli(t, f.dsn, "dead", "purge", dead[0].String()).must(t, exitAborted)
	if !strings.Contains(r.stderr, "--yes") {
		t.Fatalf("refusal does not say what to do: %s", r.stderr)
	}
	for _, id := range append(dead, deadMail) {
		if s := f.status(t, id); s != outbox.StatusDead {
			t.Fatalf("after a dry run and a refusal %s is %s", id, s)
		}
	}
	r = cli(t, f.dsn, "dead", "purge", "--topic", "shop/order_paid", "--yes", "--by", "test operator").must(t, exitOK)
	if !strings.Contains(r.stdout, "purged 2 event(s)") {
		t.Fatalf("purge:\n%s", r.stdout)
	}
	for _, id := range dead {
		if _, err := f.client.Admin().Get(bg, id); !errors.Is(err, outbox.ErrNotFound) {
			t.Fatalf("purged %s: %v, want ErrNotFound", id, err)
		}
		if h, err := f.client.Admin().History(bg, id); err != nil || len(h) == 0 || h[len(h)-1].Outcome != "purged" ||
			!strings.Contains(h[len(h)-1].Detail, "test operator") {
			t.Fatalf("history of the purged event: %+v %v", h, err)
		}
	}
	if s := f.status(t, deadMail); s != outbox.StatusDead {
		t.Fatalf("the filter purged another topic's event: %s", s)
	}
	cli(t, f.dsn, "dead", "purge", "0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b", "--yes").must(t, exitNotFound)
	cli(t, f.dsn, "dead", "purge", "--key", "k", "--yes").must(t, exitUsage)
}

// TestDeadLetter: dead letter makes pending events dead (a dry run and a
// refusal without --yes change nothing; another topic's events and events
// not pending are left alone; the history says who); dead replay brings
// them back and notes that no dispatcher serves their topic.
func TestDeadLetter(t *testing.T) {
	f := newFixture(t)
	pending := f.enqueue(t, orders, 3)
	mail := f.enqueue(t, mails, 1)[0]

	r := cli(t, f.dsn, "dead", "letter", "--topic", "shop/order_paid", "--dry-run").must(t, exitOK)
	if !strings.Contains(r.stdout, "dry run: 3 pending event(s) would be dead-lettered") {
		t.Fatalf("dry run:\n%s", r.stdout)
	}
	// Even one event, without --yes and no terminal to ask on: refused.
	r = cli(t, f.dsn, "dead", "letter", pending[0].String()).must(t, exitAborted)
	if !strings.Contains(r.stderr, "--yes") || !strings.Contains(r.stderr, "Dead-letter 1 pending event(s)?") {
		t.Fatalf("refusal does not say what it asked, or what to do: %s", r.stderr)
	}
	for _, id := range append(slices.Clone(pending), mail) {
		if s := f.status(t, id); s != outbox.StatusPending {
			t.Fatalf("after a dry run and a refusal %s is %s", id, s)
		}
	}
	r = cli(t, f.dsn, "dead", "letter").must(t, exitUsage)
	if !strings.Contains(r.stderr, "--all for every pending event") {
		t.Fatalf("no selection: %s", r.stderr)
	}
	r = cli(t, f.dsn, "dead", "letter", "--topic", "shop/order_paid", "--yes", "--by", "test operator").must(t, exitOK)
	if !strings.Contains(r.stdout, "dead-lettered 3 event(s)") {
		t.Fatalf("dead letter:\n%s", r.stdout)
	}
	for _, id := range pending {
		if s := f.status(t, id); s != outbox.StatusDead {
			t.Fatalf("dead-lettered %s is %s", id, s)
		}
		if h, err := f.client.Admin().History(bg, id); err != nil || len(h) == 0 || h[len(h)-1].Outcome != "dead_lettered" ||
			!strings.Contains(h[len(h)-1].Detail, "test operator") {
			t.Fatalf("history of the dead-lettered event: %+v %v", h, err)
		}
	}
	if s := f.status(t, mail); s != outbox.StatusPending {
		t.Fatalf("the filter dead-lettered another topic's event: %s", s)
	}
	r = cli(t, f.dsn, "dead", "letter", pending[0].String(), "--yes").must(t, exitOK)
	if !strings.Contains(r.stderr, "it is dead, not pending") || !strings.Contains(r.stdout, "nothing to dead-letter") {
		t.Fatalf("dead-lettering a dead event: %+v", r)
	}

	r = cli(t, f.dsn, "dead", "replay", "--topic", "shop/order_paid", "--yes").must(t, exitOK)
	if !strings.Contains(r.stdout, "replayed 3 event(s)") || !strings.Contains(r.stderr, "no running dispatcher serves shop/order_paid") {
		t.Fatalf("replay of events no dispatcher serves: %+v", r)
	}

	// Leased events: one under a live lease is left alone; one whose lease
	// ended (its dispatcher died) goes with the pending ones.
	f.enqueue(t, mails, 2)
	leased, err := f.store.Claim(bg, driver.ClaimParams{Topics: []string{"crm:welcome_mail"}, Limit: 3, MaxAttempts: 5,
		Worker: uuid.New(), Lease: time.Minute})
	if err != nil || len(leased) != 3 || leased[0].ID != mail {
		t.Fatalf("leased %v, %v; want the 3 mails, %s first", leased, err, mail)
	}
	if _, err := f.pool.Exec(bg, "UPDATE modkit_outbox_events SET locked_until = now() - interval '1 second' WHERE id = ANY($1)",
		[]uuid.UUID{leased[0].ID, leased[1].ID}); err != nil {
		t.Fatal(err)
	}
	r = cli(t, f.dsn, "dead", "letter", leased[2].ID.String(), "--yes").must(t, exitOK)
	if !strings.Contains(r.stderr, "it is processing (leased until") || !strings.Contains(r.stdout, "nothing to dead-letter") {
		t.Fatalf("dead-lettering an event under a live lease: %+v", r)
	}
	r = cli(t, f.dsn, "dead", "letter", "--topic", "crm/welcome_mail", "--yes").must(t, exitOK)
	if !strings.Contains(r.stdout, "dead-lettered 2 event(s)") {
		t.Fatalf("dead letter of events whose lease ended:\n%s%s", r.stdout, r.stderr)
	}
	for i, want := range []outbox.Status{outbox.StatusDead, outbox.StatusDead, outbox.StatusProcessing} {
		if s := f.status(t, leased[i].ID); s != want {
			t.Fatalf("leased event %d is %s, want %s", i, s, want)
		}
	}

	// On a schema without migration 0044 it says what to run, before it
	// lists or asks anything.
	if _, err := f.pool.Exec(bg, "DROP FUNCTION modkit_outbox_dead_letter_filter, modkit_outbox_dead_letter"); err != nil {
		t.Fatal(err)
	}
	r = cli(t, f.dsn, "dead", "letter", "--topic", "shop/order_paid", "--dry-run").must(t, exitFailure)
	if !strings.Contains(r.stderr, "dead letter needs migration 0044") || strings.Contains(r.stdout, "dry run") {
		t.Fatalf("dead letter without migration 0044: %+v", r)
	}
}

func TestPurge(t *testing.T) {
	f := newFixture(t)
	ids := f.enqueue(t, orders, 2)
	f.settle(t, orders, 2, driver.Delivered, 0)
	r := cli(t, f.dsn, "purge", "--topic", "shop/order_paid", "--older-than", "0s").must(t, exitAborted)
	if !strings.Contains(r.stderr, "Delete all 2 delivered event(s) of shop/order_paid") {
		t.Fatalf("the confirmation does not say how many go:\n%s", r.stderr)
	}
	r = cli(t, f.dsn, "purge", "--topic", "shop/order_paid", "--older-than", "0s", "--yes").must(t, exitOK)
	if !strings.Contains(r.stdout, "deleted 2 delivered event(s)") {
		t.Fatalf("purge: %s", r.stdout)
	}
	if _, err := f.client.Admin().Get(bg, ids[0]); err == nil {
		t.Fatal("a purged event is still there")
	}
	cli(t, f.dsn, "purge", "--topic", "order_paid", "--older-than", "1h", "--yes").must(t, exitUsage)
	cli(t, f.dsn, "purge", "--older-than", "1h").must(t, exitUsage)
}

// TestPurgeDryRun: purge --dry-run counts, per topic and in all, the
// delivered events a purge could delete (an upper bound: those of any
// age) and deletes nothing, as dead replay --dry-run does; the
// confirmation gives the same bound; topics with nothing delivered need
// no confirmation, as there is nothing to purge.
func TestPurgeDryRun(t *testing.T) {
	f := newFixture(t)
	delivered := f.enqueue(t, orders, 3)
	f.settle(t, orders, 3, driver.Delivered, 0)
	f.enqueue(t, orders, 1) // pending: never purged, never counted
	f.enqueue(t, mails, 1)
	f.settle(t, mails, 1, driver.Delivered, 0)

	r := cli(t, f.dsn, "purge", "--topic", "shop/order_paid", "--topic", "crm/welcome_mail", "--topic", "shop/order_paid",
		"--older-than", "1h", "--dry-run").must(t, exitOK)
	table := map[string]string{}
	for _, line := range strings.Split(r.stdout, "\n") {
		if cols := strings.Fields(line); len(cols) == 3 {
			table[cols[0]+"/"+cols[1]] = cols[2]
		}
	}
	if table["shop/order_paid"] != "3" || table["crm/welcome_mail"] != "1" ||
		!strings.Contains(r.stdout, "dry run: at most 4 delivered event(s) of shop/order_paid, crm/welcome_mail, shop/order_paid would be deleted "+
			"(those older than 1h0m0s; 4 is how many the topics hold of any age") || !strings.Contains(r.stdout, "nothing was changed") {
		t.Fatalf("purge --dry-run:\n%s", r.stdout)
	}
	if r := cli(t, f.dsn, "purge", "--topic", "shop/order_paid", "--older-than", "0s", "--dry-run", "--yes").must(t, exitOK); !strings.Contains(r.stdout,
		"dry run: all 3 delivered event(s) of shop/order_paid would be deleted") {
		t.Fatalf("purge --dry-run --older-than 0s:\n%s", r.stdout)
	}
	for _, id := range delivered {
		if s := f.status(t, id); s != outbox.StatusDelivered {
			t.Fatalf("after dry runs a delivered event is %s", s)
		}
	}
	r = cli(t, f.dsn, "purge", "--topic", "shop/order_paid", "--older-than", "1h").must(t, exitAborted)
	if !strings.Contains(r.stderr, "Delete the delivered events of shop/order_paid older than 1h0m0s? At most 3 go") {
		t.Fatalf("the confirmation does not give the bound:\n%s", r.stderr)
	}
	for _, args := range [][]string{{"--dry-run"}, {}} {
		r := cli(t, f.dsn, append([]string{"purge", "--topic", "shop/refunded", "--older-than", "0s"}, args...)...).must(t, exitOK)
		if !strings.Contains(r.stdout, "no delivered event of shop/refunded; nothing to purge") {
			t.Fatalf("purge %v of a topic with nothing delivered:\n%s", args, r.stdout)
		}
	}
	if r := cli(t, f.dsn, "purge", "--topic", "shop/order_paid", "--older-than", "0s", "--yes").must(t, exitOK); !strings.Contains(r.stdout, "deleted 3") {
		t.Fatalf("purge --yes after the dry runs:\n%s", r.stdout)
	}
}

// TestPurgeSequences: purge --sequences deletes the sequence rows of
// ordering keys with no event left (after a purge of their delivered
// events), counts them for --dry-run and the confirmation, honours
// --limit, keeps the rows of keys with events, refuses the flags of a
// purge of events, and says which migration a schema lacks.
func TestPurgeSequences(t *testing.T) {
	f := newFixture(t)
	for i, key := range []string{"acct-1", "acct-2", "acct-3", "acct-4"} {
		if _, err := f.client.Enqueue(bg, f.pool, outbox.Message{Namespace: orders.Namespace, Topic: orders.Topic,
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i)), OrderingKey: key}); err != nil {
			t.Fatal(err)
		}
	}
	f.settle(t, orders, 3, driver.Delivered, 0) // acct-4's event stays pending
	cli(t, f.dsn, "purge", "--topic", "shop/order_paid", "--older-than", "0s", "--yes").must(t, exitOK)
	rows := func() int {
		t.Helper()
		var n int
		if err := f.pool.QueryRow(bg, "SELECT count(*) FROM modkit_outbox_sequences").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	r := cli(t, f.dsn, "purge", "--sequences", "--dry-run").must(t, exitOK)
	if !strings.Contains(r.stdout, "dry run: the sequence rows of 3 ordering key(s) without events would be deleted; nothing was changed") {
		t.Fatalf("purge --sequences --dry-run:\n%s", r.stdout)
	}
	r = cli(t, f.dsn, "purge", "--sequences").must(t, exitAborted)
	if !strings.Contains(r.stderr, "Delete the sequence rows of 3 ordering key(s) that have no event left?") || rows() != 4 {
		t.Fatalf("the confirmation does not say how many go, or something went:\n%s", r.stderr)
	}
	r = cli(t, f.dsn, "purge", "--sequences", "--limit", "2", "--yes").must(t, exitOK)
	if !strings.Contains(r.stdout, "deleted the sequence rows of 2 ordering key(s) without events") || rows() != 2 {
		t.Fatalf("purge --sequences --limit 2:\n%s", r.stdout)
	}
	r = cli(t, f.dsn, "purge", "--sequences", "--yes").must(t, exitOK)
	if !strings.Contains(r.stdout, "deleted the sequence rows of 1 ordering key(s)") || rows() != 1 {
		t.Fatalf("purge --sequences:\n%s", r.stdout)
	}
	r = cli(t, f.dsn, "purge", "--sequences").must(t, exitOK)
	if !strings.Contains(r.stdout, "no ordering key without events; nothing to purge") {
		t.Fatalf("purge --sequences with nothing to prune:\n%s", r.stdout)
	}
	for _, args := range [][]string{
		{"--sequences", "--topic", "shop/order_paid"}, {"--sequences", "--older-than", "1h"}, {"--sequences", "--limit", "-1"},
		{"--topic", "shop/order_paid", "--older-than", "1h", "--limit", "5"},
	} {
		cli(t, f.dsn, append([]string{"purge"}, args...)...).must(t, exitUsage)
	}

	if _, err := f.pool.Exec(bg, "DROP FUNCTION modkit_outbox_prune_sequences, modkit_outbox_prunable_sequences"); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"--dry-run"}, {"--yes"}} {
		r = cli(t, f.dsn, append([]string{"purge", "--sequences"}, args...)...).must(t, exitFailure)
		if !strings.Contains(r.stderr, "purge --sequences needs migration 0045") {
			t.Fatalf("purge --sequences %v without migration 0045: %+v", args, r)
		}
	}
}

func TestExitCodes(t *testing.T) {
	f := newFixture(t)
	for _, c := range []struct {
		dsn  string
		args []string
		code int
		hint string
	}{
		{f.dsn, []string{"stats", "--no-such-flag"}, exitUsage, "flag provided but not defined"},
		{f.dsn, []string{"frobnicate"}, exitUsage, "unknown command"},
		{f.dsn, []string{}, exitUsage, "Commands:"},
		{f.dsn, []string{"events", "list", "--status", "lost"}, exitUsage, "pending, processing, delivered, dead"},
		{f.dsn, []string{"events", "list", "--after", "garbage"}, exitUsage, "cursor"},
		{f.dsn, []string{"events", "show", "not-a-uuid"}, exitUsage, "not an event id"},
		{f.dsn, []string{"events", "list", "--since", "yesterday"}, exitUsage, "RFC 3339"},
		{f.dsn, []string{"migrate", "sideways"}, exitUsage, "up, down, status or sql"},
		{f.dsn, []string{"migrate", "sql", "--format", "flyway"}, exitUsage, "golang-migrate, goose or plain"},
		{f.dsn, []string{"migrate", "sql", "--schema", "shop"}, exitUsage, "search_path"},
		{f.dsn, []string{"migrate", "up", "--steps", "2"}, exitUsage, "--steps is for migrate down only"},
		{f.dsn, []string{"migrate", "status", "--format", "goose"}, exitUsage, "--format is for migrate sql only"},
		{"", []string{"stats"}, exitUsage, "DATABASE_URL"},
		{"postgres://nobody@127.0.0.1:1/none?connect_timeout=5", []string{"stats"}, exitUnreachable, "cannot reach the database"},
		{"host=127.0.0.1 port=1 user=x", []string{"events", "list", "--connect-timeout", "5s"}, exitUnreachable, "cannot reach"},
		{"::not a url::", []string{"stats"}, exitUsage, "not a valid PostgreSQL URL"},
		{f.dsn, []string{"tail", "--since", "-1h"}, exitUsage, "negative"},
		{f.dsn, []string{"events", "list", "--topic", "shop/"}, exitUsage, "NAMESPACE/TOPIC"},
		{f.dsn, []string{"dead", "replay", "--topic", "/order_paid", "--yes"}, exitUsage, "NAMESPACE/TOPIC"},
		{f.dsn, []string{"dead", "replay", "--by", " "}, exitUsage, "--by"},
		{f.dsn, []string{"stats", "--connect-timeout", "0s"}, exitUsage, "--connect-timeout is 0s"},
		{f.dsn, []string{"migrate", "sql", "--database-url", f.dsn}, exitUsage, "without connecting"},
		{f.dsn, []string{"events", "show", uuid.NewString(), "--topic", "shop/order_paid"}, exitUsage, "is for events list"},
		{f.dsn, []string{"events", "list", "--payload"}, exitUsage, "needs --json"},
		{f.dsn, []string{"dead", "replay", uuid.NewString(), "--limit", "5"}, exitUsage, "--limit bounds a replay by filter"},
		{f.dsn, []string{"purge", "--topic", "shop/order_paid", "--older-than", "-1h", "--yes"}, exitUsage, "--older-than is -1h0m0s"},
		{f.dsn, []string{"stats", "--blocked-keys", "0"}, exitUsage, "--blocked-keys is 0"},
		{f.dsn, []string{"stats", "--schema", "Bad-Schema"}, exitUsage, `--schema "Bad-Schema" is not a schema name the outbox takes: use 1 to 63`},
		{f.dsn, []string{"migrate", "status", "--schema", "pg_shop"}, exitUsage, `--schema "pg_shop" is not a schema name`},
		{f.dsn, []string{"events", "show", uuid.NewString(), "--schema", "9shop"}, exitUsage, `--schema "9shop" is not a schema name`},
	} {
		r := cli(t, c.dsn, c.args...)
		if r.code != c.code || !strings.Contains(r.stderr, c.hint) {
			t.Errorf("%v: exit %d, want %d with %q in stderr:\n%s", c.args, r.code, c.code, c.hint, r.stderr)
		}
	}
	if r := cli(t, f.dsn, "purge", "--help"); r.code != exitOK || strings.Contains(r.stdout, "default -1") {
		t.Errorf("purge --help shows a default for --older-than: %+v", r)
	}
	if r := cli(t, f.dsn, "stats", "--help"); r.code != exitOK || !strings.Contains(r.stdout, "Examples:") || strings.Contains(r.stdout, f.dsn) {
		t.Errorf("stats --help: %+v", r)
	}
	if r := cli(t, f.dsn, "help", "dead"); r.code != exitOK || !strings.Contains(r.stdout, "--dry-run") {
		t.Errorf("help dead: %+v", r)
	}
}

// enqueueKey enqueues n events of topic under one ordering key.
func (f *fixture) enqueueKey(t *testing.T, topic outbox.Topic, key string, n int) []uuid.UUID {
	t.Helper()
	var ids []uuid.UUID
	for i := range n {
		r, err := f.client.Enqueue(bg, f.pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic,
			OrderingKey: key, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, r.ID)
	}
	return ids
}

// blockedHeads lists the dead heads that hold their keys back.
func (f *fixture) blockedHeads(t *testing.T) []uuid.UUID {
	t.Helper()
	blocked, err := f.client.Admin().BlockedKeys(bg, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []uuid.UUID
	for _, b := range blocked {
		out = append(out, b.Head)
	}
	return out
}

// TestDeadSkipHead: skip-head refuses what it cannot skip and changes
// nothing then, asks before skipping, and skips a key's dead head by key
// or by id, after which the key's next event is claimable and the head's
// history says who skipped it.
func TestDeadSkipHead(t *testing.T) {
	f := newFixture(t)
	acct7 := f.enqueueKey(t, orders, "acct-7", 3)
	acct8 := f.enqueueKey(t, orders, "acct-8", 2)
	if heads := f.settle(t, orders, 10, driver.Dead, 0); len(heads) != 2 { // only the heads are claimable
		t.Fatalf("claimed %d events of two keys, want their two heads", len(heads))
	}
	f.enqueue(t, mails, 1)
	deadMail := f.settle(t, mails, 1, driver.Dead, 0)[0] // dead, without a key
	pending := f.enqueue(t, mails, 1)[0]

	stats := cli(t, f.dsn, "stats").must(t, exitOK).stdout
	if !strings.Contains(stats, `skipped with "dead skip-head HEAD"`) {
		t.Fatalf("stats does not name the command that skips a head:\n%s", stats)
	}

	for _, c := range []struct {
		args []string
		code int
		hint string
	}{
		{[]string{"dead", "skip-head"}, exitUsage, "needs the dead head's event id, or --topic"},
		{[]string{"dead", "skip-head", "--topic", "shop/order_paid"}, exitUsage, "--key"},
		{[]string{"dead", "skip-head", "--key", "acct-7"}, exitUsage, "--topic"},
		{[]string{"dead", "skip-head", "--topic", "order_paid", "--key", "acct-7"}, exitUsage, "NAMESPACE/TOPIC"},
		{[]string{"dead", "skip-head", "--topic", "shop/order_paid", "--key", " "}, exitUsage, "blank"},
		{[]string{"dead", "skip-head", acct7[0].String(), "--topic", "shop/order_paid", "--key", "acct-7"}, exitUsage, "not both"},
		{[]string{"dead", "skip-head", "acct-7"}, exitUsage, "not an event id"},
		{[]string{"dead", "skip-head", acct7[0].String(), acct8[0].String(), "--yes"}, exitUsage, "one event id"},
		{[]string{"dead", "skip-head", acct7[0].String(), "--since", "1h"}, exitUsage, "--since is for dead replay, purge and letter"},
		{[]string{"dead", "skip-head", acct7[0].String(), "--by", " ", "--yes"}, exitUsage, "--by"},
		{[]string{"dead", "replay", "--key", "acct-7"}, exitUsage, "--key is for dead skip-head"},
		{[]string{"dead", "skip-head", "0192b7a4-5c1e-7d3f-9a2b-6c8d4e0f1a2b", "--yes"}, exitNotFound, "no event"},
		{[]string{"dead", "skip-head", pending.String(), "--yes"}, exitNotFound, "is pending, not dead"},
		{[]string{"dead", "skip-head", deadMail.String(), "--yes"}, exitNotFound, "no ordering key"},
		{[]string{"dead", "skip-head", "--topic", "shop/order_paid", "--key", "acct-9", "--yes"}, exitNotFound, "no dead event holds back key"},
		{[]string{"dead", "skip-head", "--topic", "crm/welcome_mail", "--key", "acct-7", "--yes"}, exitNotFound, "no dead event holds back key"},
		{[]string{"dead", "skip-head", "--topic", "shop/order_paid", "--key", "acct-7"}, exitAborted, "--yes"},
		{[]string{"dead", "skip-head", acct7[0].String()}, exitAborted, "--yes"},
	} {
		r := cli(t, f.dsn, c.args...)
		if r.code != c.code || !strings.Contains(r.stderr, c.hint) {
			t.Errorf("%v: exit %d, want %d with %q in stderr:\n%s", c.args, r.code, c.code, c.hint, r.stderr)
		}
	}
	r := cli(t, f.dsn, "dead", "skip-head", "--topic", "shop/order_paid", "--key", "acct-7", "--dry-run").must(t, exitOK)
	if !strings.Contains(r.stdout, "dry run: the dead head "+acct7[0].String()) || !strings.Contains(r.stdout, "acct-7") {
		t.Fatalf("dry run:\n%s", r.stdout)
	}
	// Nothing above changed anything: both keys are held back, and no
	// history records a skip.
	if heads := f.blockedHeads(t); len(heads) != 2 {
		t.Fatalf("after the refusals the blocked heads are %v, want both", heads)
	}
	if h, err := f.client.Admin().History(bg, acct7[0]); err != nil || h[len(h)-1].Outcome != "dead" {
		t.Fatalf("history of acct-7's head after the refusals: %+v %v", h, err)
	}

	// By key.
	r = cli(t, f.dsn, "dead", "skip-head", "--topic", "shop/order_paid", "--key", "acct-7", "--yes", "--by", "test operator").must(t, exitOK)
	if !strings.Contains(r.stdout, "skipped the dead head "+acct7[0].String()+` of shop/order_paid key "acct-7"`) {
		t.Fatalf("skip by key:\n%s", r.stdout)
	}
	if heads := f.blockedHeads(t); len(heads) != 1 || heads[0] != acct8[0] {
		t.Fatalf("blocked heads after skipping acct-7's: %v, want acct-8's %s", heads, acct8[0])
	}
	if s := f.status(t, acct7[0]); s != outbox.StatusDead {
		t.Fatalf("the skipped head is %s, want it still dead", s)
	}
	h, err := f.client.Admin().History(bg, acct7[0])
	if err != nil || h[len(h)-1].Outcome != "skipped" || !strings.Contains(h[len(h)-1].Detail, "test operator") {
		t.Fatalf("history of the skipped head: %+v %v", h, err)
	}
	if next := f.settle(t, orders, 10, driver.Delivered, 0); len(next) != 1 || next[0] != acct7[1] {
		t.Fatalf("claimable after the skip: %v, want acct-7's second event %s alone", next, acct7[1])
	}
	// Skipped already: by key and by id, refused.
	cli(t, f.dsn, "dead", "skip-head", "--topic", "shop/order_paid", "--key", "acct-7", "--yes").must(t, exitNotFound)
	if r := cli(t, f.dsn, "dead", "skip-head", acct7[0].String(), "--yes").must(t, exitNotFound); !strings.Contains(r.stderr, "skipped already") {
		t.Fatalf("skipping a skipped head again: %s", r.stderr)
	}

	// By id, confirmed on a terminal; a terminal answer other than yes
	// aborts first.
	var out, errOut strings.Builder
	interactive := func(answer string) int {
		out.Reset()
		errOut.Reset()
		e := env{stdin: strings.NewReader(answer), stdout: &out, stderr: &errOut, interactive: true,
			getenv: func(k string) string {
				if k == "DATABASE_URL" {
					return f.dsn
				}
				return ""
			}}
		return run(bg, e, []string{"dead", "skip-head", acct8[0].String()})
	}
	if code := interactive("no\n"); code != exitAborted || len(f.blockedHeads(t)) != 1 {
		t.Fatalf("answered no: exit %d, blocked %v\n%s", code, f.blockedHeads(t), errOut.String())
	}
	if code := interactive("yes\n"); code != exitOK || !strings.Contains(errOut.String(), "Skip the dead head "+acct8[0].String()) ||
		!strings.Contains(out.String(), "skipped the dead head "+acct8[0].String()) {
		t.Fatalf("answered yes: exit %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
	}
	if heads := f.blockedHeads(t); len(heads) != 0 {
		t.Fatalf("blocked heads after skipping both: %v", heads)
	}
}

// settleSkippingDead is settle for a topic whose publisher skips dead
// heads (Publisher.SkipDeadHeads): the events behind a dead head of their
// key are let into the claim, as that dispatcher lets them.
func (f *fixture) settleSkippingDead(t *testing.T, topic outbox.Topic, n int, kind driver.OutcomeKind) []uuid.UUID {
	t.Helper()
	key := []string{topic.Namespace + ":" + topic.Topic}
	if _, err := f.store.ReleaseHeld(bg, key, key, 1000); err != nil {
		t.Fatal(err)
	}
	worker := uuid.New()
	claimed, err := f.store.Claim(bg, driver.ClaimParams{Topics: key, Limit: n, MaxAttempts: 5, Worker: worker,
		Lease: time.Minute, SkipDeadTopics: key})
	if err != nil {
		t.Fatal(err)
	}
	var ids []uuid.UUID
	for _, c := range claimed {
		if _, err := f.store.Complete(bg, nil, worker, []driver.Outcome{{ID: c.ID, LeaseToken: c.LeaseToken, Kind: kind,
			Error: "boom: consumer said no"}}); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, c.ID)
	}
	return ids
}

// TestDeadSkipHeadBehindDeadHead: skip-head of a dead event behind its
// key's dead head that is not skipped (under Publisher.SkipDeadHeads both
// die) is refused naming that head, which must be skipped first, not as
// skipped already; behind the head replayed (pending) it is refused too;
// skip-head of the head, then of the event, succeeds.
func TestDeadSkipHeadBehindDeadHead(t *testing.T) {
	f := newFixture(t)
	ids := f.enqueueKey(t, orders, "S", 3)
	if got := f.settle(t, orders, 3, driver.Delivered, 0); len(got) != 1 || got[0] != ids[0] {
		t.Fatalf("delivered %v, want the key's first event %s alone", got, ids[0])
	}
	for i := 1; i < 3; i++ {
		if got := f.settleSkippingDead(t, orders, 1, driver.Dead); len(got) != 1 || got[0] != ids[i] {
			t.Fatalf("dead %v, want the key's event %d %s", got, i+1, ids[i])
		}
	}
	if heads := f.blockedHeads(t); len(heads) != 1 || heads[0] != ids[1] {
		t.Fatalf("blocked heads %v, want the key's event 2 %s", heads, ids[1])
	}

	r := cli(t, f.dsn, "dead", "skip-head", ids[2].String(), "--yes").must(t, exitNotFound)
	for _, want := range []string{"is not the dead head of key \"S\"", ids[1].String() + " before it (event 2 of the key)", "skipped first"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("skip-head of the event behind the dead head: want %q in stderr:\n%s", want, r.stderr)
		}
	}
	if strings.Contains(r.stderr, "skipped already") {
		t.Errorf("skip-head of the event behind the dead head says it was skipped already:\n%s", r.stderr)
	}
	if h, err := f.client.Admin().History(bg, ids[2]); err != nil || h[len(h)-1].Outcome != "dead" {
		t.Fatalf("history of the event after a refused skip: %+v %v", h, err)
	}

	// The head replayed, the event behind it waits for it: not a head
	// either, and not skipped already.
	cli(t, f.dsn, "dead", "replay", ids[1].String()).must(t, exitOK)
	r = cli(t, f.dsn, "dead", "skip-head", ids[2].String(), "--yes").must(t, exitNotFound)
	if !strings.Contains(r.stderr, "is not the dead head of key \"S\": an earlier event of the key is still pending") {
		t.Errorf("skip-head of the event behind a replayed head:\n%s", r.stderr)
	}
	if got := f.settleSkippingDead(t, orders, 1, driver.Dead); len(got) != 1 || got[0] != ids[1] {
		t.Fatalf("dead %v, want the replayed event 2 %s", got, ids[1])
	}
	cli(t, f.dsn, "dead", "skip-head", ids[1].String(), "--yes").must(t, exitOK)
	cli(t, f.dsn, "dead", "skip-head", ids[2].String(), "--yes").must(t, exitOK)
	if r := cli(t, f.dsn, "dead", "skip-head", ids[2].String(), "--yes").must(t, exitNotFound); !strings.Contains(r.stderr, "skipped already") {
		t.Fatalf("skipping a skipped event again: %s", r.stderr)
	}
}

// TestNilEventID: the nil UUID given as an event id is an id no event has,
// refused as any unknown id (exit 4, "no event … in this schema"), by
// skip-head too (which took it for no id and looked up an empty key).
func TestNilEventID(t *testing.T) {
	f := newFixture(t)
	nilID := uuid.Nil.String()
	for _, args := range [][]string{
		{"dead", "skip-head", nilID, "--yes"},
		{"dead", "replay", nilID},
		{"dead", "purge", nilID, "--yes"},
		{"events", "show", nilID},
	} {
		r := cli(t, f.dsn, args...)
		if r.code != exitNotFound || !strings.Contains(r.stderr, "no event "+nilID+" in this schema") {
			t.Errorf("%q: exit %d, want %d saying there is no event %s:\n%s", args, r.code, exitNotFound, nilID, r.stderr)
		}
	}
}

// A confirmation whose stdin ends without an answer (/dev/null passes for
// a terminal: systemd, docker run without -i) aborts saying to pass --yes,
// as when stdin is not a terminal.
func TestConfirmWithoutAnswer(t *testing.T) {
	var errOut strings.Builder
	e := env{stdin: strings.NewReader(""), stdout: io.Discard, stderr: &errOut, interactive: true}
	err := confirm(e, "Skip it?")
	var x *exitError
	if !errors.As(err, &x) || x.code != exitAborted || !strings.Contains(err.Error(), "--yes") {
		t.Fatalf("confirm on an ended stdin: %v, want exit %d saying to pass --yes", err, exitAborted)
	}
	if err := confirm(env{stdin: strings.NewReader("no\n"), stdout: io.Discard, stderr: io.Discard, interactive: true}, "Skip it?"); err == nil ||
		!strings.Contains(err.Error(), "aborted") {
		t.Fatalf("confirm answered no: %v", err)
	}
	if err := confirm(env{stdin: strings.NewReader("yes"), stdout: io.Discard, stderr: io.Discard, interactive: true}, "Skip it?"); err != nil {
		t.Fatalf("confirm answered yes without a newline: %v", err)
	}
}

// TestReaderRole: as a reader, a payload asked for is reported hidden (not
// printed empty), and an operator's action is refused with what to grant;
// an unmigrated schema's error says how to migrate from the shell.
func TestReaderRole(t *testing.T) {
	f := newFixture(t)
	id := f.enqueue(t, orders, 1)[0]
	f.settle(t, orders, 1, driver.Dead, 0)
	reader, name := f.login(t, "modkit_outbox_reader")

	r := cli(t, reader, "events", "show", id.String(), "--payload").must(t, exitOK)
	if !strings.Contains(r.stderr, "payloads hidden: database role "+name) ||
		!strings.Contains(r.stdout, "(hidden: database role "+name+" may not read payloads") || strings.Contains(r.stdout, "s3cr3t") {
		t.Fatalf("events show --payload as a reader:\n%s\n%s", r.stdout, r.stderr)
	}
	r = cli(t, reader, "events", "list", "--json", "--payload").must(t, exitOK)
	if !strings.Contains(r.stderr, "payloads hidden") || strings.Contains(r.stdout, `"payload"`) {
		t.Fatalf("events list --json --payload as a reader:\n%s\n%s", r.stdout, r.stderr)
	}
	if r := cli(t, f.dsn, "events", "show", id.String(), "--payload").must(t, exitOK); strings.Contains(r.stderr, "hidden") ||
		!strings.Contains(r.stdout, "s3cr3t") {
		t.Fatalf("events show --payload as the owner:\n%s\n%s", r.stdout, r.stderr)
	}

	r = cli(t, reader, "dead", "replay", id.String(), "--yes").must(t, exitFailure)
	if !strings.Contains(r.stderr, "SQLSTATE 42501") || !strings.Contains(r.stderr, "need modkit_outbox_operator") {
		t.Fatalf("dead replay as a reader:\n%s", r.stderr)
	}
	if s := f.status(t, id); s != outbox.StatusDead {
		t.Fatalf("after a refused replay the event is %s", s)
	}
	if _, err := f.pool.Exec(bg, "CREATE SCHEMA IF NOT EXISTS not_migrated"); err != nil {
		t.Fatal(err)
	}
	r = cli(t, f.dsn, "stats", "--schema", "not_migrated").must(t, exitFailure)
	if !strings.Contains(r.stderr, "schema not_migrated holds no outbox; schema public holds one") {
		t.Fatalf("stats on a schema not migrated:\n%s", r.stderr)
	}
}
