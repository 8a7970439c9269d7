package db

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"maps"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/migrations"
)

// MigrationsTable is the table, in the migrated schema, that records which
// migrations have run.
const MigrationsTable = "modkit_schema_migrations"

// SchemaDefault is the schema a Migrator targets when none is configured.
const SchemaDefault = "public"

// ErrMigrationConflict: the migrations table does not match the migration
// set: it records a version under another name (two sets share one table:
// give each its own MigratorConfig.Table), or, for Down, a version newer
// than the set knows (the database was migrated by a newer program, which
// must revert its own migrations first). Nothing is applied or reverted.
var ErrMigrationConflict = errors.New("modkit/db: the migrations table does not match this migration set")

// ErrTransactionInMigration: a migration file ended the transaction the
// Migrator runs it in (a COMMIT or ROLLBACK in the file, with or without
// AND CHAIN). What ran before that statement is committed (or, for a
// ROLLBACK, undone), what ran after it outside a transaction of the
// Migrator's ran outside Schema's search_path, and the migration is not
// recorded: remove the transaction control from the file, repair the
// schema by hand, and migrate again.
var ErrTransactionInMigration = errors.New("modkit/db: the migration file ended the migrator's transaction (a COMMIT or ROLLBACK in it)")

// ErrUnknownVersion is returned by UpTo for a version that is not one of
// the set's migrations.
var ErrUnknownVersion = errors.New("modkit/db: no such migration version")

// ErrInvalidSchema is returned for a schema (or table) name that is not a
// plain PostgreSQL identifier.
var ErrInvalidSchema = errors.New("modkit/db: invalid schema or table name: use 1-63 letters, digits or underscores, not starting with a digit or pg_")

var schemaPattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// ValidateSchema reports whether name can be used as a schema name. Names are
// always quoted in SQL too; the pattern keeps them portable and readable.
// The prefix pg_ is refused: PostgreSQL reserves it for system schemas.
func ValidateSchema(name string) error {
	if !schemaPattern.MatchString(name) || strings.HasPrefix(name, "pg_") {
		return fmt.Errorf("%w (got %q)", ErrInvalidSchema, name)
	}
	return nil
}

// MigratorConfig configures a Migrator. The zero value migrates the embedded
// modkit migrations into the public schema.
type MigratorConfig struct {
	// Schema to migrate; created if missing. Default SchemaDefault.
	Schema string
	// FS holds NNNN_name.up.sql / NNNN_name.down.sql files at its root.
	// Default migrations.FS. Each file runs in a transaction of the
	// Migrator's, with the version's tracking row, and must not control
	// transactions itself (BEGIN … COMMIT, as some tools want: see
	// ErrTransactionInMigration). It runs with search_path set to Schema
	// alone: qualify objects of other schemas (an extension's types in
	// public, say) with their schema's name. Session settings a file
	// changes (SET, set_config, as pg_dump's output does) end with the
	// Migrator's connection, which is closed afterwards rather than given
	// back to the pool.
	FS fs.FS
	// Logger receives one line per migration applied or reverted. Default
	// slog.Default().
	Logger *slog.Logger
	// Table records the applied versions of this set of migrations.
	// Default MigrationsTable. Give each independent set (an application's
	// own tables, say) a table of its own so versions do not collide. A
	// table records versions and names only, so a Migrator can tell
	// another set's versions from its own by name alone: one that finds a
	// version of its set recorded under another name fails with
	// ErrMigrationConflict, as does a Down that finds a version newer than
	// its set's newest. Two sets whose versions share names (0001_init in
	// both), or never overlap, are not told apart: each would take the
	// other's rows for its own, or leave them alone.
	Table string
}

// Migration is one versioned pair of SQL files.
type Migration struct {
	Version int64  // the file names' number: 7 for 0007_name.up.sql
	Name    string // the file names' name: "name" for 0007_name.up.sql
	up      string
	down    string
}

// MigrationStatus tells whether one migration has run.
type MigrationStatus struct {
	Version   int64     // as Migration.Version
	Name      string    // as Migration.Name
	Applied   bool      // recorded in the migrations table
	AppliedAt time.Time // when it was recorded; zero when not applied
	// Unknown marks a migration the migrations table records but the set
	// does not have: one newer than the set's newest, applied by a newer
	// program (Up leaves it alone, Down refuses to go past it). Its Name
	// is the one recorded, and Applied is true.
	Unknown bool
}

