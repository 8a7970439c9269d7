package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/modkit-go/modkit/modkit/db"
)

// migrationFile is one file of a migration tool's layout.
type migrationFile struct {
	name, body string
}

// formatMigrations lays ms out for a migration tool. Each works from the
// same embedded files, so new migrations are included without change here.
//
//   - golang-migrate: the files as they are (NNNN_name.up.sql and
//     NNNN_name.down.sql), which is that tool's naming.
//   - goose: one NNNN_name.sql per version with "-- +goose Up" and
//     "-- +goose Down" sections. Each section is one StatementBegin/End
//     block: goose then sends it as one batch, exactly as modkit's migrator
//     does, so statements with semicolons inside ($$ function bodies) need
//     no care.
//   - plain: one script of every up migration in order, in a transaction,
//     recording each version in modkit_schema_migrations so that
//     "modkit-outbox migrate up" (or Client.Migrate) later agrees.
func formatMigrations(format string, ms []db.Migration) ([]migrationFile, error) {
	var out []migrationFile
	switch format {
	case "golang-migrate":
		for _, m := range ms {
			base := fmt.Sprintf("%04d_%s", m.Version, m.Name)
			out = append(out, migrationFile{base + ".up.sql", withNewline(m.UpSQL())},
				migrationFile{base + ".down.sql", withNewline(m.DownSQL())})
		}
	case "goose":
		for _, m := range ms {
			var b strings.Builder
			fmt.Fprintf(&b, "-- modkit migration %04d_%s, converted for goose by modkit-outbox migrate sql.\n", m.Version, m.Name)
			b.WriteString("-- +goose Up\n-- +goose StatementBegin\n")
			b.WriteString(withNewline(m.UpSQL()))
			b.WriteString("-- +goose StatementEnd\n\n-- +goose Down\n-- +goose StatementBegin\n")
			b.WriteString(withNewline(m.DownSQL()))
			b.WriteString("-- +goose StatementEnd\n")
			out = append(out, migrationFile{fmt.Sprintf("%04d_%s.sql", m.Version, m.Name), b.String()})
		}
	case "plain":
		var b strings.Builder
		b.WriteString("-- The modkit migrations, every up migration in order, printed by modkit-outbox migrate sql.\n" +
			"-- Tables land in the first schema of the search_path. Run it with: psql -v ON_ERROR_STOP=1 -f FILE\n" +
			"BEGIN;\n\n")
		fmt.Fprintf(&b, "CREATE TABLE IF NOT EXISTS %s (version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());\n", db.MigrationsTable)
		for _, m := range ms {
			fmt.Fprintf(&b, "\n-- %04d_%s\n%s", m.Version, m.Name, withNewline(m.UpSQL()))
			fmt.Fprintf(&b, "INSERT INTO %s (version, name) VALUES (%d, '%s');\n", db.MigrationsTable, m.Version, m.Name)
		}
		b.WriteString("\nCOMMIT;\n")
		out = append(out, migrationFile{"modkit_outbox.sql", b.String()})
	default:
		return nil, usageErr("--format %q: use golang-migrate, goose or plain", format)
	}
	return out, nil
}

func withNewline(s string) string {
	if s == "" || strings.HasSuffix(s, "\n") {
		return s
	}
	return s + "\n"
}

// writeFiles writes files into dir (created if missing), refusing to
// overwrite a file that differs.
func writeFiles(dir string, files []migrationFile) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, f := range files {
		p := filepath.Join(dir, f.name)
		old, err := os.ReadFile(p)
		if err == nil && string(old) != f.body {
			return fmt.Errorf("%s exists with other content; remove it or choose another --out", p)
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if err := os.WriteFile(p, []byte(f.body), 0o644); err != nil {
			return err
		}
	}
	return nil
}
