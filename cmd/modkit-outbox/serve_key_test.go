package main

import (
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Two serves given the same --signing-key-file, as replicas behind a load
// balancer, accept each other's forms and sign-ins: a form fetched from
// one signs in on the other, and the first then shows the browser as
// signed in.
func TestServeSharesASigningKey(t *testing.T) {
	f := newFixture(t)
	const token = "0123456789abcdef-operator"
	keyFile := filepath.Join(t.TempDir(), "ui.key")
	if err := os.WriteFile(keyFile, []byte("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	start := func() string {
		t.Helper()
		out, ended, stop := background(t, f.dsn, "serve", "--addr", "127.0.0.1:0", "--token", token, "--signing-key-file", keyFile)
		t.Cleanup(func() { stop() })
		out.waitFor(t, "dashboard on", ended)
		return regexp.MustCompile(`http://\S+/`).FindString(out.String())
	}
	a, b := start(), start()
	jar, _ := cookiejar.New(nil) // both on 127.0.0.1: they share its cookies, as replicas behind one address do
	client := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	m := csrfInput.FindStringSubmatch(httpGet(t, client, a))
	if m == nil {
		t.Fatal("no CSRF token on a's page")
	}
	resp, err := client.PostForm(b+"login", url.Values{"csrf": {m[1]}, "token": {token}})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("a's form posted to b: %d\n%s", resp.StatusCode, body)
	}
	if page := httpGet(t, client, a); !strings.Contains(page, `id="operator"`) {
		t.Fatalf("a does not honour the sign-in made on b:\n%s", page)
	}
}

// A signing key that cannot be read, or is short, is a usage error that
// names where it came from, and serve does not start.
func TestServeRefusesABadSigningKey(t *testing.T) {
	dir := t.TempDir()
	short := filepath.Join(dir, "short.key")
	if err := os.WriteFile(short, []byte("0123456789abcdef0123456789abcde\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.key")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for file, want := range map[string]string{
		short:                         "holds a signing key of 31 bytes: use at least 32",
		empty:                         "holds a signing key of 0 bytes",
		filepath.Join(dir, "missing"): "--signing-key-file:",
	} {
		r := cli(t, "", "serve", "--signing-key-file", file).must(t, exitUsage)
		if !strings.Contains(r.stderr, want) {
			t.Fatalf("--signing-key-file %s: stderr %q, want %q", file, r.stderr, want)
		}
	}
}

// A short operator token is a usage error that names where it came from,
// --token or $MODKIT_OUTBOX_TOKEN, without printing it, before serve
// connects.
func TestServeRefusesAWeakToken(t *testing.T) {
	for _, c := range []struct {
		args       []string
		env, where string
	}{
		{[]string{"serve", "--token", "short"}, "", "--token holds an operator token of 5 characters, too short: use at least 16"},
		{[]string{"serve"}, "shorter", "$MODKIT_OUTBOX_TOKEN holds an operator token of 7 characters, too short"},
		{[]string{"serve", "--token", "short"}, "0123456789abcdef-operator", "--token holds an operator token of 5 characters"},
	} {
		var out, errOut strings.Builder
		e := env{stdin: strings.NewReader(""), stdout: &out, stderr: &errOut, getenv: func(k string) string {
			if k == "MODKIT_OUTBOX_TOKEN" {
				return c.env
			}
			return "" // no DATABASE_URL: the token is refused before connecting
		}}
		if code := run(bg, e, c.args); code != exitUsage || !strings.Contains(errOut.String(), c.where) ||
			strings.Contains(errOut.String(), "short\"") || strings.Contains(errOut.String(), "shorter") {
			t.Errorf("%q with $MODKIT_OUTBOX_TOKEN %q: exit %d, want %d with %q:\n%s", c.args, c.env, code, exitUsage, c.where, errOut.String())
		}
	}
}

// The key comes from --signing-key-file, else $MODKIT_OUTBOX_SIGNING_KEY,
// less a final newline; neither gives none (a random key per serve).
func TestServeSigningKeySources(t *testing.T) {
	const fromEnv, fromFile = "env-0123456789abcdef0123456789abcdef", "file-0123456789abcdef0123456789abcdef"
	file := filepath.Join(t.TempDir(), "ui.key")
	if err := os.WriteFile(file, []byte(fromFile+"\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	withEnv := func(v string) env {
		return env{getenv: func(k string) string {
			if k == "MODKIT_OUTBOX_SIGNING_KEY" {
				return v
			}
			return ""
		}}
	}
	for _, c := range []struct {
		e          env
		path, want string
	}{
		{withEnv(""), "", ""},
		{withEnv(fromEnv + "\n"), "", fromEnv},
		{withEnv(fromEnv), file, fromFile},
		{withEnv(""), file, fromFile},
	} {
		key, err := signingKey(c.e, c.path)
		if err != nil || string(key) != c.want || (c.want == "") != (key == nil) {
			t.Fatalf("signingKey(%q): %q %v, want %q", c.path, key, err, c.want)
		}
	}
	if _, err := signingKey(withEnv("too short"), ""); err == nil || !strings.Contains(err.Error(), "$MODKIT_OUTBOX_SIGNING_KEY holds a signing key of 9 bytes") {
		t.Fatalf("a short key in the variable: %v", err)
	}
}