// Migrator applies and reverts the versioned SQL files in a schema. Every
// migration runs in its own transaction together with its tracking row,
// holding a PostgreSQL advisory lock per schema, and which migration that
// is gets decided under the lock, from the migrations table read there: so
// concurrent migrators (two replicas starting at once, sets sharing the
// schema) take turns one migration at a time, each migration runs exactly
// once, in version order, and an Up and a Down at once leave the applied
// migrations a prefix of the set. A transaction's lock works through a
// pooler in transaction mode (PgBouncer's) too.
type Migrator struct {
	pool       *pgxpool.Pool
	schema     string
	tableName  string
	migrations []Migration
	logger     *slog.Logger
}

var migrationFile = regexp.MustCompile(`^(\d+)_([A-Za-z0-9_]+)\.(up|down)\.sql$`)

// NewMigrator reads and checks the migration files; it does not touch the
// database.
func NewMigrator(pool *pgxpool.Pool, cfg MigratorConfig) (*Migrator, error) {
	if pool == nil {
		return nil, errors.New("modkit/db: NewMigrator needs a pool: pass the *pgxpool.Pool, for example Provider.Pool")
	}
	if cfg.Schema == "" {
		cfg.Schema = SchemaDefault
	}
	if err := ValidateSchema(cfg.Schema); err != nil {
		return nil, err
	}
	if cfg.FS == nil {
		cfg.FS = migrations.FS
	}
	if cfg.Table == "" {
		cfg.Table = MigrationsTable
	}
	if err := ValidateSchema(cfg.Table); err != nil {
		return nil, fmt.Errorf("modkit/db: MigratorConfig.Table: %w", err)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ms, err := readMigrations(cfg.FS)
	if err != nil {
		return nil, err
	}
	return &Migrator{pool: pool, schema: cfg.Schema, tableName: cfg.Table, migrations: ms, logger: cfg.Logger}, nil
}

func readMigrations(fsys fs.FS) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("modkit/db: read migrations: %w", err)
	}
	byVersion := map[int64]*Migration{}
	files := map[string]string{} // "version.up" or "version.down": its file's name
	for _, e := range entries {
		if e.IsDir() || path.Ext(e.Name()) != ".sql" {
			continue
		}
		m := migrationFile.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("modkit/db: migration file %q: name it NNNN_name.up.sql or NNNN_name.down.sql", e.Name())
		}
		version, err := strconv.ParseInt(m[1], 10, 64)
		if err != nil || version <= 0 {
			return nil, fmt.Errorf("modkit/db: migration file %q: the version must be a positive number below 2^63 "+
				"(at most 19 digits; a timestamp such as 20260102150405 fits)", e.Name())
		}
		body, err := fs.ReadFile(fsys, e.Name())
		if err != nil {
			return nil, fmt.Errorf("modkit/db: read %s: %w", e.Name(), err)
		}
		mig := byVersion[version]
		if mig == nil {
			mig = &Migration{Version: version, Name: m[2]}
			byVersion[version] = mig
		} else if mig.Name != m[2] {
			return nil, fmt.Errorf("modkit/db: migration %d has two names, %q and %q", version, mig.Name, m[2])
		}
		// 0001_x.up.sql and 1_x.up.sql are one version: one would
		// silently replace the other.
		part := fmt.Sprintf("%d.%s", version, m[3])
		if other, ok := files[part]; ok {
			return nil, fmt.Errorf("modkit/db: migration %d has two .%s.sql files, %q and %q", version, m[3], other, e.Name())
		}
		files[part] = e.Name()
		if m[3] == "up" {
			mig.up = string(body)
		} else {
			mig.down = string(body)
		}
	}
	if len(byVersion) == 0 {
		return nil, errors.New("modkit/db: no migrations: no NNNN_name.up.sql / .down.sql files at the root of the FS " +
			"(for files in a directory of an embed.FS, pass fs.Sub(fsys, \"dir\"))")
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		// An empty file is a migration that does nothing.
		if _, ok := files[fmt.Sprintf("%d.up", m.Version)]; !ok {
			return nil, fmt.Errorf("modkit/db: migration %04d_%s has no .up.sql file", m.Version, m.Name)
		}
		if _, ok := files[fmt.Sprintf("%d.down", m.Version)]; !ok {
			return nil, fmt.Errorf("modkit/db: migration %04d_%s has no .down.sql file", m.Version, m.Name)
		}
		out = append(out, *m)
	}
	slices.SortFunc(out, func(a, b Migration) int { return cmp.Compare(a.Version, b.Version) })
	return out, nil
}

