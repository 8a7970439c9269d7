-- Back to the batch enqueue that took each event's sequence through
-- modkit_outbox_enqueue (migration 0032's version), with its grants.
DROP FUNCTION modkit_outbox_enqueue_many(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[]);
ALTER FUNCTION modkit_outbox_enqueue_many_0032(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[])
    RENAME TO modkit_outbox_enqueue_many;
SELECT modkit_outbox_grant_roles();
