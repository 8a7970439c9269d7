package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgserver"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// target is the database the benchmark runs in: a dedicated database (or,
// when the role may not create databases, a dedicated schema) created for
// this run and removed afterwards, so that an external server is left as it
// was found.
type target struct {
	// outboxSchema is the schema the phases work in: main, or another one
	// made by addSchema while a workload uses it (see use). Its fields are
	// read through target (t.schema, t.table, …).
	*outboxSchema
	main     *outboxSchema   // the run's own schema: "public" in a dedicated database
	template *pgxpool.Config // pool settings for the benchmark database
	ownDB    bool            // the run has a database of its own (not just a schema)
	server   string          // human description of the server
	admin    *pgxpool.Pool   // setup, preloads and measurements; never timed against
	log      *slog.Logger
	cleanup  []func() // run in reverse order by close
}

// outboxSchema is one schema of the run holding the outbox's tables.
type outboxSchema struct {
	schema   string
	table    pgx.Identifier // the outbox table, schema-qualified
	leaders  pgx.Identifier // the maintenance leases (migration 0002), schema-qualified
	attempts pgx.Identifier // the attempts ledger (migration 0004), schema-qualified
	migrator *db.Migrator
	// history is how many delivered rows of eventSource.history the table
	// holds besides the events of the current phase (see
	// bench.prepareDrain); 0 after truncate and freshTable.
	history int
}

// newOutboxSchema names the outbox tables of schema and builds its
// migrator; it does not touch the database.
func (t *target) newOutboxSchema(schema string) (*outboxSchema, error) {
	m, err := db.NewMigrator(t.admin, db.MigratorConfig{Schema: schema, Logger: quietLogger()})
	if err != nil {
		return nil, err
	}
	return &outboxSchema{schema: schema, migrator: m,
		table: pgx.Identifier{schema, outboxpg.TableName}, leaders: pgx.Identifier{schema, outboxpg.LeadersTableName},
		attempts: pgx.Identifier{schema, "modkit_outbox_attempts"}}, nil
}

// addSchema creates a second outbox schema for the run, named after the
// run's own with suffix, migrated and empty, and returns it with a function
// that drops it again. Switch to it with use.
func (t *target) addSchema(ctx context.Context, suffix string) (*outboxSchema, func(), error) {
	name := "modkit_bench_" + suffix
	if !t.ownDB { // the run lives in a schema of a shared database
		name = t.main.schema + "_" + suffix
	}
	s, err := t.newOutboxSchema(name)
	if err != nil {
		return nil, nil, err
	}
	drop := func() {
		if _, err := t.admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.log.Warn("could not drop a schema of the run", "schema", name, "error", err)
		}
	}
	if _, err := s.migrator.Up(ctx); err != nil {
		drop()
		return nil, nil, fmt.Errorf("migrate schema %s: %w", name, err)
	}
	return s, drop, nil
}

// use makes s the schema the following phases work in.
func (t *target) use(s *outboxSchema) { t.outboxSchema = s }

// openTarget starts a throwaway durable cluster when dsn is empty, or uses
// the server in dsn, and creates the run's database (or schema) there.
func openTarget(ctx context.Context, dsn string, log *slog.Logger) (t *target, err error) {
	t = &target{log: log}
	defer func() {
		if err != nil {
			t.close()
		}
	}()
	if dsn == "" {
		log.Info("starting a throwaway PostgreSQL cluster (durable: fsync and synchronous_commit on)")
		cluster, err := pgserver.Start(ctx, pgserver.Options{Durable: true})
		if err != nil {
			return t, err
		}
		t.cleanup = append(t.cleanup, func() {
			if err := cluster.Stop(); err != nil {
				log.Warn("stopping the cluster", "error", err)
			}
		})
		dsn = cluster.DSN("postgres")
		t.server = "throwaway durable cluster (internal/pgserver), port " + fmt.Sprint(cluster.Port())
	}
	base, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return t, fmt.Errorf("parse DSN: %w", err)
	}
	if t.server == "" {
		c := base.ConnConfig
		t.server = fmt.Sprintf("external server %s:%d (database %s)", c.Host, c.Port, c.Database)
	}
	schema, err := t.createRunDatabase(ctx, base)
	if err != nil {
		return t, err
	}
	if t.admin, err = pgxpool.NewWithConfig(ctx, t.newPoolConfig(poolSpec{maxConns: 4})); err != nil {
		return t, fmt.Errorf("open pool: %w", err)
	}
	t.cleanup = append(t.cleanup, t.admin.Close)
	if err := t.admin.Ping(ctx); err != nil {
		return t, fmt.Errorf("connect to the benchmark database: %w", err)
	}
	if t.main, err = t.newOutboxSchema(schema); err != nil {
		return t, err
	}
	t.use(t.main)
	return t, nil
}