// Migrations lists the known migrations in version order.
func (m *Migrator) Migrations() []Migration { return slices.Clone(m.migrations) }

// ReadMigrations reads and checks the NNNN_name.up.sql / .down.sql pairs at
// the root of fsys (migrations.FS for modkit's own), in version order,
// without a database: tools use it to print or convert the migrations.
func ReadMigrations(fsys fs.FS) ([]Migration, error) { return readMigrations(fsys) }

// UpSQL is the text of the migration's .up.sql file.
func (m Migration) UpSQL() string { return m.up }

// DownSQL is the text of the migration's .down.sql file.
func (m Migration) DownSQL() string { return m.down }

// Up applies every migration not yet applied, in version order, and returns
// the ones it applied. Running it again applies nothing. Migrations the
// table records that are newer than the set's newest (a newer program
// applied them) are left alone; Up logs them at Info, and Status lists
// them as Unknown.
func (m *Migrator) Up(ctx context.Context) ([]Migration, error) {
	return m.UpTo(ctx, m.migrations[len(m.migrations)-1].Version)
}

// UpTo is Up that stops after version, which must be a version of the set
// (ErrUnknownVersion otherwise, and nothing is applied): the migrations up
// to it not yet applied are applied, in version order, and the later ones
// are left for another call. It lets a deploy apply a migration that
// locks a large table at a time of its choosing.
func (m *Migrator) UpTo(ctx context.Context, version int64) ([]Migration, error) {
	if !slices.ContainsFunc(m.migrations, func(mig Migration) bool { return mig.Version == version }) {
		return nil, fmt.Errorf("%w: %04d is not a migration of this set (%04d_%s to %04d_%s)", ErrUnknownVersion, version,
			m.migrations[0].Version, m.migrations[0].Name, m.migrations[len(m.migrations)-1].Version, m.migrations[len(m.migrations)-1].Name)
	}
	var applied []Migration
	err := m.locked(ctx, true, func(conn *pgx.Conn) error {
		done, err := m.appliedVersions(ctx, conn)
		if err != nil {
			return err
		}
		if err := m.checkRecorded(done, false); err != nil {
			return err
		}
		if newer := m.newer(done); len(newer) > 0 {
			last, ours := newer[len(newer)-1], m.migrations[len(m.migrations)-1]
			m.logger.Info("the schema has migrations newer than this program's, applied by a newer version; left alone",
				"schema", m.schema, "newest_recorded", fmt.Sprintf("%04d_%s", last.Version, last.Name),
				"newest_known", fmt.Sprintf("%04d_%s", ours.Version, ours.Name), "count", len(newer))
		}
		mine := map[int64]bool{}
		for {
			mig, ok, err := m.step(ctx, conn, true, mine, version)
			if err != nil || !ok {
				return err
			}
			mine[mig.Version] = true
			applied = append(applied, mig)
		}
	})
	return applied, err
}

// Down reverts the last steps applied migrations, newest first, and returns
// the ones it reverted. steps must be positive; asking for more than are
// applied reverts them all. It refuses (ErrMigrationConflict) when the
// database has a migration applied that is newer than the set's newest,
// checked again before each step: an Up of a newer program running at the
// same time may apply one.
func (m *Migrator) Down(ctx context.Context, steps int) ([]Migration, error) {
	if steps <= 0 {
		return nil, fmt.Errorf("modkit/db: Down needs a positive number of steps (got %d)", steps)
	}
	var reverted []Migration
	err := m.locked(ctx, false, func(conn *pgx.Conn) error {
		done, err := m.appliedVersions(ctx, conn)
		if err != nil {
			return err
		}
		if err := m.checkRecorded(done, true); err != nil {
			return err
		}
		for len(reverted) < steps {
			mig, ok, err := m.step(ctx, conn, false, nil, 0)
			if err != nil || !ok {
				return err
			}
			reverted = append(reverted, mig)
		}
		return nil
	})
	return reverted, err
}

