package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/outboxui"
)

const serveExamples = `  modkit-outbox serve                                  # read-only, on 127.0.0.1:8080
  MODKIT_OUTBOX_TOKEN=$(openssl rand -hex 16) modkit-outbox serve --addr 127.0.0.1:9000
  modkit-outbox serve --show-payloads
`

func runServe(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "serve", "serve [flags]", serveExamples)
	addr := f.String("addr", "127.0.0.1:8080", "address to listen on; the dashboard has no accounts, so keep it private")
	token := f.String("token", "", "operator token that enables replay and purge (default $MODKIT_OUTBOX_TOKEN; prefer the variable: flags show in ps)")
	payloads := f.Bool("show-payloads", false, "show event payloads (they may hold personal data)")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageErr("serve takes no arguments (got %q)", pos)
	}
	if *token == "" {
		*token = e.getenv("MODKIT_OUTBOX_TOKEN")
	}
	c, pool, err := f.client(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	logger := slog.New(slog.NewTextHandler(e.stderr, nil))
	ui, err := outboxui.New(c.Admin(), outboxui.Options{OperatorToken: *token, ShowPayloads: *payloads,
		By: "modkit-outbox serve", Logger: logger})
	if errors.Is(err, outboxui.ErrWeakToken) {
		return withCode(exitUsage, err)
	}
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return usageErr("--addr %s: %v", *addr, err)
	}
	srv := &http.Server{Handler: ui, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	mode := "read-only (set MODKIT_OUTBOX_TOKEN to enable replay and purge)"
	if *token != "" {
		mode = "operator actions enabled for holders of the token"
	}
	fmt.Fprintf(e.stdout, "dashboard on http://%s/ — %s\n", ln.Addr(), mode)
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
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return err
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
