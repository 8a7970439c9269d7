package pgtest

import (
	"testing"

	"github.com/jackc/pgx/v5"
)

// replaceDatabase points every form of DSN at the tests' database, even one
// whose query names a database (which would win over the URL's path: the
// tests then ran in, and migrated, the server's own database).
func TestReplaceDatabase(t *testing.T) {
	for _, dsn := range []string{
		"postgres://u@localhost:5432/app",
		"postgres://u@/?host=/var/run/postgresql&dbname=app",
		"postgresql://u@localhost/app?database=app&sslmode=disable",
		"host=localhost user=u dbname=app",
	} {
		got, err := replaceDatabase(dsn, "modkit_test_1")
		if err != nil {
			t.Errorf("%s: %v", dsn, err)
			continue
		}
		if cfg, err := pgx.ParseConfig(got); err != nil || cfg.Database != "modkit_test_1" {
			t.Errorf("%s became %s, which names database %q (%v)", dsn, got, cfg.Database, err)
		}
	}
}
