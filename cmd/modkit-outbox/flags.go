package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// schemaEnv is the environment variable whose value is --schema's default.
const schemaEnv = "MODKIT_OUTBOX_SCHEMA"

// errHelp: --help was asked for and printed.
var errHelp = errors.New("help printed")

// cmdFlags is a command's flag set with the connection flags every command
// shares.
type cmdFlags struct {
	*flag.FlagSet
	databaseURL, schema string
	// schemaDefaulted: neither --schema nor $MODKIT_OUTBOX_SCHEMA named the
	// schema (it is public by default).
	schemaDefaulted bool
	connectTimeout  time.Duration
	usage, examples string
	getenv          func(string) string
}

func newFlags(e env, name, usage, examples string) *cmdFlags {
	f := &cmdFlags{FlagSet: flag.NewFlagSet(name, flag.ContinueOnError), usage: usage, examples: examples, getenv: e.getenv}
	f.SetOutput(io.Discard)
	// The default is read after parsing, so that --help never prints the
	// URL (and its password).
	f.StringVar(&f.databaseURL, "database-url", "", "PostgreSQL URL or DSN (default $DATABASE_URL)")
	f.StringVar(&f.schema, "schema", "", "schema holding the outbox tables (default $"+schemaEnv+", else public)")
	f.DurationVar(&f.connectTimeout, "connect-timeout", 10*time.Second, "give up connecting after this long")
	return f
}

func (f *cmdFlags) printUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage:\n  modkit-outbox %s\n\nFlags:\n", f.usage)
	f.SetOutput(w)
	f.PrintDefaults()
	f.SetOutput(io.Discard)
	if f.examples != "" {
		fmt.Fprintf(w, "\nExamples:\n%s", f.examples)
	}
}

// parse parses flags placed anywhere among the arguments and returns the
// positional arguments. --help prints the usage and returns errHelp.
func (f *cmdFlags) parse(e env, args []string) ([]string, error) {
	var pos []string
	for {
		if err := f.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				f.printUsage(e.stdout)
				return nil, errHelp
			}
			f.printUsage(e.stderr)
			return nil, usageErr("%s: %v", f.Name(), err)
		}
		args = f.Args()
		if len(args) == 0 {
			if !f.setFlags()["schema"] {
				f.schema = f.getenv(schemaEnv)
				f.schemaDefaulted = f.schema == ""
				f.schema = cmp.Or(f.schema, "public")
			}
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// setFlags returns the names of the flags given on the command line.
func (f *cmdFlags) setFlags() map[string]bool {
	set := map[string]bool{}
	f.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	return set
}

// refuse returns a usage error for the first of names that was given: a
// flag the command line's subcommand does not use is refused, not ignored.
// why ends the message ("is for events list only").
func (f *cmdFlags) refuse(names []string, why string) error {
	set := f.setFlags()
	for _, name := range names {
		if set[name] {
			return usageErr("--%s %s", name, why)
		}
	}
	return nil
}

// connect opens a pool on the database and checks that it answers.
func (f *cmdFlags) connect(ctx context.Context) (*pgxpool.Pool, error) {
	// Checked here, so that the error names the flag rather than the
	// Config.Schema field the library's own check would name.
	if db.ValidateSchema(f.schema) != nil {
		return nil, usageErr("--schema %q is not a schema name the outbox takes: use 1 to 63 letters, digits or underscores, "+
			"not starting with a digit or pg_", f.schema)
	}
	if f.databaseURL == "" {
		f.databaseURL = f.getenv("DATABASE_URL")
	}
	if f.databaseURL == "" {
		return nil, usageErr("no database: set DATABASE_URL or pass --database-url")
	}
	if f.connectTimeout <= 0 {
		return nil, usageErr("--connect-timeout is %v; give how long to try, such as 10s", f.connectTimeout)
	}
	cfg, err := pgxpool.ParseConfig(f.databaseURL)
	if err != nil {
		return nil, usageErr("--database-url is not a valid PostgreSQL URL or DSN: %v", err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.ConnectTimeout = f.connectTimeout
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, withCode(exitUnreachable, fmt.Errorf("cannot reach the database: %w", err))
	}
	pingCtx, cancel := context.WithTimeout(ctx, f.connectTimeout)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, withCode(exitUnreachable, fmt.Errorf("cannot reach the database at %s:%d: %w (check --database-url or DATABASE_URL)",
			cfg.ConnConfig.Host, cfg.ConnConfig.Port, err))
	}
	return pool, nil
}

// client connects and returns an outbox client on the schema; close the
// pool when done.
func (f *cmdFlags) client(ctx context.Context) (*outbox.Client, *pgxpool.Pool, error) {
	pool, err := f.connect(ctx)
	if err != nil {
		return nil, nil, err
	}
	if err := f.checkSchema(ctx, pool); err != nil {
		pool.Close()
		return nil, nil, err
	}
	c, err := outbox.New(outboxpg.New(pool), outbox.Config{Schema: f.schema})
	if err != nil {
		pool.Close()
		return nil, nil, usageErr("%v", err)
	}
	return c, pool, nil
}

// qOutboxSchemas lists the schemas of the database that hold an outbox
// (its events table), from the catalog, which every role may read.
const qOutboxSchemas = `SELECT n.nspname FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = 'modkit_outbox_events' AND c.relkind IN ('r', 'p')
ORDER BY 1`

// otherOutboxes returns the schemas other than --schema's that hold an
// outbox, when --schema's holds none (nil otherwise).
func (f *cmdFlags) otherOutboxes(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	rows, err := pool.Query(ctx, qOutboxSchemas)
	if err != nil {
		return nil, fmt.Errorf("look up the schemas that hold an outbox: %w", err)
	}
	schemas, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("look up the schemas that hold an outbox: %w", err)
	}
	if slices.Contains(schemas, f.schema) {
		return nil, nil
	}
	return schemas, nil
}

