-- Back to migration 0001's (status, next_attempt_at) index and migration
-- 0004's sweep and depth, kept by the up migration under other names.
DROP FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz);
DROP FUNCTION modkit_outbox_depth(text[], timestamptz);
ALTER FUNCTION modkit_outbox_sweep_0004(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep;
ALTER FUNCTION modkit_outbox_depth_0004(text[], timestamptz) RENAME TO modkit_outbox_depth;
DROP INDEX modkit_outbox_events_settled_idx;
CREATE INDEX modkit_outbox_events_status_next_attempt_idx
    ON modkit_outbox_events (status, next_attempt_at);
SELECT modkit_outbox_grant_roles();
