// Package outboxui is a web dashboard for a modkit outbox, as an
// http.Handler to mount in your own server (modkit-outbox serve runs it on
// its own):
//
//	ui, err := outboxui.New(client.Admin(), outboxui.Options{OperatorToken: os.Getenv("OUTBOX_UI_TOKEN")})
//	mux.Handle("/outbox/", http.StripPrefix("/outbox", ui))
//
// It shows per-topic depth, the age of the oldest due event, throughput and
// dead counts; the health of the dispatchers given in Options.Dispatchers; a
// chart of throughput and delivery latency over the last hour; the ordering
// keys a dead event blocks; the events with filters; and each event's detail with its history of attempts,
// which the page still shows, marked purged, once the event's row is
// purged. Everything it serves is embedded: no CDN, no script from elsewhere.
//
// In an fx app, build it from the graph (the *outbox.Dispatcher is nil when
// the app registers no publisher; the dashboard skips it) and mount
// HealthHandler for probes:
//
//	fx.Invoke(func(mux *http.ServeMux, c *outbox.Client, d *outbox.Dispatcher) error {
//		ui, err := outboxui.New(c.Admin(), outboxui.Options{Dispatchers: []*outbox.Dispatcher{d}})
//		if err != nil {
//			return err
//		}
//		mux.Handle("/outbox/", http.StripPrefix("/outbox", ui))
//		mux.Handle("GET /healthz/outbox", outboxui.HealthHandler(d))
//		return nil
//	})
//
// # Security
//
//   - Read-only by default. With Options.OperatorToken set, an operator who
//     signs in with that token may replay, purge or skip (the dead head
//     of an ordering key) dead events, purge delivered ones and dead-letter
//     the pending events of a topic no dispatcher serves. The sign-in sets an HttpOnly, SameSite=Strict session cookie,
//     valid for at most OperatorSessionMax and until the handler is rebuilt
//     (a restart signs everyone out) unless Options.SigningKey is set, as
//     below. Signing out replaces the browser's id, to which the sign-in
//     was bound; the dashboard keeps no sessions, so a copy of a browser's
//     two cookies taken before it signed out stays valid until the
//     sign-in's time is up (change the key or the token to end it sooner).
//     Wrong tokens are limited per client address (the request's own, or
//     what Options.ClientAddr says; an IPv6 address's /64): ten at once, then one each
//     six seconds, each a 403 and a log line; beyond that they get 429
//     with Retry-After, and the log one line each time the limit is
//     reached. The right token signs in whatever the address's allowance,
//     so a visitor sharing the operator's address cannot lock the operator
//     out; guessing is defeated by the token's length, not by the limit.
//   - The sign-in cookie, the CSRF tokens and the messages after an action
//     are signed with a key that never leaves the process: by default a
//     random one that New makes for its handler. Several replicas behind a
//     load balancer (the dashboard mounted in each instance of an app, say)
//     must share one: give each the same Options.SigningKey (at least
//     SigningKeyMinLen random bytes, from your secret store). Without it,
//     route each browser to one replica (sticky sessions) or serve the
//     dashboard from one process; otherwise a form posted to another
//     replica than its page came from is refused as stale, a sign-in holds
//     on one replica only, and the message after an action is dropped by
//     the replica that shows the next page. With a SigningKey a sign-in
//     also outlives restarts: it holds until the browser closes, its time
//     is up, or the key or the operator token changes (change either to
//     sign everyone out).
//   - Every POST must carry the CSRF token of the page it came from (bound
//     to a per-browser cookie with an HMAC; that cookie is SameSite=Lax, so
//     that a link from another site, which does not send it, does not
//     replace it and sign the operator out); a POST whose Origin is another
//     host is refused too.
//   - An action redirects to a page that says what it did; that message is
//     signed for the browser that acted, so a link cannot make the
//     dashboard show a message of someone else's writing.
//   - Payloads are hidden unless Options.ShowPayloads is set: they may hold
//     personal data.
//   - The database login of the Admin bounds it too. The dashboard asks
//     the database what that login may do (Admin.Rights, again after a
//     minute): with a login that may not replay or purge (one in
//     modkit_outbox_reader) it is read-only whatever the token, offers no
//     sign-in and says why; with one that may not read payloads it says so
//     where a payload would be.
//   - Failures that are not the visitor's doing (the database's, say) are
//     logged to Options.Logger with an error_id; the page shows that id
//     instead of the error, whose text may quote SQL or the database's
//     address. A bad filter, cursor or purge topic is a 400 that says
//     what is wrong. A dispatcher whose claims fail is shown with the time
//     they began failing, not their error, which the dispatcher logs.
//   - The dashboard has no user accounts: put it behind your own
//     authentication, or bind it to a private address, for reading too.
//     Mounted in your own server on a loopback or private address, check
//     the Host header (a page of another site can point its own name at
//     such an address: DNS rebinding), as modkit-outbox serve does on a
//     loopback address, and on any with --hosts. Behind a
//     proxy that terminates TLS, set Options.SecureCookies.
//   - What page loads cost the database is bounded, since anyone who
//     reaches the dashboard may load them: at most four page loads read
//     the database at once (the others wait for their turn), and the
//     overview's chart and hourly figures, whose read sorts every delivery
//     of the last hour, are read at most every 10 seconds and shared by
//     the page loads meanwhile (a purge from the dashboard reads them
//     afresh). The events page reads an index for pending, processing
//     and dead events; with no status, or delivered, it reads the whole
//     table (no index holds events by enqueue time). So the overview's
//     links lead to the indexed lists: a topic's name to its pending
//     events, each count to the events of its status; only the count of
//     the last hour's deliveries leads to the delivered ones.
//   - A purge of delivered events (an operator's action) is bounded by
//     Options.PurgeTimeLimit rather than by its request: a visitor or proxy that
//     gives up does not cut it short midway, unreported. Its answer, and
//     the log, say how many it deleted and, when it stopped before it was
//     done (at the time limit, or at the shutdown: Options.Context), to
//     purge again for the rest.
//
// Every call goes through outbox.Admin; the dashboard has no SQL of its
// own.
package outboxui

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// TokenMinLen is the shortest operator token New accepts, in characters.
const TokenMinLen = 16

