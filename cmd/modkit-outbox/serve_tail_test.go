package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// notifyingBuffer is a goroutine-safe buffer that signals each write.
type notifyingBuffer struct {
	mu    sync.Mutex
	b     strings.Builder
	wrote chan struct{}
}

func newNotifyingBuffer() *notifyingBuffer { return &notifyingBuffer{wrote: make(chan struct{}, 1)} }

func (n *notifyingBuffer) Write(p []byte) (int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.b.Write(p)
	select {
	case n.wrote <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (n *notifyingBuffer) String() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.b.String()
}

// waitFor blocks until the output contains s or the command ended; it fails
// the test after two minutes (a hang guard, not a timed assertion).
func (n *notifyingBuffer) waitFor(t *testing.T, s string, ended <-chan int) {
	t.Helper()
	guard := time.After(2 * time.Minute)
	for !strings.Contains(n.String(), s) {
		select {
		case <-n.wrote:
		case code := <-ended:
			t.Fatalf("the command ended (exit %d) before printing %q:\n%s", code, s, n.String())
		case <-guard:
			t.Fatalf("no %q printed in two minutes:\n%s", s, n.String())
		}
	}
}

// background runs the command until the test cancels it.
func background(t *testing.T, dsn string, args ...string) (out *notifyingBuffer, ended chan int, stop func() int) {
	t.Helper()
	out = newNotifyingBuffer()
	ctx, cancel := context.WithCancel(bg)
	e := env{stdin: strings.NewReader(""), stdout: out, stderr: io.Discard,
		getenv: func(k string) string {
			if k == "DATABASE_URL" {
				return dsn
			}
			return ""
		}}
	ended = make(chan int, 1)
	go func() { ended <- run(ctx, e, args) }()
	return out, ended, func() int { cancel(); return <-ended }
}

func TestTail(t *testing.T) {
	f := newFixture(t)
	// Without --since, tail starts at the database's clock minus its 5s
	// overlap: the outcomes below are printed if it connects within 5s of
	// them (TestTailReplayedSoonAfter passes --since instead).
	out, ended, stop := background(t, f.dsn, "tail", "--interval", "100ms", "--json")
	ids := f.enqueue(t, orders, 2)
	delivered := f.settle(t, orders, 1, driver.Delivered, 0)[0]
	out.waitFor(t, delivered.String(), ended)
	dead := f.settle(t, orders, 1, driver.Dead, 0)[0]
	out.waitFor(t, dead.String(), ended)
	if code := stop(); code != exitOK {
		t.Fatalf("tail ended with %d", code)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], `"status":"delivered"`) || !strings.Contains(lines[1], `"status":"dead"`) ||
		ids[0] != delivered {
		t.Fatalf("tail printed:\n%s", out.String())
	}
}

// tailPastOthers runs tail from a minute back, behind the 1,200 outcomes
// the test recorded, settles one more event and waits until tail has
// printed it; it stops tail and returns what it printed and that event.
func tailPastOthers(t *testing.T, f *fixture) (*notifyingBuffer, uuid.UUID) {
	t.Helper()
	out, ended, stop := background(t, f.dsn, "tail", "--since", "1m", "--interval", "100ms", "--json")
	f.enqueue(t, mails, 1)
	late := f.settle(t, mails, 1, driver.Delivered, 0)[0]
	guard := time.After(2 * time.Minute) // a hang guard, not a timed assertion
	for !strings.Contains(out.String(), late.String()) {
		select {
		case <-out.wrote:
		case code := <-ended:
			t.Fatalf("tail ended (exit %d) before printing the late event", code)
		case <-guard:
			stop()
			t.Fatalf("tail never printed the event settled after 1,200 others; it printed %d lines", strings.Count(out.String(), "\n"))
		}
	}
	if code := stop(); code != exitOK {
		t.Fatalf("tail ended with %d", code)
	}
	return out, late
}

// More outcomes within tail's overlap window than one read returns (two
// batches of 600 settled at two timestamps) do not stall it: it prints them
// all, and what is settled afterwards.
func TestTailPastAPage(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 1200)
	f.settle(t, orders, 600, driver.Delivered, 0)
	f.settle(t, orders, 600, driver.Delivered, 0)
	out, _ := tailPastOthers(t, f)
	if n := strings.Count(out.String(), "\n"); n != 1201 {
		t.Fatalf("tail printed %d lines, want 1,201", n)
	}
}

