// Package pgserver starts a throwaway PostgreSQL cluster from the server
// binaries installed on this machine, for tests, the demo and benchmarks.
//
// The cluster lives in a fresh temporary directory, listens on a free
// loopback port only, runs as an unprivileged OS user when the caller is root
// (PostgreSQL refuses to run as root), and is removed by Stop. If the calling
// process dies without calling Stop, the kernel sends the postmaster SIGQUIT
// (an immediate shutdown) and the next Start removes the abandoned directory.
package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNoServerBinaries says that initdb/pg_ctl/postgres were not found.
var ErrNoServerBinaries = errors.New("pgserver: PostgreSQL server binaries (initdb, postgres) not found on PATH or under /usr/lib/postgresql/*/bin: " +
	"install them (Debian/Ubuntu: apt-get install postgresql) or set DATABASE_URL to an existing server")

// Options tune the cluster.
type Options struct {
	// Durable keeps fsync and synchronous_commit on, as a production server
	// has them. Off by default, which makes tests much faster; benchmarks
	// turn it on.
	Durable bool
	// Settings are extra server settings (name -> value), passed as -c flags.
	Settings map[string]string
	// Stderr, if set, receives a line for each start and stop.
	Logf func(format string, args ...any)
}

// Cluster is a running throwaway PostgreSQL server.
type Cluster struct {
	dir     string // temp dir holding data/ and the log
	binDir  string
	port    int
	opts    Options
	cred    *syscall.Credential
	version string

	mu      sync.Mutex
	proc    *os.Process
	exited  chan struct{}
	exitErr error
}

const dirPrefix = "modkit-pg-"

// Start initialises and starts a new cluster. Call Stop to remove it.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	binDir, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	c := &Cluster{binDir: binDir, opts: opts}
	base := os.TempDir()
	if os.Geteuid() == 0 {
		if c.cred, err = unprivilegedUser(); err != nil {
			return nil, err
		}
		if base, err = reachableTempDir(base); err != nil {
			return nil, err
		}
	}
	removeAbandoned(base)
	c.dir, err = os.MkdirTemp(base, dirPrefix)
	if err != nil {
		return nil, fmt.Errorf("pgserver: temp dir: %w", err)
	}
	if err := os.WriteFile(filepath.Join(c.dir, "owner.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		c.removeDir()
		return nil, fmt.Errorf("pgserver: %w", err)
	}
	if c.cred != nil {
		if err := os.Chown(c.dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			c.removeDir()
			return nil, fmt.Errorf("pgserver: chown %s: %w", c.dir, err)
		}
	}
	if err := c.initdb(ctx); err != nil {
		c.removeDir()
		return nil, err
	}
	// A free port can be taken between our probe and the server's bind; try
	// a few.
	for try := 0; ; try++ {
		if c.port, err = freePort(); err != nil {
			c.removeDir()
			return nil, err
		}
		if err = c.start(ctx); err == nil {
			break
		}
		if try == 4 || ctx.Err() != nil {
			c.removeDir()
			return nil, err
		}
	}
	if err := c.closePublicSchema(ctx); err != nil {
		_ = c.Stop()
		return nil, err
	}
	c.logf("pgserver: PostgreSQL %s started on 127.0.0.1:%d (data in %s)", c.version, c.port, c.dir)
	return c, nil
}

// closePublicSchema takes from PUBLIC the right to create objects in the
// public schema of the databases that others are created from and of
// postgres, as PostgreSQL 15 does: on 14 and earlier every role has it,
// and the outbox refuses a schema others may create objects in (see
// migration 0028).
func (c *Cluster) closePublicSchema(ctx context.Context) error {
	for _, db := range []string{"template1", "postgres"} {
		conn, err := pgconn.Connect(ctx, c.DSN(db))
		if err != nil {
			return fmt.Errorf("pgserver: connect to %s: %w", db, err)
		}
		_, err = conn.Exec(ctx, "REVOKE CREATE ON SCHEMA public FROM PUBLIC").ReadAll()
		_ = conn.Close(ctx)
		if err != nil {
			return fmt.Errorf("pgserver: in %s, REVOKE CREATE ON SCHEMA public FROM PUBLIC: %w", db, err)
		}
	}
	return nil
}

// DSN returns the connection URL of database name (the superuser is
// "postgres", trust authentication, loopback only).
func (c *Cluster) DSN(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.port, database)
}

