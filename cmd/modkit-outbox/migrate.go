package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/modkit-go/modkit/migrations"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

const migrateExamples = `  modkit-outbox migrate up                        # apply what is missing
  modkit-outbox migrate up --to 38                # stop after 0038 (the rest later, at a quiet time)
  modkit-outbox migrate status
  modkit-outbox migrate down --steps 1 --yes      # revert the newest migration (the prompt names any that drops tables)
  modkit-outbox migrate sql --format goose --out db/outbox   # then: goose -dir db/outbox -table outbox_goose_db_version …
  modkit-outbox migrate sql --format plain | psql -v ON_ERROR_STOP=1 "$DATABASE_URL"

migrate sql connects to nothing, so it takes neither --database-url nor
--schema (nor --connect-timeout): its files create the outbox in the first
schema of the search_path of the session that runs them.
`

func runMigrate(ctx context.Context, e env, args []string) error {
	f := newFlags(e, "migrate", "migrate up|down|status|sql [flags]", migrateExamples)
	steps := f.Int("steps", 1, "down: how many migrations to revert, newest first")
	to := f.String("to", "", "up: apply the migrations up to this version only (38 or 0038), leaving the later ones for another run")
	yes := f.Bool("yes", false, "up, down: do not ask for confirmation")
	format := f.String("format", "plain", "sql: golang-migrate, goose or plain")
	out := f.String("out", "", "sql: write the files into this directory instead of printing them")
	pos, err := f.parse(e, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		f.printUsage(e.stderr)
		return usageErr("migrate needs one of up, down, status, sql")
	}
	if pos[0] != "up" && pos[0] != "down" && pos[0] != "status" && pos[0] != "sql" {
		return usageErr("migrate %q: use up, down, status or sql", pos[0])
	}
	// A flag the subcommand does not use is refused, not ignored: a
	// schema that sql ignored put the tables in another schema.
	set := f.setFlags()
	for name, subcommands := range map[string][]string{"steps": {"down"}, "yes": {"up", "down"}, "format": {"sql"}, "out": {"sql"}, "to": {"up"}} {
		if set[name] && !slices.Contains(subcommands, pos[0]) {
			return usageErr("--%s is for migrate %s only", name, strings.Join(subcommands, " and "))
		}
	}
	if pos[0] == "sql" {
		for _, name := range []string{"database-url", "connect-timeout"} {
			if set[name] {
				return usageErr("migrate sql does not take --%s: it prints the migrations without connecting", name)
			}
		}
		if set["schema"] {
			return usageErr("migrate sql does not take --schema: the files create the outbox in the first schema of the " +
				"search_path of the session that runs them; run them with it set (PGOPTIONS='-c search_path=shop' psql …), " +
				"or use migrate up --schema")
		}
		if v := e.getenv(schemaEnv); v != "" {
			fmt.Fprintf(e.stderr, "modkit-outbox: note: migrate sql ignores %s=%s: the files create the outbox in the first schema "+
				"of the search_path of the session that runs them\n", schemaEnv, v)
		}
		return printMigrations(e, *format, *out)
	}
	if pos[0] == "down" && *steps <= 0 {
		return usageErr("--steps is %d; it must be at least 1", *steps)
	}
	var upTo int64
	if set["to"] {
		known, err := db.ReadMigrations(migrations.FS)
		if err != nil {
			return err
		}
		v, err := strconv.ParseInt(strings.TrimSpace(*to), 10, 64)
		if err != nil || !slices.ContainsFunc(known, func(m db.Migration) bool { return m.Version == v }) {
			return usageErr("--to %q is not a migration of this modkit-outbox: use a version from %04d to %04d (migrate status lists them)",
				*to, known[0].Version, known[len(known)-1].Version)
		}
		upTo = v
	}
	pool, err := f.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	m, err := db.NewMigrator(pool, db.MigratorConfig{Schema: f.schema, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return usageErr("%v", err)
	}
	// A schema without an outbox while others hold one: when the schema
	// is public by default, --schema was most likely forgotten, and
	// migrate up would make a second, empty outbox that every later
	// command without --schema reads. A schema named on purpose (a
	// deploy script making a tenant's outbox, say) is migrated as asked.
	others, err := f.otherOutboxes(ctx, pool)
	if err != nil {
		return err
	}
	switch pos[0] {
	case "up":
		if len(others) > 0 && f.schemaDefaulted && !*yes {
			if err := confirm(e, fmt.Sprintf("Schema %s (the default) holds no outbox, but %s (pass --schema %s to migrate that one). "+
				"Create a second outbox in schema %s?", f.schema, elsewhere(others), others[0], f.schema)); err != nil {
				return err
			}
		}
		// Through Client.Migrate, as an app migrates: it refuses a schema
		// others may create objects in before migrating anything, and warns
		// (on stderr) when the role may not create the outbox's roles. The
		// migrations this process applied are the ones its migrator
		// reports: another process migrating the schema at the same time
		// applies the rest, and says so itself.
		applied := &appliedPrinter{out: e.stdout, next: slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}),
			count: new(int)}
		client, err := outbox.New(outboxpg.New(pool), outbox.Config{Schema: f.schema, Logger: slog.New(applied)})
		if err != nil {
			return usageErr("%v", err)
		}
		migrate := client.Migrate
		if upTo != 0 {
			migrate = func(ctx context.Context) error { return client.MigrateTo(ctx, upTo) }
		}
		if err := migrate(ctx); err != nil {
			return err
		}
		st, err := m.Status(ctx)
		if err != nil {
			return err
		}
		var later int
		for _, s := range st {
			if !s.Applied && s.Version > upTo {
				later++
			}
		}
		newer := slices.DeleteFunc(st, func(s db.MigrationStatus) bool { return !s.Unknown })
		switch {
		case upTo != 0 && later > 0:
			if *applied.count == 0 {
				fmt.Fprintf(e.stdout, "schema %s is up to date up to %04d\n", f.schema, upTo)
			}
			fmt.Fprintf(e.stdout, "%d later migration(s) wait: run migrate up (or migrate up --to) for them\n", later)
		case len(newer) > 0:
			last := newer[len(newer)-1]
			fmt.Fprintf(e.stdout, "schema %s has every migration of this modkit-outbox, and %d newer migration(s) it does not know, up to %04d_%s: "+
				"a newer version applied them; use that version's modkit-outbox for this schema\n", f.schema, len(newer), last.Version, last.Name)
		case *applied.count == 0:
			fmt.Fprintf(e.stdout, "schema %s is up to date\n", f.schema)
		}
	case "down":
		if !*yes {
			st, err := m.Status(ctx)
			if err != nil {
				return err
			}
			// A newer version's migrations (Status lists them last) make
			// Down refuse, naming them: nothing to confirm.
			newer := len(st) > 0 && st[len(st)-1].Unknown
			var names, dropping []string
			for i := len(st) - 1; i >= 0 && len(names) < *steps && !newer; i-- {
				if st[i].Applied {
					name := fmt.Sprintf("%04d_%s", st[i].Version, st[i].Name)
					names = append(names, name)
					if dropsTables(m, st[i].Version) {
						dropping = append(dropping, name)
					}
				}
			}
			switch {
			case newer:
			case len(names) == 0:
				fmt.Fprintf(e.stdout, "schema %s has no migration applied\n", f.schema)
				return nil
			default:
				what := "Their down scripts drop no table."
				if len(dropping) > 0 {
					what = fmt.Sprintf("The down script of %s drops tables, with the rows in them (events, history).", strings.Join(dropping, ", "))
				}
				if err := confirm(e, fmt.Sprintf("Revert %s in schema %s? %s", strings.Join(names, ", "), f.schema, what)); err != nil {
					return err
				}
			}
		}
		reverted, err := m.Down(ctx, *steps)
		for _, mig := range reverted {
			fmt.Fprintf(e.stdout, "reverted %04d_%s\n", mig.Version, mig.Name)
		}
		if err != nil {
			return err
		}
		if len(reverted) == 0 {
			fmt.Fprintf(e.stdout, "schema %s has no migration applied\n", f.schema)
		}
	case "status":
		st, err := m.Status(ctx)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "VERSION\tNAME\tAPPLIED")
		for _, s := range st {
			applied := "no"
			if s.Applied {
				applied = s.AppliedAt.UTC().Format("2006-01-02 15:04:05Z")
			}
			name := s.Name
			if s.Unknown {
				name += " (newer than this modkit-outbox)"
			}
			fmt.Fprintf(tw, "%04d\t%s\t%s\n", s.Version, name, applied)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if len(others) > 0 {
			fmt.Fprintf(e.stderr, "modkit-outbox: note: schema %s holds no outbox, but %s: pass --schema %s for its status\n",
				f.schema, elsewhere(others), others[0])
		}
	}
	return nil
}

