// Package migrations holds the versioned SQL that creates and evolves the
// modkit tables. Files follow the golang-migrate naming
// (NNNN_name.up.sql / NNNN_name.down.sql) and contain no transaction control
// statements, so golang-migrate can run them as they are. goose cannot (it
// wants one file per version with -- +goose Up/Down sections): `modkit-outbox
// migrate sql --format goose` writes that layout, and --format plain one
// script for psql. The statements use unqualified table names: they land in the
// first schema of the search_path, which the modkit migrator sets to its
// configured schema.
//
// Released files are never edited; every change is a new, higher-numbered
// pair. (One exception: a down file that fails may be corrected, as 0004's
// was for a schema whose name has upper-case letters; what an up file did
// is recorded, what a down file does is not.)
package migrations

import "embed"

// FS holds every *.sql migration file of this directory.
//
//go:embed *.sql
var FS embed.FS
