-- Back to migration 0026's grants, without the backlog counts.
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0026() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_backlog(timestamptz);
