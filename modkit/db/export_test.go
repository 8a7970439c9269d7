package db

// LockKey is the advisory lock m takes for its schema.
func LockKey(m *Migrator) int64 { return m.lockKey() }