// ErrWeakToken is returned by New for an operator token shorter than
// TokenMinLen. It matches outbox.ErrInvalidConfig too.
var ErrWeakToken = fmt.Errorf("%w: outboxui: the operator token is too short: use at least %d random characters (openssl rand -hex 16)", outbox.ErrInvalidConfig, TokenMinLen)

// SigningKeyMinLen is the shortest Options.SigningKey New accepts, in bytes.
const SigningKeyMinLen = 32

// ErrWeakSigningKey is returned by New for an Options.SigningKey shorter
// than SigningKeyMinLen. It matches outbox.ErrInvalidConfig too.
var ErrWeakSigningKey = fmt.Errorf("%w: outboxui: the signing key is too short: use at least %d random bytes (openssl rand -hex 32)", outbox.ErrInvalidConfig, SigningKeyMinLen)

// Options configures the dashboard. The zero value is a read-only
// dashboard that hides payloads.
type Options struct {
	// OperatorToken, when set, lets an operator who signs in with it replay,
	// purge or skip (Admin.SkipHead) dead events, purge delivered ones and
	// dead-letter the pending events of a topic no dispatcher serves
	// (Admin.DeadLetter). At least TokenMinLen
	// characters. Empty: read-only. A database login that may not replay
	// (Admin.Rights) makes the dashboard read-only all the same.
	OperatorToken string
	// ShowPayloads shows event payloads on the event page, when the
	// database login may read them (Admin.Rights).
	ShowPayloads bool
	// By names the dashboard in the audit trail of replays, purges, skips
	// and dead-letterings ("replayed by …"). Default "outboxui".
	By string
	// Logger receives a record of every action, and of every failure that
	// is not the visitor's doing, under the error_id the page shows.
	// Default slog.Default().
	Logger *slog.Logger
	// Dispatchers of this process to show with their Health on the
	// overview, when the dashboard is mounted in the application that runs
	// them. Optional; nil entries are skipped, so an fx app can pass the
	// *outbox.Dispatcher of its graph, which is nil when it registers no
	// publisher.
	Dispatchers []*outbox.Dispatcher
	// SigningKey, when set, is the secret that signs the sign-in cookie,
	// the CSRF tokens and the messages after an action, instead of a
	// random key of the handler's own. Give replicas behind a load
	// balancer the same key so that each accepts what another signed. At
	// least SigningKeyMinLen bytes, random (openssl rand -hex 32), kept
	// secret: whoever holds it can forge those tokens (though not sign in
	// without the operator token). The dashboard derives its own key from
	// it, so a key shared with other uses yields different signatures;
	// New copies what it needs, so the slice may be reused afterwards.
	// Nil: a random key per handler. An empty but non-nil key (an unset
	// variable read into it, say) is refused like any short one, rather
	// than falling back to a random key that replicas would not share.
	SigningKey []byte
	// SecureCookies marks the dashboard's cookies Secure (sent over HTTPS
	// only) whatever the request came in on. Set it when a proxy or load
	// balancer terminates TLS in front of the dashboard: the handler then
	// sees plain HTTP, and without it a browser that once reaches it over
	// http:// sends the sign-in cookie in clear. (A request that arrives
	// over TLS gets Secure cookies either way.)
	SecureCookies bool
	// ClientAddr returns the address of the client that sent a request, by
	// which wrong operator tokens are limited (see the package doc). Nil:
	// the request's RemoteAddr. Behind a proxy, whose address every visitor
	// would otherwise share, return the address the proxy puts in a header
	// it overwrites (X-Forwarded-For as your proxy sets it, say); never one
	// a client can set itself, or each forged value gets an allowance of its
	// own. An IPv6 address counts by its /64 either way.
	ClientAddr func(r *http.Request) string
	// Context, when set, ends the purges of delivered events under way
	// when it is cancelled: cancel it when the server shuts down. Such a
	// purge goes on when its request is cancelled (a visitor or proxy that
	// gives up does not cut it short), for PurgeTimeLimit at most;
	// cancelling Context ends it sooner, with an answer that says how many
	// it deleted. Nil: only PurgeTimeLimit ends it. modkit-outbox serve
	// cancels it when its shutdown begins. Nothing else uses it.
	Context context.Context
	// PurgeTimeLimit bounds a purge of delivered events from the
	// dashboard: it deletes in batches (Admin.Purge) for at most this
	// long, then answers with how many it deleted and whether it stopped
	// before it was done, in which case the operator purges again for the
	// rest. Zero means DefaultPurgeTimeLimit, short enough that the answer
	// comes before a client or proxy gives up on the request; a negative
	// value is refused.
	PurgeTimeLimit time.Duration
}