// Port is the TCP port the server listens on.
func (c *Cluster) Port() int { return c.port }

// Version is the server's major version, as initdb reported it.
func (c *Cluster) Version() string { return c.version }

// Stop shuts the server down immediately and removes its directory. It is
// safe to call more than once.
func (c *Cluster) Stop() error {
	err := c.shutdown(syscall.SIGQUIT)
	c.removeDir()
	c.logf("pgserver: stopped cluster on port %d", c.port)
	return err
}

// Restart stops the server the way a crash would (immediate shutdown: no
// checkpoint, clients cut off) and starts it again on the same port, where it
// runs crash recovery.
func (c *Cluster) Restart(ctx context.Context) error {
	if err := c.shutdown(syscall.SIGQUIT); err != nil {
		return err
	}
	return c.start(ctx)
}

// Kill stops the server immediately without restarting it; Start it again
// with Resume.
func (c *Cluster) Kill() error { return c.shutdown(syscall.SIGQUIT) }

// Resume starts a server stopped by Kill.
func (c *Cluster) Resume(ctx context.Context) error { return c.start(ctx) }

func (c *Cluster) logf(format string, args ...any) {
	if c.opts.Logf != nil {
		c.opts.Logf(format, args...)
	}
}

func (c *Cluster) dataDir() string { return filepath.Join(c.dir, "data") }
func (c *Cluster) logFile() string { return filepath.Join(c.dir, "postgres.log") }

func (c *Cluster) command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, name), args...)
	cmd.Dir = c.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "TZ=UTC")
	// A process group of its own: a terminal's Ctrl-C goes to the
	// foreground group, and would shut the server down (SIGINT is its fast
	// shutdown) under the program, which stops gracefully and needs it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Setpgid: true}
	return cmd
}

func (c *Cluster) initdb(ctx context.Context) error {
	cmd := c.command(ctx, "initdb", "-D", c.dataDir(), "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-sync")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("pgserver: initdb failed: %w\n%s", err, out)
	}
	v, err := os.ReadFile(filepath.Join(c.dataDir(), "PG_VERSION"))
	if err != nil {
		return fmt.Errorf("pgserver: read PG_VERSION: %w", err)
	}
	c.version = strings.TrimSpace(string(v))
	return nil
}

func (c *Cluster) settings() []string {
	s := map[string]string{
		"listen_addresses":        "127.0.0.1",
		"port":                    strconv.Itoa(c.port),
		"unix_socket_directories": "",
		"max_connections":         "300",
		"shared_buffers":          "256MB",
		"log_min_messages":        "warning",
		"logging_collector":       "off",
	}
	if !c.opts.Durable {
		s["fsync"] = "off"
		s["synchronous_commit"] = "off"
		s["full_page_writes"] = "off"
	}
	for k, v := range c.opts.Settings {
		s[k] = v
	}
	keys := make([]string, 0, len(s))
	for k := range s {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	args := []string{"-D", c.dataDir()}
	for _, k := range keys {
		args = append(args, "-c", k+"="+s[k])
	}
	return args
}

// start runs the postmaster as our child. Pdeathsig makes the kernel send it
// SIGQUIT if the thread that started it dies, so the thread is locked for the
// life of the server: it is the goroutine below, which waits for the exit.
func (c *Cluster) start(ctx context.Context) error {
	logf, err := os.OpenFile(c.logFile(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("pgserver: open log: %w", err)
	}
	started := make(chan error, 1)
	exited := make(chan struct{})
	var proc *os.Process
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine.
		defer close(exited)
		defer logf.Close()
		cmd := c.command(context.Background(), "postgres", c.settings()...)
		cmd.Stdout, cmd.Stderr = logf, logf
		setDeathSignal(cmd.SysProcAttr, syscall.SIGQUIT)
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("pgserver: start postgres: %w", err)
			return
		}
		proc = cmd.Process
		started <- nil
		err := cmd.Wait()
		c.mu.Lock()
		c.exitErr = err
		c.mu.Unlock()
	}()
	if err := <-started; err != nil {
		return err
	}
	c.mu.Lock()
	c.proc, c.exited = proc, exited
	c.mu.Unlock()
	if err := c.waitReady(ctx, exited); err != nil {
		_ = c.shutdown(syscall.SIGQUIT)
		return err
	}
	return nil
}

