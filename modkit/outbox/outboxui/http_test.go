package outboxui_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
	"github.com/modkit-go/modkit/modkit/outbox/outboxui"
)

func newJar() *http.Client {
	jar, _ := cookiejar.New(nil)
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// get fetches a page and returns its body and the CSRF token in it.
func get(t *testing.T, c *http.Client, u string) (string, string) {
	t.Helper()
	code, body := fetch(t, c, u)
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d\n%s", u, code, body)
	}
	var csrf string
	if m := csrfField.FindStringSubmatch(body); m != nil {
		csrf = m[1]
	}
	return body, csrf
}

// fetch GETs u and returns the status and the body, whatever the status.
func fetch(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func post(t *testing.T, c *http.Client, u string, form url.Values, origin string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if origin != "" {
		req.Header.Set("Origin", origin)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// The dashboard's links keep their filters: a topic's dead count lists that
// topic's dead events alone (so the page's replay button acts on them
// alone), a topic's name lists that topic alone, and the next page of a
// list moves on. (html/template escaped the = and & of the query strings
// again, so every filter and cursor was lost.) Every link of the
// overview's topics leads to a list the database reads by an index: a
// topic's name to its pending events (with no status, the list reads the
// whole table: seconds on millions of rows), each count to the events of
// its status; only the count of the last hour's deliveries leads to the
// delivered ones.
func TestDashboardLinksKeepTheirFilters(t *testing.T) {
	w := newWorld(t)
	for i := range 60 { // more than a page of the mails topic
		if _, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: mails.Namespace, Topic: mails.Topic,
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}); err != nil {
			t.Fatal(err)
		}
	}
	st, err := outboxpg.New(w.pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	leased, err := st.Claim(bg, driver.ClaimParams{Topics: []string{mails.Namespace + ":" + mails.Topic}, Limit: 1,
		MaxAttempts: 5, Worker: uuid.New(), Lease: time.Hour})
	if err != nil || len(leased) != 1 {
		t.Fatalf("claim: %v %v", leased, err)
	}
	base := serve(t, w, outboxui.Options{OperatorToken: token})
	jar := newJar()
	overview, _ := get(t, jar, base)
	table := regexp.MustCompile(`(?s)<table id="topics">.*?</table>`).FindString(overview)
	// cell: the class of a row's cell ("" for the name) -> the status its
	// link lists.
	links := map[string]map[string]string{}
	for _, row := range regexp.MustCompile(`(?s)<tr data-topic="([^"]+)">(.*?)</tr>`).FindAllStringSubmatch(table, -1) {
		links[row[1]] = map[string]string{}
		for _, cell := range regexp.MustCompile(`(?s)<td(?: class="(\w+)")?>(.*?)</td>`).FindAllStringSubmatch(row[2], -1) {
			for _, href := range regexp.MustCompile(`href="([^"]+)"`).FindAllStringSubmatch(cell[2], -1) {
				u, err := url.Parse(html.UnescapeString(href[1]))
				if err != nil {
					t.Fatal(err)
				}
				q := u.Query()
				if topic := q.Get("namespace") + "/" + q.Get("topic"); topic != row[1] {
					t.Errorf("a link of %s's row lists %s: %s", row[1], topic, href[1])
				}
				links[row[1]][cell[1]] = q.Get("status")
			}
		}
	}
	for topic, want := range map[string]map[string]string{
		orders.String(): {"": "pending", "pending": "pending", "hour": "delivered", "dead": "dead"},
		mails.String():  {"": "pending", "pending": "pending", "processing": "processing", "dead": "dead"},
	} {
		if !maps.Equal(links[topic], want) {
			t.Errorf("the links of %s's row, by cell, list the events of status %v; want %v", topic, links[topic], want)
		}
	}
	if t.Failed() {
		t.Fatalf("the topics table:\n%s", table)
	}
	processing := regexp.MustCompile(`(?s)<tr data-topic="` + mails.String() + `">.*?<td class="processing"><a href="([^"]+)"`).FindStringSubmatch(overview)
	if body, _ := get(t, jar, base+strings.TrimPrefix(html.UnescapeString(processing[1]), "./")); !strings.Contains(body, leased[0].ID.String()) {
		t.Fatal("the processing link of the mails topic does not list its leased event")
	}
	follow := func(page, what, pattern string) string {
		t.Helper()
		m := regexp.MustCompile(pattern).FindStringSubmatch(page)
		if m == nil {
			t.Fatalf("no link to %s", what)
		}
		body, _ := get(t, jar, base+strings.TrimPrefix(html.UnescapeString(m[1]), "./"))
		return body
	}
	row := `(?s)<tr data-topic="` + mails.Namespace + "/" + mails.Topic + `">.*?`
	dead := follow(overview, "the mails topic's dead events", row+`<td class="dead"><a href="([^"]+)"`)
	if !strings.Contains(dead, w.deadMail.String()) || strings.Contains(dead, w.deadOrder.String()) {
		t.Fatal("the dead link of the mails topic does not list that topic's dead events alone")
	}
	first := follow(overview, "the mails topic's events", row+`<td><a href="([^"]+)"`)
	ids := regexp.MustCompile(`events/([0-9a-f-]{36})`)
	if strings.Contains(first, orders.Topic) {
		t.Fatal("the mails topic's link lists other topics' events")
	}
	// The topic as the overview writes it, pasted into the filter.
	if pasted, _ := get(t, jar, base+"events?status=pending&topic="+url.QueryEscape(mails.String())); ids.FindString(pasted) != ids.FindString(first) ||
		strings.Contains(pasted, orders.Topic) || !strings.Contains(pasted, `name="namespace" value="`+mails.Namespace+`"`) {
		t.Fatalf("events?topic=%s does not list the mails topic's events, with its namespace in the filter:\n%s", mails, pasted)
	}
	if code, body := fetch(t, jar, base+"events?namespace=shop&topic="+url.QueryEscape(mails.String())); code != http.StatusBadRequest ||
		!strings.Contains(body, "but Namespace is") {
		t.Fatalf("a topic of another namespace than the filter's: %d\n%s", code, body)
	}
	second := follow(first, "the next page", `<a id="next" href="([^"]+)"`)
	a, b := ids.FindString(first), ids.FindString(second)
	if a == "" || b == "" || a == b || strings.Contains(second, orders.Topic) {
		t.Fatalf("the next page starts with %q after a page that starts with %q; want the mails topic's next events", b, a)
	}
}

// logRecorder is a slog.Handler that keeps every record, for a test to
// read what was logged and to wait for a record.
type logRecorder struct {
	mu      sync.Mutex
	records []slog.Record
	added   chan struct{} // closed, and replaced, when a record is added
}

func newLogRecorder() *logRecorder { return &logRecorder{added: make(chan struct{})} }

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *logRecorder) WithGroup(string) slog.Handler            { return l }

func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.records = append(l.records, r.Clone())
	close(l.added)
	l.added = make(chan struct{})
	return nil
}

