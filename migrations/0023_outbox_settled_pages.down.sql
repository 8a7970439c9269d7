-- Back to migration 0020's grants, without the paged reads of settled
-- events (modkit_outbox_settled, which the up migration left alone, stays).
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0020() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_settled_page(timestamptz, timestamptz, uuid, int, timestamptz),
    modkit_outbox_settled_page_payloads(timestamptz, timestamptz, uuid, int, timestamptz),
    modkit_outbox_settled_page_rows(boolean, timestamptz, timestamptz, uuid, int, timestamptz);
SELECT modkit_outbox_grant_roles();
