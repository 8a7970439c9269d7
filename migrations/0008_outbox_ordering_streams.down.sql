-- Back to the (namespace, topic, ordering_key, ordering_seq) indexes and
-- the functions that used them, kept by the up migration under other names.
DROP FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text);
DROP FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz);
DROP FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz);
DROP FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz);
DROP FUNCTION modkit_outbox_release_held(text[], text[], int);
DROP FUNCTION modkit_outbox_blocked_keys(int);
DROP FUNCTION modkit_outbox_skip_head(uuid, text, timestamptz);
ALTER FUNCTION modkit_outbox_enqueue_0004(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text)
    RENAME TO modkit_outbox_enqueue;
ALTER FUNCTION modkit_outbox_complete_0005(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete;
ALTER FUNCTION modkit_outbox_claim_chained_0006(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chained;
ALTER FUNCTION modkit_outbox_sweep_0007(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep;
ALTER FUNCTION modkit_outbox_release_held_0004(text[], text[], int) RENAME TO modkit_outbox_release_held;
ALTER FUNCTION modkit_outbox_blocked_keys_0004(int) RENAME TO modkit_outbox_blocked_keys;
ALTER FUNCTION modkit_outbox_skip_head_0004(uuid, text, timestamptz) RENAME TO modkit_outbox_skip_head;
DROP INDEX modkit_outbox_events_stream_idx;
DROP INDEX modkit_outbox_events_held_idx;
CREATE UNIQUE INDEX modkit_outbox_events_ordering_idx
    ON modkit_outbox_events (namespace, topic, ordering_key, ordering_seq) WHERE ordering_key IS NOT NULL;
CREATE INDEX modkit_outbox_events_held_idx
    ON modkit_outbox_events (namespace, topic, ordering_key, ordering_seq) WHERE held;
ALTER TABLE modkit_outbox_events
    DROP CONSTRAINT modkit_outbox_events_stream_fkey,
    DROP CONSTRAINT modkit_outbox_events_stream_check,
    DROP COLUMN ordering_stream;
ALTER TABLE modkit_outbox_sequences DROP COLUMN stream_id;
SELECT modkit_outbox_grant_roles();
