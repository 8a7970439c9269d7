-- Back to the modkit_outbox_complete that the up migration kept under
-- another name.
DROP FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz);
ALTER FUNCTION modkit_outbox_complete_0008(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete;
SELECT modkit_outbox_grant_roles();