//go:embed assets
var assets embed.FS

var pages = template.Must(template.New("").Funcs(template.FuncMap{
	"age":  fmtAge,
	"when": func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") },
	"deref": func(s *string) string {
		if s == nil {
			return ""
		}
		return *s
	},
	"uuidp": func(u *uuid.UUID) string {
		if u == nil {
			return ""
		}
		return u.String()
	},
}).ParseFS(assets, "assets/*.html"))

type handler struct {
	admin *outbox.Admin
	opts  Options
	key   []byte // signs CSRF tokens, operator sessions and flash messages: derived from Options.SigningKey, else random per handler
	mux   *http.ServeMux
	log   *slog.Logger
	// series keeps the overview's series for a while, and reads bounds
	// the page loads that read the database at once (load.go).
	series *readCache[outbox.Series]
	reads  chan struct{}
	// signIns limits wrong operator tokens per remote address (signin.go).
	signIns *signInLimiter
	// rights keeps what the database login may do (rights.go).
	rights *readCache[outbox.Rights]
}

// New returns the dashboard on admin.
func New(admin *outbox.Admin, opts Options) (http.Handler, error) {
	if admin == nil {
		return nil, errors.New("outboxui: New needs the Admin of an outbox client (client.Admin())")
	}
	if opts.OperatorToken != "" && utf8.RuneCountInString(opts.OperatorToken) < TokenMinLen { // characters, as documented, not bytes
		return nil, ErrWeakToken
	}
	if opts.SigningKey != nil && len(opts.SigningKey) < SigningKeyMinLen {
		return nil, ErrWeakSigningKey
	}
	if opts.By == "" {
		opts.By = "outboxui"
	}
	switch {
	case opts.PurgeTimeLimit < 0:
		return nil, fmt.Errorf("outboxui: Options.PurgeTimeLimit is %v; it must be positive, or zero for %v", opts.PurgeTimeLimit, DefaultPurgeTimeLimit)
	case opts.PurgeTimeLimit == 0:
		opts.PurgeTimeLimit = DefaultPurgeTimeLimit
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	h := &handler{admin: admin, opts: opts, mux: http.NewServeMux(), log: opts.Logger,
		reads: make(chan struct{}, maxConcurrentReads), signIns: newSignInLimiter(time.Now)}
	h.series = &readCache[outbox.Series]{now: time.Now, ttl: seriesTTL, read: func(ctx context.Context) (outbox.Series, error) {
		return admin.Series(ctx, outbox.SeriesQuery{Window: time.Hour, Bucket: time.Minute})
	}}
	h.rights = &readCache[outbox.Rights]{now: time.Now, ttl: rightsTTL, keepFailed: true, read: admin.Rights}
	if opts.SigningKey != nil {
		// A key of the dashboard's own, so that a key the application also
		// uses elsewhere never signs the same bytes for both.
		m := hmac.New(sha256.New, opts.SigningKey)
		m.Write([]byte("modkit-go outboxui signing key v1"))
		h.key = m.Sum(nil)
	} else {
		h.key = make([]byte, 32)
		if _, err := rand.Read(h.key); err != nil {
			return nil, err
		}
	}
	h.opts.SigningKey = nil // h.key is all the handler needs
	h.mux.HandleFunc("GET /{$}", h.limitReads(h.overview))
	h.mux.HandleFunc("GET /events", h.limitReads(h.events))
	h.mux.HandleFunc("GET /events/{id}", h.limitReads(h.event))
	h.mux.HandleFunc("GET /assets/style.css", func(w http.ResponseWriter, r *http.Request) {
		http.ServeFileFS(w, r, assets, "assets/style.css")
	})
	h.mux.HandleFunc("POST /login", h.action(false, h.login))
	h.mux.HandleFunc("POST /logout", h.action(false, h.logout))
	h.mux.HandleFunc("POST /replay", h.action(true, h.replay))
	h.mux.HandleFunc("POST /purge", h.action(true, h.purge))
	h.mux.HandleFunc("POST /purge-dead", h.action(true, h.purgeDead))
	h.mux.HandleFunc("POST /skip-head", h.action(true, h.skipHead))
	h.mux.HandleFunc("POST /dead-letter", h.action(true, h.deadLetter))
	return h, nil
}

const (
	csrfCookie     = "modkit_outbox_csrf"
	operatorCookie = "modkit_outbox_operator"
)

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'; form-action 'self'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "same-origin")
	h.mux.ServeHTTP(w, r)
}

