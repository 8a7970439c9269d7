// Package benchsql holds the raw SQL that both benchmark programs
// (cmd/outbox-bench and the River comparison in bench/river) measure the
// library against, so that their raw claim+ack loops write the same rows.
// Each program keeps its own raw claim: they differ on purpose (what they
// return).
package benchsql

// RawAck marks the claimed events $1 (a uuid array) of table delivered by
// id, clearing the lease as the table's lease constraint requires; unlike
// the library's outcome write it checks no lease token and writes no
// ledger row. table is a quoted, qualified name.
func RawAck(table string) string {
	return `UPDATE ` + table + ` SET status = 'delivered', locked_by = NULL, locked_until = NULL,
	lease_token = NULL, updated_at = now()
WHERE id = ANY($1)`
}

// RawAckLedger is RawAck that also appends, in the same statement, the
// attempts-ledger row (to ledger, a quoted, qualified name) the library's
// outcome write appends for a delivery: the same columns, $2 the worker,
// $3 the claim's first lease token, and the event's ledger entries
// counted as the library counts them. A loop that uses it writes what the
// dispatcher writes per event, so the two compare the machinery, not the
// ledger.
func RawAckLedger(table, ledger string) string {
	return `WITH upd AS (
	UPDATE ` + table + ` AS e SET status = 'delivered', locked_by = NULL, locked_until = NULL, lease_token = NULL,
		ledger_seq = e.ledger_seq + 1, updated_at = now()
	WHERE e.id = ANY($1)
	RETURNING e.id, e.ledger_seq, e.namespace, e.topic, e.attempts)
INSERT INTO ` + ledger + ` (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at)
SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'delivered', u.attempts, $2::uuid, $3::uuid, now(), now() FROM upd u`
}
