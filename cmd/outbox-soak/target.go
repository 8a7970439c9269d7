package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgserver"
	"github.com/modkit-go/modkit/modkit/db"
)

// target is where the soak runs: a database created for the run on a
// throwaway durable cluster or on an external server.
type target struct {
	cluster  *pgserver.Cluster // nil on an external server: no restarts then
	adminDSN string
	name     string // the run database
	dsn      string // connects to it
	server   string // human description
}

// The soak's own tables, beside the outbox table: what was enqueued (in the
// producer's transaction), what was delivered (by the publisher), and an
// audit of every transition out of processing (by trigger).
const soakDDL = `
CREATE TABLE soak_enqueued (
	event_id    uuid PRIMARY KEY,
	-- The producer's sequence number, its dedupe key. One event a seq,
	-- unless events are deleted on delivery: a producer's retry after an
	-- ambiguous commit then enqueues a second event when the first was
	-- already delivered (its dedupe key free again).
	seq         bigint NOT NULL,
	poison      text CHECK (poison IN ('transient', 'permanent')),
	enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE soak_deliveries (
	event_id    uuid NOT NULL,
	lease_token uuid, -- NULL: made after its lease had ended (see recordDelivery)
	attempt     int NOT NULL,
	pid         int NOT NULL,
	sent_at     timestamptz NOT NULL, -- the dispatcher's clock just before it sent the insert
	started_at  timestamptz NOT NULL DEFAULT statement_timestamp(), -- the server began the insert
	at          timestamptz NOT NULL DEFAULT clock_timestamp()  -- the server made the row
);
CREATE INDEX ON soak_deliveries (event_id);
CREATE INDEX ON soak_enqueued (seq);
CREATE TABLE soak_audit (
	event_id         uuid NOT NULL,
	new_status       text NOT NULL,
	old_token        uuid,
	new_token        uuid,
	old_locked_until timestamptz,
	new_last_error   text,
	-- The start of the statement that made the transition: the time the
	-- outbox's functions judge a lease by (modkit_outbox_clock). now(), the
	-- transaction's start, can lie tens of milliseconds earlier (the
	-- implicit transaction starts with the Parse message, the statement
	-- with the Execute after it), so a lease that ended in between looked
	-- valid to this audit though the claim rightly found it expired.
	at               timestamptz NOT NULL
);
CREATE FUNCTION soak_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO soak_audit VALUES (OLD.id, NEW.status, OLD.lease_token, NEW.lease_token, OLD.locked_until, NEW.last_error, statement_timestamp());
	RETURN NULL;
END $$;
CREATE TRIGGER soak_audit AFTER UPDATE ON modkit_outbox_events
	FOR EACH ROW WHEN (OLD.status = 'processing') EXECUTE FUNCTION soak_audit();
-- A delivery under Publisher.DeleteOnDelivery deletes the leased row.
CREATE FUNCTION soak_audit_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO soak_audit VALUES (OLD.id, 'delivered', OLD.lease_token, NULL, OLD.locked_until, NULL, statement_timestamp());
	RETURN NULL;
END $$;
CREATE TRIGGER soak_audit_delete AFTER DELETE ON modkit_outbox_events
	FOR EACH ROW WHEN (OLD.status = 'processing') EXECUTE FUNCTION soak_audit_delete();
-- Nothing in the soak changes a delivered or dead event (purges delete
-- them); an update of one would be a resurrection.
CREATE TABLE soak_resettled (event_id uuid NOT NULL, old_status text NOT NULL, new_status text NOT NULL,
	at timestamptz NOT NULL DEFAULT statement_timestamp());
CREATE FUNCTION soak_resettled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO soak_resettled (event_id, old_status, new_status) VALUES (OLD.id, OLD.status, NEW.status);
	RETURN NULL;
END $$;
CREATE TRIGGER soak_resettled AFTER UPDATE ON modkit_outbox_events
	FOR EACH ROW WHEN (OLD.status IN ('delivered', 'dead')) EXECUTE FUNCTION soak_resettled();`

// openTarget starts a durable throwaway cluster when dsn is empty, creates
// the run database, and migrates it.
func openTarget(ctx context.Context, dsn string) (t *target, err error) {
	t = &target{adminDSN: dsn}
	defer func() {
		if err != nil {
			t.close()
		}
	}()
	if dsn == "" {
		logf("starting a throwaway durable PostgreSQL cluster")
		if t.cluster, err = pgserver.Start(ctx, pgserver.Options{Durable: true}); err != nil {
			return t, err
		}
		t.adminDSN = t.cluster.DSN("postgres")
		t.server = fmt.Sprintf("throwaway durable PostgreSQL %s on port %d", t.cluster.Version(), t.cluster.Port())
	} else {
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			return t, fmt.Errorf("parse DSN: %w", err)
		}
		t.server = fmt.Sprintf("external server %s:%d (no restarts)", cfg.Host, cfg.Port)
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	t.name = fmt.Sprintf("modkit_soak_%d_%s", os.Getpid(), hex.EncodeToString(suffix))
	if err := t.admin(ctx, "CREATE DATABASE "+pgx.Identifier{t.name}.Sanitize()); err != nil {
		t.name = ""
		return t, fmt.Errorf("create the run database (the role needs CREATEDB): %w", err)
	}
	if t.dsn, err = withDatabase(t.adminDSN, t.name); err != nil {
		return t, err
	}
	pool, err := pgxpool.New(ctx, t.dsn)
	if err != nil {
		return t, fmt.Errorf("connect to the run database: %w", err)
	}
	defer pool.Close()
	m, err := db.NewMigrator(pool, db.MigratorConfig{Logger: quietLogger()})
	if err != nil {
		return t, err
	}
	if _, err := m.Up(ctx); err != nil {
		return t, fmt.Errorf("migrate: %w", err)
	}
	if _, err := pool.Exec(ctx, soakDDL); err != nil {
		return t, fmt.Errorf("create the soak tables: %w", err)
	}
	return t, nil
}

func (t *target) admin(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, t.adminDSN)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql)
	return err
}

// restart stops the server the way a crash would and starts it again. It
// is only possible on the throwaway cluster.
func (t *target) restart(ctx context.Context) error {
	if t.cluster == nil {
		return nil
	}
	if err := t.cluster.Restart(ctx); err != nil {
		return fmt.Errorf("restart PostgreSQL: %w", err)
	}
	return nil
}

// close drops the run database and stops the cluster.
func (t *target) close() {
	if t.cluster != nil {
		_ = t.cluster.Stop()
		return
	}
	if t.name != "" {
		if err := t.admin(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{t.name}.Sanitize()+" WITH (FORCE)"); err != nil {
			fmt.Fprintf(os.Stderr, "outbox-soak: drop the run database %s: %v\n", t.name, err)
		}
	}
}

// withDatabase points dsn (a URL or key=value string) at database name.
func withDatabase(dsn, name string) (string, error) {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("parse DSN: %w", err)
		}
		u.Path = "/" + name
		return u.String(), nil
	}
	return dsn + " dbname=" + name, nil // a later keyword wins
}