// checkSchema refuses a --schema without an outbox when other schemas of
// the database hold one: an operator who forgot --schema would otherwise
// read an empty outbox, or be told to migrate one. With no outbox in any
// schema, the command goes on and says the outbox is not migrated.
func (f *cmdFlags) checkSchema(ctx context.Context, pool *pgxpool.Pool) error {
	others, err := f.otherOutboxes(ctx, pool)
	if err != nil || len(others) == 0 {
		return err
	}
	return fmt.Errorf("schema %s holds no outbox; %s: pass --schema %s (or set %s=%s)",
		f.schema, elsewhere(others), others[0], schemaEnv, others[0])
}

// elsewhere says which schemas hold an outbox.
func elsewhere(schemas []string) string {
	if len(schemas) == 1 {
		return "schema " + schemas[0] + " holds one"
	}
	return "schemas " + strings.Join(schemas, ", ") + " hold one each"
}

// filterFlags are the event filters shared by events list and dead replay.
type filterFlags struct {
	namespace, topic, tenant, since, until string
}

func (ff *filterFlags) register(f *cmdFlags) {
	ff.registerTopic(f)
	f.Var((*filterValue)(&ff.tenant), "tenant", "only events of this tenant id (a `UUID`)")
	f.Var((*filterValue)(&ff.since), "since", "only events enqueued at or after this `time`: RFC 3339 (2026-01-02T15:04:05Z) or a duration ago (90m)")
	f.Var((*filterValue)(&ff.until), "until", "only events enqueued before this `time`: RFC 3339 or a duration ago")
}

// registerTopic registers --namespace and --topic only (tail's filters).
func (ff *filterFlags) registerTopic(f *cmdFlags) {
	f.Var((*filterValue)(&ff.namespace), "namespace", "only events of this `namespace`")
	f.Var((*filterValue)(&ff.topic), "topic", "only events of this `topic`: NAMESPACE/TOPIC, or TOPIC in any namespace")
}

// filterValue is a filter flag's value. A filter narrows what a command
// reads or changes, so it refuses what would silently widen it: an empty
// value (--topic "$T" with T unset would otherwise match every topic, and
// dead purge would delete them all) and a second value (which would
// otherwise replace the first, not add to it).
type filterValue string

func (v *filterValue) String() string { return string(*v) }

func (v *filterValue) Set(s string) error {
	switch {
	case *v != "":
		return fmt.Errorf("given twice (%q, then %q); a filter takes one value", string(*v), s)
	case strings.TrimSpace(s) == "":
		return errors.New("is empty; leave the flag out to match every value")
	}
	*v = filterValue(s)
	return nil
}

