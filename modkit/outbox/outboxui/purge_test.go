package outboxui_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxui"
)

// A purge of delivered events from the dashboard is bounded and always
// reported: a visitor (or proxy) that gives up does not cut it short
// midway with the count told to no one (it goes on, and the log says what
// it did); it stops at its time limit, or at the dashboard's shutdown
// (Options.Context), and says how many it deleted and to purge again.
// Each purge here waits on a lock on the events table, held by the test,
// so that it is still running when the visitor leaves, the time limit
// passes or the shutdown begins.

// hangGuard bounds a wait for what happens at once when all is well: a
// hang guard, not a timing, so it is long enough for a loaded machine.
const hangGuard = time.Minute

func TestDashboardPurgeIsBoundedAndReported(t *testing.T) {
	w := newWorld(t)
	if _, err := outboxui.New(w.client.Admin(), outboxui.Options{PurgeTimeLimit: -time.Second}); err == nil ||
		!strings.Contains(err.Error(), "PurgeTimeLimit") {
		t.Fatalf("a negative PurgeTimeLimit: %v, want it refused", err)
	}
	log := newLogRecorder()
	life, shutdown := context.WithCancel(bg)
	defer shutdown()
	base := serve(t, w, outboxui.Options{OperatorToken: token, Logger: slog.New(log), Context: life, PurgeTimeLimit: 300 * time.Millisecond})
	var jar *http.Client
	form := url.Values{"topic": {orders.String()}, "older_than": {"0s"}}
	// signIn signs a new browser in to the dashboard at base; the client
	// follows redirects.
	signIn := func() {
		t.Helper()
		jar = newJar()
		_, csrf := get(t, jar, base)
		if code, _ := post(t, jar, base+"login", url.Values{"csrf": {csrf}, "token": {token}}, ""); code != http.StatusSeeOther {
			t.Fatalf("sign in: %d", code)
		}
		jar.CheckRedirect = nil
		form.Set("csrf", csrf)
	}
	signIn()

	// lock holds a lock on the events table that a purge's DELETE waits
	// for; the returned func releases it. A guard releases it after a
	// while, so that a purge nothing else ends fails the test rather than
	// hang it.
	lock := func() func() {
		t.Helper()
		tx, err := w.pool.Begin(bg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(bg, `LOCK TABLE modkit_outbox_events IN SHARE MODE`); err != nil {
			t.Fatal(err)
		}
		guard := time.AfterFunc(hangGuard, func() { _ = tx.Rollback(bg) })
		return func() { guard.Stop(); _ = tx.Rollback(bg) }
	}
	// waitBlocked waits until a purge waits for the lock.
	waitBlocked := func() {
		t.Helper()
		for deadline := time.Now().Add(hangGuard); ; time.Sleep(10 * time.Millisecond) {
			var n int
			if err := w.pool.QueryRow(bg, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
				AND wait_event_type = 'Lock' AND query LIKE '%modkit_outbox_purge_recorded%'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("the purge does not wait for the lock")
			}
		}
	}
	// purge posts the form and returns the message of the page it leads
	// to (the client follows the redirect), or an error; it may run on
	// another goroutine than the test's.
	purge := func() (string, error) {
		resp, err := jar.PostForm(base+"purge", form)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return "", fmt.Errorf("purge: %d\n%s", resp.StatusCode, b)
		}
		return flashOf(string(b)), nil
	}

	// The time limit ends a purge that takes longer, and says so.
	release := lock()
	if got, err := purge(); err != nil {
		t.Fatal(err)
	} else if want := "Purged 0 delivered event(s) of shop/order_paid, then stopped before it was done (a purge " +
		"from the dashboard runs for 300ms at most); the batch it was deleting may have gone too. Purge again for the rest."; got != want {
		t.Fatalf("a purge past its time limit says %q, want %q", got, want)
	}
	release()

	// The shutdown ends one, and says so.
	base = serve(t, w, outboxui.Options{OperatorToken: token, Logger: slog.New(log), Context: life, PurgeTimeLimit: time.Minute})
	signIn()
	release = lock()
	type answer struct {
		flash string
		err   error
	}
	said := make(chan answer, 1)
	go func() {
		flash, err := purge()
		said <- answer{flash, err}
	}()
	waitBlocked()
	shutdown()
	select {
	case got := <-said:
		if got.err != nil {
			t.Fatal(got.err)
		}
		if want := "Purged 0 delivered event(s) of shop/order_paid, then stopped before it was done (the dashboard is " +
			"shutting down); the batch it was deleting may have gone too. Purge again for the rest."; got.flash != want {
			t.Fatalf("a purge the shutdown ended says %q, want %q", got.flash, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the shutdown (Options.Context) does not end a purge")
	}
	release()

	// A visitor who leaves does not end it: it goes on, deletes, and the
	// log says what it did and that the visitor had gone.
	// Its own topic: the statements cut short above may still have
	// deleted the order_paid event after their locks went.
	receipts := outbox.Topic{Namespace: "shop", Topic: "receipt_sent"}
	if _, err := w.client.Enqueue(bg, w.pool, outbox.Message{Namespace: receipts.Namespace, Topic: receipts.Topic,
		Payload: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	delivered := settleNext(t, w, receipts, driver.Delivered)
	// The server's side of the visitor's request: gone is closed when the
	// server sees the visitor leave (its request's context is cancelled).
	ui, err := outboxui.New(w.client.Admin(), outboxui.Options{OperatorToken: token, Logger: slog.New(log)})
	if err != nil {
		t.Fatal(err)
	}
	gone := make(chan struct{})
	var goneOnce sync.Once
	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/purge") {
			context.AfterFunc(r.Context(), func() { goneOnce.Do(func() { close(gone) }) })
		}
		ui.ServeHTTP(rw, r)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	base = srv.URL + "/outbox/"
	signIn()
	form.Set("topic", receipts.String())
	release = lock()
	visit, leave := context.WithCancel(bg)
	req, err := http.NewRequestWithContext(visit, http.MethodPost, base+"purge", strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	left := make(chan error, 1)
	go func() {
		resp, err := jar.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		left <- err
	}()
	waitBlocked()
	leave()
	if err := <-left; !errors.Is(err, context.Canceled) {
		t.Fatalf("the visitor's request: %v, want it cancelled", err)
	}
	select { // the server has seen the visitor go (without the fix, the purge is cancelled)
	case <-gone:
	case <-time.After(hangGuard):
		t.Fatal("the server did not see the visitor leave")
	}
	release()
	for deadline := time.Now().Add(hangGuard); log.count("outboxui: purge") < 3; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no log record of the purge whose visitor left")
		}
	}
	rec := log.withAttr("visitor_gone", "true")
	if rec == nil || rec["deleted"] != "1" || rec["done"] != "true" {
		t.Fatalf("the log record of the purge whose visitor left: %v, want 1 deleted, done", rec)
	}
	if _, err := w.client.Admin().Get(bg, delivered); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("the delivered event after the purge whose visitor left: %v, want it purged", err)
	}
}