// Status reports every known migration and whether it has been applied,
// in version order, followed by the migrations the table records that are
// newer than the set's newest (Unknown: a newer program applied them).
func (m *Migrator) Status(ctx context.Context) ([]MigrationStatus, error) {
	var out []MigrationStatus
	err := m.withConn(ctx, func(conn *pgx.Conn) error {
		done, err := m.appliedVersions(ctx, conn)
		if err != nil {
			return err
		}
		if err := m.checkRecorded(done, false); err != nil {
			return err
		}
		for _, mig := range m.migrations {
			rec, ok := done[mig.Version]
			out = append(out, MigrationStatus{Version: mig.Version, Name: mig.Name, Applied: ok, AppliedAt: rec.at})
		}
		out = append(out, m.newer(done)...)
		return nil
	})
	return out, err
}

func (m *Migrator) table() string {
	return pgx.Identifier{m.schema, m.tableName}.Sanitize()
}

// lockKey is the advisory lock of the migrated schema: one per schema, not
// per migrations table, so that sets of migrations sharing a schema (the
// outbox's and an application's) take turns too, and never race to create
// it (two CREATE SCHEMA IF NOT EXISTS at once can fail one with a unique
// violation).
func (m *Migrator) lockKey() int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("modkit/db migrate " + m.schema))
	return int64(h.Sum64())
}

func (m *Migrator) withConn(ctx context.Context, fn func(conn *pgx.Conn) error) error {
	c, err := m.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("modkit/db: migrate: acquire connection: %w", err)
	}
	defer c.Release()
	return fn(c.Conn())
}

// withOwnConn runs fn on a connection taken out of the pool and closed
// afterwards: a migration file may change its session (SET search_path,
// SET lock_timeout, set_config(…, false), as pg_dump's output does), and
// the application's queries must not inherit that on a pooled connection.
// (Behind a pooler in transaction mode the server connection goes on to
// other clients all the same: there, files must change only their
// transaction, SET LOCAL; see the README's Behind PgBouncer.)
func (m *Migrator) withOwnConn(ctx context.Context, fn func(conn *pgx.Conn) error) error {
	c, err := m.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("modkit/db: migrate: acquire connection: %w", err)
	}
	conn := c.Hijack()
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	return fn(conn)
}

