-- Back to one claim function, planned for each call: migration 0008's,
-- which the up migration renamed.
DROP FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz);
DROP FUNCTION modkit_outbox_claim_plain(uuid, text[], int, int, interval, text[], timestamptz);
ALTER FUNCTION modkit_outbox_claim_chains(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chained;
SELECT modkit_outbox_grant_roles();
