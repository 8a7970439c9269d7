package outbox_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// Two modules each register a publisher through the value group; the
// dispatcher runs with the app, delivers both modules' events and stops
// cleanly with it.
func TestFxModuleWithTwoPublishingModules(t *testing.T) {
	tdb := pgtest.NewDB(t)
	chatTopic := outbox.Topic{Namespace: "chat", Topic: "message_sent"}
	billingTopic := outbox.Topic{Namespace: "billing", Topic: "invoice_paid"}
	got := make(chan outbox.Topic, 10)
	publisherModule := func(name string, topic outbox.Topic) fx.Option {
		return fx.Module(name, fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: topic, Name: name, Publish: func(ctx context.Context, d outbox.Delivery) error {
				got <- outbox.Topic{Namespace: d.Namespace, Topic: d.Topic}
				return nil
			}}
		})))
	}
	log := newOutcomeLog()
	var (
		d      *outbox.Dispatcher
		client *outbox.Client
		p      *db.Provider
	)
	app := fxtest.New(t,
		fx.Supply(db.Config{DSN: tdb.DSN}),
		fx.Supply(outbox.DispatcherConfig{PollInterval: 50 * time.Millisecond, Logger: quietLog, OnOutcome: log.hook}),
		fx.Supply(quietLog),
		db.Module,
		outbox.Module,
		publisherModule("chat", chatTopic),
		publisherModule("billing", billingTopic),
		fx.Populate(&d, &client, &p),
		fx.NopLogger,
	)
	app.RequireStart()
	if d == nil || client == nil {
		t.Fatalf("Module provided dispatcher %v and client %v", d, client)
	}
	if st := d.Task().Status(); st.String() != "running" {
		t.Fatalf("dispatcher %s after app start", st)
	}
	for _, topic := range []outbox.Topic{chatTopic, billingTopic, chatTopic} {
		if _, err := client.Enqueue(ctx, p.Pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	log.waitFor(t, "3 deliveries", finalCount(outbox.StatusDelivered, 3))
	seen := map[outbox.Topic]int{}
	for range 3 {
		seen[<-got]++
	}
	if seen[chatTopic] != 2 || seen[billingTopic] != 1 {
		t.Fatalf("delivered %v", seen)
	}
	app.RequireStop()
	if st := d.Task().Status(); st.String() != "stopped" {
		t.Fatalf("dispatcher %s after app stop", st)
	}
}

// A service that only enqueues includes Module with no publisher: the app
// starts and stops, no dispatcher runs (the *Dispatcher is nil), the log
// says so once, and the *Client enqueues with the Config from the graph.
func TestFxModuleWithoutPublishers(t *testing.T) {
	tdb := pgtest.NewDB(t)
	logs := &recordingHandler{}
	var (
		d      *outbox.Dispatcher
		client *outbox.Client
		p      *db.Provider
	)
	app := fxtest.New(t,
		fx.Supply(db.Config{DSN: tdb.DSN}),
		fx.Supply(outbox.Config{MaxPayloadBytes: 64}),
		fx.Supply(slog.New(logs)),
		db.Module,
		outbox.Module,
		fx.Populate(&d, &client, &p),
		fx.NopLogger,
	)
	app.RequireStart()
	if d != nil {
		t.Fatalf("a dispatcher (%v) without publishers", d)
	}
	if client == nil {
		t.Fatal("no client")
	}
	res, err := client.Enqueue(ctx, p.Pool, msg(1))
	if err != nil {
		t.Fatal(err)
	}
	big := msg(2)
	big.Payload = []byte(`"` + strings.Repeat("x", 64) + `"`)
	if _, err := client.Enqueue(ctx, p.Pool, big); !errors.Is(err, outbox.ErrPayloadTooLarge) {
		t.Fatalf("payload above the supplied Config's limit: %v, want ErrPayloadTooLarge", err)
	}
	app.RequireStop()
	if n := logs.count("no publisher registered"); n != 1 {
		t.Fatalf("%d log records say that no dispatcher runs, want 1: %q", n, logs.messages())
	}
	// Nothing delivered it: it waits, pending, for a dispatcher elsewhere.
	if e := get(t, clientOn(t, tdb.Provider.Pool, outbox.Config{}), res.ID); e.Status != outbox.StatusPending || e.Attempts != 0 {
		t.Fatalf("event after the app ran: %+v", e)
	}
}

// fx.Supply(&cfg) provides a pointer: Module reads a *Config and a
// *DispatcherConfig as it reads the values (it used to ignore them without
// a word, and the app ran in the default schema with default retries), and
// refuses a graph that holds both forms of one.
func TestFxModuleTakesConfigPointers(t *testing.T) {
	tdb := pgtest.NewDB(t)
	var (
		client *outbox.Client
		d      *outbox.Dispatcher
	)
	publisher := fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
		return outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }}
	}))
	app := fxtest.New(t,
		fx.Supply(tdb.Provider),
		fx.Supply(&outbox.Config{MaxPayloadBytes: 64, Logger: quietLog}),
		fx.Supply(&outbox.DispatcherConfig{MaxAttempts: 2, Logger: quietLog}),
		publisher,
		outbox.Module,
		fx.Populate(&client, &d),
		fx.NopLogger,
	)
	app.RequireStart()
	if got := client.Config().MaxPayloadBytes; got != 64 {
		t.Errorf("the client's MaxPayloadBytes is %d; the supplied *Config says 64", got)
	}
	if got := d.Config().MaxAttempts; got != 2 {
		t.Errorf("the dispatcher's MaxAttempts is %d; the supplied *DispatcherConfig says 2", got)
	}
	app.RequireStop()

	for name, both := range map[string]fx.Option{
		"Config":           fx.Supply(outbox.Config{MaxPayloadBytes: 64}, &outbox.Config{MaxPayloadBytes: 128}),
		"DispatcherConfig": fx.Supply(outbox.DispatcherConfig{MaxAttempts: 2}, &outbox.DispatcherConfig{MaxAttempts: 3}),
	} {
		app := fx.New(fx.Supply(tdb.Provider), both, publisher, outbox.Module, fx.Populate(&client, &d), fx.NopLogger)
		if err := app.Err(); !errors.Is(err, outbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "supply one of them") {
			t.Errorf("a graph with both a %s and a pointer to one: %v; want ErrInvalidConfig saying to supply one", name, err)
		}
	}
}

