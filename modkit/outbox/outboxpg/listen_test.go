package outboxpg_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
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
	if _, err := watcher.Exec(ctx, "LISTEN "+pgx.Identifier{outboxpg.NotifyChannel("public")}.Sanitize()); err != nil {
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
		if err == nil || !strings.Contains(err.Error(), "delivered no notification") || errors.Is(err, driver.ErrListenDeaf) {
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

// Enqueues announce their topics on their schema's channel, on every path
// (a keyless INSERT, a keyed INSERT, the enqueue function for an ordered
// event, the batch function with and without ordering keys, COPY), and a
// dispatcher hears its own schema's channel and the channel every schema
// shared before migration 0032, where producers of an earlier version
// announce. Every schema's enqueues used the one channel, so two outboxes
// in one database woke each other's dispatchers. Notifications arrive in
// commit order, so an announcement heard by the wrong listener would come
// before the marker that ends each sequence. A schema's name as long as
// PostgreSQL allows makes a channel's name too long, cut alike by the
// driver and the functions.
func TestListenHearsItsOwnSchema(t *testing.T) {
	for _, schema := range []string{"second_outbox", "second_outbox_" + strings.Repeat("x", 49)} {
		t.Run(fmt.Sprint(len(schema)), func(t *testing.T) { testListenHearsItsOwnSchema(t, schema) })
	}
}

func testListenHearsItsOwnSchema(t *testing.T, schema string) {
	tdb := pgtest.NewDB(t)
	pool := tdb.Provider.Pool
	public := open(t, pool, driver.Options{})
	second := open(t, pool, driver.Options{Schema: schema})
	if err := second.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// A session listening on the public schema's channel and the shared one.
	other, err := pgx.Connect(ctx, tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close(ctx) })
	for _, c := range []string{outboxpg.NotifyChannel("public"), outboxpg.LegacyNotifyChannel} {
		if _, err := other.Exec(ctx, "LISTEN "+pgx.Identifier{c}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	// The second schema's dispatcher.
	lctx, cancel := context.WithCancel(ctx)
	heard, ready, done, exited := make(chan string, 100), make(chan struct{}), make(chan error, 1), make(chan struct{})
	go func() {
		defer close(exited)
		done <- second.Listen(lctx, func() { close(ready) }, func(topic string) { heard <- topic })
	}()
	t.Cleanup(func() {
		cancel()
		<-exited
	})
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("the listener could not listen: %v", err)
	}

	ordered := func(rs []driver.InsertRow) []driver.InsertRow {
		for i := range rs {
			k := fmt.Sprint("key ", i%2)
			rs[i].OrderingKey = &k
		}
		return rs
	}
	keyed := rows(1, "second", "keyed")
	key := "k"
	keyed[0].DedupeKey = &key
	inserts := []struct {
		topic string
		rows  []driver.InsertRow
	}{
		{"second:keyless", rows(1, "second", "keyless")},
		{"second:keyed", keyed},
		{"second:ordered", ordered(rows(1, "second", "ordered"))},
		{"second:batch", rows(3, "second", "batch")},
		{"second:ordered-batch", ordered(rows(3, "second", "ordered-batch"))},
		{"second:copy", rows(200, "second", "copy")},
	}
	for _, in := range inserts {
		if _, err := second.Insert(ctx, pool, in.rows, []string{in.topic}); err != nil {
			t.Fatalf("%s: %v", in.topic, err)
		}
	}
	// An enqueue of an earlier version, on the shared channel.
	if _, err := pool.Exec(ctx, "SELECT pg_notify($1, 'second:legacy')", outboxpg.LegacyNotifyChannel); err != nil {
		t.Fatal(err)
	}
	if _, err := public.Insert(ctx, pool, rows(1, "public", "marker"), []string{"public:marker"}); err != nil {
		t.Fatal(err)
	}
	if _, err := second.Insert(ctx, pool, rows(1, "second", "marker"), []string{"second:marker"}); err != nil {
		t.Fatal(err)
	}

	var want []string
	for _, in := range inserts {
		want = append(want, in.topic)
	}
	want = append(want, "second:legacy", "second:marker")
	var got []string
	for len(got) == 0 || got[len(got)-1] != "second:marker" {
		select {
		case topic := <-heard:
			got = append(got, topic)
		case err := <-done:
			t.Fatalf("the listener stopped after %q: %v", got, err)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("the second schema's listener heard %q; want %q", got, want)
	}
	// The public schema's listener heard nothing of the second schema's
	// enqueues but the earlier version's, then its own marker.
	if got := heardUntil(t, other, "public:marker"); !slices.Equal(got, []string{"second:legacy", "public:marker"}) {
		t.Errorf("a listener of the public schema heard %q; want only the shared channel's announcement and its own marker", got)
	}
}

// Driver.ListenOn gives the listener a connection of its own settings (a
// direct one to the server, when the pool goes through PgBouncer in
// transaction mode, where LISTEN does not work): it connects with them,
// whatever the pool's settings are.
func TestListenOnItsOwnConnection(t *testing.T) {
	tdb := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	direct := cfg.ConnConfig.Copy()
	direct.RuntimeParams["application_name"] = "modkit-test-direct-listener"
	cfg.ConnConfig.Port = 1 // the pool's own settings reach nothing: only ListenOn's do
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st, err := outboxpg.New(pool).ListenOn(direct).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	ready, done := listening(t, st)
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("the listener could not connect with ListenOn's settings: %v", err)
	case <-time.After(guard):
		t.Fatal("the listener never listened")
	}
	var n int
	if err := tdb.Provider.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE application_name = 'modkit-test-direct-listener' AND query LIKE 'LISTEN%'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("listeners on ListenOn's connection: %d, %v; want 1", n, err)
	}
}

// A listener that hears no one else says so. Behind PgBouncer in
// transaction mode LISTEN registers on a server connection that hands the
// notifications to no one, yet the listener's check, sent on its own
// connection, came back there: it listened deaf for ever, and Health said
// nothing. The check is now sent from the pool. Here the deaf listener's
// connection (ListenOn) is to another database, where the pool's
// notifications never arrive: its check does not come back, and Listen
// ends with ErrListenDeaf. A listener that hears calls wake with the empty
// topic for each check that comes back, and goes on listening.
func TestListenNoticesItHearsNoOneElse(t *testing.T) {
	t.Cleanup(outboxpg.SetListenCheck(100*time.Millisecond, 2*time.Second))
	tdb, other := pgtest.NewDB(t), pgtest.NewDB(t)

	hearing := open(t, tdb.Provider.Pool, driver.Options{})
	lctx, cancel := context.WithCancel(ctx)
	checks, done, exited := make(chan struct{}, 100), make(chan error, 1), make(chan struct{})
	go func() {
		defer close(exited)
		done <- hearing.Listen(lctx, func() {}, func(topic string) {
			if topic == "" {
				select {
				case checks <- struct{}{}:
				default:
				}
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-exited
	})
	for range 3 {
		select {
		case <-checks:
		case err := <-done:
			t.Fatalf("a listener that hears ended: %v", err)
		case <-time.After(guard):
			t.Fatal("a listener that hears reported no check that came back")
		}
	}

	elsewhere, err := pgx.ParseConfig(other.DSN)
	if err != nil {
		t.Fatal(err)
	}
	deaf, err := outboxpg.New(tdb.Provider.Pool).ListenOn(elsewhere).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	ready, deafDone := listening(t, deaf)
	select {
	case <-ready:
	case err := <-deafDone:
		t.Fatalf("the listener could not connect: %v", err)
	}
	select {
	case err := <-deafDone:
		if !errors.Is(err, driver.ErrListenDeaf) || !strings.Contains(err.Error(), "ListenOn") {
			t.Fatalf("a deaf listener ended with %v; want driver.ErrListenDeaf, naming the cure", err)
		}
	case <-time.After(guard):
		t.Fatal("a listener that hears no one else listened on")
	}
}

// A listener whose own connection goes silent while the pool is healthy
// is a dead connection, not a deaf listener: the pool's check does not
// come back, and its own connection does not answer either. It was
// reported deaf, with the advice for PgBouncer, every time.
func TestListenTellsADeadConnectionFromADeafOne(t *testing.T) {
	t.Cleanup(outboxpg.SetListenCheck(100*time.Millisecond, 2*time.Second))
	tdb := pgtest.NewDB(t)
	lc, err := pgx.ParseConfig(tdb.DSN)
	if err != nil {
		t.Fatal(err)
	}
	px := newSilencingProxy(t, lc.Host, lc.Port)
	lc.Host, lc.Port = "127.0.0.1", px.port()
	lc.TLSConfig, lc.Fallbacks = nil, nil
	st, err := outboxpg.New(tdb.Provider.Pool).ListenOn(lc).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	checks, done := listeningForChecks(t, st)
	for range 2 { // the pool's checks come back through the proxy
		select {
		case <-checks:
		case err := <-done:
			t.Fatalf("the listener ended on a live connection: %v", err)
		case <-time.After(guard):
			t.Fatal("no check came back")
		}
	}
	px.silence()
	select {
	case err := <-done:
		if errors.Is(err, driver.ErrListenDeaf) || err == nil || !strings.Contains(err.Error(), "delivered no notification") {
			t.Fatalf("a listener whose connection went silent ended with %v; want a silent connection, not a deaf listener", err)
		}
	case <-time.After(guard):
		t.Fatal("the listener kept waiting on a connection that delivers nothing")
	}
}

// A check the listener sends on its own connection, when the pool cannot
// send it (every connection busy), proves nothing about hearing others:
// it comes back even where no one else's notification would. It was
// reported as heard (wake with the empty topic), which cleared a deaf
// listener's Health report whenever the pool was busy. Here the listener
// is deaf (ListenOn another database) and the pool exhausted: its own
// checks, seen by a watcher there, come back to it unreported.
func TestListenDoesNotCountItsOwnCheck(t *testing.T) {
	t.Cleanup(outboxpg.SetListenCheck(100*time.Millisecond, 2*time.Second))
	tdb, other := pgtest.NewDB(t), pgtest.NewDB(t)
	cfg := tdb.Provider.Pool.Config().Copy()
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	held, err := pool.Acquire(ctx) // the pool cannot send a check
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(held.Release)
	watcher, err := pgx.Connect(ctx, other.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { watcher.Close(ctx) })
	if _, err := watcher.Exec(ctx, "LISTEN "+pgx.Identifier{outboxpg.NotifyChannel("public")}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	elsewhere, err := pgx.ParseConfig(other.DSN)
	if err != nil {
		t.Fatal(err)
	}
	st, err := outboxpg.New(pool).ListenOn(elsewhere).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	checks, done := listeningForChecks(t, st)
	wctx, cancel := context.WithTimeout(ctx, guard)
	defer cancel()
	for seen := 0; seen < 2; {
		n, err := watcher.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("waiting for the listener's own checks: %v", err)
		}
		if strings.HasPrefix(n.Payload, " modkit-outbox listener check ") {
			seen++
		}
	}
	// The second check was sent after the first came back to the listener.
	select {
	case <-checks:
		t.Fatal("the listener reported its own check as heard")
	case err := <-done:
		t.Fatalf("the listener ended: %v", err)
	default:
	}
}

// listeningForChecks runs s.Listen until the test ends and returns a
// channel that receives each check that came back as heard (wake with the
// empty topic) and one that receives what Listen returned.
func listeningForChecks(t *testing.T, s driver.Store) (checks <-chan struct{}, done <-chan error) {
	t.Helper()
	lctx, cancel := context.WithCancel(ctx)
	c, d, exited := make(chan struct{}, 100), make(chan error, 1), make(chan struct{})
	go func() {
		defer close(exited)
		d <- s.Listen(lctx, func() {}, func(topic string) {
			if topic == "" {
				select {
				case c <- struct{}{}:
				default:
				}
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-exited
	})
	return c, d
}
