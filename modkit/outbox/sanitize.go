package outbox

import (
	"fmt"
	"regexp"
	"strings"
)

// Publish errors end up in last_error and in logs, and errors from HTTP
// clients and drivers like to quote credentials. These patterns cover the
// usual shapes; the replacement keeps the label so the message stays useful.
var secretPatterns = []struct {
	re   *regexp.Regexp
	repl string
}{
	// Authorization: Bearer xyz / Authorization=Basic xyz / "authorization":"…"
	{regexp.MustCompile(`(?i)(authorization"?\s*[:=]\s*"?)(?:(bearer|basic|token|digest)\s+)?[^\s",;]+`), "${1}${2} [REDACTED]"},
	// a bare bearer token anywhere
	{regexp.MustCompile(`(?i)\b(bearer)\s+[A-Za-z0-9\-._~+/]+=*`), "${1} [REDACTED]"},
	// password=…, api_key: …, secret=…, token=…, access_token=…
	{regexp.MustCompile(`(?i)\b((?:password|passwd|pwd|secret|api[_-]?key|access[_-]?token|refresh[_-]?token|token)"?\s*[:=]\s*"?)[^\s",;&]+`), "${1}[REDACTED]"},
	// credentials in URLs: scheme://user:pass@host
	{regexp.MustCompile(`(://[^/\s:@]+):[^/\s@]+@`), "${1}:[REDACTED]@"},
}

// sanitizeError makes an error message safe and small enough for
// last_error and logs: secrets redacted, NUL bytes and invalid UTF-8
// replaced, and at most maxLen bytes (cut on a character boundary, with a
// note saying how much was cut).
func sanitizeError(msg string, maxLen int) string {
	for _, p := range secretPatterns {
		msg = p.re.ReplaceAllString(msg, p.repl)
	}
	msg = strings.ToValidUTF8(msg, "\uFFFD")
	msg = strings.ReplaceAll(msg, "\x00", "\uFFFD")
	if len(msg) <= maxLen {
		return msg
	}
	note := fmt.Sprintf("… [truncated %d bytes]", len(msg)) // upper bound of the cut; fixed below
	cut := maxLen - len(note)
	for cut > 0 && !isRuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut] + fmt.Sprintf("… [truncated %d bytes]", len(msg)-cut)
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }

// SanitizeError returns err's message as the outbox stores it in last_error
// and logs it: credentials redacted, invalid bytes replaced, at most maxLen
// bytes. Publishers that log errors themselves can use it too.
func SanitizeError(err error, maxLen int) string {
	if err == nil {
		return ""
	}
	return sanitizeError(err.Error(), max(maxLen, 64))
}
