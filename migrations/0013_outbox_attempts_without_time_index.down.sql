-- Back to an index of the ledger by finished_at (built over the whole
-- ledger, which takes a while on a large one).
CREATE INDEX modkit_outbox_attempts_finished_idx ON modkit_outbox_attempts (finished_at);
