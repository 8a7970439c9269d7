package outbox

import (
	"fmt"
	"strings"
)

// Publish errors end up in last_error and in logs, and errors from HTTP
// clients, SDKs and drivers like to quote credentials: connection URLs,
// headers, query strings, JSON bodies. redactSecrets finds them in one pass
// over the message, without regular expressions (it runs on every failed
// publish), and replaces each secret with [REDACTED], keeping the label
// (the parameter or header name, the URL's scheme and user, the token's
// kind) so the message stays useful. It errs on the side of redacting:
// whatever follows a sensitive name and a separator goes, even when it
// was harmless.
//
// What it recognises:
//   - URL userinfo: scheme://user:password@host (the password may contain
//     '/' or '@': the userinfo ends at the last '@' before the query, or
//     of the URL without one before it, unless a port and a query come
//     first: host:8080/hook?to=ops@example.com),
//     scheme://:password@host, and scheme://token@host;
//   - name=value, name: value, "name": "value" (also with JSON's quotes
//     escaped, \"name\": \"value\"), and URL-encoded name%3Dvalue, for
//     names that contain password, passwd, passphrase, secret, credential,
//     signature, api_key, apikey, private_key, access_key, or end in token,
//     pwd, _sig, _auth, session, sessionid, session_id, or are key, pass,
//     pw, sig, auth, sid ('-', '.' and '_' alike, any case): client_secret,
//     auth_token, aws_secret_access_key, ?key=, X-Amz-Signature, X-Api-Key…;
//   - Authorization and Proxy-Authorization: the credentials after the
//     scheme (Bearer, Basic…); Cookie and Set-Cookie: the whole value;
//   - bare tokens: "Bearer xyz", Stripe (sk_live_…, rk_…, whsec_…), GitHub
//     (ghp_…, github_pat_…), GitLab (glpat-…), Slack (xoxb-…) and Google
//     (AIza…) keys, AWS access key ids (AKIA…, ASIA…), JWTs (eyJ….….…),
//     and Slack webhook paths (hooks.slack.com/services/…).

const redacted = "[REDACTED]"

// redactor builds the redacted message, copying only once a secret is
// found: a message without secrets is returned as it is, unallocated.
type redactor struct {
	s    string
	out  []byte
	done int // s[:done] is in out (or needs no copying yet)
}

// cut replaces s[from:to] with [REDACTED].
func (r *redactor) cut(from, to int) {
	if from >= to || r.s[from:to] == redacted {
		return
	}
	if r.out == nil {
		r.out = make([]byte, 0, len(r.s)+len(redacted))
	}
	r.out = append(r.out, r.s[r.done:from]...)
	r.out = append(r.out, redacted...)
	r.done = to
}

func (r *redactor) result() string {
	if r.out == nil {
		return r.s
	}
	return string(append(r.out, r.s[r.done:]...))
}

func redactSecrets(s string) string {
	r := redactor{s: s}
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == ':' && strings.HasPrefix(s[i:], "://"):
			i = r.userinfo(i + 3)
		case isWordByte(c):
			j := i + 1
			for j < len(s) && isWordByte(s[j]) {
				j++
			}
			for j > i+1 && (s[j-1] == '.' || s[j-1] == '-') { // a sentence's full stop, a dash
				j--
			}
			i = r.word(i, j)
		default:
			i++
		}
	}
	return r.result()
}

