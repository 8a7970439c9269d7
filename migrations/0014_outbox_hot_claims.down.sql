-- Back to migration 0013's functions, kept by the up migration under the
-- suffix _0013, and to its indexes (built over the whole table, which takes
-- a while on a large one). Dropping the generated columns does not rewrite
-- the table; pages already written keep their fill.
DROP FUNCTION modkit_outbox_claim_plain(uuid, text[], int, int, interval, text[], timestamptz);
DROP FUNCTION modkit_outbox_claim_chains(uuid, text[], int, int, interval, text[], int[], timestamptz);
DROP FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz);
DROP FUNCTION modkit_outbox_depth(text[], timestamptz);
DROP FUNCTION modkit_outbox_purge(text[], interval, int, timestamptz);
DROP FUNCTION modkit_outbox_purge_recorded(text[], interval, int, timestamptz);
DROP FUNCTION modkit_outbox_blocked_keys(int);
ALTER FUNCTION modkit_outbox_claim_plain_0013(uuid, text[], int, int, interval, text[], timestamptz)
    RENAME TO modkit_outbox_claim_plain;
ALTER FUNCTION modkit_outbox_claim_chains_0013(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chains;
ALTER FUNCTION modkit_outbox_sweep_0013(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep;
ALTER FUNCTION modkit_outbox_depth_0013(text[], timestamptz) RENAME TO modkit_outbox_depth;
ALTER FUNCTION modkit_outbox_purge_0013(text[], interval, int, timestamptz) RENAME TO modkit_outbox_purge;
ALTER FUNCTION modkit_outbox_purge_recorded_0013(text[], interval, int, timestamptz)
    RENAME TO modkit_outbox_purge_recorded;
ALTER FUNCTION modkit_outbox_blocked_keys_0013(int) RENAME TO modkit_outbox_blocked_keys;

DROP INDEX modkit_outbox_events_claim_idx;
DROP INDEX modkit_outbox_events_settled_idx;
ALTER TABLE modkit_outbox_events
    DROP COLUMN settled_status,
    DROP COLUMN settled_at,
    SET (fillfactor = 85);
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE status = 'pending' AND NOT held;
CREATE INDEX modkit_outbox_events_settled_idx
    ON modkit_outbox_events (status, updated_at)
    WHERE status IN ('delivered', 'dead');
CREATE INDEX modkit_outbox_events_locked_until_idx
    ON modkit_outbox_events (locked_until)
    WHERE locked_until IS NOT NULL;
SELECT modkit_outbox_grant_roles();
