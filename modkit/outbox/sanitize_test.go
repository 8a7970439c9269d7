package outbox

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

// TestSanitizeErrorRedacts: one case per kind of secret that error
// messages quote (issue 11); each secret must be gone and [REDACTED] in its
// place, and the label kept where there is one.
func TestSanitizeErrorRedacts(t *testing.T) {
	cases := []struct {
		name, in string
		secrets  []string // none of these may survive
		keep     string   // this must survive (the label)
	}{
		{"authorization header", "POST /hook: 401 (Authorization: Bearer eyJhbGciOi.abc.def)", []string{"eyJhbGciOi"}, "Authorization: Bearer [REDACTED]"},
		{"authorization in JSON", `request headers {"authorization":"Basic dXNlcjpwYXNz"}`, []string{"dXNlcjpwYXNz"}, `"authorization":"Basic [REDACTED]"`},
		{"authorization in escaped JSON", `body: "{\"authorization\": \"Bearer tok.en-123\", \"id\": 7}"`, []string{"tok.en-123"}, `\"authorization\": \"Bearer [REDACTED]\", \"id\": 7`},
		{"authorization in a Go header map", "headers map[Authorization:[Bearer abc.def] Content-Type:[application/json]]", []string{"abc.def"}, "Authorization:[Bearer [REDACTED]] Content-Type:[application/json]"},
		{"authorization digest", `WWW: Authorization: Digest username="u", response="6629fae49393a05397450978507c4ef1"`, []string{"6629fae4"}, "Digest [REDACTED]"},
		{"URL password", "dial postgres://app:s3cr3t@db:5432/x failed", []string{"s3cr3t"}, "postgres://app:[REDACTED]@db:5432/x"},
		{"URL password with /", "dial postgres://app:ab/cd@db:5432/x failed", []string{"ab/cd", "cd@"}, "postgres://app:[REDACTED]@db:5432/x"},
		{"URL password with @", "dial amqp://app:p@ss@rabbit:5672/ failed", []string{"p@ss"}, "amqp://app:[REDACTED]@rabbit:5672/"},
		{"URL password with / and @", "dial mysql://root:a@b/c@d@db/x", []string{"a@b/c@d"}, "mysql://root:[REDACTED]@db/x"},
		{"URL password of digits and /", "dial postgres://app:123/456@db/x", []string{"123/456"}, "postgres://app:[REDACTED]@db/x"},
		{"URL password and an e-mail address in the query", "dial https://app:s3cr3t@hooks.example:8443/in?to=ops@example.com",
			[]string{"s3cr3t"}, "https://app:[REDACTED]@hooks.example:8443/in?to=ops@example.com"},
		{"URL password with ?", "dial amqp://app:pa?ss@rabbit:5672/ failed", []string{"pa?ss"}, "amqp://app:[REDACTED]@rabbit:5672/"},
		{"redis empty user", "dial redis://:hunter2@cache:6379/0: i/o timeout", []string{"hunter2"}, "redis://:[REDACTED]@cache:6379/0"},
		{"https token user", "GET https://ghp0123456789abcdef@github.com/org/repo.git: 403", []string{"ghp0123456789abcdef"}, "https://[REDACTED]@github.com/org/repo.git"},
		{"nats token user", "nats: connect nats://s3cr3ttoken@nats.internal:4222 refused", []string{"s3cr3ttoken"}, "nats://[REDACTED]@nats.internal:4222"},
		{"password=", "connect: host=db user=app password=hunter2 sslmode=require", []string{"hunter2"}, "password=[REDACTED] sslmode=require"},
		{"password quoted", "connect: host=db password='two words' dbname=x", []string{"two words"}, "password='[REDACTED]' dbname=x"},
		{"token=", "upstream rejected token=abcdef123 for client", []string{"abcdef123"}, "token=[REDACTED] for client"},
		{"api_key:", "config api_key: AKIA1234 invalid", []string{"AKIA1234"}, "api_key: [REDACTED] invalid"},
		{"bare bearer", "send with bearer zzz.yyy.xxx", []string{"zzz.yyy.xxx"}, "bearer [REDACTED]"},
		{"client_secret=", "oauth: POST /token client_id=app&client_secret=Zx9-secret-Qw&grant_type=client_credentials", []string{"Zx9-secret-Qw"}, "client_secret=[REDACTED]&grant_type"},
		{"auth_token=", "twilio: 401 auth_token=0f9e8d7c6b5a49382716 rejected", []string{"0f9e8d7c6b5a49382716"}, "auth_token=[REDACTED] rejected"},
		{"private_key=", "signer: private_key=MIIEvQIBADANBgkqhkiG9w0 invalid", []string{"MIIEvQIBADANBgkqhkiG9w0"}, "private_key=[REDACTED] invalid"},
		{"private_key in JSON", `parse {"private_key": "-----BEGIN PRIVATE KEY-----\nMIIEv\n-----END PRIVATE KEY-----\n", "x": 1}`, []string{"MIIEv", "BEGIN PRIVATE"}, `"private_key": "[REDACTED]", "x": 1`},
		{"aws_secret_access_key=", "aws: aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY bad", []string{"wJalrXUtnFEMI"}, "aws_secret_access_key=[REDACTED] bad"},
		{"cookie header", "GET /api: 401\nCookie: session=abc123; csrftoken=def456\nAccept: */*", []string{"abc123", "def456"}, "Cookie: [REDACTED]\nAccept: */*"},
		{"set-cookie header", "unexpected response: Set-Cookie: sid=s%3Aabc.def; Path=/; HttpOnly", []string{"s%3Aabc.def"}, "Set-Cookie: [REDACTED]"},
		{"cookie in a Go header map", "headers map[Cookie:[sid=abc123; theme=dark] Accept:[*/*]]", []string{"abc123"}, "Cookie:[[REDACTED]] Accept:[*/*]"},
		{"?key=", "GET https://maps.example.com/api/geocode?address=x&key=AIzaSyD-secret-value: 403", []string{"AIzaSyD-secret-value"}, "&key=[REDACTED]: 403"},
		{"?key= in a Go url.Error", `Get "https://api.example.com/v1?key=abc123&x=1": dial tcp: i/o timeout`, []string{"abc123"}, `?key=[REDACTED]&x=1": dial tcp`},
		{"X-Amz-Signature", "GET https://b.s3.amazonaws.com/o?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20240101&X-Amz-Signature=fe5f80f77d5fa3beca038a248ff027d0445342fe2855ddc963176630326f1024: 403",
			[]string{"fe5f80f77d5f", "AKIAEXAMPLE"}, "X-Amz-Signature=[REDACTED]: 403"},
		{"slack webhook", "POST https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX: 404", []string{"T00000000", "XXXXXXXX"}, "https://hooks.slack.com/services/[REDACTED]: 404"},
		{"stripe key", "stripe: invalid API key provided: sk_live_4eC39HqLyjWDarjtT1zdp7dc", []string{"4eC39HqLyjWDarjtT1zdp7dc"}, "sk_live_[REDACTED]"},
		{"aws access key id", "aws: InvalidClientTokenId: AKIAIOSFODNN7EXAMPLE is not valid", []string{"IOSFODNN7EXAMPLE"}, "AKIA[REDACTED] is not valid"},
		{"URL-encoded password", "POST /login body=user%3Dbob%26password%3Dhunter2%26remember%3D1 failed", []string{"hunter2"}, "password%3D[REDACTED]%26remember%3D1"},
		{"github token", "git: auth failed with ghp_16C7e42F292c6912E7710c838347Ae178B4a", []string{"16C7e42F292c6912E7710c838347Ae178B4a"}, "ghp_[REDACTED]"},
		{"jwt", "verify eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk: expired", []string{"eyJzdWIiOiIxIn0"}, "verify [REDACTED]: expired"},
		{"x-api-key header", "POST /v1: 401 X-Api-Key: 9b1c-secret-77", []string{"9b1c-secret-77"}, "X-Api-Key: [REDACTED]"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := sanitizeError(c.in, 2048)
			for _, s := range c.secrets {
				if strings.Contains(out, s) {
					t.Errorf("%q\n -> %q\n still shows %q", c.in, out, s)
				}
			}
			if !strings.Contains(out, c.keep) {
				t.Errorf("%q\n -> %q\n lost %q", c.in, out, c.keep)
			}
		})
	}
}

