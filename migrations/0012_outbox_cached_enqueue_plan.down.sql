-- Back to planning the enqueue's statements on every call, with the
-- server's scan settings.
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text) RESET plan_cache_mode;
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text) RESET enable_seqscan;
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text) RESET enable_bitmapscan;
