package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/modkit-go/modkit/internal/pgserver"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

const (
	outboxSchema = "outbox"
	riverSchema  = "river"
)

// env is the run's database: created for the run, with the outbox migrated
// into schema outbox and River into schema river, dropped at the end.
type env struct {
	template *pgxpool.Config
	admin    *pgxpool.Pool
	server   string
	log      *slog.Logger
	cleanup  []func()

	outboxTable, outboxLeaders, outboxAttempts, riverJob pgx.Identifier
}

func openEnv(ctx context.Context, dsn string, log *slog.Logger) (e *env, err error) {
	e = &env{log: log,
		outboxTable:    pgx.Identifier{outboxSchema, outboxpg.TableName},
		outboxLeaders:  pgx.Identifier{outboxSchema, outboxpg.LeadersTableName},
		outboxAttempts: pgx.Identifier{outboxSchema, "modkit_outbox_attempts"},
		riverJob:       pgx.Identifier{riverSchema, "river_job"},
	}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	if dsn == "" {
		log.Info("starting a throwaway PostgreSQL cluster (durable: fsync and synchronous_commit on)")
		cluster, err := pgserver.Start(ctx, pgserver.Options{Durable: true})
		if err != nil {
			return e, err
		}
		e.cleanup = append(e.cleanup, func() {
			if err := cluster.Stop(); err != nil {
				log.Warn("stopping the cluster", "error", err)
			}
		})
		dsn = cluster.DSN("postgres")
		e.server = fmt.Sprintf("throwaway durable cluster (internal/pgserver), port %d", cluster.Port())
	}
	base, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return e, fmt.Errorf("parse DSN: %w", err)
	}
	if e.server == "" {
		e.server = fmt.Sprintf("external server %s:%d", base.ConnConfig.Host, base.ConnConfig.Port)
	}
	name := fmt.Sprintf("river_bench_%d_%d", os.Getpid(), time.Now().Unix()%100000)
	conn, err := pgx.ConnectConfig(ctx, base.ConnConfig.Copy())
	if err != nil {
		return e, fmt.Errorf("connect: %w", err)
	}
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	conn.Close(context.WithoutCancel(ctx))
	if err != nil {
		return e, fmt.Errorf("create the run database (the role needs CREATEDB): %w", err)
	}
	e.cleanup = append(e.cleanup, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.ConnectConfig(ctx, base.ConnConfig.Copy())
		if err == nil {
			_, err = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
			conn.Close(ctx)
		}
		if err != nil {
			log.Warn("could not drop the run database; drop it by hand", "database", name, "error", err)
		}
	})
	e.server += ", run database " + name
	e.template = base.Copy()
	e.template.ConnConfig.Database = name
	e.template.MaxConnIdleTime = time.Hour
	if e.admin, err = e.newPool(ctx, 4, 0, nil); err != nil {
		return e, err
	}
	e.cleanup = append(e.cleanup, e.admin.Close)

	m, err := db.NewMigrator(e.admin, db.MigratorConfig{Schema: outboxSchema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return e, err
	}
	if _, err := m.Up(ctx); err != nil {
		return e, fmt.Errorf("migrate the outbox: %w", err)
	}
	if _, err := e.admin.Exec(ctx, "CREATE SCHEMA "+riverSchema); err != nil {
		return e, err
	}
	rm, err := rivermigrate.New(riverpgxv5.New(e.admin), &rivermigrate.Config{Schema: riverSchema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return e, err
	}
	if _, err := rm.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return e, fmt.Errorf("migrate River: %w", err)
	}
	return e, nil
}

// newPool opens a pool on the run's database with maxConns connections
// (0: pgx's default), warm of them opened before it returns, and session
// settings.
func (e *env) newPool(ctx context.Context, maxConns int32, warm int, settings map[string]string) (*pgxpool.Pool, error) {
	cfg := e.template.Copy()
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	for k, v := range settings {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	var conns []*pgxpool.Conn
	for range warm {
		c, err := pool.Acquire(ctx)
		if err != nil {
			pool.Close()
			return nil, err
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	return pool, nil
}

// reset empties the outbox's tables (the attempts ledger too) and River's,
// so that every phase starts from empty tables and unelected leaders, then
// settles. The ledger's append-only triggers refuse TRUNCATE; the run's
// superuser switches them off for its own transaction
// (session_replication_role = replica).
func (e *env) reset(ctx context.Context) error {
	tables := []string{e.outboxTable.Sanitize(), e.outboxLeaders.Sanitize(), e.outboxAttempts.Sanitize(),
		e.riverJob.Sanitize(), pgx.Identifier{riverSchema, "river_leader"}.Sanitize()}
	err := pgx.BeginFunc(ctx, e.admin, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL session_replication_role = replica"); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "TRUNCATE "+strings.Join(tables, ", "))
		return err
	})
	if err != nil {
		return fmt.Errorf("empty the tables (the run needs a superuser): %w", err)
	}
	return e.settle(ctx)
}

// settle runs VACUUM (ANALYZE) on the run's tables and a CHECKPOINT, so that
// every timed phase starts with statistics, no autovacuum debt and the same
// full-page-write debt.
func (e *env) settle(ctx context.Context) error {
	for _, t := range []pgx.Identifier{e.outboxTable, e.outboxAttempts, e.riverJob} {
		if _, err := e.admin.Exec(ctx, "VACUUM (ANALYZE) "+t.Sanitize()); err != nil {
			return fmt.Errorf("vacuum: %w", err)
		}
	}
	if _, err := e.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			return fmt.Errorf("checkpoint: %w", err)
		}
	}
	return nil
}

func (e *env) count(ctx context.Context, query string, args ...any) (int, error) {
	var n int
	err := e.admin.QueryRow(ctx, query, args...).Scan(&n)
	return n, err
}

func (e *env) postgresInfo(ctx context.Context) (string, string) {
	var version string
	_ = e.admin.QueryRow(ctx, "SHOW server_version").Scan(&version)
	var settings []string
	for _, name := range []string{"shared_buffers", "synchronous_commit", "fsync", "full_page_writes", "max_wal_size", "autovacuum"} {
		var v string
		if err := e.admin.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v); err == nil {
			settings = append(settings, name+"="+v)
		}
	}
	return version, strings.Join(settings, " ")
}

func (e *env) close() {
	for i := len(e.cleanup) - 1; i >= 0; i-- {
		e.cleanup[i]()
	}
	e.cleanup = nil
}