// TestSanitizeErrorKeepsHarmlessText: messages that only look like secrets
// (a sensitive word without a value, an '@' in a path, a port) stay as
// they are.
func TestSanitizeErrorKeepsHarmlessText(t *testing.T) {
	for _, in := range []string{
		"dial tcp 10.0.0.5:5432: connect: connection refused",
		`ERROR: password authentication failed for user "app" (SQLSTATE 28P01)`,
		`ERROR: duplicate key value violates unique constraint "orders_pkey": Key (id)=(42) already exists.`,
		"GET https://api.example.com:8443/v1/events?page=2&sort=asc: 503 Service Unavailable",
		"GET https://medium.com/@author/post-1: 404",
		"GET https://example.com/search?email=ops@example.com: 400",
		"outboxhttp: http://127.0.0.1:35957/s/400?to=ops@example.com answered 400 Bad Request",
		"mail to ops@example.com bounced: mailbox full",
		"token bucket exhausted; retry after 2s",
		"publish failed: max_tokens=4096 exceeds the model's limit, dedupe_key=order-42",
		"consumer lag: 1200 messages behind; topic=billing.invoice partition=3",
		"context deadline exceeded (Client.Timeout exceeded while awaiting headers)",
		"TAKIAB is not an access key, nor is AKIA alone",
		"",
	} {
		if out := sanitizeError(in, 2048); out != in {
			t.Errorf("harmless text changed:\n %q\n -> %q", in, out)
		}
	}
}

