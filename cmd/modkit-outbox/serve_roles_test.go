package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// login creates a login role in group (an outbox role) and returns a DSN
// that connects as it, and its name. The role is dropped when the test
// ends.
func (f *fixture) login(t *testing.T, group string) (dsn, name string) {
	t.Helper()
	name = strings.TrimPrefix(group, "modkit_outbox_") + "_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	password := uuid.NewString()
	if _, err := f.pool.Exec(bg, fmt.Sprintf("CREATE ROLE %s LOGIN PASSWORD '%s' IN ROLE %s",
		pgx.Identifier{name}.Sanitize(), password, pgx.Identifier{group}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := f.pool.Exec(bg, "DROP ROLE "+pgx.Identifier{name}.Sanitize()); err != nil {
			t.Errorf("drop role %s: %v", name, err)
		}
	})
	if u, err := url.Parse(f.dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.User = url.UserPassword(name, password)
		return u.String(), name
	}
	return f.dsn + " user=" + name + " password=" + password, name // key=value: later keys win
}

// httpGet fetches u with c and returns the body; the status must be 200.
func httpGet(t *testing.T, c *http.Client, u string) string {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d\n%s", u, resp.StatusCode, b)
	}
	return string(b)
}

var csrfInput = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// The database role bounds the dashboard: as a reader it is read-only and
// without payloads whatever the flags say; as an operator, signed in with
// the token, it replays, and the replay is recorded under that login.
func TestServeAsDatabaseRoles(t *testing.T) {
	f := newFixture(t)
	f.enqueue(t, orders, 1)
	dead := f.settle(t, orders, 1, driver.Dead, 0)[0]
	const token = "0123456789abcdef-operator"
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

	readerDSN, reader := f.login(t, outboxpg.RoleReader)
	out, ended, stop := background(t, readerDSN, "serve", "--addr", "127.0.0.1:0", "--token", token, "--show-payloads")
	out.waitFor(t, "dashboard on", ended)
	banner := out.String()
	if !strings.Contains(banner, "read-only: database role "+reader+" may not replay") || !strings.Contains(banner, "payloads hidden") ||
		!strings.Contains(banner, "(schema public)") {
		t.Fatalf("the reader's banner: %s", banner)
	}
	base := regexp.MustCompile(`http://\S+/`).FindString(banner)
	if body := httpGet(t, client, base); !strings.Contains(body, `data-topic="shop/order_paid"`) || !strings.Contains(body, `id="readonly"`) {
		t.Fatalf("the reader's overview:\n%s", body)
	}
	body := httpGet(t, client, base+"events/"+dead.String())
	if strings.Contains(body, "s3cr3t") || strings.Contains(body, `id="login"`) || !strings.Contains(body, `id="history"`) ||
		!strings.Contains(body, "database login "+reader+" may not read them") || strings.Contains(body, "Sign in") {
		t.Fatalf("the reader's event page (payload hidden by the login, no sign-in, history shown):\n%s", body)
	}
	if code := stop(); code != exitOK {
		t.Fatalf("serve as the reader ended with %d", code)
	}

	operatorDSN, operator := f.login(t, outboxpg.RoleOperator)
	out, ended, stop = background(t, operatorDSN, "serve", "--addr", "127.0.0.1:0", "--token", token, "--show-payloads")
	out.waitFor(t, "dashboard on", ended)
	if banner := out.String(); !strings.Contains(banner, "operator actions enabled") {
		t.Fatalf("the operator's banner: %s", banner)
	}
	base = regexp.MustCompile(`http://\S+/`).FindString(out.String())
	body = httpGet(t, client, base+"events/"+dead.String())
	if !strings.Contains(body, "s3cr3t") {
		t.Fatalf("the operator's event page hides the payload:\n%s", body)
	}
	m := csrfInput.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no CSRF token on the page:\n%s", body)
	}
	for _, step := range []struct {
		path string
		form url.Values
	}{
		{"login", url.Values{"csrf": {m[1]}, "token": {token}}},
		{"replay", url.Values{"csrf": {m[1]}, "id": {dead.String()}}},
	} {
		resp, err := client.PostForm(base+step.path, step.form)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusSeeOther {
			t.Fatalf("POST %s: %d\n%s", step.path, resp.StatusCode, b)
		}
	}
	if s := f.status(t, dead); s != outbox.StatusPending {
		t.Fatalf("after the operator's replay the event is %s", s)
	}
	h, err := f.client.Admin().History(bg, dead)
	if err != nil || len(h) == 0 || h[len(h)-1].Outcome != "replayed" || h[len(h)-1].Actor != operator {
		t.Fatalf("the replay is not recorded under the operator's login %s: %+v %v", operator, h, err)
	}
	if code := stop(); code != exitOK {
		t.Fatalf("serve as the operator ended with %d", code)
	}
}
