-- Drops the functions, the ledger (its history is lost) and the checks. The
-- roles are cluster-wide and may serve other schemas: they are left in place.
DO $migration$
DECLARE
    fn text;
BEGIN
    FOR fn IN
        SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = quote_ident(current_schema())::regnamespace AND p.proname LIKE 'modkit\_outbox\_%'
          AND p.proname <> 'modkit_outbox_attempts_append_only'
    LOOP
        EXECUTE format('DROP FUNCTION %s', fn);
    END LOOP;
END $migration$;

DROP TYPE modkit_outbox_event_row;

DO $revoke$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_operator', 'modkit_outbox_reader'] LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            EXECUTE format('REVOKE ALL ON modkit_outbox_events FROM %I', r);
            EXECUTE format('REVOKE ALL ON SCHEMA %I FROM %I', current_schema(), r);
        END IF;
    END LOOP;
END $revoke$;

DROP TABLE modkit_outbox_attempts;
DROP TABLE modkit_outbox_sequences;
DROP INDEX modkit_outbox_events_ordering_idx;
DROP INDEX modkit_outbox_events_held_idx;
DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE status IN ('pending', 'processing');
DROP FUNCTION modkit_outbox_attempts_append_only();

ALTER TABLE modkit_outbox_events
    DROP CONSTRAINT modkit_outbox_events_payload_size_check,
    DROP CONSTRAINT modkit_outbox_events_headers_check,
    DROP CONSTRAINT modkit_outbox_events_ordering_check,
    DROP CONSTRAINT modkit_outbox_events_tenant_key_check,
    DROP CONSTRAINT modkit_outbox_events_dedupe_key_length_check,
    DROP CONSTRAINT modkit_outbox_events_name_pattern_check,
    DROP COLUMN ledger_seq,
    DROP COLUMN claimed_at,
    DROP COLUMN headers,
    DROP COLUMN ordering_key,
    DROP COLUMN ordering_seq,
    DROP COLUMN head_skipped,
    DROP COLUMN held;