func (ff *filterFlags) filter(now time.Time) (outbox.EventFilter, error) {
	var out outbox.EventFilter
	out.Namespace = ff.namespace
	if ns, t, ok := strings.Cut(ff.topic, "/"); ok {
		if ns == "" || t == "" { // an empty part would match any namespace or topic
			return out, usageErr("--topic %q: write it as NAMESPACE/TOPIC, or TOPIC for that topic in any namespace", ff.topic)
		}
		if ff.namespace != "" && ff.namespace != ns {
			return out, usageErr("--namespace %q contradicts --topic %q", ff.namespace, ff.topic)
		}
		out.Namespace, out.Topic = ns, t
	} else {
		out.Topic = ff.topic
	}
	// Checked here, so that the error names the flag rather than the
	// EventFilter field the library's own check would name.
	for _, n := range []struct{ flag, what, v string }{
		{"--namespace", "namespace", ff.namespace}, {"--topic", "namespace", out.Namespace}, {"--topic", "topic", out.Topic},
	} {
		if n.v != "" {
			if err := checkName(n.flag, n.what, n.v); err != nil {
				return out, err
			}
		}
	}
	if ff.tenant != "" {
		id, err := uuid.Parse(ff.tenant)
		if err != nil {
			return out, usageErr("--tenant %q is not a UUID", ff.tenant)
		}
		if id == uuid.Nil { // the library refuses it too, naming EventFilter.TenantID
			return out, usageErr("--tenant is the nil UUID, which no event has (enqueue refuses it); leave --tenant out to match every tenant")
		}
		out.TenantID = &id
	}
	var err error
	if out.CreatedAfter, err = parseWhen("--since", ff.since, now); err != nil {
		return out, err
	}
	if out.CreatedBefore, err = parseWhen("--until", ff.until, now); err != nil {
		return out, err
	}
	// An empty range would match nothing without a word: a --since later
	// than --until is a mistake (durations count back from now, so the
	// larger one is the earlier time).
	if ff.since != "" && ff.until != "" && !out.CreatedAfter.Before(out.CreatedBefore) {
		return out, usageErr("--since %s (%s) is not before --until %s (%s), so no event can match: give --since the earlier time "+
			"(a duration counts back from now: --since 3h --until 2h)", ff.since, fmtTime(out.CreatedAfter), ff.until, fmtTime(out.CreatedBefore))
	}
	return out, nil
}

// checkName returns a usage error naming flag when v is not a valid
// namespace or topic name (what says which).
func checkName(flag, what, v string) error {
	if validName(v) {
		return nil
	}
	return usageErr("%s: %q is not a valid %s: 1 to 128 of a-z, 0-9, '.', '_' and '-', starting with a letter or digit", flag, v, what)
}

// validName is the rule of namespace and topic names (outbox.Message's).
func validName(s string) bool {
	if len(s) == 0 || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case (c == '.' || c == '_' || c == '-') && i > 0:
		default:
			return false
		}
	}
	return true
}

// parseWhen reads an RFC 3339 time or a duration before now; "" is zero.
func parseWhen(flagName, v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, usageErr("%s %q: use an RFC 3339 time (2026-01-02T15:04:05Z) or a duration ago (90m)", flagName, v)
}

// parseTopic reads --topic NAMESPACE/TOPIC. The names are checked here,
// so that the error names the flag rather than the library's own check's
// pattern (or, for skip-head, finds no key of a topic no event can have).
func parseTopic(v string) (outbox.Topic, error) {
	ns, t, ok := strings.Cut(v, "/")
	if !ok || ns == "" || t == "" {
		return outbox.Topic{}, usageErr("--topic %q: write it as NAMESPACE/TOPIC", v)
	}
	if err := checkName("--topic", "namespace", ns); err != nil {
		return outbox.Topic{}, err
	}
	if err := checkName("--topic", "topic", t); err != nil {
		return outbox.Topic{}, err
	}
	return outbox.Topic{Namespace: ns, Topic: t}, nil
}

// listFlag collects a repeated string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// requiredDuration is a duration flag without a default: set tells
// whether it was given, and the usage shows no default.
type requiredDuration struct {
	d   time.Duration
	set bool
}

func (r *requiredDuration) String() string {
	if r == nil || !r.set {
		return ""
	}
	return r.d.String()
}

func (r *requiredDuration) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("is not a duration (such as 72h or 90m)")
	}
	r.d, r.set = d, true
	return nil
}