// wait returns the attributes of the first record whose message is msg,
// waiting for it (a minute at most: a hang guard).
func (l *logRecorder) wait(t *testing.T, msg string) map[string]string {
	t.Helper()
	guard := time.After(time.Minute)
	for {
		l.mu.Lock()
		added := l.added
		for _, r := range l.records {
			if r.Message == msg {
				l.mu.Unlock()
				return attrs(r)
			}
		}
		l.mu.Unlock()
		select {
		case <-added:
		case <-guard:
			t.Fatalf("no log record %q", msg)
		}
	}
}

// withAttr returns the attributes of the record whose attribute key is
// value, or nil.
func (l *logRecorder) withAttr(key, value string) map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.records {
		if a := attrs(r); a[key] == value {
			return a
		}
	}
	return nil
}

// count is the number of records whose message contains part.
func (l *logRecorder) count(part string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.records {
		if strings.Contains(r.Message, part) {
			n++
		}
	}
	return n
}

func attrs(r slog.Record) map[string]string {
	out := map[string]string{}
	r.Attrs(func(a slog.Attr) bool {
		out[a.Key] = a.Value.String()
		return true
	})
	return out
}

var errorID = regexp.MustCompile(`error_id=([0-9a-f]{12})`)

// hidesError checks that body, a page answered for a failure that is not
// the visitor's doing, gives an error id instead of the error, and that
// the dashboard logged the error under that id.
func hidesError(t *testing.T, log *logRecorder, what, body string) {
	t.Helper()
	m := errorID.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("%s: no error id on the page:\n%s", what, body)
	}
	rec := log.withAttr("error_id", m[1])
	if rec == nil || rec["error"] == "" {
		t.Fatalf("%s: no log record with error_id=%s and the error", what, m[1])
	}
	if text := html.UnescapeString(body); strings.Contains(text, rec["error"]) || strings.Contains(text, "SQLSTATE") {
		t.Fatalf("%s: the page shows the error %q:\n%s", what, rec["error"], body)
	}
}