func (c *Cluster) waitReady(ctx context.Context, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for delay := 5 * time.Millisecond; ; delay = min(delay*2, 200*time.Millisecond) {
		conn, err := pgconn.Connect(ctx, c.DSN("postgres"))
		if err == nil {
			// Ours, not another server that took the port meanwhile (a
			// restart binds the port it had before).
			res, qerr := conn.Exec(ctx, "SHOW data_directory").ReadAll()
			_ = conn.Close(ctx)
			if qerr != nil {
				return fmt.Errorf("pgserver: the server on port %d: %w", c.port, qerr)
			}
			if len(res) != 1 || len(res[0].Rows) != 1 || string(res[0].Rows[0][0]) != c.dataDir() {
				return fmt.Errorf("pgserver: port %d is answered by another PostgreSQL server, not the one started in %s", c.port, c.dataDir())
			}
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("pgserver: postgres exited during start-up:\n%s", c.logTail())
		case <-ctx.Done():
			return fmt.Errorf("pgserver: postgres did not accept connections: %w (last error: %v)\n%s", ctx.Err(), err, c.logTail())
		case <-time.After(delay):
		}
	}
}

func (c *Cluster) shutdown(sig syscall.Signal) error {
	c.mu.Lock()
	proc, exited := c.proc, c.exited
	c.proc = nil
	c.mu.Unlock()
	if proc == nil {
		return nil
	}
	_ = proc.Signal(sig)
	select {
	case <-exited:
		return nil
	case <-time.After(30 * time.Second):
		_ = proc.Kill()
		<-exited
		return fmt.Errorf("pgserver: postgres did not stop within 30s after %v; killed it", sig)
	}
}

func (c *Cluster) logTail() string {
	b, _ := os.ReadFile(c.logFile())
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(bytes.TrimSpace(b))
}

func (c *Cluster) removeDir() {
	if c.dir != "" {
		_ = os.RemoveAll(c.dir)
	}
}

// FindBinDir finds the directory holding initdb and postgres: next to
// initdb on PATH (following symlinks), else the newest
// /usr/lib/postgresql/N/bin.
func FindBinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			dir := filepath.Dir(real)
			if isFile(filepath.Join(dir, "postgres")) {
				return dir, nil
			}
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
		return vb - va
	})
	for _, d := range dirs {
		if isFile(filepath.Join(d, "initdb")) && isFile(filepath.Join(d, "postgres")) {
			return d, nil
		}
	}
	return "", ErrNoServerBinaries
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}

func unprivilegedUser() (*syscall.Credential, error) {
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, _ := strconv.ParseUint(u.Uid, 10, 32)
		gid, _ := strconv.ParseUint(u.Gid, 10, 32)
		if uid == 0 {
			continue
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
	}
	return nil, errors.New("pgserver: running as root and found neither a postgres nor a nobody user to run the server as: create one (useradd --system postgres)")
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgserver: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// removeAbandoned deletes cluster directories whose owning process is gone
// (it was killed before it could call Stop).
func removeAbandoned(base string) {
	dirs, _ := filepath.Glob(filepath.Join(base, dirPrefix+"*"))
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "owner.pid"))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 {
			continue
		}
		if syscall.Kill(pid, 0) == syscall.ESRCH {
			_ = os.RemoveAll(d)
		}
	}
}

// reachableTempDir returns dir when every directory on its path lets
// others through (the server runs as another user, who must reach its
// cluster's directory), else /tmp when that does: a root-only temp dir
// (libpam-tmpdir's /tmp/user/0, a CI runner's private one) made initdb
// fail with a bare "permission denied".
func reachableTempDir(dir string) (string, error) {
	if othersMayEnter(dir) {
		return dir, nil
	}
	if othersMayEnter("/tmp") {
		return "/tmp", nil
	}
	return "", fmt.Errorf("pgserver: the temp dir %s (and /tmp) is closed to other users, and the server runs as one "+
		"(root may not run it): set TMPDIR to a directory every user may enter", dir)
}

// othersMayEnter reports whether dir and each directory above it are
// searchable by users other than their owner.
func othersMayEnter(dir string) bool {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return false
	}
	for d := abs; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil || !fi.IsDir() || fi.Mode().Perm()&0o001 == 0 {
			return false
		}
		if d == filepath.Dir(d) {
			return true
		}
	}
}
