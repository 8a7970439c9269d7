package outboxui_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/browser"
	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
	"github.com/modkit-go/modkit/modkit/outbox/outboxui"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const token = "0123456789abcdef-operator"

var (
	bg     = context.Background()
	orders = outbox.Topic{Namespace: "shop", Topic: "order_paid"}
	mails  = outbox.Topic{Namespace: "crm", Topic: "welcome_mail"}
	quiet  = slog.New(slog.NewTextHandler(io.Discard, nil))
)

// world is a database holding, for shop/order_paid, one delivered, one
// dead and one pending event, and for crm/welcome_mail one dead event.
type world struct {
	client                  *outbox.Client
	pool                    *pgxpool.Pool
	db                      *pgtest.DB
	deadOrder, deadMail     uuid.UUID
	pendingOrder, delivered uuid.UUID
}

func newWorld(t *testing.T) *world {
	t.Helper()
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	c, err := outbox.New(outboxpg.New(pool), outbox.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	st, err := outboxpg.New(pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	enqueue := func(topic outbox.Topic, n int) {
		for i := range n {
			if _, err := c.Enqueue(bg, pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic,
				Payload: json.RawMessage(fmt.Sprintf(`{"n":%d,"email":"someone@example.com"}`, i))}); err != nil {
				t.Fatal(err)
			}
		}
	}
	settle := func(topic outbox.Topic, kind driver.OutcomeKind) uuid.UUID {
		worker := uuid.New()
		got, err := st.Claim(bg, driver.ClaimParams{Topics: []string{topic.Namespace + ":" + topic.Topic}, Limit: 1,
			MaxAttempts: 5, Worker: worker, Lease: time.Minute})
		if err != nil || len(got) != 1 {
			t.Fatalf("claim: %v %v", got, err)
		}
		if _, err := st.Complete(bg, nil, worker, []driver.Outcome{{ID: got[0].ID, LeaseToken: got[0].LeaseToken, Kind: kind, Error: "webhook answered 410 Gone"}}); err != nil {
			t.Fatal(err)
		}
		return got[0].ID
	}
	w := &world{client: c, pool: pool, db: tdb}
	enqueue(orders, 3)
	w.delivered = settle(orders, driver.Delivered)
	w.deadOrder = settle(orders, driver.Dead)
	enqueue(mails, 1)
	w.deadMail = settle(mails, driver.Dead)
	page, err := c.Admin().List(bg, outbox.EventFilter{Status: outbox.StatusPending})
	if err != nil || len(page.Events) != 1 {
		t.Fatalf("pending: %+v %v", page, err)
	}
	w.pendingOrder = page.Events[0].ID
	return w
}

func (w *world) status(t *testing.T, id uuid.UUID) outbox.Status {
	t.Helper()
	ev, err := w.client.Admin().Get(bg, id)
	if err != nil {
		t.Fatal(err)
	}
	return ev.Status
}

// serve mounts the dashboard under /outbox/ of a test server, as a user
// would in their own mux. Without opts.Logger it logs nowhere.
func serve(t *testing.T, w *world, opts outboxui.Options) string {
	t.Helper()
	return serveAdmin(t, w.client.Admin(), opts)
}

// serveAdmin is serve on admin, a client's of another login, say.
func serveAdmin(t *testing.T, admin *outbox.Admin, opts outboxui.Options) string {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = quiet
	}
	ui, err := outboxui.New(admin, opts)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", ui))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL + "/outbox/"
}