// createRunDatabase creates a database named for this run on the server of
// base and points t.template at it; if the role may not create databases it
// creates a schema in base's database instead and sets the search_path. It
// returns the schema the outbox tables go in.
func (t *target) createRunDatabase(ctx context.Context, base *pgxpool.Config) (schema string, err error) {
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	name := fmt.Sprintf("modkit_bench_%d_%s", os.Getpid(), hex.EncodeToString(suffix))
	conn, err := pgx.ConnectConfig(ctx, base.ConnConfig.Copy())
	if err != nil {
		return "", fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	t.template = base.Copy()
	t.template.MaxConnIdleTime = time.Hour // keep connections across phases; pool churn is not what we measure
	ident := pgx.Identifier{name}.Sanitize()
	_, err = conn.Exec(ctx, "CREATE DATABASE "+ident)
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		t.template.ConnConfig.Database = name
		schema, t.ownDB = "public", true
		t.cleanup = append(t.cleanup, func() { t.dropRunObject(base, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)") })
		t.server += ", run database " + name
	case errors.As(err, &pgErr) && pgErr.Code == "42501": // insufficient_privilege
		if _, err := conn.Exec(ctx, "CREATE SCHEMA "+ident); err != nil {
			return "", fmt.Errorf("the role can create neither a database nor a schema for the run: %w", err)
		}
		t.template.ConnConfig.RuntimeParams["search_path"] = name
		schema = name
		t.cleanup = append(t.cleanup, func() { t.dropRunObject(base, "DROP SCHEMA IF EXISTS "+ident+" CASCADE") })
		t.server += ", run schema " + name
	default:
		return "", fmt.Errorf("create the run database: %w", err)
	}
	return schema, nil
}

// dropRunObject runs the statement that removes the run's database or
// schema, on a fresh connection (the run's pools are closed by then) and
// with a context of its own, so that it also runs after an interrupt.
func (t *target) dropRunObject(base *pgxpool.Config, stmt string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, base.ConnConfig.Copy())
	if err == nil {
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, stmt)
	}
	if err != nil {
		t.log.Warn("could not remove the run's objects; remove them by hand", "statement", stmt, "error", err)
	}
}

// close removes everything the run created, newest first.
func (t *target) close() {
	for i := len(t.cleanup) - 1; i >= 0; i-- {
		t.cleanup[i]()
	}
	t.cleanup = nil
}

// poolSpec says how to open a pool on the run's database.
type poolSpec struct {
	// maxConns 0 keeps pgx's default (the larger of 4 and the CPU count).
	maxConns int32
	// tracer, if set, sees every statement of the pool's connections; a
	// *queryCounter also counts the liveness pings the pool sends.
	tracer pgx.QueryTracer
	// warm connections are opened before the pool is returned, so that
	// connection set-up stays out of the timed part.
	warm int
	// settings are session settings (name -> value) of every connection.
	settings map[string]string
}

// newPoolConfig returns the pool configuration for spec.
func (t *target) newPoolConfig(spec poolSpec) *pgxpool.Config {
	cfg := t.template.Copy()
	if spec.maxConns > 0 {
		cfg.MaxConns = spec.maxConns
	}
	for k, v := range spec.settings {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	if spec.tracer != nil {
		cfg.ConnConfig.Tracer = spec.tracer
	}
	if counter, ok := spec.tracer.(*queryCounter); ok {
		cfg.ShouldPing = func(_ context.Context, p pgxpool.ShouldPingParams) bool {
			// pgxpool's default rule, counted.
			if p.IdleDuration > time.Second {
				counter.pings.Add(1)
				return true
			}
			return false
		}
	}
	return cfg
}

// newPool opens a pool on the run's database as spec says.
func (t *target) newPool(ctx context.Context, spec poolSpec) (*pgxpool.Pool, error) {
	pool, err := pgxpool.NewWithConfig(ctx, t.newPoolConfig(spec))
	if err != nil {
		return nil, err
	}
	conns := make([]*pgxpool.Conn, 0, spec.warm)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range spec.warm {
		c, err := pool.Acquire(ctx)
		if err != nil {
			pool.Close()
			return nil, err
		}
		conns = append(conns, c)
	}
	return pool, nil
}

// freshTable gives a workload an outbox table of its own: every migration is
// reverted (newest first: the leaders table of 0002, then the events table
// of 0001) and applied again with db.Migrator, so each workload starts from
// empty, newly created tables and indexes, with no bloat, statistics or
// maintenance leases left by the previous one.
func (t *target) freshTable(ctx context.Context) error {
	t.history = 0
	if _, err := t.migrator.Down(ctx, len(t.migrator.Migrations())); err != nil {
		return fmt.Errorf("revert migrations: %w", err)
	}
	if _, err := t.migrator.Up(ctx); err != nil {
		return fmt.Errorf("run migrations: %w", err)
	}
	return nil
}

// truncate empties the outbox table between the phases of one workload,
// and the maintenance leases with it, so that every phase's dispatcher is
// elected for maintenance at once as a first dispatcher would be (a
// stopped dispatcher resigns its leases, but one that failed to would
// otherwise keep the next out of maintenance until the lease expired).
// The attempts ledger is emptied too when the run's role may switch its
// append-only triggers off for its transaction (session_replication_role,
// a superuser's); otherwise it keeps growing, and settle vacuums it.
func (t *target) truncate(ctx context.Context) error {
	t.history = 0
	err := pgx.BeginFunc(ctx, t.admin, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL session_replication_role = replica"); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "TRUNCATE "+t.table.Sanitize()+", "+t.leaders.Sanitize()+", "+t.attempts.Sanitize())
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" { // not a superuser: the ledger stays
		_, err = t.admin.Exec(ctx, "TRUNCATE "+t.table.Sanitize()+", "+t.leaders.Sanitize())
	}
	return err
}

// settle prepares a timed phase: VACUUM (ANALYZE) of the outbox table and
// the attempts ledger, so that no autovacuum of the preload (or of the
// ledger rows earlier phases wrote) runs during the measurement and the
// planner has statistics, then CHECKPOINT so that every phase starts with
// the same full-page-write debt. CHECKPOINT needs superuser or pg_checkpoint; without it the phase
// runs anyway.
func (t *target) settle(ctx context.Context) error {
	for _, table := range []pgx.Identifier{t.table, t.attempts} {
		if _, err := t.admin.Exec(ctx, "VACUUM (ANALYZE) "+table.Sanitize()); err != nil {
			return fmt.Errorf("vacuum: %w", err)
		}
	}
	if _, err := t.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			return fmt.Errorf("checkpoint: %w", err)
		}
	}
	return nil
}

