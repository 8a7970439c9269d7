-- Back to the ledger key (event_id, attempt_no). It fails, changing
-- nothing, when an id's history holds two entries of one number (an id
-- used again after its event was purged): remove one of them first.
ALTER TABLE modkit_outbox_attempts
    DROP CONSTRAINT modkit_outbox_attempts_pkey,
    ADD CONSTRAINT modkit_outbox_attempts_pkey PRIMARY KEY (event_id, attempt_no);

DO $migration$
DECLARE
    v_oid oid;
BEGIN
    SELECT p.oid INTO v_oid FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = current_schema() AND p.proname = 'modkit_outbox_history';
    EXECUTE replace(pg_catalog.pg_get_functiondef(v_oid), 'ORDER BY a.attempt_no, a.finished_at;', 'ORDER BY a.attempt_no;');
END $migration$;
