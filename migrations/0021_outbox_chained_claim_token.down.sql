-- Back to migration 0014's claim with chains (a token an event), which the
-- up migration kept under another name.
DROP FUNCTION modkit_outbox_claim_chains(uuid, text[], int, int, interval, text[], int[], timestamptz);
ALTER FUNCTION modkit_outbox_claim_chains_0014(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chains;
SELECT modkit_outbox_grant_roles();