func (h *handler) sign(parts ...string) string {
	m := hmac.New(sha256.New, h.key)
	m.Write([]byte(strings.Join(parts, "\x00")))
	return hex.EncodeToString(m.Sum(nil))
}

// OperatorSessionMax is the longest a sign-in holds: the operator cookie
// carries its time, signed, and is refused after this.
const OperatorSessionMax = 12 * time.Hour

// operatorCookieValue is the operator cookie's value for browser, signed
// in at issued: the time (Unix seconds) and the signature of both. It is
// bound to the operator token too, so that with a lasting
// Options.SigningKey a change of token still signs everyone out.
func (h *handler) operatorCookieValue(browser string, issued int64) string {
	t := sha256.Sum256([]byte(h.opts.OperatorToken))
	at := strconv.FormatInt(issued, 10)
	return at + "." + h.sign("operator", browser, hex.EncodeToString(t[:]), at)
}

// operatorCookieValid reports whether v is browser's operator cookie,
// signed in less than OperatorSessionMax before now.
func (h *handler) operatorCookieValid(v, browser string, now time.Time) bool {
	at, _, ok := strings.Cut(v, ".")
	issued, err := strconv.ParseInt(at, 10, 64)
	if !ok || err != nil || !hmac.Equal([]byte(v), []byte(h.operatorCookieValue(browser, issued))) {
		return false
	}
	age := now.Sub(time.Unix(issued, 0))
	return age < OperatorSessionMax && age > -time.Minute // a minute of clock skew between replicas
}

// browserID returns the per-browser CSRF cookie, setting one when the
// browser has none.
func (h *handler) browserID(w http.ResponseWriter, r *http.Request) string {
	if c, err := r.Cookie(csrfCookie); err == nil && len(c.Value) == 64 {
		return c.Value
	}
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	v := hex.EncodeToString(b)
	h.setBrowserID(w, r, v)
	return v
}

// setBrowserID sets the per-browser cookie. It is SameSite=Lax: a
// Strict one is not sent when a link from another site leads here, and
// the page would set a new one, signing the operator out.
func (h *handler) setBrowserID(w http.ResponseWriter, r *http.Request, v string) {
	http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: v, Path: cookiePath(r), HttpOnly: true, SameSite: http.SameSiteLaxMode, Secure: h.secure(r)})
}

// secure says whether the cookies set for r are Secure (see
// Options.SecureCookies).
func (h *handler) secure(r *http.Request) bool { return h.opts.SecureCookies || r.TLS != nil }

