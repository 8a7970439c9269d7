// Package db is modkit's database layer on PostgreSQL: one pgx pool per
// process, shared with database/sql and bun, and the pieces every module
// needs around it.
//
//   - Provider (Open, FromPool, Module for fx) owns the pool and hands out
//     a *pgxpool.Pool, a *sql.DB and a *bun.DB that all draw from it, so
//     pgx and bun code share connections, limits and settings. Open checks
//     the connection once; Module's start hook waits, within the start's
//     time, for a database that cannot be reached yet.
//   - Runner is "the caller's connection or transaction, whatever library
//     opened it": modkit calls that take one (outbox Enqueue, for example)
//     run their SQL through it, so their writes commit or roll back with
//     the caller's. pgx values are Runners as they are; SQL wraps a
//     database/sql or bun handle; anything else does not compile.
//     AsQuerier adapts one to a small common interface.
//   - InTx runs a function in a pgx transaction: commit on nil, rollback on
//     error or panic. The function leaves the transaction open: one that
//     commits or rolls it back itself gets an error saying so.
//   - Migrator applies versioned NNNN_name.up.sql / .down.sql files
//     (golang-migrate's naming) from an fs.FS into a schema, each in its own
//     transaction with its tracking row, holding the schema's advisory lock
//     (a transaction's, which a pooler in transaction mode keeps): migrators
//     of several processes take turns, one migration at a time.
//
// # Example
//
//	prov, err := db.Open(ctx, db.Config{DSN: os.Getenv("DATABASE_URL")})
//	if err != nil {
//		return err
//	}
//	defer prov.Close()
//	m, err := db.NewMigrator(prov.Pool, db.MigratorConfig{Schema: "app", FS: appMigrations, Table: "app_schema_migrations"})
//	if err != nil {
//		return err
//	}
//	if _, err := m.Up(ctx); err != nil {
//		return err
//	}
//	err = prov.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
//		_, err := tx.Exec(ctx, "INSERT INTO app.notes (body) VALUES ($1)", "hello")
//		return err
//	})
package db