func TestFxModuleRejectsDuplicatePublishers(t *testing.T) {
	tdb := pgtest.NewDB(t)
	pub := func(name string) fx.Option {
		return fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: testTopic, Name: name, Publish: func(context.Context, outbox.Delivery) error { return nil }}
		}))
	}
	// The test's own provider stands in for db.Module: an app that fails
	// to build never runs its stop hooks, so db.Module's pool would leak.
	app := fx.New(fx.Supply(tdb.Provider), outbox.Module, pub("one"), pub("two"), fx.NopLogger)
	err := app.Err()
	if !errors.Is(err, outbox.ErrDuplicatePublisher) || !errors.Is(err, outbox.ErrInvalidConfig) {
		t.Fatalf("two publishers for one topic: %v, want ErrDuplicatePublisher", err)
	}
	if msg := err.Error(); !strings.Contains(msg, `"one"`) || !strings.Contains(msg, `"two"`) {
		t.Fatalf("the error must name both publishers: %s", msg)
	}
}

// An app that lists its modules in the "wrong" order, with a module whose
// own start hook enqueues listed first, migrates first: the outbox into a
// schema no one migrated yet, then the app's own set, then that module's
// hook runs, then the dispatcher starts and delivers the event.
func TestFxWithMigrationsRunsBeforeAnyStartHook(t *testing.T) {
	tdb := pgtest.NewDB(t)
	topic := outbox.Topic{Namespace: "shop", Topic: "order_placed"}
	appFS := fstest.MapFS{
		"0001_orders.up.sql":   {Data: []byte(`CREATE TABLE orders (id bigint PRIMARY KEY)`)},
		"0001_orders.down.sql": {Data: []byte(`DROP TABLE orders`)},
	}
	delivered := make(chan outbox.Delivery, 1)
	orders := fx.Module("orders",
		fx.Invoke(func(lc fx.Lifecycle, c *outbox.Client, p *db.Provider) {
			lc.Append(fx.Hook{OnStart: func(ctx context.Context) error {
				return db.InTx(ctx, p.Pool, func(ctx context.Context, tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO shop.orders (id) VALUES (1)`); err != nil {
						return err
					}
					_, err := c.Enqueue(ctx, tx, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic, Payload: []byte(`{"order":1}`)})
					return err
				})
			}})
		}),
		fx.Provide(outbox.AsPublisher(func() outbox.Publisher {
			return outbox.Publisher{Topic: topic, Publish: func(_ context.Context, d outbox.Delivery) error { delivered <- d; return nil }}
		})),
	)
	app := fxtest.New(t,
		orders,
		outbox.Module,
		outbox.WithMigrations(db.MigratorConfig{Schema: "shop", FS: appFS, Table: "shop_schema_migrations"}),
		db.Module,
		fx.Supply(outbox.Config{Schema: "fresh_outbox"}),
		fx.Supply(outbox.DispatcherConfig{PollInterval: 50 * time.Millisecond}),
		fx.Supply(db.Config{DSN: tdb.DSN}),
		fx.Supply(quietLog),
		fx.NopLogger,
	)
	app.RequireStart()
	select {
	case d := <-delivered:
		if string(d.Payload) != `{"order": 1}` {
			t.Fatalf("delivered %s", d.Payload)
		}
	case <-time.After(guard):
		t.Fatal("the event enqueued by a start hook was not delivered")
	}
	app.RequireStop()
}

// An app set of migrations on the outbox's migrations table (the default
// table in the outbox's schema), or on another set's, fails the app at
// construction with ErrInvalidConfig naming the table: each set would take
// the other's versions for its own and skip its own migrations.
func TestFxWithMigrationsRefusesASharedTable(t *testing.T) {
	tdb := pgtest.NewDB(t)
	appFS := fstest.MapFS{
		"0001_orders.up.sql":   {Data: []byte("CREATE TABLE orders (id int)")},
		"0001_orders.down.sql": {Data: []byte("DROP TABLE orders")},
	}
	for name, sets := range map[string][]db.MigratorConfig{
		"the outbox's table":  {{FS: appFS}},
		"another set's table": {{Schema: "shop", FS: appFS, Table: "t"}, {Schema: "shop", FS: appFS, Table: "t"}},
	} {
		t.Run(name, func(t *testing.T) {
			app := fx.New(fx.Supply(tdb.Provider), outbox.Module, outbox.WithMigrations(sets...), fx.NopLogger)
			err := app.Err()
			if !errors.Is(err, outbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "MigratorConfig.Table") {
				t.Fatalf("app error %v, want ErrInvalidConfig naming MigratorConfig.Table", err)
			}
		})
	}
}

// Two modules may each add WithMigrations with their own sets: both sets
// run before the start hooks of what is built on the Client. Two calls
// whose sets share a migrations table fail the app at construction.
func TestFxWithMigrationsFromTwoModules(t *testing.T) {
	set := func(table string) fstest.MapFS {
		return fstest.MapFS{
			"0001_" + table + ".up.sql":   {Data: []byte("CREATE TABLE " + table + " (id int)")},
			"0001_" + table + ".down.sql": {Data: []byte("DROP TABLE " + table)},
		}
	}
	t.Run("two sets", func(t *testing.T) {
		tdb := pgtest.NewDB(t)
		var seen []string
		app := fxtest.New(t,
			fx.Module("orders", outbox.WithMigrations(db.MigratorConfig{Schema: "shop", FS: set("orders"), Table: "orders_migrations"})),
			fx.Module("billing", outbox.WithMigrations(db.MigratorConfig{Schema: "shop", FS: set("invoices"), Table: "billing_migrations"})),
			fx.Invoke(func(lc fx.Lifecycle, c *outbox.Client, p *db.Provider) {
				lc.Append(fx.Hook{OnStart: func(ctx context.Context) error {
					for _, table := range []string{"shop.orders", "shop.invoices", "fresh_outbox.modkit_outbox_events"} {
						var name *string
						if err := p.Pool.QueryRow(ctx, "SELECT to_regclass($1)::text", table).Scan(&name); err != nil {
							return err
						}
						if name != nil {
							seen = append(seen, *name)
						}
					}
					return nil
				}})
			}),
			outbox.Module,
			fx.Supply(outbox.Config{Schema: "fresh_outbox"}),
			fx.Supply(tdb.Provider),
			fx.Supply(quietLog),
			fx.NopLogger,
		)
		app.RequireStart()
		app.RequireStop()
		if len(seen) != 3 {
			t.Fatalf("tables a start hook on the client found: %v, want both sets' and the outbox's", seen)
		}
	})
	t.Run("a shared table", func(t *testing.T) {
		tdb := pgtest.NewDB(t)
		app := fx.New(fx.Supply(tdb.Provider), outbox.Module,
			fx.Module("orders", outbox.WithMigrations(db.MigratorConfig{Schema: "shop", FS: set("orders"), Table: "t"})),
			fx.Module("billing", outbox.WithMigrations(db.MigratorConfig{Schema: "shop", FS: set("invoices"), Table: "t"})),
			fx.NopLogger)
		err := app.Err()
		if !errors.Is(err, outbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "shop.t") {
			t.Fatalf("app error %v, want ErrInvalidConfig naming the table shop.t", err)
		}
	})
}

// An app set of migrations without files fails the app at construction: a
// Migrator's default files are the outbox's own, so it installed a second
// outbox in the set's schema.
func TestFxWithMigrationsRefusesASetWithoutFiles(t *testing.T) {
	tdb := pgtest.NewDB(t)
	app := fx.New(fx.Supply(tdb.Provider), outbox.Module,
		outbox.WithMigrations(db.MigratorConfig{Schema: "shop", Table: "shop_schema_migrations"}), fx.NopLogger)
	if err := app.Err(); !errors.Is(err, outbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "no FS") {
		t.Fatalf("app error %v, want ErrInvalidConfig saying the set has no FS", err)
	}
}

// A publisher constructor of the wrong shape fails the app at construction,
// with an error naming it, instead of leaving the topic without publisher.
func TestFxAsPublisherRejectsWrongShape(t *testing.T) {
	tdb := pgtest.NewDB(t)
	for _, tc := range []struct {
		name        string
		constructor any
		want        []string
	}{
		{"returns a Topic", topicConstructor, []string{"topicConstructor", "func() outbox.Topic", "must return outbox.Publisher"}},
		{"not a function", outbox.Publisher{}, []string{"outbox.Publisher", "constructor function"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			app := fx.New(fx.Supply(tdb.Provider), outbox.Module, fx.Provide(outbox.AsPublisher(tc.constructor)), fx.NopLogger)
			err := app.Err()
			if !errors.Is(err, outbox.ErrInvalidConfig) {
				t.Fatalf("app error %v, want ErrInvalidConfig", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("the error must say %q: %v", w, err)
				}
			}
		})
	}
}

func topicConstructor() outbox.Topic { return testTopic }

// A publisher constructor that returns an error fails the app with an error
// naming that constructor, among several modules' (fx named the function
// reflect made to annotate it, "reflect".makeFuncStub, whichever failed).
func TestFxAsPublisherNamesTheConstructorThatFailed(t *testing.T) {
	tdb := pgtest.NewDB(t)
	app := fx.New(fx.Supply(tdb.Provider), outbox.Module,
		fx.Module("chat", fx.Provide(outbox.AsPublisher(newChatPublisher))),
		fx.Module("billing", fx.Provide(outbox.AsPublisher(newBillingPublisher))),
		fx.NopLogger)
	err := app.Err()
	if !errors.Is(err, errNoBrokerAddress) {
		t.Fatalf("app error %v, want the constructor's error", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "outbox_test\".newBillingPublisher") || strings.Contains(msg, "makeFuncStub") {
		t.Fatalf("the error must name the constructor that failed, newBillingPublisher: %v", err)
	}
}

var errNoBrokerAddress = errors.New("billing: no broker address configured")

func newChatPublisher(*db.Provider) outbox.Publisher {
	return outbox.Publisher{Topic: outbox.Topic{Namespace: "chat", Topic: "message_sent"}, Publish: noopPublish}
}

func newBillingPublisher(*db.Provider) (outbox.Publisher, error) {
	return outbox.Publisher{}, errNoBrokerAddress
}

// recordingHandler is a slog.Handler that keeps every record's message.
type recordingHandler struct {
	mu   sync.Mutex
	msgs []string
}

func (h *recordingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordingHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *recordingHandler) WithGroup(string) slog.Handler            { return h }
func (h *recordingHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.msgs = append(h.msgs, r.Message)
	return nil
}

func (h *recordingHandler) messages() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.msgs)
}

func (h *recordingHandler) count(substr string) int {
	n := 0
	for _, m := range h.messages() {
		if strings.Contains(m, substr) {
			n++
		}
	}
	return n
}
