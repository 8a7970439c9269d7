-- Back to migration 0005's chained claim, kept by the up migration under
-- another name.
DROP FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz);
ALTER FUNCTION modkit_outbox_claim_chained_0005(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chained;
SELECT modkit_outbox_grant_roles();
