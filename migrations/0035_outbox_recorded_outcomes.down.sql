-- Back to migration 0034's grants, without the lookup of recorded outcomes.
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0034() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_recorded_outcomes(uuid, uuid[], uuid[]);