// A failure of the database shows the visitor an error id, not the
// database's error (which names the schema, functions, SQLSTATEs); the
// dashboard's log has the error under that id. The visitor's own mistakes
// still say what is wrong, and an unknown event is still a 404.
func TestDashboardHidesInternalErrors(t *testing.T) {
	w := newWorld(t)
	// A client on a schema that was never migrated: every Admin call fails
	// with the database's error.
	broken, err := outbox.New(outboxpg.New(w.pool), outbox.Config{Schema: "not_migrated", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	log := newLogRecorder()
	base := serve(t, &world{client: broken}, outboxui.Options{OperatorToken: token, Logger: slog.New(log)})
	jar := newJar()
	code, body := fetch(t, jar, base)
	if code != http.StatusInternalServerError {
		t.Fatalf("overview on a broken database: %d", code)
	}
	hidesError(t, log, "overview", body)
	csrf := csrfField.FindStringSubmatch(body)[1]
	if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	for _, path := range []string{"events?status=dead", "events/" + w.deadOrder.String()} {
		code, body := fetch(t, jar, base+path)
		if code != http.StatusInternalServerError {
			t.Fatalf("GET %s on a broken database: %d", path, code)
		}
		hidesError(t, log, path, body)
	}
	for path, form := range map[string]url.Values{
		"replay": {"csrf": {csrf}, "id": {w.deadOrder.String()}},
		"purge":  {"csrf": {csrf}, "topic": {"shop/order_paid"}, "older_than": {"0s"}},
	} {
		code, body := post(t, jar, base+path, form, "")
		if code != http.StatusInternalServerError {
			t.Fatalf("POST %s on a broken database: %d", path, code)
		}
		hidesError(t, log, path, body)
	}

	// The overview without its chart and an event without its history say
	// so with an error id too.
	if _, err := w.pool.Exec(bg, `ALTER FUNCTION modkit_outbox_history(uuid) RENAME TO modkit_outbox_history_gone;
		ALTER FUNCTION modkit_outbox_series(interval, interval, timestamptz) RENAME TO modkit_outbox_series_gone`); err != nil {
		t.Fatal(err)
	}
	base = serve(t, w, outboxui.Options{Logger: slog.New(log)})
	overview, _ := get(t, jar, base)
	if !strings.Contains(overview, `id="chart-error"`) {
		t.Fatalf("the overview without its series:\n%s", overview)
	}
	hidesError(t, log, "overview without its series", overview)
	event, _ := get(t, jar, base+"events/"+w.deadOrder.String())
	if !strings.Contains(event, `id="history-error"`) || !strings.Contains(event, "410 Gone") {
		t.Fatalf("the event without its history:\n%s", event)
	}
	hidesError(t, log, "event without its history", event)

	// The visitor's own mistakes.
	for path, want := range map[string]string{
		"events?status=bogus":   "EventFilter.Status",
		"events?after=nonsense": "invalid page cursor",
		"events?tenant=nobody":  "is not a UUID",
		"events?namespace=%00":  "EventFilter.Namespace",
		"events?topic=%ff":      "EventFilter.Topic",
		"events?topic=Orders":   "EventFilter.Topic",
	} {
		if code, body := fetch(t, jar, base+path); code != http.StatusBadRequest || !strings.Contains(body, want) {
			t.Errorf("GET %s: %d, want 400 saying %q:\n%s", path, code, want, body)
		}
	}
	if code, _ := fetch(t, jar, base+"events/"+uuid.NewString()); code != http.StatusNotFound {
		t.Errorf("an unknown event: %d, want 404", code)
	}
}

// Neither the health handler nor the overview quotes the error of failing
// claims (the database's error text); they say since when claims fail, and
// the dispatcher logs the error.
func TestHealthHidesClaimErrors(t *testing.T) {
	w := newWorld(t)
	log := newLogRecorder()
	d, err := w.client.NewDispatcher(outbox.DispatcherConfig{Logger: slog.New(log)},
		outbox.Publisher{Topic: mails, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(bg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(bg); err != nil {
			t.Error(err)
		}
	})
	// From now on every claim fails with the database's error.
	if _, err := w.pool.Exec(bg, `DO $$ DECLARE f regprocedure; BEGIN
		FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'modkit_outbox_claim_chained' LOOP
			EXECUTE format('ALTER FUNCTION %s RENAME TO modkit_outbox_claim_gone', f);
		END LOOP; END $$`); err != nil {
		t.Fatal(err)
	}
	claimErr := log.wait(t, "claim failed; retrying")["error"]
	if claimErr == "" {
		t.Fatal("the failed claim was logged without its error")
	}
	health := httptest.NewServer(outboxui.HealthHandler(d))
	t.Cleanup(health.Close)
	code, h := probe(t, health.URL)
	if code != http.StatusOK || len(h.Dispatchers) != 1 || !h.Dispatchers[0].Degraded || len(h.Dispatchers[0].Problems) != 1 {
		t.Fatalf("health while claims fail: %d %+v", code, h)
	}
	if p := h.Dispatchers[0].Problems[0]; !strings.HasPrefix(p, "claims failing since ") || strings.Contains(p, claimErr) || strings.Contains(p, "SQLSTATE") {
		t.Fatalf("the health handler's problem %q; want when claims began failing without the error %q", p, claimErr)
	}
	overview, _ := get(t, newJar(), serve(t, w, outboxui.Options{Dispatchers: []*outbox.Dispatcher{d}}))
	if text := html.UnescapeString(overview); !strings.Contains(text, "claims failing since ") || strings.Contains(text, claimErr) ||
		strings.Contains(text, "SQLSTATE") {
		t.Fatalf("the overview shows the claim's error %q, or not that claims fail:\n%s", claimErr, overview)
	}
}

var flashPara = regexp.MustCompile(`<p class="flash" id="flash">([^<]*)</p>`)

// flashOf returns the message a page shows after an action, or "".
func flashOf(body string) string {
	if m := flashPara.FindStringSubmatch(body); m != nil {
		return html.UnescapeString(m[1])
	}
	return ""
}

// Only the dashboard puts a message on a page: each action redirects to a
// page that says what it did, and a link that carries a message of its
// own, or the dashboard's message for another browser or with its words
// changed, shows none.
func TestDashboardFlashComesFromItsActions(t *testing.T) {
	w := newWorld(t)
	base := serve(t, w, outboxui.Options{OperatorToken: token})
	jar := newJar()
	_, csrf := get(t, jar, base)
	// act posts form to path, follows the redirect and returns the URL it
	// led to and the message of that page.
	act := func(path string, form url.Values) (*url.URL, string) {
		t.Helper()
		form.Set("csrf", csrf)
		resp, err := jar.PostForm(base+path, form)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		to, err := resp.Location()
		if resp.StatusCode != http.StatusSeeOther || err != nil {
			t.Fatalf("POST %s: %d %v", path, resp.StatusCode, err)
		}
		body, _ := get(t, jar, to.String())
		return to, flashOf(body)
	}

	lure := url.Values{"flash": {"Replay succeeded; now enter your password at https://evil.example"}}.Encode()
	for _, path := range []string{"?" + lure, "events?" + lure, "events/" + w.deadOrder.String() + "?" + lure} {
		if body, _ := get(t, jar, base+path); strings.Contains(body, "evil.example") || flashOf(body) != "" {
			t.Fatalf("GET %s shows the link's message:\n%s", path, body)
		}
	}

	for _, step := range []struct {
		path string
		form url.Values
		want string
	}{
		{"login", url.Values{"token": {token}}, "Signed in as operator."},
		{"replay", url.Values{"id": {w.deadOrder.String()}}, "Event replayed: it is pending again."},
		{"replay", url.Values{"id": {w.deadOrder.String()}}, "Nothing replayed: the event is no longer dead."},
		{"replay", url.Values{"id": {w.deadMail.String(), w.deadOrder.String()}}, "Replayed 1 of 2 events; they are pending again."},
		{"purge", url.Values{"topic": {"shop/order_paid"}, "older_than": {"0s"}}, "Purged 1 delivered event(s) of shop/order_paid."},
		{"logout", url.Values{}, "Signed out."},
	} {
		to, got := act(step.path, step.form)
		if got != step.want {
			t.Fatalf("after %s %v: message %q, want %q", step.path, step.form, got, step.want)
		}
		if body, _ := get(t, newJar(), to.String()); flashOf(body) != "" {
			t.Fatalf("another browser sees the message of %s at %s", step.path, to)
		}
		q := to.Query()
		q.Set("flash", "Signed in as operator; now enter your password at https://evil.example")
		to.RawQuery = q.Encode()
		if body, _ := get(t, jar, to.String()); flashOf(body) != "" {
			t.Fatalf("a message changed from that of %s is shown: %q", step.path, flashOf(body))
		}
	}
}

var historyRow = regexp.MustCompile(`<tr data-no="\d+" class="(\w+)">`)

// A purged event's page shows the history the purge kept, saying that the
// row was purged and when, or that it is gone when the purge left no
// entry (a dispatcher's retention); an id with neither row nor history is
// a 404.
func TestDashboardShowsAPurgedEventsHistory(t *testing.T) {
	w := newWorld(t)
	base := serve(t, w, outboxui.Options{})
	jar := newJar()
	if n, err := w.client.Admin().Purge(bg, 0, orders); err != nil || n != 1 {
		t.Fatalf("purge: %d %v", n, err)
	}
	history, err := w.client.Admin().History(bg, w.delivered)
	if err != nil || len(history) != 2 || history[1].Outcome != "purged" {
		t.Fatalf("history of the purged event: %+v %v", history, err)
	}
	body, _ := get(t, jar, base+"events/"+w.delivered.String())
	purgedAt := history[1].FinishedAt.UTC().Format("2006-01-02 15:04:05Z")
	if !strings.Contains(body, `id="purged"`) || !strings.Contains(body, "purged at "+purgedAt) || strings.Contains(body, `id="detail"`) {
		t.Fatalf("the purged event's page does not say it was purged at %s:\n%s", purgedAt, body)
	}
	if got := historyRow.FindAllStringSubmatch(body, -1); len(got) != 2 || got[0][1] != "delivered" || got[1][1] != "purged" {
		t.Fatalf("the purged event's history rows %v, want delivered and purged", got)
	}

	// A dispatcher's retention purge (the driver's unrecorded purge) leaves
	// no entry: the row is gone, since when is not known.
	deliver(t, w, orders, w.pendingOrder)
	st, err := outboxpg.New(w.pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := st.Purge(bg, driver.PurgeParams{Topics: []string{orders.Namespace + ":" + orders.Topic}, Limit: 10}); err != nil || res.Purged != 1 {
		t.Fatalf("retention purge: %d %v", res.Purged, err)
	}
	body, _ = get(t, jar, base+"events/"+w.pendingOrder.String())
	if !strings.Contains(body, `id="purged"`) || !strings.Contains(body, "row is gone") || strings.Contains(body, "purged at") {
		t.Fatalf("the page of an event purged by retention:\n%s", body)
	}
	if got := historyRow.FindAllStringSubmatch(body, -1); len(got) != 1 || got[0][1] != "delivered" {
		t.Fatalf("the history rows of an event purged by retention %v, want delivered", got)
	}

	if code, body := fetch(t, jar, base+"events/"+uuid.NewString()); code != http.StatusNotFound {
		t.Fatalf("an id with neither row nor history: %d\n%s", code, body)
	}
	if body, _ := get(t, jar, base+"events/"+w.deadOrder.String()); strings.Contains(body, `id="purged"`) || !strings.Contains(body, `id="detail"`) {
		t.Fatalf("the page of an event that was not purged:\n%s", body)
	}
}

// Replicas behind a load balancer that share Options.SigningKey accept
// each other's CSRF tokens, sign-ins and messages: a browser whose every
// request may land on either (two servers on one host share its cookies,
// as replicas behind one address do) signs in and acts. Without a shared
// key each still refuses what the other signed.
func TestDashboardReplicasShareASigningKey(t *testing.T) {
	w := newWorld(t)
	key := []byte("0123456789abcdef0123456789abcdef") // SigningKeyMinLen bytes
	a := serve(t, w, outboxui.Options{OperatorToken: token, SigningKey: key})
	b := serve(t, w, outboxui.Options{OperatorToken: token, SigningKey: append([]byte(nil), key...)})
	jar := newJar()
	// redirected posts form to base+path and returns the redirect's path
	// and query, to be fetched from either replica.
	redirected := func(base, path string, form url.Values) string {
		t.Helper()
		resp, err := jar.PostForm(base+path, form)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		to, err := resp.Location()
		if resp.StatusCode != http.StatusSeeOther || err != nil {
			t.Fatalf("POST %s%s: %d %v\n%s", base, path, resp.StatusCode, err, body)
		}
		return strings.TrimPrefix(to.RequestURI(), "/outbox/")
	}

	_, csrf := get(t, jar, a)
	to := redirected(b, "login", url.Values{"csrf": {csrf}, "token": {token}}) // a's form, posted to b
	body, csrfB := get(t, jar, a+to)                                           // b's message, shown by a
	if got := flashOf(body); got != "Signed in as operator." {
		t.Fatalf("a shows the message of b's sign-in as %q", got)
	}
	if !strings.Contains(body, `id="operator"`) {
		t.Fatal("a does not honour the sign-in made on b")
	}
	to = redirected(a, "replay", url.Values{"csrf": {csrfB}, "id": {w.deadOrder.String()}}) // b's page's token, posted to a
	if body, _ := get(t, jar, b+to); flashOf(body) != "Event replayed: it is pending again." || !strings.Contains(body, `id="operator"`) {
		t.Fatalf("b after a replay made on a: message %q\n%s", flashOf(body), body)
	}
	if s := w.status(t, w.deadOrder); s != outbox.StatusPending {
		t.Fatalf("after the replay the event is %s", s)
	}

	// Each with a key of its own (a random one, or another SigningKey):
	// refused as before.
	for name, keys := range map[string][2][]byte{
		"random keys":    {nil, nil},
		"different keys": {key, []byte("fedcba9876543210fedcba9876543210")},
	} {
		a := serve(t, w, outboxui.Options{OperatorToken: token, SigningKey: keys[0]})
		b := serve(t, w, outboxui.Options{OperatorToken: token, SigningKey: keys[1]})
		jar = newJar()
		_, csrf := get(t, jar, a)
		if code, body := post(t, jar, b+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusForbidden || !strings.Contains(body, "stale") {
			t.Fatalf("%s: a's form posted to b: %d\n%s", name, code, body)
		}
		to := redirected(a, "login", url.Values{"csrf": {csrf}, "token": {token}})
		if body, _ := get(t, jar, b+to); flashOf(body) != "" || strings.Contains(body, `id="operator"`) {
			t.Fatalf("%s: b shows a's message %q or honours its sign-in", name, flashOf(body))
		}
		_, csrfB := get(t, jar, b)
		if code, body := post(t, jar, b+"replay", url.Values{"csrf": {csrfB}, "id": {w.deadMail.String()}}, ""); code != http.StatusForbidden || !strings.Contains(body, "Sign in") {
			t.Fatalf("%s: b replays for a browser signed in on a: %d\n%s", name, code, body)
		}
	}
	if s := w.status(t, w.deadMail); s != outbox.StatusDead {
		t.Fatalf("the refused replays left the event %s", s)
	}
}

// A SigningKey shorter than SigningKeyMinLen, an empty one included, is
// refused, with an error that matches outbox.ErrInvalidConfig too.
func TestDashboardRefusesAShortSigningKey(t *testing.T) {
	w := newWorld(t)
	for _, key := range [][]byte{{}, []byte("0123456789abcdef0123456789abcde")} {
		_, err := outboxui.New(w.client.Admin(), outboxui.Options{SigningKey: key})
		if !errors.Is(err, outboxui.ErrWeakSigningKey) || !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Fatalf("a signing key of %d bytes: %v", len(key), err)
		}
	}
	if _, err := outboxui.New(w.client.Admin(), outboxui.Options{SigningKey: make([]byte, outboxui.SigningKeyMinLen)}); err != nil {
		t.Fatalf("a signing key of %d bytes: %v", outboxui.SigningKeyMinLen, err)
	}
}

// Signing out replaces the browser's id: the operator cookie it had, sent
// again (a copy, or one the browser did not delete), no longer signs it
// in; the message after the sign-out still shows. The id cookie is
// SameSite=Lax (a link from another site sends it, so the page does not
// replace it), the sign-in's Strict.
func TestDashboardSignOutEndsTheSignIn(t *testing.T) {
	w := newWorld(t)
	a := serve(t, w, outboxui.Options{OperatorToken: token})
	jar := newJar()
	_, csrf := get(t, jar, a)
	if code, body := post(t, jar, a+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d\n%s", code, body)
	}
	u, _ := url.Parse(a)
	var operator *http.Cookie
	for _, c := range jar.Jar.Cookies(u) {
		if c.Name == "modkit_outbox_operator" {
			operator = c
		}
	}
	if operator == nil {
		t.Fatal("no operator cookie after the sign-in")
	}
	body, csrf := get(t, jar, a)
	if !strings.Contains(body, `id="operator"`) {
		t.Fatal("not signed in")
	}
	resp, err := jar.PostForm(a+"logout", url.Values{"csrf": {csrf}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	to, err := resp.Location()
	if resp.StatusCode != http.StatusSeeOther || err != nil {
		t.Fatalf("sign out: %d %v", resp.StatusCode, err)
	}
	if page, _ := get(t, jar, to.String()); flashOf(page) != "Signed out." {
		t.Fatalf("after signing out the page says %q", flashOf(page))
	}
	jar.Jar.SetCookies(u, []*http.Cookie{{Name: operator.Name, Value: operator.Value, Path: "/outbox/"}})
	if body, _ := get(t, jar, a); strings.Contains(body, `id="operator"`) {
		t.Fatal("the operator cookie of before the sign-out still signs the browser in")
	}

	resp, err = newJar().Get(a)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for _, c := range resp.Cookies() {
		if c.Name == "modkit_outbox_csrf" && c.SameSite != http.SameSiteLaxMode {
			t.Errorf("the id cookie is SameSite %v, want Lax", c.SameSite)
		}
	}
}

// A sign-in made with a SigningKey, which outlives the handler, ends when
// the operator token changes.
func TestDashboardSignInEndsWithItsToken(t *testing.T) {
	w := newWorld(t)
	key := []byte("0123456789abcdef0123456789abcdef")
	a := serve(t, w, outboxui.Options{OperatorToken: token, SigningKey: key})
	jar := newJar()
	_, csrf := get(t, jar, a)
	if code, body := post(t, jar, a+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d\n%s", code, body)
	}
	if body, _ := get(t, jar, serve(t, w, outboxui.Options{OperatorToken: token, SigningKey: key})); !strings.Contains(body, `id="operator"`) {
		t.Fatal("a handler rebuilt with the same key and token does not honour the sign-in")
	}
	if body, _ := get(t, jar, serve(t, w, outboxui.Options{OperatorToken: token + "-rotated", SigningKey: key})); strings.Contains(body, `id="operator"`) {
		t.Fatal("a sign-in outlived a change of operator token")
	}
}

// With SecureCookies, a dashboard reached over plain HTTP (as behind a
// proxy that terminates TLS) sets its cookies Secure, the sign-in's and
// the sign-out's included; without it, such a request gets cookies that
// are not (a browser would drop Secure cookies received over http://).
func TestDashboardSecureCookies(t *testing.T) {
	w := newWorld(t)
	cookies := func(opts outboxui.Options) []*http.Cookie {
		t.Helper()
		a := serve(t, w, opts)
		jar := newJar()
		resp, err := jar.Get(a)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out := resp.Cookies()
		m := csrfField.FindStringSubmatch(string(body))
		if m == nil {
			t.Fatal("no CSRF token on the page")
		}
		for _, action := range []url.Values{{"csrf": {m[1]}, "token": {token}}, {"csrf": {m[1]}}} {
			path := map[bool]string{true: "login", false: "logout"}[action.Has("token")]
			req, _ := http.NewRequest(http.MethodPost, a+path, strings.NewReader(action.Encode()))
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			resp, err := jar.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusSeeOther {
				t.Fatalf("%s: %d", path, resp.StatusCode)
			}
			out = append(out, resp.Cookies()...)
		}
		var names []string
		for _, c := range out {
			names = append(names, c.Name)
		}
		if want := []string{"modkit_outbox_csrf", "modkit_outbox_operator", "modkit_outbox_operator", "modkit_outbox_csrf"}; !slices.Equal(names, want) {
			t.Fatalf("cookies set: %v, want %v (the CSRF one, the sign-in's, and the sign-out's two)", names, want)
		}
		return out
	}
	for _, c := range cookies(outboxui.Options{OperatorToken: token, SecureCookies: true}) {
		if !c.Secure {
			t.Errorf("cookie %s is not Secure with SecureCookies", c.Name)
		}
	}
	for _, c := range cookies(outboxui.Options{OperatorToken: token}) {
		if c.Secure {
			t.Errorf("cookie %s is Secure over plain HTTP without SecureCookies", c.Name)
		}
	}
}

// An operator purges a dead event from its page: it is deleted, its page
// then shows the history with the purge, by the dashboard, and a second
// purge changes nothing. Without the sign-in the purge is refused.
func TestDashboardPurgesADeadEvent(t *testing.T) {
	w := newWorld(t)
	base := serve(t, w, outboxui.Options{OperatorToken: token, By: "ops dashboard"})
	jar := newJar()
	body, csrf := get(t, jar, base+"events/"+w.deadMail.String())
	if strings.Contains(body, `id="purge-dead"`) {
		t.Fatal("the purge button is shown before the sign-in")
	}
	form := url.Values{"csrf": {csrf}, "id": {w.deadMail.String()}}
	if code, _ := post(t, jar, base+"purge-dead", form, ""); code != http.StatusForbidden {
		t.Fatalf("purge without the sign-in: %d, want 403", code)
	}
	if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	if body, _ := get(t, jar, base+"events/"+w.deadMail.String()); !strings.Contains(body, `id="purge-dead"`) {
		t.Fatal("no purge button on a dead event's page for the operator")
	}
	for _, want := range []string{"Event purged: it is deleted, and its history stays.", "Nothing purged: the event's row is gone (purged); its history is below."} {
		resp, err := jar.PostForm(base+"purge-dead", form)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		to, err := resp.Location()
		if resp.StatusCode != http.StatusSeeOther || err != nil {
			t.Fatalf("purge: %d %v", resp.StatusCode, err)
		}
		page, _ := get(t, jar, to.String())
		if flashOf(page) != want || !strings.Contains(page, "purged while dead by ops dashboard") {
			t.Fatalf("after the purge: message %q, want %q; the page must show the purge in the history:\n%s", flashOf(page), want, page)
		}
	}
	if _, err := w.client.Admin().Get(bg, w.deadMail); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("the purged event: %v, want ErrNotFound", err)
	}
}

// TestOverviewListsTopicsDeliveredInTheLastHour: the overview counts the
// backlog (Admin.Backlog, no delivered event read), so a topic whose events
// were all delivered has no backlog row; it is still listed, from the last
// hour's deliveries, and the delivered history kept is not counted.
func TestOverviewListsTopicsDeliveredInTheLastHour(t *testing.T) {
	w := newWorld(t)
	receipts := outbox.Topic{Namespace: "shop", Topic: "receipt_sent"}
	if _, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: receipts.Namespace, Topic: receipts.Topic,
		Payload: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	settleNext(t, w, receipts, driver.Delivered)
	if b, err := w.client.Admin().Backlog(bg); err != nil || slices.ContainsFunc(b.Topics, func(s outbox.TopicStats) bool { return s.Topic == receipts }) {
		t.Fatalf("backlog: %+v, %v; want no row of %s, whose only event was delivered", b, err, receipts)
	}
	base := serve(t, w, outboxui.Options{OperatorToken: token})
	jar := newJar()
	body, csrf := get(t, jar, base)
	row := regexp.MustCompile(`(?s)<tr data-topic="shop/receipt_sent">(.*?)</tr>`).FindStringSubmatch(body)
	if row == nil || !strings.Contains(row[1], `<td class="pending">0</td>`) || !regexp.MustCompile(`<td class="hour"><a [^>]*>1</a></td>`).MatchString(row[1]) {
		t.Fatalf("the overview has no row for shop/receipt_sent with its delivery of the last hour:\n%s", body)
	}
	if strings.Contains(body, "Delivered (kept)") {
		t.Fatal("the overview still has a column of the delivered events kept")
	}

	// A topic that is not listed (its deliveries are older than an hour)
	// can still be purged: an operator's overview has a form that takes
	// any topic.
	if strings.Contains(body, `id="purge-any"`) {
		t.Fatal("a visitor who has not signed in is offered the purge form")
	}
	resp, err := jar.PostForm(base+"login", url.Values{"token": {token}, "csrf": {csrf}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	body, _ = get(t, jar, base)
	form := regexp.MustCompile(`(?s)<form [^>]*id="purge-any"[^>]*>(.*?)</form>`).FindStringSubmatch(body)
	if form == nil || !strings.Contains(form[1], `name="topic"`) || !strings.Contains(form[1], `name="older_than"`) || !strings.Contains(form[1], `name="csrf"`) {
		t.Fatalf("an operator's overview has no form to purge any topic:\n%s", body)
	}

	// After a purge of its delivered events the overview no longer lists
	// the topic: the series the first load read (kept for 10 s) is read
	// afresh.
	resp, err = jar.PostForm(base+"purge", url.Values{"topic": {"shop/receipt_sent"}, "older_than": {"0s"}, "csrf": {csrf}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("purge: %d", resp.StatusCode)
	}
	if body, _ = get(t, jar, base); strings.Contains(body, `<tr data-topic="shop/receipt_sent">`) {
		t.Fatalf("after the purge of its delivered events the overview still lists shop/receipt_sent:\n%s", body)
	}
}

// A dead event left unpurged because an earlier event of its ordering key
// is not settled (PurgeDead keeps a key's order) is not said to be "no
// longer dead": the message says why, and the page shows the key.
func TestDashboardPurgeOfADeadEventBehindItsKey(t *testing.T) {
	w := newWorld(t)
	keyed := outbox.Topic{Namespace: "shop", Topic: "ledger"}
	for i := range 2 {
		if _, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: keyed.Namespace, Topic: keyed.Topic, OrderingKey: "acct-7",
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}); err != nil {
			t.Fatal(err)
		}
	}
	kill := func() uuid.UUID { return settleNext(t, w, keyed, driver.Dead) } // the key's head, dead
	adm := w.client.Admin()
	first := kill()
	if err := adm.SkipHead(bg, "test", first); err != nil {
		t.Fatal(err)
	}
	second := kill() // the key's head once the first was skipped
	if _, err := adm.ReplayDead(bg, "test", outbox.EventFilter{}, first); err != nil {
		t.Fatal(err)
	}
	base := serve(t, w, outboxui.Options{OperatorToken: token, By: "ops dashboard"})
	jar := newJar()
	_, csrf := get(t, jar, base+"events/"+second.String())
	if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	resp, err := jar.PostForm(base+"purge-dead", url.Values{"csrf": {csrf}, "id": {second.String()}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	to, err := resp.Location()
	if err != nil {
		t.Fatal(err)
	}
	page, _ := get(t, jar, to.String())
	if !strings.HasPrefix(flashOf(page), "Nothing purged: it waits behind an earlier event of its ordering key") ||
		!strings.Contains(page, `id="ordering-key">acct-7 (event 2 of the key)`) {
		t.Fatalf("after the purge of a dead event behind its key: message %q; the page must show the key:\n%s", flashOf(page), page)
	}
	if ev, err := adm.Get(bg, second); err != nil || ev.Status != outbox.StatusDead {
		t.Fatalf("the event: %+v %v, want it still dead", ev, err)
	}
}

// An ordering key held back by a dead event is listed on the overview with
// a link to the dead event, whose page lets an operator skip it; the skip
// is refused for an event that is not the key's dead head, and once done
// the key is no longer listed and the event's history records who skipped.
func TestDashboardBlockedKeysAndSkipHead(t *testing.T) {
	w := newWorld(t)
	keyed := outbox.Topic{Namespace: "shop", Topic: "ledger"}
	var ids []uuid.UUID
	for i := range 3 {
		r, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: keyed.Namespace, Topic: keyed.Topic, OrderingKey: "acct-9",
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, r.ID)
	}
	st, err := outboxpg.New(w.pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	worker := uuid.New()
	got, err := st.Claim(bg, driver.ClaimParams{Topics: []string{keyed.Namespace + ":" + keyed.Topic}, Limit: 1,
		MaxAttempts: 5, Worker: worker, Lease: time.Minute})
	if err != nil || len(got) != 1 || got[0].ID != ids[0] {
		t.Fatalf("claim of the key's head: %v %v", got, err)
	}
	if _, err := st.Complete(bg, nil, worker, []driver.Outcome{{ID: got[0].ID, LeaseToken: got[0].LeaseToken, Kind: driver.Dead,
		Error: "the ledger refused it"}}); err != nil {
		t.Fatal(err)
	}
	head := ids[0]

	base := serve(t, w, outboxui.Options{OperatorToken: token, By: "ops dashboard"})
	jar := newJar()
	overview, csrf := get(t, jar, base)
	row := regexp.MustCompile(`(?s)<tr data-key="acct-9">.*?</tr>`).FindString(overview)
	if !strings.Contains(row, `events/`+head.String()+`"`) || !strings.Contains(row, `<td class="waiting">2</td>`) ||
		!strings.Contains(row, "the ledger refused it") {
		t.Fatalf("the overview's blocked key acct-9 (head %s, 2 waiting):\n%s", head, overview)
	}
	if page, _ := get(t, jar, base+"events/"+head.String()); strings.Contains(page, `id="skip-head"`) {
		t.Fatal("the skip form is shown to a visitor who has not signed in")
	}
	if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	if page, _ := get(t, jar, base+"events/"+head.String()); !strings.Contains(page, `id="skip-head"`) {
		t.Fatalf("no skip form on the dead head's page:\n%s", page)
	}
	skip := func(id uuid.UUID) string {
		t.Helper()
		resp, err := jar.PostForm(base+"skip-head", url.Values{"csrf": {csrf}, "id": {id.String()}})
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		to, err := resp.Location()
		if err != nil {
			t.Fatalf("skip of %s: %d, no redirect", id, resp.StatusCode)
		}
		page, _ := get(t, jar, to.String())
		return flashOf(page)
	}
	if msg := skip(ids[1]); !strings.HasPrefix(msg, "Nothing skipped") {
		t.Fatalf("skip of a pending event behind the head: %q", msg)
	}
	if msg := skip(head); !strings.HasPrefix(msg, "Skipped:") {
		t.Fatalf("skip of the dead head: %q", msg)
	}
	adm := w.client.Admin()
	if ev, err := adm.Get(bg, head); err != nil || ev.Status != outbox.StatusDead {
		t.Fatalf("the skipped head: %+v %v, want it still dead", ev, err)
	}
	h, err := adm.History(bg, head)
	if err != nil || len(h) == 0 || h[len(h)-1].Outcome != "skipped" || !strings.Contains(h[len(h)-1].Detail, "ops dashboard") {
		t.Fatalf("the skipped head's history: %+v %v", h, err)
	}
	if overview, _ := get(t, jar, base); strings.Contains(overview, `data-key="acct-9"`) {
		t.Fatalf("the skipped key is still listed as blocked:\n%s", overview)
	}
}

// A replay or purge of an id no event has (a crafted or stale form) says
// so, rather than that the event is no longer dead.
func TestDashboardActionsOnAnUnknownID(t *testing.T) {
	w := newWorld(t)
	base := serve(t, w, outboxui.Options{OperatorToken: token})
	jar := newJar()
	_, csrf := get(t, jar, base)
	if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	unknown := uuid.New()
	for action, want := range map[string]string{
		"replay":     "Nothing replayed: no event has this id.",
		"purge-dead": "Nothing purged: no event has this id.",
	} {
		resp, err := jar.PostForm(base+action, url.Values{"csrf": {csrf}, "id": {unknown.String()}})
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		to, err := resp.Location()
		if err != nil {
			t.Fatalf("%s of an unknown id: %d, no redirect", action, resp.StatusCode)
		}
		_, body := fetch(t, jar, to.String()) // the event's page: 404, with the message
		if msg := flashOf(body); !strings.HasPrefix(msg, want) {
			t.Errorf("%s of an unknown id: message %q, want %q", action, msg, want)
		}
	}
}

// A topic with events waiting and no running dispatcher (no maintenance
// lease held for it) is marked on the overview: its events would wait
// without an error anywhere. A topic a dispatcher serves is not.
func TestOverviewMarksTopicsNobodyServes(t *testing.T) {
	w := newWorld(t)
	for _, topic := range []string{"oders", "orders"} {
		if _, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: "shop", Topic: topic, Payload: json.RawMessage(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	st, err := outboxpg.New(w.pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	// A dispatcher of shop/orders holds its maintenance lease, as a running
	// one does.
	if held, err := st.Elect(bg, driver.ElectParams{Roles: []string{"maintenance:shop:orders"}, Holder: uuid.New(), TTL: time.Minute}); err != nil || len(held) != 1 {
		t.Fatalf("elect: %v, %v", held, err)
	}
	base := serve(t, w, outboxui.Options{})
	body, _ := get(t, newJar(), base)
	rowOf := func(topic string) string {
		row := regexp.MustCompile(`(?s)<tr data-topic="` + topic + `">(.*?)</tr>`).FindStringSubmatch(body)
		if row == nil {
			t.Fatalf("the overview has no row for %s:\n%s", topic, body)
		}
		return row[1]
	}
	if !strings.Contains(rowOf("shop/oders"), `class="problem unserved"`) {
		t.Errorf("shop/oders, which no dispatcher serves, is not marked:\n%s", rowOf("shop/oders"))
	}
	if strings.Contains(rowOf("shop/orders"), "unserved") {
		t.Errorf("shop/orders, whose maintenance lease is held, is marked as served by none:\n%s", rowOf("shop/orders"))
	}
	if strings.Contains(body, "dead-letter") {
		t.Errorf("a read-only dashboard offers to dead-letter events:\n%s", rowOf("shop/oders"))
	}

	// An operator may dead-letter the pending events of the topic nobody
	// serves, from its row; the served topic's row offers nothing of the
	// kind.
	base = serve(t, w, outboxui.Options{OperatorToken: token, By: "ops dashboard"})
	jar := newJar()
	_, csrf := get(t, jar, base)
	if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	body, _ = get(t, jar, base)
	if !strings.Contains(rowOf("shop/oders"), `dead-letter" class="inline dead-letter">`) {
		t.Fatalf("no dead-letter form on the row of the topic nobody serves:\n%s", rowOf("shop/oders"))
	}
	if strings.Contains(rowOf("shop/orders"), "dead-letter") {
		t.Fatalf("a dead-letter form on the row of a served topic:\n%s", rowOf("shop/orders"))
	}
	resp, err := jar.PostForm(base+"dead-letter", url.Values{"csrf": {csrf}, "topic": {"shop/oders"}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	to, err := resp.Location()
	if resp.StatusCode != http.StatusSeeOther || err != nil {
		t.Fatalf("dead-letter: %d %v", resp.StatusCode, err)
	}
	page, _ := get(t, jar, to.String())
	if want := "Dead-lettered 1 event(s) of shop/oders: replay them from the dead list once a publisher runs."; flashOf(page) != want {
		t.Fatalf("after the dead-lettering: message %q, want %q", flashOf(page), want)
	}
	// A topic a dispatcher serves is refused, and nothing changes.
	if code, _ := post(t, jar, base+"dead-letter", url.Values{"csrf": {csrf}, "topic": {"shop/orders"}}, ""); code != http.StatusConflict {
		t.Fatalf("dead-letter of a served topic: %d, want 409", code)
	}
	st2, err := w.client.Admin().Backlog(bg)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"oders": 0, "orders": 1}
	for _, ts := range st2.Topics {
		if n, ok := want[ts.Topic.Topic]; ok && ts.Namespace == "shop" && ts.Pending != n {
			t.Fatalf("%s: %d pending after the dead-lettering, want %d", ts.Topic, ts.Pending, n)
		}
	}
}

// Wrong operator tokens are limited per address: after ten, a wrong one is
// answered 429 with Retry-After, and the log says so once rather than once
// a try. The right token still signs in: a visitor who spends the
// allowance of an address the operator shares (a proxy's) cannot lock the
// operator out.
func TestWrongOperatorTokensAreLimited(t *testing.T) {
	w := newWorld(t)
	log := newLogRecorder()
	base := serve(t, w, outboxui.Options{OperatorToken: token, Logger: slog.New(log)})
	jar := newJar()
	_, csrf := get(t, jar, base)
	for i := range 10 {
		if code, body := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {"wrong-token-" + strconv.Itoa(i)}}, ""); code != http.StatusForbidden || !strings.Contains(body, "Wrong operator token.") {
			t.Fatalf("wrong token %d: %d\n%s", i+1, code, body)
		}
	}
	for range 2 {
		req, err := http.NewRequest(http.MethodPost, base+"login", strings.NewReader(url.Values{"csrf": {csrf}, "token": {"yet another wrong one"}}.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		resp, err := jar.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		secs, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		if resp.StatusCode != http.StatusTooManyRequests || secs < 1 || secs > 6 || !strings.Contains(string(body), "too many from your address") {
			t.Fatalf("a wrong token after ten: %d, Retry-After %q\n%s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
	}
	if n := log.count("too many wrong tokens"); n != 1 {
		t.Fatalf("the log says %d times that the limit was reached, want once", n)
	}
	if n := log.count("operator sign-in refused"); n != 10 {
		t.Fatalf("%d wrong tokens logged, want the ten within the allowance", n)
	}
	if code, body := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("the right token from an address whose allowance is spent: %d, want signed in\n%s", code, body)
	}
}

// The dashboard asks the database what its login may do. Started with an
// operator token and payloads on, as a login in the reader role it says
// that the login hides the payloads (not that it was started without
// them), offers no sign-in and no action, and refuses one crafted by
// hand, saying why; as a login in the operator role it shows the payload
// and the sign-in.
func TestDashboardFollowsItsDatabaseLogin(t *testing.T) {
	w := newWorld(t)
	login := func(group string) (*outbox.Client, string) {
		pool := w.db.LoginAs(t, group)
		var user string
		if err := pool.QueryRow(bg, "SELECT current_user").Scan(&user); err != nil {
			t.Fatal(err)
		}
		c, err := outbox.New(outboxpg.New(pool), outbox.Config{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		return c, user
	}
	// One signing key, so that a CSRF token of the owner's dashboard (the
	// reader's pages have no form to take one from) holds on the reader's.
	opts := outboxui.Options{OperatorToken: token, ShowPayloads: true, SigningKey: []byte(strings.Repeat("k", outboxui.SigningKeyMinLen))}
	jar := newJar()
	_, csrf := get(t, jar, serve(t, w, opts))

	reader, user := login(outboxpg.RoleReader)
	base := serveAdmin(t, reader.Admin(), opts)
	overview, _ := get(t, jar, base)
	if strings.Contains(overview, `id="login"`) || !strings.Contains(overview, `id="readonly"`) ||
		!strings.Contains(overview, "its database login "+user+" may not replay or purge") {
		t.Fatalf("the reader's overview offers a sign-in, or does not say why it is read-only:\n%s", overview)
	}
	page, _ := get(t, jar, base+"events/"+w.deadOrder.String())
	main := page[strings.Index(page, "<main>"):]
	switch {
	case strings.Contains(page, "someone@example.com"):
		t.Fatalf("the reader's event page shows the payload:\n%s", page)
	case strings.Contains(page, "started without payloads") ||
		!strings.Contains(page, "hidden: the dashboard's database login "+user+" may not read them"):
		t.Fatalf("the reader's event page does not say that its login hides the payload:\n%s", page)
	case strings.Contains(page, "Sign in") || strings.Contains(main, "<form"):
		t.Fatalf("the reader's event page invites a sign-in or offers an action:\n%s", page)
	case !strings.Contains(main, `id="readonly-hint"`) || !strings.Contains(main, "may not replay or purge (grant it modkit_outbox_operator"):
		t.Fatalf("the reader's event page does not say why it offers no action:\n%s", page)
	}
	// A sign-in and a replay made by hand: the replay is refused with the
	// reason, and the event stays dead.
	if code, body := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d\n%s", code, body)
	}
	if code, body := post(t, jar, base+"replay", url.Values{"csrf": {csrf}, "id": {w.deadOrder.String()}}, ""); code != http.StatusForbidden ||
		!strings.Contains(body, "This dashboard is read-only: its database login "+user+" may not replay or purge") {
		t.Fatalf("a replay through the reader's dashboard: %d\n%s", code, body)
	}
	if s := w.status(t, w.deadOrder); s != outbox.StatusDead {
		t.Fatalf("after a refused replay the event is %s", s)
	}

	operator, _ := login(outboxpg.RoleOperator)
	base = serveAdmin(t, operator.Admin(), opts)
	jar = newJar()
	page, _ = get(t, jar, base+"events/"+w.deadOrder.String())
	if !strings.Contains(page, `id="login"`) || !strings.Contains(page, `id="sign-in-hint"`) || !strings.Contains(page, "someone@example.com") {
		t.Fatalf("the operator login's event page lacks the sign-in or the payload:\n%s", page)
	}
}

// Only a pending event has a next attempt: the event page of a dead or a
// delivered one shows none (the row keeps the time its last attempt was
// due, which read as an attempt to come).
func TestEventPageShowsANextAttemptForPendingEventsOnly(t *testing.T) {
	w := newWorld(t)
	base := serve(t, w, outboxui.Options{})
	jar := newJar()
	next := regexp.MustCompile(`<dd id="next-attempt">([^<]*)</dd>`)
	pending, err := w.client.Admin().Get(bg, w.pendingOrder)
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[uuid.UUID]string{
		w.pendingOrder: pending.NextAttemptAt.UTC().Format("2006-01-02 15:04:05Z"),
		w.deadOrder:    "–",
		w.delivered:    "–",
	} {
		page, _ := get(t, jar, base+"events/"+id.String())
		if m := next.FindStringSubmatch(page); m == nil || m[1] != want {
			t.Errorf("the %s event's page: next attempt %q, want %q", w.status(t, id), m, want)
		}
	}
}

// The overview lists the ordering keys whose dead head holds events back,
// and counts, without listing them, the keys whose dead head has nothing
// behind it (often a key's only event): they crowded out the keys that
// hold events back.
func TestOverviewCountsDeadHeadsThatHoldNothingBack(t *testing.T) {
	w := newWorld(t)
	keyed := outbox.Topic{Namespace: "shop", Topic: "ledger"}
	st, err := outboxpg.New(w.pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	// deadHead enqueues n events of key and lets its head die.
	deadHead := func(key string, n int) {
		t.Helper()
		for i := range n {
			if _, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: keyed.Namespace, Topic: keyed.Topic, OrderingKey: key,
				Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}); err != nil {
				t.Fatal(err)
			}
		}
		worker := uuid.New()
		got, err := st.Claim(bg, driver.ClaimParams{Topics: []string{keyed.Namespace + ":" + keyed.Topic}, Limit: 1,
			MaxAttempts: 5, Worker: worker, Lease: time.Minute})
		if err != nil || len(got) != 1 {
			t.Fatalf("claim of %s's head: %v %v", key, got, err)
		}
		if _, err := st.Complete(bg, nil, worker, []driver.Outcome{{ID: got[0].ID, LeaseToken: got[0].LeaseToken, Kind: driver.Dead,
			Error: "the ledger refused it"}}); err != nil {
			t.Fatal(err)
		}
	}
	base := serve(t, w, outboxui.Options{})
	jar := newJar()

	deadHead("acct-1", 1)
	overview, _ := get(t, jar, base)
	if strings.Contains(overview, `id="blocked"`) || strings.Contains(overview, `data-key="acct-1"`) ||
		!strings.Contains(overview, "1 ordering key(s) have a dead event with nothing waiting behind it") {
		t.Fatalf("the overview with one dead head holding nothing back:\n%s", overview)
	}

	deadHead("acct-2", 2)
	overview, _ = get(t, jar, base)
	if !strings.Contains(overview, `data-key="acct-2"`) || strings.Contains(overview, `data-key="acct-1"`) ||
		!strings.Contains(overview, "1 more ordering key(s), not listed, have a dead event with nothing waiting behind it") ||
		strings.Contains(overview, `id="more-blocked"`) {
		t.Fatalf("the overview with a blocked key (acct-2) and a dead head holding nothing back (acct-1):\n%s", overview)
	}
}

// Options.ClientAddr names the client behind a proxy: each gets its own
// allowance of wrong tokens, where all shared the proxy's address.
func TestWrongOperatorTokensPerClientAddr(t *testing.T) {
	w := newWorld(t)
	base := serve(t, w, outboxui.Options{OperatorToken: token, Logger: quiet,
		ClientAddr: func(r *http.Request) string { return r.Header.Get("X-Test-Client") }})
	jar := newJar()
	_, csrf := get(t, jar, base)
	signIn := func(client string) int {
		req, err := http.NewRequest(http.MethodPost, base+"login", strings.NewReader(url.Values{"csrf": {csrf}, "token": {"wrong"}}.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("X-Test-Client", client)
		resp, err := jar.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for range 10 {
		if code := signIn("198.51.100.1"); code != http.StatusForbidden {
			t.Fatalf("a wrong token within the first client's allowance: %d", code)
		}
	}
	if code := signIn("198.51.100.1"); code != http.StatusTooManyRequests {
		t.Fatalf("the first client's eleventh wrong token: %d, want 429", code)
	}
	if code := signIn("198.51.100.2"); code != http.StatusForbidden {
		t.Fatalf("another client behind the same proxy: %d, want 403 (an allowance of its own)", code)
	}
}

// settleNext claims the next due event of topic and records kind for it
// (Dead with the error "x"), and returns its id.
func settleNext(t *testing.T, w *world, topic outbox.Topic, kind driver.OutcomeKind) uuid.UUID {
	t.Helper()
	st, err := outboxpg.New(w.pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	worker := uuid.New()
	got, err := st.Claim(bg, driver.ClaimParams{Topics: []string{topic.Namespace + ":" + topic.Topic}, Limit: 1,
		MaxAttempts: 5, Worker: worker, Lease: time.Minute})
	if err != nil || len(got) != 1 {
		t.Fatalf("claim: %v %v", got, err)
	}
	o := driver.Outcome{ID: got[0].ID, LeaseToken: got[0].LeaseToken, Kind: kind}
	if kind == driver.Dead {
		o.Error = "x"
	}
	if _, err := st.Complete(bg, nil, worker, []driver.Outcome{o}); err != nil {
		t.Fatal(err)
	}
	return got[0].ID
}
