package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Enqueueing or dispatching before the migrations ran fails with
// ErrNotMigrated, the PostgreSQL error still reachable, and a message that
// names the schema and the three ways to migrate.
func TestNotMigratedSaysWhatToDo(t *testing.T) {
	tdb := pgtest.NewDB(t)
	c := clientOn(t, tdb.Provider.Pool, outbox.Config{Schema: "not_yet", Logger: quietLog})
	check := func(what string, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.Is(err, outbox.ErrNotMigrated) || !errors.As(err, &pgErr) {
			t.Fatalf("%s: %v, want ErrNotMigrated wrapping the PostgreSQL error", what, err)
		}
		for _, hint := range []string{`"not_yet"`, "Client.Migrate", "outbox.WithMigrations", "migrations/"} {
			if !strings.Contains(err.Error(), hint) {
				t.Errorf("%s: the error must mention %s: %v", what, hint, err)
			}
		}
	}
	_, err := c.Enqueue(ctx, tdb.Provider.Pool, msg(1))
	check("Enqueue", err)
	_, err = c.EnqueueBatch(ctx, tdb.Provider.Pool, []outbox.Message{msg(1), msg(2)})
	check("EnqueueBatch", err)
	d, err := c.NewDispatcher(outbox.DispatcherConfig{Logger: quietLog},
		outbox.Publisher{Topic: testTopic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	check("Dispatcher.Start", d.Start(ctx))
	// The operator's tools say the same.
	admin := c.Admin()
	_, err = admin.Stats(ctx)
	check("Admin.Stats", err)
	_, err = admin.List(ctx, outbox.EventFilter{})
	check("Admin.List", err)
	_, err = admin.Get(ctx, uuid.New())
	check("Admin.Get", err)
	_, err = admin.History(ctx, uuid.New())
	check("Admin.History", err)
	_, err = admin.ReplayDead(ctx, "test", outbox.EventFilter{Status: outbox.StatusDead})
	check("Admin.ReplayDead", err)
	// A schema whose table lacks a column a later migration added (a
	// migration left out) says the same.
	partly := clientOn(t, tdb.Provider.Pool, outbox.Config{Schema: "partly", Logger: quietLog})
	if err := partly.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := tdb.Provider.Pool.Exec(ctx, "ALTER TABLE partly.modkit_outbox_events DROP COLUMN headers CASCADE"); err != nil {
		t.Fatal(err)
	}
	if _, err := partly.Enqueue(ctx, tdb.Provider.Pool, msg(1)); !errors.Is(err, outbox.ErrNotMigrated) {
		t.Fatalf("Enqueue into a table without a column a migration added: %v, want ErrNotMigrated", err)
	}
	// A migrated database is not reported as unmigrated.
	if _, err := clientOn(t, tdb.Provider.Pool, outbox.Config{}).Enqueue(ctx, tdb.Provider.Pool, msg(3)); err != nil {
		t.Fatal(err)
	}
}

// Enqueueing in a transaction that an earlier statement broke says to roll
// it back, instead of PostgreSQL's bare "current transaction is aborted".
func TestEnqueueInFailedTransactionSaysRollBack(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	tx, err := tdb.Provider.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("division by zero succeeded")
	}
	_, err = c.Enqueue(ctx, tx, msg(1))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25P02" || !strings.Contains(err.Error(), "roll it back") {
		t.Fatalf("enqueue in an aborted transaction: %v", err)
	}
}

// Enqueueing in a read-only transaction says so. It gave PostgreSQL's bare
// error (for a batch, "cannot execute SELECT in a read-only transaction")
// and for a batch hinted that the outbox was not migrated.
func TestEnqueueInReadOnlyTransactionSaysSo(t *testing.T) {
	c, tdb := newClient(t, outbox.Config{})
	for name, enqueue := range map[string]func(pgx.Tx) error{
		"Enqueue": func(tx pgx.Tx) error { _, err := c.Enqueue(ctx, tx, msg(1)); return err },
		"EnqueueBatch": func(tx pgx.Tx) error {
			_, err := c.EnqueueBatch(ctx, tx, []outbox.Message{msg(1), msg(2)})
			return err
		},
	} {
		tx, err := tdb.Provider.Pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		err = enqueue(tx)
		_ = tx.Rollback(ctx)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "25006" || !strings.Contains(err.Error(), "read-write transaction") ||
			strings.Contains(err.Error(), "migrated") {
			t.Errorf("%s in a read-only transaction: %v", name, err)
		}
	}
}