// userinfo redacts the credentials of the URL whose authority starts at
// start (after "://") and returns where to go on scanning.
func (r *redactor) userinfo(start int) int {
	s := r.s
	end := start
	for end < len(s) && !isSpace(s[end]) && !strings.ContainsRune("\"'<>\\`", rune(s[end])) {
		end++
	}
	// An '@' before the query or fragment ends the userinfo (the
	// password may hold '/' and '@'); only without one there is the last
	// '@' of the URL taken (a password may hold a '?' too).
	at := -1
	if q := strings.IndexAny(s[start:end], "?#"); q >= 0 {
		at = strings.LastIndexByte(s[start:start+q], '@')
	}
	if at < 0 {
		at = strings.LastIndexByte(s[start:end], '@')
	}
	if at <= 0 {
		return start
	}
	ui := s[start : start+at]
	colon := strings.IndexByte(ui, ':')
	switch {
	case colon < 0:
		// token@host, unless the '@' is in the path or query (a mention, an
		// e-mail address in a parameter).
		if !strings.ContainsAny(ui, "/?#") {
			r.cut(start, start+at)
		}
	case strings.ContainsAny(ui[:colon], "/?#"):
		// a colon in the path or query: not userinfo. (host:port/path@…
		// is taken for a password with a '/', and redacted: better too much
		// than a leak.)
	case portThenQuery(ui[colon+1:]):
		// host:port/path?to=ops@example.com: the '@' is in the query (an
		// e-mail address), which a password, a '?' in it too, seldom is;
		// redacting would show example.com as the host.
	default:
		r.cut(start+colon+1, start+at)
	}
	return start + at + 1
}

// portThenQuery reports whether s, what follows the first colon of a URL's
// authority, is a port, then a path, query or fragment that has a query or
// fragment: 8080/hook?to=a, 8080?x.
func portThenQuery(s string) bool {
	n := 0
	for n < len(s) && n < 6 && s[n] >= '0' && s[n] <= '9' {
		n++
	}
	return n >= 1 && n <= 5 && n < len(s) && strings.IndexByte("/?#", s[n]) >= 0 && strings.ContainsAny(s[n:], "?#")
}

// tokenPrefixes are the prefixes of well-known API keys and tokens.
var tokenPrefixes = []string{
	"sk_live_", "sk_test_", "rk_live_", "rk_test_", "whsec_", // Stripe
	"ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", // GitHub
	"glpat-",                                    // GitLab
	"xoxb-", "xoxp-", "xoxa-", "xoxr-", "xoxs-", // Slack
	"AIza", // Google
}

// word looks at the word s[i:j] (letters, digits, '_', '-', '.'): a
// well-known token, or a sensitive name followed by a value. It returns
// where to go on scanning.
func (r *redactor) word(i, j int) int {
	s := r.s
	w := s[i:j]
	for _, p := range tokenPrefixes {
		if len(w) >= len(p)+8 && strings.HasPrefix(w, p) {
			r.cut(i+len(p), j)
			return j
		}
	}
	switch {
	case len(w) == 20 && (strings.HasPrefix(w, "AKIA") || strings.HasPrefix(w, "ASIA")) && isUpperAlnum(w[4:]):
		r.cut(i+4, j)
		return j
	case len(w) >= 16 && strings.HasPrefix(w, "eyJ") && strings.Count(w, ".") >= 2: // a JWT
		r.cut(i, j)
		return j
	case foldEqual(w, "hooks.slack.com") && strings.HasPrefix(s[j:], "/services/"):
		k := j + len("/services/")
		return r.cut1(k, valueEnd(s, k, false))
	case foldEqual(w, "bearer"):
		k := j
		for k < len(s) && s[k] == ' ' {
			k++
		}
		if k == j || k == len(s) || !isValueByte(s[k]) {
			return j
		}
		return r.cut1(k, valueEnd(s, k, false))
	}
	k, quote, encoded, ok := separator(s, j) // most words are not followed by one
	if !ok {
		return j
	}
	kind := nameKind(w)
	if kind == notSecret {
		return j
	}
	switch kind {
	case cookieName: // the whole value: every cookie in it
		if quote == "" {
			return r.cut1(k, lineEnd(s, k))
		}
		return r.cut1(k, closeQuote(s, k, quote))
	case authorizationName: // keep the scheme, redact the credentials
		e := k
		for e < len(s) && (isLetter(s[e]) || s[e] == '-' || s[e] >= '0' && s[e] <= '9') {
			e++
		}
		scheme := s[k:e]
		if e > k && e < len(s) && s[e] == ' ' && isAuthScheme(scheme) {
			for e < len(s) && s[e] == ' ' {
				e++
			}
			k = e
		} else {
			scheme = ""
		}
		switch {
		case quote != "":
			return r.cut1(k, closeQuote(s, k, quote))
		case scheme == "" || foldEqual(scheme, "bearer") || foldEqual(scheme, "basic") || foldEqual(scheme, "token"):
			return r.cut1(k, valueEnd(s, k, false))
		default: // Digest, AWS4-HMAC-SHA256…: parameters up to the end of the line
			return r.cut1(k, lineEnd(s, k))
		}
	}
	if quote != "" {
		return r.cut1(k, closeQuote(s, k, quote))
	}
	return r.cut1(k, valueEnd(s, k, encoded))
}

