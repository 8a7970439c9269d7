-- Back to migration 0025's grants, without the purge of dead events.
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0025() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_purge_dead_filter(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int, text, timestamptz),
    modkit_outbox_purge_dead(uuid[], text, timestamptz);
SELECT modkit_outbox_grant_roles();
