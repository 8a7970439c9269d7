// Package outbox is a transactional outbox on PostgreSQL: commit a change
// and reliably tell someone about it.
//
// A module writes its domain rows and an event in one transaction, through
// whatever it already uses (pgx, bun or database/sql). A Dispatcher, run as
// a lifecycle task in an fx app (see Module) or on its own, claims due events
// in batches under a lease, hands each to the Publisher that the owning
// module registered for its (namespace, topic), and records the outcome:
// delivered; retried with exponential backoff and equal jitter; or
// dead-lettered after MaxAttempts.
//
// # Example
//
//	// In the domain transaction:
//	err := db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
//		if _, err := tx.Exec(ctx, "UPDATE turns SET state = 'completed' WHERE id = $1", turnID); err != nil {
//			return err
//		}
//		_, err := outbox.Enqueue(ctx, tx, outbox.Message{
//			Namespace: "mini-chat", Topic: "usage_snapshot",
//			TenantID: &tenantID, DedupeKey: outbox.Key(tenantID.String() + "/" + turnID.String() + "/" + requestID),
//			Payload: payload,
//		})
//		return err
//	})
//
//	// At start-up:
//	var pubs outbox.Publishers
//	pubs.Register(outbox.Publisher{Topic: outbox.Topic{Namespace: "mini-chat", Topic: "usage_snapshot"}, Publish: sendToBilling})
//	d, err := outbox.NewDispatcher(pool, &pubs, outbox.DispatcherConfig{})
//	err = d.Start(ctx) // … d.Stop(ctx) at shutdown
//
// # Guarantees
//
//   - Completeness: an event enqueued in a transaction is committed with it or
//     not at all. Enqueue adds no network call beyond the INSERT itself.
//   - Idempotent enqueue: while a row with the same (namespace, topic,
//     dedupe_key) exists, enqueueing again inserts nothing and reports
//     Enqueued.AlreadyEnqueued with the existing id, also under races. The
//     dedupe window is the row's lifetime: delivered rows are purged after
//     DispatcherConfig.Retention, after which the key can be used again.
//   - At-least-once delivery: an event is published until a publisher
//     returns nil and the outcome is recorded, or until it is dead. A crash
//     at any point leads to redelivery after the lease expires, with the
//     same ID and DedupeKey: consumers must be idempotent on them (or use
//     HandleTx, below).
//   - Fencing: every claim issues a fresh lease token, and an outcome is
//     recorded only if it carries the current token of an unexpired lease.
//     A worker that stalled past its lease (GC pause, network partition)
//     gets ErrLeaseLost and changes nothing; it never nacks an event that
//     another worker now owns.
//   - No double publishing under valid leases: claims use FOR UPDATE SKIP
//     LOCKED, so replicas never hold the same event at once; publish
//     contexts end LeaseHeadroom before the lease.
//   - Exhausted events end dead, never stuck: a worker that dies on the last
//     allowed attempt leaves the row processing with attempts =
//     max_attempts, which no claim picks up; the dispatcher's sweep moves it
//     to dead with a last_error saying so.
//   - Exactly-once effects for consumers in the same database: a Publisher
//     with HandleTx gets a transaction in which its writes and the ack
//     commit together.
//   - All times (next_attempt_at, leases) come from the database clock.
//
// # Failure modes
//
//   - Database unavailable: claims and outcome writes are retried with
//     capped backoff; events whose outcomes could not be recorded before
//     their lease ended are delivered again.
//   - Lost notifications: LISTEN is only a wake-up. Polling every
//     PollInterval always runs, and a lost LISTEN connection is re-opened.
//   - Publisher panics are recovered, logged with a stack, and count as a
//     failed attempt.
//   - Errors stored in last_error and logged are stripped of credentials
//     (Authorization headers, bearer tokens, passwords in URLs) and
//     truncated (Config.ErrorMaxLen).
//
// # Choosing Publish or HandleTx
//
// Use Publish for anything outside the database: a broker, a webhook, an
// in-process call. Use HandleTx when the consumer's effect is rows in the
// outbox's own database: its writes and the delivered mark commit together.
//
// # Operations
//
// Store has Stats, ListDead, ReplayDead, PurgeDelivered and SweepExhausted.
// The dispatcher exports OpenTelemetry metrics through the global
// MeterProvider (see MeterName).
package outbox
