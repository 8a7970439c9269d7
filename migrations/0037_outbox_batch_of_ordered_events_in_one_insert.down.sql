-- Back to migration 0036's batch enqueue, with its grants.
DROP FUNCTION modkit_outbox_enqueue_many(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[]);
ALTER FUNCTION modkit_outbox_enqueue_many_0036(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[])
    RENAME TO modkit_outbox_enqueue_many;
SELECT modkit_outbox_grant_roles();
