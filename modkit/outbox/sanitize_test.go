package outbox

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestSanitizeError(t *testing.T) {
	cases := map[string]string{
		"POST /hook: 401 (Authorization: Bearer eyJhbGciOi.abc.def)": "eyJhbGciOi",
		`request headers {"authorization":"Basic dXNlcjpwYXNz"}`:     "dXNlcjpwYXNz",
		"dial postgres://app:s3cr3t@db:5432/x failed":                "s3cr3t",
		"upstream rejected token=abcdef123 for client":               "abcdef123",
		"config api_key: AKIA1234 invalid":                           "AKIA1234",
		"send with bearer zzz.yyy.xxx":                               "zzz.yyy.xxx",
	}
	for in, secret := range cases {
		out := sanitizeError(in, 2048)
		if strings.Contains(out, secret) || !strings.Contains(out, "[REDACTED]") {
			t.Errorf("%q -> %q still shows %q", in, out, secret)
		}
	}
	long := strings.Repeat("é", 5000) // 2 bytes each
	out := sanitizeError(long, 1000)
	if len(out) > 1000 || !utf8.ValidString(out) || !strings.Contains(out, "[truncated ") {
		t.Fatalf("truncation: %d bytes, valid %v, %q", len(out), utf8.ValidString(out), out[len(out)-40:])
	}
	if got := sanitizeError("a\x00b\xffc", 100); got != "a\uFFFDb\uFFFDc" {
		t.Fatalf("invalid bytes: %q", got)
	}
	if SanitizeError(nil, 10) != "" || SanitizeError(errors.New("x"), 10) != "x" {
		t.Fatal("SanitizeError")
	}
}
