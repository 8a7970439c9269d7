package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/outboxui"
)

const serveExamples = `  modkit-outbox serve                                  # read-only, on 127.0.0.1:8080
  MODKIT_OUTBOX_TOKEN=$(openssl rand -hex 16) modkit-outbox serve --addr 127.0.0.1:9000
  modkit-outbox serve --show-payloads

  # Least privilege: a login in modkit_outbox_reader gives a dashboard that
  # the database itself keeps read-only and without payloads; one in
  # modkit_outbox_operator may replay, purge, skip and dead-letter (with the
  # token), and each such action is recorded under that login.
  #   CREATE ROLE outbox_ui LOGIN PASSWORD '…' IN ROLE modkit_outbox_reader;
  DATABASE_URL=postgres://outbox_ui@db.internal/app modkit-outbox serve

  # Several serves behind a load balancer: give each the same signing key,
  # or forms posted to another than their page came from are refused as
  # stale and sign-ins hold on one only (without it, use sticky sessions).
  openssl rand -hex 32 > /etc/modkit/ui.key
  modkit-outbox serve --signing-key-file /etc/modkit/ui.key
`

func runServe(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "serve", "serve [flags]", serveExamples)
	addr := f.String("addr", "127.0.0.1:8080", "address to listen on; the dashboard has no accounts, so keep it private")
	token := f.String("token", "", "operator token that enables replay and purge (default $MODKIT_OUTBOX_TOKEN; prefer the variable: flags show in ps)")
	payloads := f.Bool("show-payloads", false, "show event payloads (they may hold personal data)")
	secureCookies := f.Bool("secure-cookies", false, "mark the dashboard's cookies Secure: set it when a proxy terminates TLS in front of serve")
	hosts := f.String("hosts", "", "comma-separated host names (with or without a port) the dashboard answers to; "+
		"default: localhost, 127.0.0.1 and ::1 when --addr is a loopback address (other names are refused, so that "+
		"a web page cannot reach it through DNS rebinding), any otherwise")
	keyFile := f.String("signing-key-file", "", "file holding the key that signs sign-ins and forms, the same for every replica behind a load balancer; "+
		"at least 32 bytes, a final newline is not part of it (default: the key in $MODKIT_OUTBOX_SIGNING_KEY; none: a random key per serve)")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageErr("serve takes no arguments (got %q)", pos)
	}
	tokenFrom := "--token"
	if *token == "" {
		*token, tokenFrom = e.getenv("MODKIT_OUTBOX_TOKEN"), "$MODKIT_OUTBOX_TOKEN"
	}
	// Checked here, before connecting, so that the error names where the
	// token came from (outboxui's own check names neither).
	if *token != "" && len(*token) < outboxui.TokenMinLen {
		return usageErr("%s holds an operator token of %d characters, too short: use at least %d random ones (openssl rand -hex 16)",
			tokenFrom, len(*token), outboxui.TokenMinLen)
	}
	key, err := signingKey(e, *keyFile)
	if err != nil {
		return err
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	logger := slog.New(slog.NewTextHandler(e.stderr, nil))
	role, err := c.Admin().Rights(ctx)
	if err != nil {
		return err
	}
	mode := "read-only (set MODKIT_OUTBOX_TOKEN to enable replay and purge)"
	if *token != "" {
		mode = "operator actions enabled for holders of the token"
	}
	// The database role bounds what the dashboard may do, whatever its
	// flags say; the dashboard asks it too, and its pages say why they
	// offer no sign-in or show no payload.
	if role.Known && !role.Operate {
		mode = fmt.Sprintf("read-only: database role %s may not replay or purge (grant it modkit_outbox_operator to enable actions)", role.User)
	}
	if *payloads && role.Known && !role.ReadPayloads {
		mode += fmt.Sprintf("; payloads hidden: database role %s may not read them", role.User)
	}
	// ctx, whose end begins the shutdown, ends a purge from the dashboard
	// too: it goes on when its visitor leaves, but not past the shutdown.
	ui, err := outboxui.New(c.Admin(), outboxui.Options{OperatorToken: *token, ShowPayloads: *payloads,
		By: "modkit-outbox serve", Logger: logger, SigningKey: key, SecureCookies: *secureCookies, Context: ctx})
	if errors.Is(err, outboxui.ErrWeakToken) || errors.Is(err, outboxui.ErrWeakSigningKey) {
		return withCode(exitUsage, err)
	}
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *addr)
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("--addr %s: %w (another server listens there: stop it, or choose another port)", *addr, err)
	}
	if err != nil {
		return usageErr("--addr %s: %v", *addr, err)
	}
	allowed := allowedHosts(*hosts, ln.Addr())
	if allowed == nil {
		fmt.Fprintf(e.stderr, "modkit-outbox: serve answers any Host on %s: on a private address, pass --hosts with the names "+
			"it is reached by, so that a web page cannot reach it by pointing its own name there (DNS rebinding)\n", ln.Addr())
	}
	// Requests run on a context of their own, cancelled when a shutdown
	// gives up waiting for them: a page waiting on the database would
	// otherwise hold the shutdown, and then the pool's close, for as long
	// as its query ran.
	reqCtx, cancelRequests := context.WithCancel(context.Background())
	defer cancelRequests()
	srv := &http.Server{Handler: hostGuard(allowed, ui), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:    slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		BaseContext: func(net.Listener) context.Context { return reqCtx }}
	fmt.Fprintf(e.stdout, "dashboard on http://%s/ (schema %s) — %s\n", ln.Addr(), f.schema, mode)
	if s, ok := e.stdout.(interface{ Sync() error }); ok {
		_ = s.Sync()
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), serveShutdownWait)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		logger.Warn("requests still running at the shutdown were cut off", "waited", serveShutdownWait, "error", err)
		cancelRequests()
		_ = srv.Close()
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// serveShutdownWait is how long serve's shutdown waits for requests in
// flight before it cancels them.
const serveShutdownWait = 5 * time.Second

