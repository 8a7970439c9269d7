package outboxui_test

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/modkit-go/modkit/modkit/outbox"
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
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d\n%s", u, resp.StatusCode, b)
	}
	var csrf string
	if m := csrfField.FindSubmatch(b); m != nil {
		csrf = string(m[1])
	}
	return string(b), csrf
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
// again, so every filter and cursor was lost.)
func TestDashboardLinksKeepTheirFilters(t *testing.T) {
	w := newWorld(t)
	for i := range 60 { // more than a page of the mails topic
		if _, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: mails.Namespace, Topic: mails.Topic,
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))}); err != nil {
			t.Fatal(err)
		}
	}
	base := serve(t, w, outboxui.Options{OperatorToken: token})
	jar := newJar()
	follow := func(page, what, pattern string) string {
		t.Helper()
		m := regexp.MustCompile(pattern).FindStringSubmatch(page)
		if m == nil {
			t.Fatalf("no link to %s", what)
		}
		body, _ := get(t, jar, base+strings.TrimPrefix(html.UnescapeString(m[1]), "./"))
		return body
	}
	overview, _ := get(t, jar, base)
	row := `(?s)<tr data-topic="` + mails.Namespace + "/" + mails.Topic + `">.*?`
	dead := follow(overview, "the mails topic's dead events", row+`<td class="dead"><a href="([^"]+)"`)
	if !strings.Contains(dead, w.deadMail.String()) || strings.Contains(dead, w.deadOrder.String()) {
		t.Fatal("the dead link of the mails topic does not list that topic's dead events alone")
	}
	first := follow(overview, "the mails topic's events", row+`<td><a href="([^"]+)"`)
	if strings.Contains(first, orders.Topic) {
		t.Fatal("the mails topic's link lists other topics' events")
	}
	second := follow(first, "the next page", `<a id="next" href="([^"]+)"`)
	ids := regexp.MustCompile(`events/([0-9a-f-]{36})`)
	a, b := ids.FindString(first), ids.FindString(second)
	if a == "" || b == "" || a == b || strings.Contains(second, orders.Topic) {
		t.Fatalf("the next page starts with %q after a page that starts with %q; want the mails topic's next events", b, a)
	}
}