// More outcomes at one timestamp than one read returns (1,200 settled by
// one statement) are all printed, each once, and so is what is settled
// afterwards: tail pages after a cursor, not by time.
func TestTailOneTimestampPastAPage(t *testing.T) {
	f := newFixture(t)
	ids := f.enqueue(t, orders, 1200)
	f.settle(t, orders, 1200, driver.Delivered, 0)
	var stamps int
	if err := f.pool.QueryRow(bg, "SELECT count(DISTINCT updated_at) FROM modkit_outbox_events WHERE status = 'delivered'").Scan(&stamps); err != nil || stamps != 1 {
		t.Fatalf("the 1,200 outcomes have %d timestamps (%v), want one", stamps, err)
	}
	out, late := tailPastOthers(t, f)
	printed := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var ev struct {
			ID string `json:"id"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("tail printed a line that is not an event: %q: %v", line, err)
		}
		printed[ev.ID]++
	}
	var wrong []string
	for _, id := range append(ids, late) {
		if n := printed[id.String()]; n != 1 {
			wrong = append(wrong, fmt.Sprintf("%s printed %d times", id, n))
		}
	}
	if len(wrong) > 0 || len(printed) != 1201 {
		t.Fatalf("tail printed %d events, want 1,201 each once; %d are not: %v", len(printed), len(wrong), wrong[:min(len(wrong), 3)])
	}
}

func TestServe(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 1)
	out, ended, stop := background(t, f.dsn, "serve", "--addr", "127.0.0.1:0")
	out.waitFor(t, "dashboard on", ended)
	url := regexp.MustCompile(`http://\S+/`).FindString(out.String())
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `data-topic="shop/order_paid"`) || !strings.Contains(string(body), "read-only") {
		t.Fatalf("GET %s: %d\n%s", url, resp.StatusCode, body)
	}
	// On a loopback address it answers to loopback names only: a page of
	// another site whose name was pointed at 127.0.0.1 (DNS rebinding)
	// sends that name as the Host.
	for host, want := range map[string]int{"evil.example:8080": http.StatusMisdirectedRequest, "localhost": http.StatusOK} {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("GET with Host %s: %d, want %d", host, resp.StatusCode, want)
		}
	}
	if code := stop(); code != exitOK {
		t.Fatalf("serve ended with %d", code)
	}
	// A weak token is a usage error.
	r := cli(t, f.dsn, "serve", "--token", "short", "--addr", "127.0.0.1:0")
	if r.code != exitUsage || !strings.Contains(r.stderr, "too short") {
		t.Fatalf("weak token: %+v", r)
	}
}

// A dead event replayed and delivered soon after (within tail's overlap)
// is printed twice: dead, then delivered. Its second outcome is not taken
// for the first one read again.
func TestTailReplayedSoonAfter(t *testing.T) {
	f := newFixture(t)
	// --since: the outcomes below are printed even if tail connects late
	// (it starts at the database's clock, minus its overlap, otherwise).
	out, ended, stop := background(t, f.dsn, "tail", "--since", "1m", "--interval", "100ms", "--json")
	f.enqueue(t, orders, 1)
	dead := f.settle(t, orders, 1, driver.Dead, 0)[0]
	out.waitFor(t, `"status":"dead"`, ended)
	if done, err := f.client.Admin().ReplayDead(bg, "test", outbox.EventFilter{}, dead); err != nil || len(done) != 1 {
		t.Fatalf("replay: %v %v", done, err)
	}
	if got := f.settle(t, orders, 1, driver.Delivered, 0); len(got) != 1 || got[0] != dead {
		t.Fatalf("delivered %v, want the replayed %s", got, dead)
	}
	guard := time.After(2 * time.Minute) // a hang guard, not a timed assertion
	for !strings.Contains(out.String(), `"status":"delivered"`) {
		select {
		case <-out.wrote:
		case code := <-ended:
			t.Fatalf("tail ended (exit %d)", code)
		case <-guard:
			stop()
			t.Fatalf("tail never printed the replayed event's delivery; it printed:\n%s", out.String())
		}
	}
	if code := stop(); code != exitOK {
		t.Fatalf("tail ended with %d", code)
	}
	if lines := strings.Split(strings.TrimSpace(out.String()), "\n"); len(lines) != 2 {
		t.Fatalf("tail printed:\n%s", out.String())
	}
}