// allowedHosts is the set of host names (without ports, lower case) the
// dashboard answers to: those of list, else the loopback names and addr's
// own IP when addr is a loopback address; nil for any.
func allowedHosts(list string, addr net.Addr) map[string]bool {
	out := map[string]bool{}
	for _, h := range strings.Split(list, ",") {
		if h = strings.TrimSpace(h); h != "" {
			out[hostOnly(h)] = true
		}
	}
	if len(out) > 0 {
		return out
	}
	if a, ok := addr.(*net.TCPAddr); ok && a.IP.IsLoopback() {
		// The listener's own address too (127.0.0.2, say: the URL serve
		// prints); an IP literal cannot be a rebound name.
		return map[string]bool{"localhost": true, "127.0.0.1": true, "::1": true, strings.ToLower(a.IP.String()): true}
	}
	return nil
}

// hostOnly is h without its port and brackets, in lower case.
func hostOnly(h string) string {
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	return strings.ToLower(strings.Trim(h, "[]"))
}

// hostGuard refuses requests whose Host is not allowed (nil: any): a page
// on another site whose name an attacker points at 127.0.0.1 (DNS
// rebinding) reaches a loopback dashboard with its own name as the Host.
func hostGuard(allowed map[string]bool, next http.Handler) http.Handler {
	if allowed == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !allowed[hostOnly(r.Host)] {
			http.Error(w, "this dashboard does not answer to host "+strconv.Quote(r.Host)+" (see serve --hosts)", http.StatusMisdirectedRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// signingKey reads the dashboard's signing key from path, else from
// $MODKIT_OUTBOX_SIGNING_KEY, less a final newline; nil when neither is
// set. Never from a flag's value, which other users see in ps.
func signingKey(e env, path string) ([]byte, error) {
	what := "$MODKIT_OUTBOX_SIGNING_KEY"
	var key []byte
	if path != "" {
		what = "--signing-key-file " + path
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, usageErr("--signing-key-file: %v", err)
		}
		key = b
	} else if v := e.getenv("MODKIT_OUTBOX_SIGNING_KEY"); v != "" {
		key = []byte(v)
	} else {
		return nil, nil
	}
	key = bytes.TrimSuffix(bytes.TrimSuffix(key, []byte("\n")), []byte("\r"))
	if len(key) < outboxui.SigningKeyMinLen {
		return nil, usageErr("%s holds a signing key of %d bytes: use at least %d (openssl rand -hex 32)", what, len(key), outboxui.SigningKeyMinLen)
	}
	return key, nil
}