// A login role refused a privilege (SQLSTATE 42501, still matched by
// errors.As) is told which outbox role to grant it: the producer role for
// an enqueue, the dispatcher role for a dispatcher's start, the reader or
// operator role for Admin's reads, the operator role for its writes. The
// hints asked whether the role "may read and
// write the outbox tables", which the outbox's roles never may.
func TestPrivilegeErrorsNameTheRoleToGrant(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	want := func(what string, err error, role string) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" || !strings.Contains(err.Error(), "grant it "+role) {
			t.Errorf("%s: %v; want SQLSTATE 42501 and a hint to grant %s", what, err, role)
		}
	}

	nobodyPool := tdb.LoginAs(t, "")
	nobody := clientOn(t, nobodyPool, outbox.Config{Logger: quietLog})
	_, err := nobody.Enqueue(ctx, nobodyPool, msg(1))
	want("enqueue by a role with no outbox role", err, "modkit_outbox_producer")

	producer := clientOn(t, tdb.LoginAs(t, "modkit_outbox_producer"), outbox.Config{Logger: quietLog})
	_, err = producer.Admin().Stats(ctx)
	want("stats by the producer role", err, "modkit_outbox_reader")

	// The reader may read; a write it tries names the operator role only.
	reader := clientOn(t, tdb.LoginAs(t, "modkit_outbox_reader"), outbox.Config{Logger: quietLog})
	_, err = reader.Admin().ReplayDead(ctx, "test", outbox.EventFilter{Status: outbox.StatusDead})
	want("a replay by the reader role", err, "modkit_outbox_operator")
	if err != nil && strings.Contains(err.Error(), "modkit_outbox_reader (to read)") {
		t.Errorf("a replay by the reader role: %v; it suggests the reader role, which the login has", err)
	}

	cfg := testConfig(newOutcomeLog())
	d, err := producer.NewDispatcher(cfg, outbox.Publisher{Topic: testTopic, Publish: noopPublish})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Start(ctx)
	want("a dispatcher started by the producer role", err, "modkit_outbox_dispatcher")
	if err == nil {
		_ = d.Stop(ctx)
	}
}

// Admin.Rights says what each outbox role's login may do, as the database
// decides it: the owner and the operator role operate and read payloads,
// the reader role does neither, and a schema without the outbox's
// functions cannot tell.
func TestAdminRightsFollowTheLoginsRole(t *testing.T) {
	owner, tdb := newClient(t, outbox.Config{})
	for _, tc := range []struct {
		name              string
		client            *outbox.Client
		operate, payloads bool
	}{
		{"owner", owner, true, true},
		{"operator", clientOn(t, tdb.LoginAs(t, "modkit_outbox_operator"), outbox.Config{Logger: quietLog}), true, true},
		{"reader", clientOn(t, tdb.LoginAs(t, "modkit_outbox_reader"), outbox.Config{Logger: quietLog}), false, false},
	} {
		r, err := tc.client.Admin().Rights(ctx)
		if err != nil || !r.Known || r.Operate != tc.operate || r.ReadPayloads != tc.payloads || r.User == "" {
			t.Errorf("%s: Rights() = %+v, %v; want known, operate %v, payloads %v and the login's name", tc.name, r, err, tc.operate, tc.payloads)
		}
	}
	unmigrated := clientOn(t, tdb.Provider.Pool, outbox.Config{Schema: "not_migrated", Logger: quietLog})
	if r, err := unmigrated.Admin().Rights(ctx); err != nil || r.Known || r.Operate || r.ReadPayloads {
		t.Errorf("a schema without the outbox: Rights() = %+v, %v; want nothing known", r, err)
	}
}

// poolerStore fails every insert and list as pgx's statement cache does
// behind PgBouncer in transaction mode: a prepared statement that another
// server connection holds (42P05) or that this one does not (26000).
type poolerStore struct {
	driver.Store
	code   string
	claims chan struct{} // receives a value at each claim, when there is room
}

func (s poolerStore) Insert(context.Context, any, []driver.InsertRow, []string) ([]driver.Inserted, error) {
	return nil, &pgconn.PgError{Code: s.code, Message: `prepared statement "stmtcache_1" already exists`}
}

func (s poolerStore) Claim(context.Context, driver.ClaimParams) ([]driver.Claimed, error) {
	select {
	case s.claims <- struct{}{}:
	default:
	}
	return nil, &pgconn.PgError{Code: s.code, Message: `prepared statement "stmtcache_1" already exists`}
}