// cookiePath is the path the dashboard is mounted on, as the browser sees
// it (ending in /): the request URI's path less the part left after http.StripPrefix.
func cookiePath(r *http.Request) string {
	orig := r.RequestURI
	if u, err := url.ParseRequestURI(orig); err == nil {
		orig = u.Path
	}
	if prefix, ok := strings.CutSuffix(orig, r.URL.Path); ok && prefix != "" {
		return prefix + "/"
	}
	return "/"
}

func (h *handler) isOperator(r *http.Request, browser string) bool {
	if h.opts.OperatorToken == "" {
		return false
	}
	c, err := r.Cookie(operatorCookie)
	return err == nil && h.operatorCookieValid(c.Value, browser, time.Now())
}

// page is what every template gets.
type page struct {
	Title    string
	Schema   string // the outbox's schema: two outboxes of one database can have the same topics
	Root     string // relative path to the dashboard's root, ending in /
	CSRF     string
	Operator bool // signed in as operator, and the dashboard may act (access.CanOperate)
	access        // what the options and the database login allow
	Flash    string
	Data     any
}

func (h *handler) newPage(w http.ResponseWriter, r *http.Request, title string, data any) page {
	browser := h.browserID(w, r)
	depth := strings.Count(strings.TrimPrefix(r.URL.Path, "/"), "/")
	root := "./"
	if depth > 0 {
		root = strings.Repeat("../", depth)
	}
	a := h.access(r.Context())
	return page{Title: title, Schema: h.admin.Schema(), Root: root, CSRF: h.sign("csrf", browser), Operator: a.CanOperate && h.isOperator(r, browser),
		access: a, Flash: h.flash(r, browser), Data: data}
}

// flash returns the message that redirect passed to this browser, or ""
// when the request has none or its signature does not match: a link of
// someone else's making cannot put words in the dashboard's mouth.
func (h *handler) flash(r *http.Request, browser string) string {
	q := r.URL.Query()
	msg := q.Get("flash")
	if msg == "" || !hmac.Equal([]byte(q.Get("flash_sig")), []byte(h.sign("flash", browser, msg))) {
		return ""
	}
	return msg
}

func (h *handler) render(w http.ResponseWriter, status int, name string, p page) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	if err := pages.ExecuteTemplate(w, name, p); err != nil {
		h.log.Error("outboxui: render", "page", name, "error", err)
	}
}

func (h *handler) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	h.render(w, status, "error.html", h.newPage(w, r, http.StatusText(status), msg))
}

// logInternal logs err, a failure that is not the visitor's doing (the
// database's, say), under a new error id and returns the id. Pages show
// the id, never err: its text may quote SQL, the database's objects or
// its address.
func (h *handler) logInternal(r *http.Request, level slog.Level, what string, err error) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	h.log.Log(r.Context(), level, "outboxui: "+what+" failed", "error_id", id, "error", err,
		"method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr)
	return id
}

// failInternal answers 500 for err, a failure that is not the visitor's
// doing: the page says what failed and gives the error id of the log
// record that holds err.
func (h *handler) failInternal(w http.ResponseWriter, r *http.Request, what string, err error) {
	id := h.logInternal(r, slog.LevelError, what, err)
	h.fail(w, r, http.StatusInternalServerError,
		fmt.Sprintf("%s%s failed. The dashboard's log has the details under error_id=%s.", strings.ToUpper(what[:1]), what[1:], id))
}

// action wraps a POST handler with the CSRF check and, when operator is
// set, the operator check.
func (h *handler) action(operator bool, fn func(w http.ResponseWriter, r *http.Request)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if o := r.Header.Get("Origin"); o != "" && o != "null" {
			if u, err := url.Parse(o); err != nil || u.Host != r.Host {
				h.fail(w, r, http.StatusForbidden, "This request came from another site and was refused.")
				return
			}
		}
		c, err := r.Cookie(csrfCookie)
		if err != nil || r.ParseForm() != nil ||
			!hmac.Equal([]byte(r.PostForm.Get("csrf")), []byte(h.sign("csrf", c.Value))) {
			h.fail(w, r, http.StatusForbidden, "The form's CSRF token is missing or stale: reload the page and try again.")
			return
		}
		if operator {
			if a := h.access(r.Context()); !a.CanOperate {
				h.fail(w, r, http.StatusForbidden, "This dashboard is read-only: "+a.ReadOnly+".")
				return
			}
			if !h.isOperator(r, c.Value) {
				h.fail(w, r, http.StatusForbidden, "Sign in with the operator token first.")
				return
			}
		}
		fn(w, r)
	}
}