// cut1 redacts s[from:to] and returns to; a value already redacted is
// left as it is.
func (r *redactor) cut1(from, to int) int {
	if strings.HasPrefix(r.s[from:], redacted) {
		return from + len(redacted)
	}
	r.cut(from, to)
	return max(to, from)
}

type nameClass int

const (
	notSecret nameClass = iota
	secretName
	authorizationName
	cookieName
)

var (
	secretInfixes = []string{"password", "passwd", "passphrase", "secret", "credential", "signature",
		"api_key", "apikey", "private_key", "privatekey", "access_key", "accesskey"}
	secretSuffixes = []string{"token", "pwd", "_sig", "_auth", "session", "sessionid", "session_id"}
	secretNames    = []string{"key", "pass", "pw", "sig", "auth", "sid"}
	authSchemes    = []string{"bearer", "basic", "token", "digest", "negotiate", "ntlm", "apikey", "aws4-hmac-sha256", "hoba", "mutual"}
)

// nameKind classifies a parameter or header name.
func nameKind(w string) nameClass {
	if len(w) < 2 || len(w) > 64 {
		return notSecret
	}
	switch {
	case foldHasSuffix(w, "authorization"):
		return authorizationName
	case foldHasSuffix(w, "cookie"):
		return cookieName
	}
	for _, n := range secretNames {
		if foldEqual(w, n) {
			return secretName
		}
	}
	for _, n := range secretSuffixes {
		if foldHasSuffix(w, n) {
			return secretName
		}
	}
	for _, n := range secretInfixes {
		if foldContains(w, n) {
			return secretName
		}
	}
	return notSecret
}

func isAuthScheme(w string) bool {
	for _, a := range authSchemes {
		if foldEqual(w, a) {
			return true
		}
	}
	return false
}

// separator parses what joins a name ending at j to its value: an optional
// closing quote of the name (", ' or \"), '=' or ':' (or URL-encoded %3D,
// %3A) with blanks around, and an optional opening quote of the value (",
// ', \", [ or URL-encoded %22). It returns where the value starts, its
// closing quote ("" if unquoted) and whether the separator was URL-encoded.
func separator(s string, j int) (k int, quote string, encoded, ok bool) {
	k = j
	switch {
	case strings.HasPrefix(s[k:], `\"`):
		k += 2
	case k < len(s) && (s[k] == '"' || s[k] == '\''):
		k++
	}
	k = skipBlanks(s, k)
	switch {
	case k >= len(s):
		return 0, "", false, false
	case s[k] == ':' && strings.HasPrefix(s[k:], "://"):
		return 0, "", false, false // a URL's scheme
	case s[k] == '=' || s[k] == ':':
		k++
	case len(s) >= k+3 && s[k] == '%' && s[k+1] == '3' && (s[k+2]|0x20 == 'd' || s[k+2]|0x20 == 'a'):
		k += 3
		encoded = true
	default:
		return 0, "", false, false
	}
	k = skipBlanks(s, k)
	switch {
	case strings.HasPrefix(s[k:], redacted):
		return k, "", encoded, true
	case strings.HasPrefix(s[k:], `\"`):
		return k + 2, `\"`, encoded, true
	case k < len(s) && s[k] == '"':
		return k + 1, `"`, encoded, true
	case k < len(s) && s[k] == '\'':
		return k + 1, `'`, encoded, true
	case k < len(s) && s[k] == '[':
		return k + 1, `]`, encoded, true
	case encoded && strings.HasPrefix(s[k:], "%22"):
		return k + 3, "%22", encoded, true
	}
	return k, "", encoded, true
}