func (s poolerStore) List(context.Context, driver.ListFilter) ([]driver.Event, error) {
	return nil, &pgconn.PgError{Code: s.code, Message: `prepared statement "stmtcache_1" does not exist`}
}

// A prepared statement's conflict behind a pooler says so and what to set,
// rather than asking whether the outbox was migrated (42P05 is of class 42,
// which the driver took for a missing table or a privilege).
func TestPoolerConflictsSayWhatToSet(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	for _, code := range []string{"42P05", "26000"} {
		claims := make(chan struct{}, 2)
		c := clientWrappingStore(t, pool, func(st driver.Store) driver.Store { return poolerStore{Store: st, code: code, claims: claims} })
		_, err := c.Enqueue(ctx, pool, msg(1))
		if err == nil || !strings.Contains(err.Error(), "max_prepared_statements") || strings.Contains(err.Error(), "migrated") {
			t.Errorf("enqueue meeting %s: %v; want the pooler's hint, not the migrations'", code, err)
		}
		_, err = c.Admin().List(ctx, outbox.EventFilter{Status: outbox.StatusDead})
		if err == nil || !strings.Contains(err.Error(), "default_query_exec_mode=cache_describe") {
			t.Errorf("list meeting %s: %v; want the pooler's hint", code, err)
		}
		// A dispatcher retries such claims (the next may not meet it), and
		// a start that runs out of time says what to set: here it ends once
		// a claim has been tried again, the first one's failure recorded.
		d, err := c.NewDispatcher(testConfig(newOutcomeLog()), outbox.Publisher{Topic: testTopic, Publish: noopPublish})
		if err != nil {
			t.Fatal(err)
		}
		sctx, cancel := context.WithCancel(ctx)
		started := make(chan error, 1)
		go func() { started <- d.Start(sctx) }()
		for range 2 {
			select {
			case <-claims:
			case err := <-started:
				t.Fatalf("a start whose claims meet %s returned before its second claim: %v", code, err)
			}
		}
		cancel()
		err = <-started
		if err == nil || !strings.Contains(err.Error(), "max_prepared_statements") {
			t.Errorf("a start whose claims meet %s: %v; want the pooler's hint", code, err)
		}
		if err := d.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// The operator's writes by id work on a pool in pgx's exec and simple
// protocol modes (the usual advice for a pool behind PgBouncer in
// transaction mode): they sent the ids as []uuid.UUID, which pgx cannot
// encode as text ("unable to encode []uuid.UUID … into text format").
func TestOperatorWritesByIDInTextModes(t *testing.T) {
	_, tdb := newClient(t, outbox.Config{})
	pool := tdb.Provider.Pool
	st := admStore(t, pool, "public", nil)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		cfg, err := pgxpool.ParseConfig(tdb.DSN)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.DefaultQueryExecMode = mode
		textPool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer textPool.Close()
		c := clientOn(t, textPool, outbox.Config{Logger: quietLog})
		ids := enqueueN(t, c, textPool, 3)
		admin := c.Admin()
		if got, err := admin.DeadLetter(ctx, "ops", outbox.EventFilter{}, ids...); err != nil || len(got) != 3 {
			t.Fatalf("%v: dead-letter by id: %v, %v", mode, got, err)
		}
		if got, err := admin.ReplayDead(ctx, "ops", outbox.EventFilter{}, ids[:2]...); err != nil || len(got) != 2 {
			t.Fatalf("%v: replay by id: %v, %v", mode, got, err)
		}
		if got, err := admin.PurgeDead(ctx, "ops", outbox.EventFilter{}, ids[2]); err != nil || len(got) != 1 {
			t.Fatalf("%v: purge dead by id: %v, %v", mode, got, err)
		}
		admSettle(t, st, driver.Delivered, "", admClaim(t, st, 2)...)
	}
}

// MigrateTo refuses a version the outbox's migrations do not have, 0 and
// negative ones included, and applies nothing.
func TestMigrateToAnUnknownVersion(t *testing.T) {
	c, _ := newClient(t, outbox.Config{})
	for _, v := range []int64{0, -1, 99999} {
		if err := c.MigrateTo(ctx, v); !errors.Is(err, db.ErrUnknownVersion) {
			t.Errorf("MigrateTo(%d): %v, want ErrUnknownVersion", v, err)
		}
	}
	if err := c.MigrateTo(ctx, 1); err != nil {
		t.Fatalf("MigrateTo(1) on a migrated schema: %v", err)
	}
}
