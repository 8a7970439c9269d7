package outbox

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"runtime"
	"slices"

	"go.uber.org/fx"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/lifecycle"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// Module wires the outbox into an fx app. It takes the *db.Provider (from
// db.Module), every Publisher provided with AsPublisher, and optionally a
// Config, a DispatcherConfig (each by value or as a pointer, as
// fx.Supply(&cfg) provides it; not both) and a *slog.Logger from the
// graph. It provides
// the *Client (for enqueues and Admin) and a *Dispatcher for the
// publishers, which starts with the app (the start waits until it is ready)
// and stops with it; if it fails on its own, it asks the app to shut down.
// With no publisher registered the *Dispatcher is nil, nothing runs and
// Module says so once in the log: a service that only enqueues includes
// Module all the same. Take the *Dispatcher from the graph for its Health
// (outboxui.Options.Dispatchers and outboxui.HealthHandler accept it, nil
// included).
//
// Add WithMigrations to have the app migrate the outbox (and, optionally,
// its own tables) when it starts. A start hook of your own that migrates is
// not enough: fx runs the hooks in the order the modules were wired, so the
// dispatcher's may come first and find no tables.
//
// A module contributes a publisher like this:
//
//	fx.Provide(outbox.AsPublisher(func(deps Deps) outbox.Publisher {
//		return outbox.Publisher{Topic: outbox.Topic{Namespace: "mini-chat", Topic: "usage_snapshot"}, Publish: deps.Send}
//	}))
var Module = fx.Module("modkit-outbox",
	fx.Provide(newFxClient, newFxDispatcher),
	fx.Invoke(func(lc fx.Lifecycle, sd fx.Shutdowner, d *Dispatcher) {
		if d != nil {
			lifecycle.HookWithShutdown(lc, sd, d.Task())
		}
	}),
)

// WithMigrations makes the app apply the outbox's migrations (into
// Config.Schema) when it starts, followed by the application's own sets
// given as app (each run by a modkit/db Migrator on the *db.Provider's
// pool; give each set its FS and its own MigratorConfig.Table: a set
// without files, or on the outbox's table or another set's, fails the app
// at construction). They run after
// the database is reachable and before the start hook of anything built
// from the outbox *Client, the dispatcher included, whatever order the
// modules are listed in. Add it next to Module:
//
//	fx.New(db.Module, outbox.Module, outbox.WithMigrations(db.MigratorConfig{
//		Schema: "shop", FS: shopMigrations, Table: "shop_schema_migrations",
//	}), …)
//
// Several modules may each add their own: every call's sets run, in the
// order fx builds them, and the sets of all calls must use different
// tables. (The outbox's own migrations then run once per call; after the
// first they find nothing to do.)
//
// Migrations are safe to run from several replicas at once (an advisory
// lock, taken by each migration's transaction, serialises them, also
// through PgBouncer in transaction mode) and do nothing when the schema is up to date. They
// run within fx's start timeout. A migration that fails stops the app from
// starting, with the migrator's error.
func WithMigrations(app ...db.MigratorConfig) fx.Option {
	sets := slices.Clone(app)
	return fx.Module("modkit-outbox-migrations",
		fx.Provide(fx.Annotate(func(p fxMigrationsParams) (*fxMigrations, error) { return newFxMigrations(p, sets) },
			fx.ResultTags(`group:"`+migrationsGroup+`"`))),
		fx.Invoke(fx.Annotate(checkFxMigrations, fx.ParamTags(`group:"`+migrationsGroup+`"`))),
	)
}

// migrationsGroup collects what each WithMigrations call registered.
const migrationsGroup = "outbox_migrations"

// fxMigrations stands for "a WithMigrations call's hook is registered":
// the *Client depends on all of them, so every start hook registered by
// something built from the client comes after the migrations. Tables are
// its app sets' migrations tables (schema.table), for the check across
// calls.
type fxMigrations struct {
	tables []string
}

// checkFxMigrations refuses two WithMigrations calls whose app sets share
// a migrations table: each set would take the other's versions for its
// own. (Within one call, newFxMigrations refuses them.)
func checkFxMigrations(calls []*fxMigrations) error {
	seen := map[string]bool{}
	for _, c := range calls {
		for _, table := range c.tables {
			if seen[table] {
				return configError("outbox.WithMigrations: two calls have app migrations on the migrations table %s: "+
					"give each set its own MigratorConfig.Table", table)
			}
			seen[table] = true
		}
	}
	return nil
}

type fxMigrationsParams struct {
	fx.In
	Lifecycle fx.Lifecycle
	DB        *db.Provider
	Config    Config       `optional:"true"`
	ConfigPtr *Config      `optional:"true"`
	Logger    *slog.Logger `optional:"true"`
}

