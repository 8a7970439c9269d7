-- An event id used again after its event was purged no longer stops the
-- dispatchers.
--
-- The attempts ledger outlives the events it records (their history is
-- kept after a purge), and its key was (event_id, attempt_no). A producer
-- chooses its events' ids (the Go client draws UUIDv7s, but the producer
-- role may INSERT any id), so a producer that enqueued an id whose event
-- had been delivered and purged started a second event whose ledger rows
-- took the numbers the first one's already had: its outcome write failed
-- with a unique violation, and so did every claim of its topics once its
-- lease expired (the claim records the expiry in the ledger) and every
-- sweep. No event of those topics was delivered again until the owner
-- repaired the rows by hand. A security review did it with the producer
-- role's own rights.
--
-- The key now includes finished_at: the second event's rows are written
-- after the first one's, so they no longer collide, and the dispatchers
-- go on. The id's history then holds both events' entries, each numbered
-- from 1; modkit_outbox_history orders them by number, then by time.
ALTER TABLE modkit_outbox_attempts
    DROP CONSTRAINT modkit_outbox_attempts_pkey,
    ADD CONSTRAINT modkit_outbox_attempts_pkey PRIMARY KEY (event_id, attempt_no, finished_at);

DO $migration$
DECLARE
    v_oid oid;
    v_def text;
    v_old constant text := 'ORDER BY a.attempt_no;';
BEGIN
    SELECT p.oid INTO v_oid FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = current_schema() AND p.proname = 'modkit_outbox_history';
    v_def := pg_catalog.pg_get_functiondef(v_oid);
    IF v_oid IS NULL OR strpos(v_def, v_old) = 0 THEN
        RAISE EXCEPTION 'outbox: migration 0039: modkit_outbox_history does not read as migration 0004 left it';
    END IF;
    EXECUTE replace(v_def, v_old, 'ORDER BY a.attempt_no, a.finished_at;');
END $migration$;
