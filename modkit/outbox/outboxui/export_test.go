package outboxui

import (
	"testing"
	"time"
)

// SetPurgeTimeLimit sets the time limit of a purge from the dashboards
// New makes for the rest of t.
func SetPurgeTimeLimit(t testing.TB, d time.Duration) {
	old := purgeTimeLimit
	purgeTimeLimit = d
	t.Cleanup(func() { purgeTimeLimit = old })
}
