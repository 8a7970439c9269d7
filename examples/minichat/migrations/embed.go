// Package migrations holds Mini Chat's own tables, applied by the modkit
// Migrator with a tracking table of their own (minichat_schema_migrations),
// next to the outbox migrations.
package migrations

import "embed"

// FS holds the Mini Chat migration files.
//
//go:embed *.sql
var FS embed.FS

// Table is the migrator tracking table of this set.
const Table = "minichat_schema_migrations"
