-- Back to migration 0015's outcome write, which the up migration kept under
-- another name.
DROP FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz);
ALTER FUNCTION modkit_outbox_complete_0015(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete;
SELECT modkit_outbox_grant_roles();