// redirect sends the browser to the page to, a path relative to the
// dashboard's root, which shows the message flash. The message is signed
// for this browser (its CSRF cookie, which every action has), so that
// only the dashboard can make a page show one.
func (h *handler) redirect(w http.ResponseWriter, r *http.Request, to, flash string) {
	browser := ""
	if c, err := r.Cookie(csrfCookie); err == nil {
		browser = c.Value
	}
	h.redirectFor(w, r, browser, to, flash)
}

// redirectFor is redirect with the message signed for browser ("": none).
func (h *handler) redirectFor(w http.ResponseWriter, r *http.Request, browser, to, flash string) {
	to = cookiePath(r) + strings.TrimPrefix(to, "./")
	if flash != "" && browser != "" {
		sep := "?"
		if strings.Contains(to, "?") {
			sep = "&"
		}
		to += sep + url.Values{"flash": {flash}, "flash_sig": {h.sign("flash", browser, flash)}}.Encode()
	}
	http.Redirect(w, r, to, http.StatusSeeOther)
}

func (h *handler) login(w http.ResponseWriter, r *http.Request) {
	tok := r.PostForm.Get("token")
	if h.opts.OperatorToken == "" || subtle.ConstantTimeCompare([]byte(tok), []byte(h.opts.OperatorToken)) != 1 {
		addr := r.RemoteAddr
		if h.opts.ClientAddr != nil {
			addr = h.opts.ClientAddr(r)
		}
		client := clientOf(addr)
		if d := h.signIns.wait(client); d > 0 {
			secs := int(math.Ceil(d.Seconds()))
			w.Header().Set("Retry-After", strconv.Itoa(secs))
			h.fail(w, r, http.StatusTooManyRequests, fmt.Sprintf(
				"Wrong operator token, and too many from your address: try again in %d s.", secs))
			return
		}
		if h.signIns.failed(client) {
			h.log.Warn("outboxui: operator sign-in refused; too many wrong tokens from this address: its next wrong ones are "+
				"answered 429, without a log line, until its allowance refills", "remote", r.RemoteAddr, "refill", signInRefill)
		} else {
			h.log.Warn("outboxui: operator sign-in refused", "remote", r.RemoteAddr)
		}
		h.fail(w, r, http.StatusForbidden, "Wrong operator token.")
		return
	}
	c, _ := r.Cookie(csrfCookie)
	http.SetCookie(w, &http.Cookie{Name: operatorCookie, Value: h.operatorCookieValue(c.Value, time.Now().Unix()), Path: cookiePath(r), HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: h.secure(r)})
	h.redirect(w, r, "./", "Signed in as operator.")
}

func (h *handler) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: operatorCookie, Value: "", Path: cookiePath(r), MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: h.secure(r)})
	// A new browser id, to which the old sign-in is not bound: a copy of
	// the operator cookie that the browser failed to delete (or that was
	// taken) no longer goes with this browser's id.
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	browser := hex.EncodeToString(b)
	h.setBrowserID(w, r, browser)
	h.redirectFor(w, r, browser, "./", "Signed out.")
}

// replayMax caps the ids one replay form may carry (a page of events).
const replayMax = 100

func (h *handler) replay(w http.ResponseWriter, r *http.Request) {
	raw := r.PostForm["id"]
	if len(raw) == 0 || len(raw) > replayMax {
		h.fail(w, r, http.StatusBadRequest, fmt.Sprintf("Replay needs 1 to %d event ids.", replayMax))
		return
	}
	ids := make([]uuid.UUID, len(raw))
	for i, v := range raw {
		id, err := uuid.Parse(v)
		if err != nil {
			h.fail(w, r, http.StatusBadRequest, fmt.Sprintf("Replay: %q is not an event id.", v))
			return
		}
		ids[i] = id
	}
	done, err := h.admin.ReplayDead(r.Context(), h.opts.By, outbox.EventFilter{}, ids...)
	if err != nil {
		h.failInternal(w, r, "replay", err)
		return
	}
	h.log.Info("outboxui: replay", "events", ids, "replayed", len(done), "remote", r.RemoteAddr)
	if len(ids) > 1 {
		h.redirect(w, r, "events?status=dead", fmt.Sprintf("Replayed %d of %d events; they are pending again.", len(done), len(ids)))
		return
	}
	flash := "Event replayed: it is pending again."
	if len(done) == 0 {
		flash = "Nothing replayed: the event is no longer dead."
		if _, err := h.admin.Get(r.Context(), ids[0]); errors.Is(err, outbox.ErrNotFound) {
			flash = h.goneFlash(r, ids[0], "Nothing replayed")
		}
	}
	h.redirect(w, r, "events/"+ids[0].String(), flash)
}