// locked runs fn on a connection of its own (withOwnConn: closed
// afterwards, not given back to the pool), creating the schema and the
// migrations table first when create is set (Up; a Down has nothing to
// revert in a schema that has neither). The schema's advisory lock is
// taken by each transaction that changes the schema (lockTx): this one,
// and each migration's (step). It is a transaction's lock, not a
// session's, so that a pooler in transaction mode (PgBouncer's), which
// may run each transaction on another server connection, keeps it and
// its release on one: a session's lock was released on another server
// connection than the one that held it, and stayed held.
func (m *Migrator) locked(ctx context.Context, create bool, fn func(conn *pgx.Conn) error) error {
	return m.withOwnConn(ctx, func(conn *pgx.Conn) error {
		// Each is created only when missing: PostgreSQL checks the right
		// to create before IF NOT EXISTS, so a role that may use an
		// existing schema, but not create schemas in the database (no
		// role but the owner may, by default), could not migrate.
		schema := pgx.Identifier{m.schema}.Sanitize()
		exist := func(q querier) (schemaExists, tableExists bool, err error) {
			err = q.QueryRow(ctx, "SELECT to_regnamespace($1) IS NOT NULL, to_regclass($2) IS NOT NULL", schema, m.table()).
				Scan(&schemaExists, &tableExists)
			if err != nil {
				err = fmt.Errorf("modkit/db: migrate: look up %s: %w", m.table(), err)
			}
			return schemaExists, tableExists, err
		}
		if !create {
			return fn(conn)
		}
		schemaExists, tableExists, err := exist(conn)
		if err != nil {
			return err
		}
		if schemaExists && tableExists {
			return fn(conn) // the usual case: nothing to create, no lock to wait for
		}
		err = InTx(ctx, conn, func(ctx context.Context, tx pgx.Tx) error {
			if err := m.lockTx(ctx, tx); err != nil {
				return err
			}
			schemaExists, tableExists, err := exist(tx)
			if err != nil {
				return err
			}
			if !schemaExists {
				if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+schema); err != nil {
					return fmt.Errorf("modkit/db: migrate: create schema %s: %w", schema, err)
				}
			}
			if !tableExists {
				if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+m.table()+
					" (version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"); err != nil {
					return fmt.Errorf("modkit/db: migrate: create %s: %w", m.table(), err)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		return fn(conn)
	})
}

// lockTx takes the schema's advisory lock for the rest of tx: migrators of
// the schema (two replicas starting at once, or sets sharing the schema)
// change it one transaction at a time.
func (m *Migrator) lockTx(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", m.lockKey()); err != nil {
		return fmt.Errorf("modkit/db: migrate: take advisory lock: %w", err)
	}
	return nil
}

// atLine adds to err, a file's failure, the line and column of the file
// where the server found the error, when it says (PgError.Position counts
// characters from 1).
func atLine(body string, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Position <= 0 {
		return err
	}
	line, col, n := 1, 1, int32(1)
	for _, r := range body {
		if n == pgErr.Position {
			return fmt.Errorf("at line %d, column %d of the file: %w", line, col, err)
		}
		n++
		if r == '\n' {
			line, col = line+1, 1
		} else {
			col++
		}
	}
	return err
}

// recorded is a row of the migrations table.
type recorded struct {
	name string
	at   time.Time
}

// querier is what the migrator reads with: a connection or a
// transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func (m *Migrator) appliedVersions(ctx context.Context, conn querier) (map[int64]recorded, error) {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", m.table()).Scan(&exists); err != nil {
		return nil, fmt.Errorf("modkit/db: migrate: look up %s: %w", m.table(), err)
	}
	done := map[int64]recorded{}
	if !exists {
		return done, nil
	}
	rows, err := conn.Query(ctx, "SELECT version, name, applied_at FROM "+m.table())
	if err != nil {
		return nil, fmt.Errorf("modkit/db: migrate: read %s: %w", m.table(), err)
	}
	var v int64
	var r recorded
	_, err = pgx.ForEachRow(rows, []any{&v, &r.name, &r.at}, func() error { done[v] = r; return nil })
	if err != nil {
		return nil, fmt.Errorf("modkit/db: migrate: read %s: %w", m.table(), err)
	}
	return done, nil
}

// newer returns, in version order, the recorded migrations newer than the
// set's newest (a set has at least one migration: NewMigrator refuses an
// empty one).
func (m *Migrator) newer(done map[int64]recorded) []MigrationStatus {
	var out []MigrationStatus
	for _, v := range slices.Sorted(maps.Keys(done)) {
		if v > m.migrations[len(m.migrations)-1].Version {
			out = append(out, MigrationStatus{Version: v, Name: done[v].name, Applied: true, AppliedAt: done[v].at, Unknown: true})
		}
	}
	return out
}

// checkRecorded checks the migrations table against the set: every version
// it records that the set knows has the set's name, and, for a Down
// (newest), none is newer than the set's newest.
func (m *Migrator) checkRecorded(done map[int64]recorded, newest bool) error {
	known := make(map[int64]string, len(m.migrations))
	for _, mig := range m.migrations {
		known[mig.Version] = mig.Name
	}
	versions := slices.Sorted(maps.Keys(done))
	for _, v := range versions {
		if name, ok := known[v]; ok && name != done[v].name {
			return fmt.Errorf("%w: %s records %04d_%s, but this set's %04d is %s: does another set of migrations use "+
				"this table? give each set its own MigratorConfig.Table", ErrMigrationConflict, m.table(), v, done[v].name, v, name)
		}
	}
	if newest && len(versions) > 0 && len(m.migrations) > 0 {
		if last, ours := versions[len(versions)-1], m.migrations[len(m.migrations)-1]; last > ours.Version {
			return fmt.Errorf("%w: %s records %04d_%s, newer than this set's newest (%04d_%s): revert it with the "+
				"program that applied it first", ErrMigrationConflict, m.table(), last, done[last].name, ours.Version, ours.Name)
		}
	}
	return nil
}