// valueEnd is the end of an unquoted value starting at k; after a
// URL-encoded separator the value also ends at an encoded '&' (%26). A
// colon ending the value is the message's punctuation ("GET url: 403").
func valueEnd(s string, k int, encoded bool) int {
	e := k
	for e < len(s) && isValueByte(s[e]) {
		if encoded && s[e] == '%' && strings.HasPrefix(s[e:], "%26") {
			break
		}
		e++
	}
	if e > k+1 && s[e-1] == ':' {
		e--
	}
	return e
}

// closeQuote is where the value quoted by quote, starting at k, ends: at
// its closing quote (a '"' escaped with a backslash does not close), or at
// the end of the line when there is none.
func closeQuote(s string, k int, quote string) int {
	for from := k; from < len(s); {
		n := strings.Index(s[from:], quote)
		if n < 0 {
			break
		}
		at := from + n
		if quote == `"` && at > k && s[at-1] == '\\' {
			from = at + 1
			continue
		}
		return at
	}
	return lineEnd(s, k)
}

func lineEnd(s string, k int) int {
	if n := strings.IndexAny(s[k:], "\r\n"); n >= 0 {
		return k + n
	}
	return len(s)
}

func skipBlanks(s string, k int) int {
	for k < len(s) && (s[k] == ' ' || s[k] == '\t') {
		k++
	}
	return k
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func isLetter(c byte) bool { return c|0x20 >= 'a' && c|0x20 <= 'z' }

func isWordByte(c byte) bool {
	return isLetter(c) || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.'
}

// isValueByte: what an unquoted value or a token may contain.
func isValueByte(c byte) bool {
	return c > ' ' && c != '"' && c != '\'' && c != '\\' && c != ',' && c != ';' && c != '&' &&
		c != ')' && c != ']' && c != '}' && c != '<' && c != '>' && c != 0x7f
}

func isUpperAlnum(s string) bool {
	for i := 0; i < len(s); i++ {
		if !(s[i] >= 'A' && s[i] <= 'Z' || s[i] >= '0' && s[i] <= '9') {
			return false
		}
	}
	return true
}

// fold maps ASCII letters to lower case and '-' and '.' to '_', so that
// X-Amz-Signature, x_amz_signature and x.amz.signature compare alike.
func fold(c byte) byte {
	switch {
	case c >= 'A' && c <= 'Z':
		return c + 'a' - 'A'
	case c == '-' || c == '.':
		return '_'
	}
	return c
}

// foldEqual compares w and pattern folded.
func foldEqual(w, pattern string) bool {
	if len(w) != len(pattern) {
		return false
	}
	for i := 0; i < len(w); i++ {
		if fold(w[i]) != fold(pattern[i]) {
			return false
		}
	}
	return true
}

func foldHasSuffix(w, suffix string) bool {
	return len(w) >= len(suffix) && foldEqual(w[len(w)-len(suffix):], suffix)
}

func foldContains(w, sub string) bool {
	for i := 0; i+len(sub) <= len(w); i++ {
		if fold(w[i]) == fold(sub[0]) && foldEqual(w[i:i+len(sub)], sub) {
			return true
		}
	}
	return false
}

// sanitizeError makes an error message safe and small enough for
// last_error and logs: secrets redacted, NUL bytes and invalid UTF-8
// replaced, and at most maxLen bytes (cut on a character boundary, with a
// note saying how much was cut).
func sanitizeError(msg string, maxLen int) string {
	msg = redactSecrets(msg)
	msg = strings.ToValidUTF8(msg, "\uFFFD")
	if strings.IndexByte(msg, 0) >= 0 {
		msg = strings.ReplaceAll(msg, "\x00", "\uFFFD")
	}
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
// bytes (at most 64 when maxLen is smaller: a truncated message keeps room
// for the note saying how much was cut). Publishers that log errors
// themselves can use it too.
func SanitizeError(err error, maxLen int) string {
	if err == nil {
		return ""
	}
	return sanitizeError(err.Error(), max(maxLen, 64))
}