// deadLetter makes the pending events of a topic dead (Admin.DeadLetter,
// at most its default limit a click), for a topic no dispatcher serves:
// every claim reads its due events. They can be replayed from the dead
// list once a publisher runs.
func (h *handler) deadLetter(w http.ResponseWriter, r *http.Request) {
	ns, topic, ok := strings.Cut(r.PostForm.Get("topic"), "/")
	if !ok || ns == "" || topic == "" {
		h.fail(w, r, http.StatusBadRequest, "Dead-lettering needs a topic (namespace/topic).")
		return
	}
	// Only a topic no dispatcher serves: a page loaded before one started,
	// or a hand-made request, must not take a served topic's events.
	unserved, err := h.admin.Unserved(r.Context())
	if err != nil {
		h.failInternal(w, r, "dead-letter: reading which topics a dispatcher serves", err)
		return
	}
	if !slices.ContainsFunc(unserved, func(t outbox.TopicStats) bool { return t.Namespace == ns && t.Topic.Topic == topic }) {
		h.fail(w, r, http.StatusConflict, fmt.Sprintf("Nothing was dead-lettered: %s/%s has no due event that no dispatcher "+
			"serves (a dispatcher serves it now, or its events were delivered or dead-lettered already). "+
			"modkit-outbox dead letter takes any topic's pending events.", ns, topic))
		return
	}
	done, err := h.admin.DeadLetter(r.Context(), h.opts.By, outbox.EventFilter{Namespace: ns, Topic: topic})
	if errors.Is(err, outbox.ErrInvalidConfig) { // a malformed name: nothing changed
		h.fail(w, r, http.StatusBadRequest, "Dead-lettering needs a topic (namespace/topic): "+err.Error())
		return
	}
	if err != nil {
		h.failInternal(w, r, "dead-letter", err)
		return
	}
	h.log.Info("outboxui: dead-letter", "topic", ns+"/"+topic, "dead_lettered", len(done), "remote", r.RemoteAddr)
	flash := fmt.Sprintf("Dead-lettered %d event(s) of %s/%s: replay them from the dead list once a publisher runs.",
		len(done), ns, topic)
	if len(done) >= deadLetterMax {
		flash += " More may wait: dead-letter again."
	}
	h.redirect(w, r, "./", flash)
}

// deadLetterMax is what one dead-lettering takes at most (Admin.DeadLetter's
// default limit).
const deadLetterMax = 10000

// purgeDead deletes one dead event (Admin.PurgeDead): one that must never
// be published. Its history stays, with the purge.
func (h *handler) purgeDead(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PostForm.Get("id"))
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, "Purge of a dead event needs its id.")
		return
	}
	done, err := h.admin.PurgeDead(r.Context(), h.opts.By, outbox.EventFilter{}, id)
	if err != nil {
		h.failInternal(w, r, "purge dead", err)
		return
	}
	h.log.Info("outboxui: purge dead", "event", id, "purged", len(done), "remote", r.RemoteAddr)
	if len(done) == 0 {
		flash := "Nothing purged: the event is no longer dead."
		ev, err := h.admin.Get(r.Context(), id)
		switch {
		case errors.Is(err, outbox.ErrNotFound):
			flash = h.goneFlash(r, id, "Nothing purged")
		case err == nil && ev.Status == outbox.StatusDead:
			// PurgeDead keeps the order of an ordering key: it leaves a
			// dead event behind an earlier one of its key that is not
			// delivered.
			flash = "Nothing purged: it waits behind an earlier event of its ordering key that is not delivered, purged " +
				"or skipped, which the events after it would overtake. Settle that event first."
		}
		h.redirect(w, r, "events/"+id.String(), flash)
		return
	}
	h.redirect(w, r, "events/"+id.String(), "Event purged: it is deleted, and its history stays.")
}

// goneFlash is the message of an action on an event whose row is gone:
// purged (its history is kept, and shown on its page), or never there.
func (h *handler) goneFlash(r *http.Request, id uuid.UUID, nothing string) string {
	if hist, err := h.admin.History(r.Context(), id); err == nil && len(hist) > 0 {
		return nothing + ": the event's row is gone (purged); its history is below."
	}
	return nothing + ": no event has this id."
}

