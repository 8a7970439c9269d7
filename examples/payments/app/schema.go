package app

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// Topic is the outbox topic of payment instructions.
var Topic = outbox.Topic{Namespace: "payments", Topic: "instruction"}

// schemaDDL is the example's own tables. A participant's next_seq is taken
// under the row's lock in the accepting transaction, so a participant's
// instructions are numbered 1, 2, … in the order they were accepted.
const schemaDDL = `
CREATE TABLE IF NOT EXISTS payments_participants (
	id       text   PRIMARY KEY,
	run_id   uuid   NOT NULL,
	name     text   NOT NULL,
	next_seq bigint NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS payments_instructions (
	id             uuid        PRIMARY KEY,
	run_id         uuid        NOT NULL,
	participant_id text        NOT NULL REFERENCES payments_participants (id),
	seq            bigint      NOT NULL,
	amount_minor   bigint      NOT NULL,
	currency       text        NOT NULL,
	destination    text        NOT NULL,
	event_id       uuid        NOT NULL,
	accepted_at    timestamptz NOT NULL DEFAULT now(),
	UNIQUE (participant_id, seq)
);
CREATE INDEX IF NOT EXISTS payments_instructions_run ON payments_instructions (run_id);
`

// Roles are the login roles of one run, one per job, each a member of the
// outbox role its job needs and granted only what it needs on the
// example's tables.
type Roles struct {
	// API enqueues (modkit_outbox_producer) and writes instructions.
	API string
	// Dispatcher claims and records outcomes (modkit_outbox_dispatcher);
	// it has no access to the example's tables.
	Dispatcher string
	// Operator skips the dead head of a blocked participant
	// (modkit_outbox_operator).
	Operator string
	// Report reads (modkit_outbox_reader) and selects the example's
	// tables.
	Report string

	names    []string
	password string
	baseDSN  string
}

// DSN returns the DSN of role: the base DSN, every setting of it (TLS
// included) kept, with role's user and password.
func (r *Roles) DSN(role string) (string, error) {
	if _, err := pgx.ParseConfig(r.baseDSN); err != nil {
		return "", err
	}
	if u, err := url.Parse(r.baseDSN); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Del("user")
		q.Del("password")
		u.User, u.RawQuery = url.UserPassword(role, r.password), q.Encode()
		return u.String(), nil
	}
	// The keyword/value form: a later keyword overrides an earlier one.
	return fmt.Sprintf("%s user='%s' password='%s'", r.baseDSN, role, r.password), nil
}

// Setup migrates the outbox and the example's tables as the administrative
// connection admin (on dsn), and creates the run's login roles.
func Setup(ctx context.Context, admin *pgxpool.Pool, dsn string) (*Roles, error) {
	client, err := outbox.New(outboxpg.New(admin), outbox.Config{})
	if err != nil {
		return nil, err
	}
	if err := client.Migrate(ctx); err != nil {
		return nil, fmt.Errorf("migrate the outbox: %w", err)
	}
	if _, err := admin.Exec(ctx, schemaDDL); err != nil {
		return nil, fmt.Errorf("create the payments tables: %w", err)
	}
	suffix := randomHex(4)
	r := &Roles{
		API: "payments_api_" + suffix, Dispatcher: "payments_dispatcher_" + suffix,
		Operator: "payments_operator_" + suffix, Report: "payments_report_" + suffix,
		password: randomHex(16), baseDSN: dsn,
	}
	steps := []struct{ role, group, grants string }{
		{r.API, outboxpg.RoleProducer, "GRANT SELECT, UPDATE ON payments_participants TO %[1]s; GRANT INSERT ON payments_instructions TO %[1]s"},
		{r.Dispatcher, outboxpg.RoleDispatcher, ""},
		{r.Operator, outboxpg.RoleOperator, ""},
		{r.Report, outboxpg.RoleReader, "GRANT SELECT ON payments_participants, payments_instructions TO %[1]s"},
	}
	for _, s := range steps {
		id := pgx.Identifier{s.role}.Sanitize()
		if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN PASSWORD '%s' IN ROLE %s",
			id, r.password, pgx.Identifier{s.group}.Sanitize())); err != nil {
			_ = r.Drop(context.WithoutCancel(ctx), admin)
			return nil, fmt.Errorf("create role %s: %w", s.role, err)
		}
		r.names = append(r.names, s.role)
		if s.grants != "" {
			if _, err := admin.Exec(ctx, fmt.Sprintf(s.grants, id)); err != nil {
				_ = r.Drop(context.WithoutCancel(ctx), admin)
				return nil, fmt.Errorf("grants of %s: %w", s.role, err)
			}
		}
	}
	return r, nil
}

// Drop removes the run's login roles and their grants. It revokes the
// grants Setup made (the tables' owner may) rather than DROP OWNED BY,
// which a role with CREATEROLE only may not run on PostgreSQL 16 and later.
func (r *Roles) Drop(ctx context.Context, admin *pgxpool.Pool) error {
	var first error
	for _, name := range r.names {
		id := pgx.Identifier{name}.Sanitize()
		if _, err := admin.Exec(ctx, "REVOKE ALL ON payments_participants, payments_instructions FROM "+id+"; DROP ROLE "+id); err != nil && first == nil {
			first = fmt.Errorf("drop role %s: %w", name, err)
		}
	}
	r.names = nil
	return first
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
