-- Back to migration 0023's grants, without the purge from a watermark
-- (modkit_outbox_purge, which the up migration left alone, stays).
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0023() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_purge_from(text[], interval, int, timestamptz, timestamptz);
SELECT modkit_outbox_grant_roles();
