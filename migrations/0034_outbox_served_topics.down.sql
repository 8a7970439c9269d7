-- Back to migration 0027's grants, without the list of topics served.
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0027() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_served_topics(timestamptz);