func newFxMigrations(p fxMigrationsParams, app []db.MigratorConfig) (*fxMigrations, error) {
	cfg, err := fromGraph(p.Config, p.ConfigPtr)
	if err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = p.Logger
	}
	// A client of its own: the graph's *Client depends on this hook.
	client, err := New(outboxpg.New(p.DB.Pool), cfg)
	if err != nil {
		return nil, err
	}
	migrators := make([]*db.Migrator, len(app))
	// Two sets sharing one migrations table would each take the other's
	// versions for their own (db.ErrMigrationConflict at start): refuse
	// them at construction.
	tables := map[string]string{client.cfg.Schema + "." + db.MigrationsTable: "the outbox's migrations"}
	res := &fxMigrations{}
	for i, mc := range app {
		if mc.FS == nil {
			// A Migrator's default FS is the outbox's own migrations: an
			// app set without files would install a second outbox.
			return nil, configError("outbox.WithMigrations: app migrations %d (schema %q) have no FS: give the set's files "+
				"(for files in a directory of an embed.FS, fs.Sub(fsys, \"dir\")); the outbox's own migrations need no set", i, mc.Schema)
		}
		table := cmp.Or(mc.Schema, db.SchemaDefault) + "." + cmp.Or(mc.Table, db.MigrationsTable)
		if other, ok := tables[table]; ok {
			return nil, configError("outbox.WithMigrations: app migrations %d use the migrations table %s, as %s do: "+
				"give each set its own MigratorConfig.Table", i, table, other)
		}
		tables[table] = fmt.Sprintf("app migrations %d", i)
		res.tables = append(res.tables, table)
		if mc.Logger == nil {
			mc.Logger = client.cfg.Logger
		}
		if migrators[i], err = db.NewMigrator(p.DB.Pool, mc); err != nil {
			return nil, fmt.Errorf("outbox.WithMigrations: app migrations %d (table %q): %w", i, mc.Table, err)
		}
	}
	p.Lifecycle.Append(fx.Hook{OnStart: func(ctx context.Context) error {
		if err := client.Migrate(ctx); err != nil {
			return err
		}
		for i, m := range migrators {
			if _, err := m.Up(ctx); err != nil {
				return fmt.Errorf("outbox.WithMigrations: app migrations %d (table %q): %w", i, app[i].Table, err)
			}
		}
		return nil
	}})
	return res, nil
}

const publisherGroup = "outbox_publishers"

var publisherType = reflect.TypeFor[Publisher]()

// AsPublisher annotates a constructor so that Module collects the Publisher
// it returns. The constructor must be a function returning a Publisher, or
// a Publisher and an error; its parameters come from the graph. Anything
// else makes the app fail at construction with an error naming it, and so
// does an error the constructor returns (fx names the function, its file
// and line).
func AsPublisher(constructor any) any {
	if err := checkPublisherConstructor(constructor); err != nil {
		return fx.Annotated{Group: publisherGroup, Target: func() (Publisher, error) { return Publisher{}, err }}
	}
	// fx.Annotated hands fx the constructor itself, which fx names in the
	// errors it returns; fx.Annotate wraps it in a function made by
	// reflect, and fx named that, "reflect".makeFuncStub, so that with
	// several modules one could not tell whose constructor failed.
	return fx.Annotated{Group: publisherGroup, Target: constructor}
}

func checkPublisherConstructor(constructor any) error {
	v := reflect.ValueOf(constructor)
	if v.Kind() != reflect.Func || v.IsNil() {
		return configError("outbox.AsPublisher(%T): pass a constructor function returning outbox.Publisher "+
			"(or outbox.Publisher and an error)", constructor)
	}
	t := v.Type()
	errType := reflect.TypeFor[error]()
	if (t.NumOut() == 1 || t.NumOut() == 2 && t.Out(1) == errType) && t.Out(0) == publisherType {
		return nil
	}
	name := "constructor"
	if f := runtime.FuncForPC(v.Pointer()); f != nil {
		name = f.Name()
	}
	return configError("outbox.AsPublisher(%s): the constructor is a %s; it must return outbox.Publisher "+
		"(or outbox.Publisher and an error)", name, t)
}

type fxClientParams struct {
	fx.In
	DB         *db.Provider
	Config     Config          `optional:"true"`
	ConfigPtr  *Config         `optional:"true"`
	Logger     *slog.Logger    `optional:"true"`
	Migrations []*fxMigrations `group:"outbox_migrations"`
}

func newFxClient(p fxClientParams) (*Client, error) {
	cfg, err := fromGraph(p.Config, p.ConfigPtr)
	if err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = p.Logger
	}
	return New(outboxpg.New(p.DB.Pool), cfg)
}

type fxDispatcherParams struct {
	fx.In
	Client     *Client
	Publishers []Publisher       `group:"outbox_publishers"`
	Config     DispatcherConfig  `optional:"true"`
	ConfigPtr  *DispatcherConfig `optional:"true"`
}

func newFxDispatcher(p fxDispatcherParams) (*Dispatcher, error) {
	cfg, err := fromGraph(p.Config, p.ConfigPtr)
	if err != nil {
		return nil, err
	}
	if len(p.Publishers) == 0 {
		p.Client.cfg.Logger.Info("outbox: no publisher registered (outbox.AsPublisher), so no dispatcher runs in this app; "+
			"its events wait for a dispatcher in another service", "component", "outbox")
		return nil, nil
	}
	return p.Client.NewDispatcher(cfg, p.Publishers...)
}

// fromGraph is the configuration the graph holds, by value or through a
// pointer (fx.Supply(&cfg) provides a pointer, which Module used to
// ignore without a word). Both at once is refused: which one was meant?
func fromGraph[T any](val T, ptr *T) (T, error) {
	if ptr == nil {
		return val, nil
	}
	if !reflect.ValueOf(val).IsZero() {
		var zero T
		return zero, configError("outbox.Module: the graph holds both a %T and a %T; supply one of them", val, ptr)
	}
	return *ptr, nil
}