// dropTable finds a DROP TABLE statement in a down script.
var dropTable = regexp.MustCompile(`(?i)\bDROP\s+TABLE\b`)

// dropsTables says whether the down script of m's migration version drops
// a table (and so the rows in it).
func dropsTables(m *db.Migrator, version int64) bool {
	for _, mig := range m.Migrations() {
		if mig.Version == version {
			return dropTable.MatchString(mig.DownSQL())
		}
	}
	return false
}

func printMigrations(e env, format, dir string) error {
	ms, err := db.ReadMigrations(migrations.FS)
	if err != nil {
		return err
	}
	files, err := formatMigrations(format, ms)
	if err != nil {
		return err
	}
	if dir != "" {
		if err := writeFiles(dir, files); err != nil {
			return err
		}
		for _, f := range files {
			fmt.Fprintln(e.stdout, "wrote", f.name)
		}
		return nil
	}
	for i, f := range files {
		if len(files) > 1 {
			if i > 0 {
				fmt.Fprintln(e.stdout)
			}
			fmt.Fprintf(e.stdout, "-- ==== %s ====\n", f.name)
		}
		fmt.Fprint(e.stdout, f.body)
	}
	return nil
}

// appliedPrinter is the slog handler of migrate up: it prints each
// migration the migrator reports applied (its "migration up" records) as
// "applied NNNN_name" and counts them, and hands records of level Warn and
// above to next. Records come from one goroutine (Client.Migrate's).
type appliedPrinter struct {
	out   io.Writer
	next  slog.Handler
	count *int
}

func (h *appliedPrinter) Enabled(context.Context, slog.Level) bool { return true }

func (h *appliedPrinter) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "migration up" {
		var version int64
		var name string
		r.Attrs(func(a slog.Attr) bool {
			switch a.Key {
			case "version":
				version = a.Value.Int64()
			case "name":
				name = a.Value.String()
			}
			return true
		})
		fmt.Fprintf(h.out, "applied %04d_%s\n", version, name)
		*h.count++
		return nil
	}
	if r.Level < slog.LevelWarn {
		return nil
	}
	return h.next.Handle(ctx, r)
}

func (h *appliedPrinter) WithAttrs(as []slog.Attr) slog.Handler {
	return &appliedPrinter{out: h.out, next: h.next.WithAttrs(as), count: h.count}
}

func (h *appliedPrinter) WithGroup(name string) slog.Handler {
	return &appliedPrinter{out: h.out, next: h.next.WithGroup(name), count: h.count}
}
