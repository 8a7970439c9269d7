-- Back to the claim with chains, the sweep and the depth gauge of 0014 and
-- the outcome write of 0019, which the up migration kept under other names.
-- Leased links stay as they are (see the up migration's header).
DROP FUNCTION modkit_outbox_claim_chains(uuid, text[], int, int, interval, text[], int[], timestamptz);
DROP FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz);
DROP FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz);
DROP FUNCTION modkit_outbox_depth(text[], timestamptz);
ALTER FUNCTION modkit_outbox_claim_chains_0014(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chains;
ALTER FUNCTION modkit_outbox_complete_0019(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete;
ALTER FUNCTION modkit_outbox_sweep_0014(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep;
ALTER FUNCTION modkit_outbox_depth_0014(text[], timestamptz) RENAME TO modkit_outbox_depth;
SELECT modkit_outbox_grant_roles();