// skipHead lets the later events of a dead event's ordering key go on
// without it (Admin.SkipHead). The event stays dead.
func (h *handler) skipHead(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PostForm.Get("id"))
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, "Skipping a dead head needs its event id.")
		return
	}
	err = h.admin.SkipHead(r.Context(), h.opts.By, id)
	h.log.Info("outboxui: skip head", "event", id, "skipped", err == nil, "remote", r.RemoteAddr)
	switch {
	case errors.Is(err, outbox.ErrNotFound):
		h.redirect(w, r, "events/"+id.String(), "Nothing skipped: this event does not hold its ordering key back (it is not dead, "+
			"was skipped already, or waits behind an earlier dead event of its key, which must be skipped first).")
	case err != nil:
		h.failInternal(w, r, "skip head", err)
	default:
		h.redirect(w, r, "events/"+id.String(), "Skipped: the later events of its ordering key go on without it; it stays dead "+
			"(a replay would deliver it out of order).")
	}
}

// DefaultPurgeTimeLimit is Options.PurgeTimeLimit when it is zero
// (modkit-outbox purge has no limit).
const DefaultPurgeTimeLimit = 4 * time.Second

// purge deletes a topic's delivered events (Admin.Purge). It runs on past
// the request's cancellation: a visitor or proxy that gives up must not
// cut it short midway, with what was deleted reported to no one. What
// bounds it is its time limit (Options.PurgeTimeLimit) and Options.Context (the
// dashboard's shutdown); either answers with the count deleted and says
// to purge again, as does the log.
func (h *handler) purge(w http.ResponseWriter, r *http.Request) {
	ns, topic, ok := strings.Cut(r.PostForm.Get("topic"), "/")
	older, err := time.ParseDuration(r.PostForm.Get("older_than"))
	if !ok || err != nil || older < 0 {
		h.fail(w, r, http.StatusBadRequest, "Purge needs a topic (namespace/topic) and an age such as 24h.")
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), h.opts.PurgeTimeLimit)
	defer cancel()
	if h.opts.Context != nil {
		stop := context.AfterFunc(h.opts.Context, cancel)
		defer stop()
	}
	n, err := h.admin.Purge(ctx, older, outbox.Topic{Namespace: ns, Topic: topic})
	if errors.Is(err, outbox.ErrInvalidConfig) { // a malformed name: nothing was purged
		h.fail(w, r, http.StatusBadRequest, "Purge needs a topic (namespace/topic) and an age such as 24h: "+err.Error())
		return
	}
	name := ns + "/" + topic
	stopped := ""
	switch {
	case err != nil && h.opts.Context != nil && h.opts.Context.Err() != nil:
		stopped = "the dashboard is shutting down"
	case err != nil && ctx.Err() != nil:
		stopped = fmt.Sprintf("a purge from the dashboard runs for %v at most", h.opts.PurgeTimeLimit)
	}
	h.series.forget() // the overview this redirects to shows the deliveries left
	// The visitor may have gone (the request's context is cancelled): then
	// the log is what tells what was done.
	gone := r.Context().Err() != nil
	if err != nil && stopped == "" {
		id := h.logInternal(r, slog.LevelError, "purge", fmt.Errorf("%w (%d deleted before the error)", err, n))
		h.fail(w, r, http.StatusInternalServerError, fmt.Sprintf("Purge failed after it deleted %d delivered event(s) of %s; "+
			"the dashboard's log has the details under error_id=%s.", n, name, id))
		return
	}
	h.log.Info("outboxui: purge", "topic", name, "older_than", older, "deleted", n, "done", stopped == "", "stopped", stopped,
		"visitor_gone", gone, "remote", r.RemoteAddr)
	if stopped != "" {
		// The statement under way was cut short on the client's side; the
		// database may still finish it, so its batch is not counted.
		h.redirect(w, r, "./", fmt.Sprintf("Purged %d delivered event(s) of %s, then stopped before it was done (%s); "+
			"the batch it was deleting may have gone too. Purge again for the rest.", n, name, stopped))
		return
	}
	h.redirect(w, r, "./", fmt.Sprintf("Purged %d delivered event(s) of %s.", n, name))
}

func fmtAge(d time.Duration) string {
	switch {
	case d <= 0:
		return "–"
	case d < time.Second:
		return "<1s"
	case d < time.Minute:
		return d.Round(time.Second).String()
	default:
		return d.Round(time.Minute).String()
	}
}
