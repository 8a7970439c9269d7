package outboxpg_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// guard bounds a wait for something that happens at once when all is well.
const guard = 2 * time.Minute

// listening runs s.Listen until the test ends and returns a channel closed
// once it listens and one that receives what Listen returned.
func listening(t *testing.T, s driver.Store) (ready <-chan struct{}, done <-chan error) {
	t.Helper()
	lctx, cancel := context.WithCancel(ctx)
	r, d, exited := make(chan struct{}), make(chan error, 1), make(chan struct{})
	var once sync.Once
	go func() {
		defer close(exited)
		d <- s.Listen(lctx, func() { once.Do(func() { close(r) }) }, func(string) {})
	}()
	t.Cleanup(func() {
		cancel()
		<-exited
	})
	return r, d
}

// The listener connects as the pool does, through its BeforeConnect and
// AfterConnect hooks (where rotating credentials and service discovery
// live). It dialled the pool's configuration itself, so a pool that needs
// its hooks served claims while its dispatchers never heard a NOTIFY.
func TestListenUsesThePoolsConnectHooks(t *testing.T) {
	tdb := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	realPort := cfg.ConnConfig.Port
	cfg.ConnConfig.Port = 1 // nothing listens there: only BeforeConnect makes the address right
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error { cc.Port = realPort; return nil }
	var afterConnect atomic.Int32
	cfg.AfterConnect = func(context.Context, *pgx.Conn) error { afterConnect.Add(1); return nil }
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	before := afterConnect.Load()
	ready, done := listening(t, open(t, pool, driver.Options{}))
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("the listener could not connect: %v", err)
	case <-time.After(guard):
		t.Fatal("the listener never listened")
	}
	if afterConnect.Load() == before {
		t.Fatal("the listener's connection did not run the pool's AfterConnect")
	}
}

// A listener whose connection stops delivering notifications without an
// error (its server went away behind a proxy that keeps the client's side
// open) gives up on it after a quiet spell and a check that does not come
// back, so that the dispatcher reconnects. It waited forever, and every
// event waited for the poll.
func TestListenGivesUpOnASilentConnection(t *testing.T) {
	// Checks every 100ms; 2s for one to come back, far more than a live
	// connection takes even on a loaded machine.
	t.Cleanup(outboxpg.SetListenCheck(100*time.Millisecond, 2*time.Second))
	tdb := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	px := newSilencingProxy(t, cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", px.port()
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	// A session of its own sees the listener's checks, which go to every
	// listener of the channel.
	watcher, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { watcher.Close(ctx) })
	if _, err := watcher.Exec(ctx, "LISTEN "+outboxpg.NotifyChannel); err != nil {
		t.Fatal(err)
	}
	ready, done := listening(t, open(t, pool, driver.Options{}))
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("the listener could not connect: %v", err)
	}
	// Quiet spells with a live connection: checks come back, it listens on.
	wctx, cancel := context.WithTimeout(ctx, guard)
	defer cancel()
	for checks := 0; checks < 3; {
		n, err := watcher.WaitForNotification(wctx)
		if err != nil {
			select {
			case lerr := <-done:
				t.Fatalf("the listener ended on a live connection after %d checks: %v", checks, lerr)
			default:
			}
			t.Fatalf("waiting for the listener's checks: %v", err)
		}
		if strings.HasPrefix(n.Payload, " modkit-outbox listener check ") {
			checks++
		}
	}
	select {
	case err := <-done:
		t.Fatalf("the listener gave up on a live connection: %v", err)
	default:
	}
	px.silence()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "delivered no notification") {
			t.Fatalf("the listener ended with %v; want it to say its connection went silent", err)
		}
	case <-time.After(guard):
		t.Fatal("the listener kept waiting on a connection that delivers nothing")
	}
}

// silencingProxy forwards connections to the server until silenced; then it
// forwards nothing in either direction and keeps the client's side open.
type silencingProxy struct {
	ln     net.Listener
	silent atomic.Bool
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
}

func newSilencingProxy(t *testing.T, host string, port uint16) *silencingProxy {
	t.Helper()
	network, addr := "tcp", net.JoinHostPort(host, fmt.Sprint(port))
	if strings.HasPrefix(host, "/") {
		network, addr = "unix", fmt.Sprintf("%s/.s.PGSQL.%d", host, port)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &silencingProxy{ln: ln}
	p.wg.Go(func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial(network, addr)
			if err != nil {
				client.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, client, server)
			p.mu.Unlock()
			p.wg.Go(func() { p.pipe(client, server) })
			p.wg.Go(func() { p.pipe(server, client) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *silencingProxy) pipe(src, dst net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.silent.Load() {
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			if !p.silent.Load() {
				dst.Close()
			}
			return
		}
	}
}

func (p *silencingProxy) port() uint16 { return uint16(p.ln.Addr().(*net.TCPAddr).Port) }

func (p *silencingProxy) silence() { p.silent.Store(true) }