// The host names serve answers to: --hosts when given (ports and case do
// not matter), else the loopback names and the listener's own IP on a
// loopback address, else any.
func TestServeAllowedHosts(t *testing.T) {
	loopback := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8080}
	public := &net.TCPAddr{IP: net.IPv4zero, Port: 8080}
	for _, tc := range []struct {
		list string
		addr net.Addr
		host string
		ok   bool
	}{
		{"", loopback, "127.0.0.1:8080", true},
		{"", loopback, "[::1]:8080", true},
		{"", loopback, "LOCALHOST", true},
		{"", loopback, "rebound.example:8080", false},
		{"", public, "anything.example", true},
		{"ops.internal, dash.example:443", public, "OPS.internal:8080", true},
		{"ops.internal, dash.example:443", public, "dash.example", true},
		{"ops.internal", loopback, "localhost:8080", false},
		// Another loopback address: its own IP, the URL serve prints.
		{"", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2), Port: 8080}, "127.0.0.2:8080", true},
		{"", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2), Port: 8080}, "127.0.0.3:8080", false},
	} {
		allowed := allowedHosts(tc.list, tc.addr)
		if got := allowed == nil || allowed[hostOnly(tc.host)]; got != tc.ok {
			t.Errorf("--hosts %q on %s, Host %s: allowed %v, want %v", tc.list, tc.addr, tc.host, got, tc.ok)
		}
	}
}

// A shutdown does not wait on a request that waits on the database: after
// serveShutdownWait it cancels it, and serve ends while the database still
// holds it up.
func TestServeShutdownCutsAWaitingRequest(t *testing.T) {
	f := newFixture(t)
	out, ended, stop := background(t, f.dsn, "serve", "--addr", "127.0.0.1:0")
	out.waitFor(t, "dashboard on", ended)
	url := regexp.MustCompile(`http://\S+/`).FindString(out.String())
	tx, err := f.pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(bg) }()
	if _, err := tx.Exec(bg, "LOCK TABLE modkit_outbox_events IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	go func() {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
		}
	}()
	// The page's query waits for the lock.
	guard := time.After(2 * time.Minute)
	for {
		var waiting int
		if err := f.pool.QueryRow(bg, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`).
			Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		select {
		case <-guard:
			t.Fatal("the page's query never waited for the lock")
		case <-time.After(10 * time.Millisecond):
		}
	}
	stopped := make(chan int, 1)
	go func() { stopped <- stop() }()
	select {
	case code := <-stopped:
		if code != exitOK {
			t.Fatalf("serve ended with %d", code)
		}
	case <-time.After(2 * time.Minute): // a guard: the lock is released only below
		_ = tx.Rollback(bg)
		t.Fatalf("serve did not end while a request waited on the database")
	}
}

// A purge of delivered events from the dashboard goes on when its visitor
// leaves, but not past serve's shutdown: the shutdown ends it at once (not
// at the purge's time limit), and its answer says how many it deleted and
// that the dashboard is shutting down.
func TestServeShutdownEndsAPurge(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 1)
	f.settle(t, orders, 1, driver.Delivered, 0)
	const token = "0123456789abcdef-operator"
	out, ended, stop := background(t, f.dsn, "serve", "--addr", "127.0.0.1:0", "--token", token)
	out.waitFor(t, "dashboard on", ended)
	base := regexp.MustCompile(`http://\S+/`).FindString(out.String())
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	m := csrfInput.FindStringSubmatch(httpGet(t, client, base))
	if m == nil {
		t.Fatal("no CSRF token on the overview")
	}
	if resp, err := client.PostForm(base+"login", url.Values{"csrf": {m[1]}, "token": {token}}); err != nil || resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign in: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	tx, err := f.pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(bg) }()
	if _, err := tx.Exec(bg, "LOCK TABLE modkit_outbox_events IN SHARE MODE"); err != nil { // the purge's DELETE waits
		t.Fatal(err)
	}
	flash := make(chan string, 1)
	go func() {
		resp, err := client.PostForm(base+"purge", url.Values{"csrf": {m[1]}, "topic": {orders.String()}, "older_than": {"0s"}})
		if err != nil {
			flash <- err.Error()
			return
		}
		resp.Body.Close()
		to, _ := resp.Location()
		if to == nil {
			flash <- fmt.Sprintf("an answer of %d, not a redirect", resp.StatusCode)
			return
		}
		flash <- to.Query().Get("flash")
	}()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		var waiting int
		if err := f.pool.QueryRow(bg, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()
			AND query LIKE '%modkit_outbox_purge_recorded%'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the purge never waited for the lock")
		}
	}
	if code := stop(); code != exitOK {
		t.Fatalf("serve ended with %d", code)
	}
	want := "Purged 0 delivered event(s) of shop/order_paid, then stopped before it was done (the dashboard is shutting down); the batch it was deleting may have gone too. Purge again for the rest."
	// The answer says the shutdown ended it, not its time limit (4 s).
	if got := <-flash; got != want {
		t.Fatalf("the purge's answer: %q, want %q", got, want)
	}
}
