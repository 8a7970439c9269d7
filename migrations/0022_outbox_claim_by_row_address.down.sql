-- Back to migration 0016's claim without chains (the lease written by id),
-- which the up migration kept under another name.
DROP FUNCTION modkit_outbox_claim_plain(uuid, text[], int, int, interval, text[], timestamptz);
ALTER FUNCTION modkit_outbox_claim_plain_0016(uuid, text[], int, int, interval, text[], timestamptz)
    RENAME TO modkit_outbox_claim_plain;
SELECT modkit_outbox_grant_roles();
