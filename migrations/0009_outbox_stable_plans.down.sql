-- Back to the server's JIT and bitmap scan settings on the dispatch and
-- enqueue paths, and to the modkit_outbox_complete that the up migration
-- kept under another name.
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text) RESET jit;
ALTER FUNCTION modkit_outbox_enqueue_many(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[]) RESET jit;
ALTER FUNCTION modkit_outbox_claim(uuid, text[], int, int, interval, text[], timestamptz) RESET jit;
ALTER FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz) RESET jit;
ALTER FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz) RESET enable_bitmapscan;
ALTER FUNCTION modkit_outbox_complete_one(uuid, uuid, uuid, text, text, bigint, timestamptz) RESET jit;
ALTER FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz) RESET jit;
ALTER FUNCTION modkit_outbox_purge(text[], interval, int, timestamptz) RESET jit;
ALTER FUNCTION modkit_outbox_purge_recorded(text[], interval, int, timestamptz) RESET jit;
ALTER FUNCTION modkit_outbox_release_held(text[], text[], int) RESET jit;
ALTER FUNCTION modkit_outbox_elect(text[], uuid, interval, timestamptz) RESET jit;
ALTER FUNCTION modkit_outbox_resign(uuid, text[]) RESET jit;
ALTER FUNCTION modkit_outbox_depth(text[], timestamptz) RESET jit;
DROP FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz);
ALTER FUNCTION modkit_outbox_complete_0008(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete;
SELECT modkit_outbox_grant_roles();