func TestSanitizeErrorBoundsAndBytes(t *testing.T) {
	long := strings.Repeat("é", 5000) // 2 bytes each
	out := sanitizeError(long, 1000)
	if len(out) > 1000 || !utf8.ValidString(out) || !strings.Contains(out, "[truncated ") {
		t.Fatalf("truncation: %d bytes, valid %v, %q", len(out), utf8.ValidString(out), out[len(out)-40:])
	}
	if got := sanitizeError("a\x00b\xffc", 100); got != "a\uFFFDb\uFFFDc" {
		t.Fatalf("invalid bytes: %q", got)
	}
	if got := sanitizeError("password=a\x00b", 100); got != "password=[REDACTED]\uFFFDb" {
		t.Fatalf("NUL inside a secret: %q", got)
	}
	if SanitizeError(nil, 10) != "" || SanitizeError(errors.New("x"), 10) != "x" {
		t.Fatal("SanitizeError")
	}
	// Redacting twice changes nothing more.
	once := sanitizeError("dial postgres://app:pw@db/x token=abc Cookie: a=b", 2048)
	if twice := sanitizeError(once, 2048); twice != once {
		t.Fatalf("not idempotent: %q -> %q", once, twice)
	}
}

// benchMessages are publish errors as they reach sanitizeError: the common
// one without secrets, one with a few, and a long response body.
var benchMessages = map[string]string{
	"plain": "attempt 2 of 10 failed: POST https://api.example.com/v1/events: 503 Service Unavailable: " +
		"upstream connect error or disconnect/reset before headers. reset reason: connection timeout",
	"secrets": "attempt 1 of 10 failed: dial postgres://app:s3cr3t@db:5432/x: password authentication failed; " +
		"request headers {\"authorization\": \"Bearer eyJhbGciOi.abc.def\"} api_key=AKIA1234 token=abcdef",
	"body2k": "attempt 3 of 10 failed: 400 Bad Request: " + strings.Repeat(`{"field":"amount","message":"must be positive","code":"invalid"},`, 30),
}

func BenchmarkSanitizeError(b *testing.B) {
	for _, name := range []string{"plain", "secrets", "body2k"} {
		msg := benchMessages[name]
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(msg)))
			for b.Loop() {
				_ = sanitizeError(msg, 2048)
			}
		})
	}
}

// FuzzSanitizeError: any message comes out valid UTF-8, bounded, and
// unchanged by a second redaction of the untruncated result.
func FuzzSanitizeError(f *testing.F) {
	for _, m := range benchMessages {
		f.Add(m)
	}
	f.Add(`x \"authorization\": \"Bearer a\" password%3D%22p%22 redis://:p@h hooks.slack.com/services/ Cookie: [a`)
	f.Fuzz(func(t *testing.T, msg string) {
		out := sanitizeError(msg, 300)
		if len(out) > 300 || !utf8.ValidString(out) || strings.IndexByte(out, 0) >= 0 {
			t.Fatalf("%q -> %q", msg, out)
		}
		once := redactSecrets(msg)
		if twice := redactSecrets(once); twice != once {
			t.Fatalf("not idempotent: %q -> %q -> %q", msg, once, twice)
		}
	})
}