// chromium returns a Chromium executable, installing Debian's package
// when none is found and this user may; the test is skipped only when
// neither works.
func chromium(t *testing.T) string {
	t.Helper()
	if p, err := browser.Find(); err == nil {
		return p
	}
	if os.Geteuid() == 0 {
		if _, err := exec.LookPath("apt-get"); err == nil {
			t.Log("no Chromium found: installing Debian's chromium package")
			ctx, cancel := context.WithTimeout(bg, 10*time.Minute)
			defer cancel()
			install := exec.CommandContext(ctx, "sh", "-c", "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium")
			if out, err := install.CombinedOutput(); err != nil {
				t.Logf("installing chromium failed: %v\n%s", err, out)
			}
		}
	}
	p, err := browser.Find()
	if err != nil {
		t.Skipf("skipping the browser test: %v, and it could not be installed (run as root with apt-get, or install chromium)", err)
	}
	return p
}

func launch(t *testing.T) (*browser.Page, context.Context) {
	t.Helper()
	b, err := browser.Launch(chromium(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("close browser: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(bg, 2*time.Minute)
	t.Cleanup(cancel)
	p, err := b.NewPage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return p, ctx
}

func text(t *testing.T, ctx context.Context, p *browser.Page, selector string) string {
	t.Helper()
	s, err := p.Text(ctx, selector)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func count(t *testing.T, ctx context.Context, p *browser.Page, selector string) int {
	t.Helper()
	var n int
	sel, _ := json.Marshal(selector)
	if err := p.Eval(ctx, fmt.Sprintf("document.querySelectorAll(%s).length", sel), &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestDashboardInChromium drives the dashboard in headless Chromium as an
// operator would.
func TestDashboardInChromium(t *testing.T) {
	w := newWorld(t)
	base := serve(t, w, outboxui.Options{OperatorToken: token})
	p, ctx := launch(t)

	// The overview counts.
	if err := p.Navigate(ctx, base); err != nil {
		t.Fatal(err)
	}
	for sel, want := range map[string]string{
		"#total-pending": "1", "#total-dead": "2", "#total-hour": "1",
		`tr[data-topic="shop/order_paid"] td.pending`: "1",
		`tr[data-topic="shop/order_paid"] td.dead`:    "1",
		`tr[data-topic="shop/order_paid"] td.hour`:    "1",
		`tr[data-topic="crm/welcome_mail"] td.dead`:   "1",
	} {
		if got := text(t, ctx, p, sel); got != want {
			t.Errorf("%s = %q, want %q", sel, got, want)
		}
	}
	if n := count(t, ctx, p, "svg#chart rect.bar"); n != 1 {
		t.Errorf("chart bars: %d, want 1 (one minute with a delivery)", n)
	}
	if got := text(t, ctx, p, "figure figcaption"); !strings.Contains(got, "at most every 10s") {
		t.Errorf("chart caption %q does not say how long the series is kept", got)
	}
	screenshot(t, ctx, p, "overview.png")

	// A filter narrows the list.
	if err := p.Click(ctx, `header nav a[href$="events"]`); err != nil {
		t.Fatal(err)
	}
	if n := count(t, ctx, p, "#events tbody tr[data-id]"); n != 4 {
		t.Fatalf("unfiltered list: %d rows, want 4", n)
	}
	// It says it reads the whole table; the navigation's first list, the
	// pending events, reads an index.
	if n, m := count(t, ctx, p, "#whole-table"), count(t, ctx, p, `header nav a[href$="events?status=pending"]`); n != 1 || m != 1 {
		t.Fatalf("the unfiltered list: %d notes that it reads the whole table, %d links to the pending events; want 1, 1", n, m)
	}
	if err := p.Do(ctx, `document.querySelector('#filters select[name=status]').value = 'dead';
		document.querySelector('#filters input[name=namespace]').value = 'shop';
		document.querySelector('#filters').requestSubmit()`); err != nil {
		t.Fatal(err)
	}
	if n := count(t, ctx, p, "#events tbody tr[data-id]"); n != 1 {
		t.Fatalf("dead events of shop: %d rows, want 1", n)
	}
	if n := count(t, ctx, p, "#whole-table"); n != 0 {
		t.Fatalf("the list of dead events notes that it reads the whole table")
	}
	screenshot(t, ctx, p, "events-dead.png")

	// The event's detail opens, payload hidden.
	if err := p.Click(ctx, "#events a.id"); err != nil {
		t.Fatal(err)
	}
	if got := text(t, ctx, p, "#status"); got != "dead" {
		t.Fatalf("detail status %q", got)
	}
	if got := text(t, ctx, p, "#last-error"); !strings.Contains(got, "410 Gone") {
		t.Fatalf("detail last error %q", got)
	}
	if n := count(t, ctx, p, "#payload"); n != 0 || strings.Contains(text(t, ctx, p, "main"), "someone@example.com") {
		t.Fatal("the payload is shown although payloads are off")
	}
	if n := count(t, ctx, p, "#replay"); n != 0 {
		t.Fatal("a replay button before signing in")
	}
	// Its history: the one claim, which ended dead.
	if n := count(t, ctx, p, "#history tbody tr"); n != 1 {
		t.Fatalf("history rows of the dead event: %d, want 1", n)
	}
	if got := text(t, ctx, p, `#history tr[data-no="1"] td.outcome`); got != "dead" {
		t.Fatalf("history outcome %q, want dead", got)
	}
	if got := text(t, ctx, p, `#history tr[data-no="1"] td.detail`); !strings.Contains(got, "410 Gone") {
		t.Fatalf("history detail %q", got)
	}
	detail := base + "events/" + w.deadOrder.String()

	// The replay without the operator credential (a well-formed form with
	// this page's CSRF token) is refused.
	if err := p.Do(ctx, fmt.Sprintf(`(() => { const f = document.createElement('form'); f.method = 'post'; f.action = '../replay';
		f.innerHTML = '<input name="id" value="%s"><input name="csrf" value="' + document.querySelector('#login input[name=csrf]').value + '">';
		document.body.append(f); f.submit() })()`, w.deadOrder)); err != nil {
		t.Fatal(err)
	}
	if got := text(t, ctx, p, "#error"); !strings.Contains(got, "Sign in") {
		t.Fatalf("replay without the credential: %q", got)
	}
	if s := w.status(t, w.deadOrder); s != outbox.StatusDead {
		t.Fatalf("a refused replay changed the event to %s", s)
	}

	// A wrong token does not sign in; the right one does.
	signIn := func(tok string) {
		t.Helper()
		if err := p.Navigate(ctx, detail); err != nil {
			t.Fatal(err)
		}
		if err := p.Do(ctx, fmt.Sprintf(`document.querySelector('#login input[name=token]').value = %q; document.querySelector('#login').requestSubmit()`, tok)); err != nil {
			t.Fatal(err)
		}
	}
	signIn("not-the-token-at-all")
	if got := text(t, ctx, p, "#error"); got != "Wrong operator token." {
		t.Fatalf("wrong token: %q", got)
	}
	signIn(token)
	if got := text(t, ctx, p, "#operator"); got != "operator" {
		t.Fatalf("not signed in: %q", got)
	}

	// Signed in, a POST without the CSRF token is refused.
	if err := p.Do(ctx, fmt.Sprintf(`(() => { const f = document.createElement('form'); f.method = 'post'; f.action = 'replay';
		f.innerHTML = '<input name="id" value="%s">'; document.body.append(f); f.submit() })()`, w.deadOrder)); err != nil {
		t.Fatal(err)
	}
	if got := text(t, ctx, p, "#error"); !strings.Contains(got, "CSRF") {
		t.Fatalf("replay without CSRF: %q", got)
	}
	if s := w.status(t, w.deadOrder); s != outbox.StatusDead {
		t.Fatalf("a POST without CSRF changed the event to %s", s)
	}

	// The real button replays; a dispatcher then delivers the event.
	if err := p.Navigate(ctx, detail); err != nil {
		t.Fatal(err)
	}
	if err := p.Click(ctx, "#replay button"); err != nil {
		t.Fatal(err)
	}
	if got := text(t, ctx, p, "#flash"); !strings.Contains(got, "replayed") {
		t.Fatalf("flash after replay: %q", got)
	}
	if got := text(t, ctx, p, "#status"); got != "pending" {
		t.Fatalf("status after replay: %q", got)
	}
	screenshot(t, ctx, p, "event-replayed.png")
	deliver(t, w, orders, w.deadOrder)
	if err := p.Navigate(ctx, detail); err != nil {
		t.Fatal(err)
	}
	if got := text(t, ctx, p, "#status"); got != "delivered" {
		t.Fatalf("status after the dispatcher ran: %q", got)
	}
	// The history tells the whole story: dead, replayed by the dashboard
	// (with the database user), delivered.
	if n := count(t, ctx, p, "#history tbody tr"); n != 3 {
		t.Fatalf("history rows after replay and delivery: %d, want 3", n)
	}
	for no, want := range []string{"dead", "replayed", "delivered"} {
		if got := text(t, ctx, p, fmt.Sprintf(`#history tr[data-no="%d"] td.outcome`, no+1)); got != want {
			t.Errorf("history entry %d: %q, want %q", no+1, got, want)
		}
	}
	if got := text(t, ctx, p, `#history tr[data-no="2"] td.detail`); !strings.Contains(got, "outboxui") {
		t.Errorf("the replay's detail %q does not name the dashboard", got)
	}
	if got := text(t, ctx, p, `#history tr[data-no="2"] td.actor`); got == "" {
		t.Error("the replay's actor (database user) is empty")
	}
	screenshot(t, ctx, p, "event-history.png")
	if s := w.status(t, w.deadMail); s != outbox.StatusDead {
		t.Fatalf("another dead event changed to %s", s)
	}
}

// screenshot saves a PNG of the page among the test's artifacts (go test
// -artifacts keeps them).
func screenshot(t *testing.T, ctx context.Context, p *browser.Page, name string) {
	t.Helper()
	shot, err := p.Screenshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.ArtifactDir(), name)
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", path)
}

// deliver runs a dispatcher on topic until id is delivered.
func deliver(t *testing.T, w *world, topic outbox.Topic, id uuid.UUID) {
	t.Helper()
	done := make(chan struct{})
	var once sync.Once
	d, err := w.client.NewDispatcher(outbox.DispatcherConfig{PollInterval: 20 * time.Millisecond, Logger: quiet,
		OnOutcome: func(dl outbox.Delivery, o outbox.Outcome) {
			if dl.ID == id && o.Status == outbox.StatusDelivered {
				once.Do(func() { close(done) })
			}
		}}, outbox.Publisher{Topic: topic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(bg); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Error("the replayed event was not delivered within a minute")
	}
	if err := d.Stop(bg); err != nil {
		t.Fatal(err)
	}
}

// TestDashboardGuards checks the refusals over plain HTTP: read-only mode,
// a foreign Origin, weak tokens, payloads shown only when enabled.
func TestDashboardGuards(t *testing.T) {
	w := newWorld(t)
	// A short token is a configuration error like a short signing key.
	if _, err := outboxui.New(w.client.Admin(), outboxui.Options{OperatorToken: "short"}); !errors.Is(err, outboxui.ErrWeakToken) || !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("short token: %v, want ErrWeakToken matching outbox.ErrInvalidConfig", err)
	}
	// Characters count, not bytes: 9 characters of 2 bytes each are short.
	if _, err := outboxui.New(w.client.Admin(), outboxui.Options{OperatorToken: "ééééééééé"}); !errors.Is(err, outboxui.ErrWeakToken) {
		t.Fatalf("a token of 9 two-byte characters: %v, want ErrWeakToken", err)
	}
	if _, err := outboxui.New(nil, outboxui.Options{}); err == nil {
		t.Fatal("New(nil) accepted")
	}

	// Read-only: no sign-in form, and actions are refused even with a
	// valid CSRF token.
	base := serve(t, w, outboxui.Options{})
	jar := newJar()
	body, csrf := get(t, jar, base+"events/"+w.deadOrder.String())
	if !strings.Contains(body, `id="readonly"`) || strings.Contains(body, `id="login"`) || strings.Contains(body, "someone@example.com") {
		t.Fatalf("read-only page:\n%s", body)
	}
	code, body := post(t, jar, base+"replay", url.Values{"csrf": {csrf}, "id": {w.deadOrder.String()}}, "")
	if code != http.StatusForbidden || !strings.Contains(body, "read-only") {
		t.Fatalf("read-only replay: %d\n%s", code, body)
	}

	// With a token: a foreign Origin is refused, even signed in.
	base = serve(t, w, outboxui.Options{OperatorToken: token, ShowPayloads: true})
	jar = newJar()
	body, csrf = get(t, jar, base+"events/"+w.deadOrder.String())
	if !strings.Contains(body, "someone@example.com") {
		t.Fatal("payload hidden although ShowPayloads is set")
	}
	if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	code, _ = post(t, jar, base+"replay", url.Values{"csrf": {csrf}, "id": {w.deadOrder.String()}}, "https://evil.example")
	if code != http.StatusForbidden || w.status(t, w.deadOrder) != outbox.StatusDead {
		t.Fatalf("cross-origin replay: %d", code)
	}
	// Purge needs a valid topic and age; then deletes the delivered event.
	for _, bad := range []string{"nonsense", "shop/", "/order_paid", "shop/order paid", "Shop/x"} {
		if code, _ := post(t, jar, base+"purge", url.Values{"csrf": {csrf}, "topic": {bad}, "older_than": {"0s"}}, ""); code != http.StatusBadRequest {
			t.Fatalf("purge of the malformed topic %q: %d, want 400", bad, code)
		}
	}
	if code, _ := post(t, jar, base+"purge", url.Values{"csrf": {csrf}, "topic": {"shop/order_paid"}, "older_than": {"0s"}}, ""); code != http.StatusSeeOther {
		t.Fatalf("purge: %d", code)
	}
	if _, err := w.client.Admin().Get(bg, w.delivered); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("the delivered event survived the purge: %v", err)
	}
	if body, _ := get(t, jar, base+"events?since=1h&namespace=shop"); strings.Count(body, `<tr data-id=`) != 2 { // the delivered one was purged
		t.Fatalf("shop events of the last hour:\n%s", body)
	}
	// Every page names the outbox's schema: two outboxes in one database
	// can have the same topics.
	if body, _ := get(t, jar, base+"events?since=1h"); !strings.Contains(body, `<span class="schema" id="schema" title="the outbox's schema">public</span>`) ||
		!strings.Contains(body, "<title>Events · public · modkit outbox</title>") {
		t.Fatalf("the events page does not name the schema:\n%s", body)
	}
	// A range the form does not offer stays selected, so that the next
	// submission keeps it.
	if body, _ := get(t, jar, base+"events?since=2h"); !strings.Contains(body, `<option value="2h" selected>`) {
		t.Fatalf("the filter form lost since=2h:\n%s", body)
	}
	if code, _ := post(t, jar, base+"events?since=yesterday", nil, ""); code != http.StatusMethodNotAllowed {
		t.Fatalf("POST to the list: %d", code)
	}
	if resp, err := http.Get(base + "events?since=yesterday"); err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("a bad since: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	// The list of dead events offers to replay the page, which replays
	// every event on it.
	if body, _ := get(t, jar, base+"events?status=dead"); !strings.Contains(body, `id="replay-page"`) {
		t.Fatalf("no page replay on the dead list:\n%s", body)
	}
	if code, _ := post(t, jar, base+"replay", url.Values{"csrf": {csrf}, "id": {"nope"}}, ""); code != http.StatusBadRequest {
		t.Fatalf("replay of a bad id: %d", code)
	}
	ids := url.Values{"csrf": {csrf}, "id": {w.deadOrder.String(), w.deadMail.String()}}
	if code, body := post(t, jar, base+"replay", ids, ""); code != http.StatusSeeOther {
		t.Fatalf("replay: %d %s", code, body)
	}
	for _, id := range []uuid.UUID{w.deadOrder, w.deadMail} {
		if s := w.status(t, id); s != outbox.StatusPending {
			t.Fatalf("after replay %s is %s", id, s)
		}
	}
	for path, want := range map[string]int{"assets/style.css": http.StatusOK, "assets/overview.html": http.StatusNotFound} {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s: %d, want %d", path, resp.StatusCode, want)
		}
	}
	if resp, err := http.Get(base + "events/" + uuid.NewString()); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Fatalf("unknown event: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
}

// TestDashboardDispatchers shows the health of the dispatchers of the
// process on the overview.
func TestDashboardDispatchers(t *testing.T) {
	w := newWorld(t)
	d, err := w.client.NewDispatcher(outbox.DispatcherConfig{Logger: quiet},
		outbox.Publisher{Topic: mails, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	// nil: the dispatcher of an fx app without publishers.
	base := serve(t, w, outboxui.Options{Dispatchers: []*outbox.Dispatcher{d, nil}})
	health := httptest.NewServer(outboxui.HealthHandler(d, nil))
	t.Cleanup(health.Close)
	row := `<tr data-worker="` + d.Config().WorkerID.String() + `" class="`
	if body, _ := get(t, newJar(), base); !strings.Contains(body, row+`stopped"`) || strings.Count(body, "<tr data-worker=") != 1 {
		t.Fatalf("a dispatcher not started:\n%s", body)
	}
	if code, h := probe(t, health.URL); code != http.StatusServiceUnavailable || h.Status != "unavailable" || len(h.Dispatchers) != 1 ||
		h.Dispatchers[0].State != "stopped" || h.Dispatchers[0].Ready {
		t.Fatalf("health of a dispatcher not started: %d %+v", code, h)
	}
	if err := d.Start(bg); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := d.Stop(bg); err != nil {
			t.Error(err)
		}
	}()
	if body, _ := get(t, newJar(), base); !strings.Contains(body, row+`running"`) {
		t.Fatalf("a running dispatcher:\n%s", body)
	}
	if code, h := probe(t, health.URL); code != http.StatusOK || h.Status != "ok" || len(h.Dispatchers) != 1 ||
		h.Dispatchers[0].State != "running" || !h.Dispatchers[0].Ready || h.Dispatchers[0].Degraded ||
		h.Dispatchers[0].WorkerID != d.Config().WorkerID.String() {
		t.Fatalf("health of a running dispatcher: %d %+v", code, h)
	}
	if resp, err := http.Post(health.URL, "text/plain", nil); err != nil || resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("POST to the health handler: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	// With no dispatcher at all (an fx app that only enqueues) it is healthy.
	none := httptest.NewServer(outboxui.HealthHandler(nil))
	t.Cleanup(none.Close)
	if code, h := probe(t, none.URL); code != http.StatusOK || h.Status != "ok" || len(h.Dispatchers) != 0 {
		t.Fatalf("health without dispatchers: %d %+v", code, h)
	}
}

// healthBody is what HealthHandler answers.
type healthBody struct {
	Status      string `json:"status"`
	Dispatchers []struct {
		WorkerID string   `json:"worker_id"`
		State    string   `json:"state"`
		Ready    bool     `json:"ready"`
		Degraded bool     `json:"degraded"`
		Problems []string `json:"problems"`
	} `json:"dispatchers"`
}

func probe(t *testing.T, u string) (int, healthBody) {
	t.Helper()
	resp, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h healthBody
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		t.Fatalf("health body: %v", err)
	}
	return resp.StatusCode, h
}
