-- Back to migration 0037's claim index and claim functions: the index of
-- (created_at, id), and the claims without the next_attempt_at condition.
DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE settled_status IS NULL AND NOT held;

DO $migration$
DECLARE
    f record;
    v_def text;
BEGIN
    FOR f IN
        SELECT p.oid FROM pg_catalog.pg_proc p
        JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = current_schema() AND p.proname IN ('modkit_outbox_claim_plain', 'modkit_outbox_claim_chains')
    LOOP
        v_def := pg_catalog.pg_get_functiondef(f.oid);
        EXECUTE replace(v_def, 'AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts', 'AND e.attempts < p_max_attempts');
    END LOOP;
END $migration$;
