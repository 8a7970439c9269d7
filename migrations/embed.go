// Package migrations holds the versioned SQL that creates and evolves the
// modkit tables. Files follow the golang-migrate naming
// (NNNN_name.up.sql / NNNN_name.down.sql) and contain no transaction control
// statements, so golang-migrate, goose (with its sqlfile adapter) or atlas can
// run them too. The statements use unqualified table names: they land in the
// first schema of the search_path, which the modkit migrator sets to its
// configured schema.
//
// Released files are never edited; every change is a new, higher-numbered
// pair.
package migrations

import "embed"

// FS holds every *.sql migration file of this directory.
//
//go:embed *.sql
var FS embed.FS