// step applies (up) or reverts one migration in a transaction of its own,
// holding the schema's advisory lock, and returns it: what it does is
// decided under the lock, from the migrations table read again there, as
// another migrator may have changed it meanwhile. Up applies the set's
// lowest version not applied (unless it is in mine, the ones this Up
// applied already, which a Down meanwhile reverted: then it stops), Down
// reverts its newest applied and refuses when the table records a newer
// one (checkRecorded); ok is false when there is nothing to do, or when
// Up's next migration is newer than upTo. A plan made from an earlier read
// could leave a gap: a Down reverting 2 after an Up applied 3.
func (m *Migrator) step(ctx context.Context, conn *pgx.Conn, up bool, mine map[int64]bool, upTo int64) (mig Migration, ok bool, err error) {
	var applyErr error
	err = InTx(ctx, conn, func(ctx context.Context, tx pgx.Tx) error {
		if err := m.lockTx(ctx, tx); err != nil {
			return err
		}
		done, err := m.appliedVersions(ctx, tx)
		if err != nil {
			return err
		}
		if err := m.checkRecorded(done, !up); err != nil {
			return err
		}
		for i := range m.migrations {
			cand := m.migrations[i]
			if !up {
				cand = m.migrations[len(m.migrations)-1-i]
			}
			if _, applied := done[cand.Version]; applied != up {
				mig, ok = cand, !mine[cand.Version] && (!up || cand.Version <= upTo)
				break
			}
		}
		if !ok {
			return nil
		}
		applyErr = m.apply(ctx, tx, mig, up)
		return applyErr
	})
	direction := "up"
	if !up {
		direction = "down"
	}
	switch {
	case applyErr != nil && errors.Is(err, ErrTransactionInMigration):
		return mig, false, fmt.Errorf("modkit/db: migration %04d_%s (%s) in schema %s was not recorded and may be partly applied: %w; "+
			"each migration runs in a transaction of its own: remove BEGIN, COMMIT and ROLLBACK from the file, "+
			"repair the schema by hand, and migrate again", mig.Version, mig.Name, direction, m.schema, err)
	case applyErr != nil || (ok && err != nil): // the file failed, or the commit did
		return mig, false, fmt.Errorf("modkit/db: migration %04d_%s (%s) in schema %s failed and was rolled back: %w",
			mig.Version, mig.Name, direction, m.schema, err)
	case err != nil:
		return mig, false, err
	case !ok:
		return Migration{}, false, nil
	}
	m.logger.Info("migration "+direction, "version", mig.Version, "name", mig.Name, "schema", m.schema)
	return mig, true, nil
}

// apply runs mig's up or down file in tx and records it in the migrations
// table.
func (m *Migrator) apply(ctx context.Context, tx pgx.Tx, mig Migration, up bool) error {
	body := mig.up
	if !up {
		body = mig.down
	}
	if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{m.schema}.Sanitize()); err != nil {
		return err
	}
	// The transaction's id, to tell whether the file ended the
	// transaction and began another (COMMIT AND CHAIN, ROLLBACK AND
	// CHAIN), which leaves the connection in a transaction all the same.
	var before int64
	if err := tx.QueryRow(ctx, "SELECT txid_current()").Scan(&before); err != nil {
		return err
	}
	// No arguments: pgx uses the simple protocol, which allows several
	// statements in one file.
	_, err := tx.Exec(ctx, body)
	// Idle ('I'), not in a transaction ('T') or a failed one ('E'):
	// the file committed or rolled back the migrator's transaction.
	if tx.Conn().PgConn().TxStatus() == 'I' && !tx.Conn().IsClosed() {
		if err != nil {
			return fmt.Errorf("%w; after it: %w", ErrTransactionInMigration, err)
		}
		return ErrTransactionInMigration
	}
	if err != nil {
		return atLine(body, err)
	}
	var after int64
	if err := tx.QueryRow(ctx, "SELECT txid_current()").Scan(&after); err != nil {
		return err
	}
	if after != before {
		return fmt.Errorf("%w (it ended the migrator's transaction and began another: COMMIT AND CHAIN or ROLLBACK AND CHAIN)",
			ErrTransactionInMigration)
	}
	if up {
		_, err = tx.Exec(ctx, "INSERT INTO "+m.table()+" (version, name) VALUES ($1, $2)", mig.Version, mig.Name)
	} else {
		_, err = tx.Exec(ctx, "DELETE FROM "+m.table()+" WHERE version = $1", mig.Version)
	}
	return err
}