// countStatus counts the outbox rows in one status.
func (t *target) countStatus(ctx context.Context, status outbox.Status) (int, error) {
	var n int
	err := t.admin.QueryRow(ctx, "SELECT count(*) FROM "+t.table.Sanitize()+" WHERE status = $1", string(status)).Scan(&n)
	return n, err
}

// machineInfo describes the client machine.
func machineInfo() map[string]string {
	info := map[string]string{
		"cpus":       fmt.Sprint(runtime.NumCPU()),
		"gomaxprocs": fmt.Sprint(runtime.GOMAXPROCS(0)),
		"go":         runtime.Version(),
		"os_arch":    runtime.GOOS + "/" + runtime.GOARCH,
		"load_start": loadAverage(),
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.Lines(string(b)) {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				info["cpu_model"] = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				var kb float64
				if _, err := fmt.Sscanf(strings.TrimSpace(v), "%f kB", &kb); err == nil {
					info["memory"] = fmt.Sprintf("%.1f GiB", kb/(1<<20))
				}
				break
			}
		}
	}
	return info
}

// loadAverage is the 1-minute load average, to flag runs that shared the
// machine with other work.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(b))[0]
}

// serverSettings are the PostgreSQL settings that shape the figures.
var serverSettings = []string{
	"shared_buffers", "synchronous_commit", "fsync", "full_page_writes", "wal_sync_method",
	"commit_delay", "max_wal_size", "checkpoint_timeout", "max_connections", "work_mem",
	"autovacuum", "jit",
}

// postgresInfo reads the server version and the settings in serverSettings.
func (t *target) postgresInfo(ctx context.Context) (version string, settings map[string]string, err error) {
	if err := t.admin.QueryRow(ctx, "SHOW server_version").Scan(&version); err != nil {
		return "", nil, err
	}
	rows, err := t.admin.Query(ctx, `SELECT name, setting, unit FROM pg_settings WHERE name = ANY($1)`, serverSettings)
	if err != nil {
		return "", nil, err
	}
	settings = map[string]string{}
	for rows.Next() {
		var name, setting string
		var unit *string
		if err := rows.Scan(&name, &setting, &unit); err != nil {
			return "", nil, err
		}
		settings[name] = formatSetting(setting, unit)
	}
	return version, settings, rows.Err()
}

// formatSetting renders a pg_settings value with its unit the way SHOW
// does for the common cases (8kB pages, kB, MB, s, ms).
func formatSetting(setting string, unit *string) string {
	if unit == nil {
		return setting
	}
	var n int64
	if _, err := fmt.Sscan(setting, &n); err != nil {
		return setting + *unit
	}
	switch *unit {
	case "8kB":
		n *= 8
		fallthrough
	case "kB":
		switch {
		case n >= 1<<20 && n%(1<<20) == 0:
			return fmt.Sprintf("%dGB", n>>20)
		case n >= 1<<10 && n%(1<<10) == 0:
			return fmt.Sprintf("%dMB", n>>10)
		}
		return fmt.Sprintf("%dkB", n)
	case "MB":
		if n >= 1<<10 && n%(1<<10) == 0 {
			return fmt.Sprintf("%dGB", n>>10)
		}
		return fmt.Sprintf("%dMB", n)
	}
	return setting + *unit
}
