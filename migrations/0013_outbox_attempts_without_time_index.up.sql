-- The attempts ledger loses its index on finished_at. Every outcome appends
-- a ledger row, so the index took an entry for every event delivered, and
-- only modkit_outbox_prune_attempts, which the owner runs now and then to
-- delete old history of purged events, ever read it: the dispatch path and
-- Admin.History find rows by (event_id, attempt_no), the primary key.
-- Without it a drain of 100,000 events ran 1-5% faster (BENCHMARKS.md,
-- "The ledger without its time index"). The prune still deletes the same
-- rows; it reads the whole ledger once to find them.
DROP INDEX modkit_outbox_attempts_finished_idx;
