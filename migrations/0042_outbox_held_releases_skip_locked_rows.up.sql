-- Letting a held event into the claim skips a row another session has
-- locked, instead of waiting for it.
--
-- A trial held one row lock (SELECT ... FOR UPDATE in psql) on an ordered
-- event held behind its predecessor. modkit_outbox_release_held, which
-- every dispatcher runs once per PollInterval from its claim loop, waited
-- for that lock until its 5-second timeout, each time, so that the claims
-- of every topic, ordered or not, stalled on every dispatcher while the
-- lock was held (commit to publish p50 1 ms -> 15-36 s), and nothing said
-- why. Recording a delivery, which lets the next event of its key into the
-- claim in the same statement (modkit_outbox_complete, step 5), waited the
-- same way, holding up every other outcome of its batch.
--
-- Both now lock the rows they let in with SKIP LOCKED: a locked one stays
-- held, and the next release_held after the lock ends lets it in (within
-- a PollInterval).
--
-- The sweep's reason for an event dead-lettered by an expired lease names
-- the third cause the same trial met: a server frozen longer than the
-- lease, so that the outcome of a publish that succeeded was not recorded
-- in time. It said only "the worker crashed or its publish outlived the
-- lease", neither of which had happened.
--
-- The functions are changed in place, by a replacement of their text
-- checked first (a schema whose functions differ fails here and changes
-- nothing).
DO $migration$
DECLARE
    f record;
    v_def text;
    v_found int;
BEGIN
    FOR f IN
        SELECT p.oid, p.proname, x.old, x.new
        FROM pg_catalog.pg_proc p
        JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
        JOIN (VALUES
            ('modkit_outbox_release_held',
             E'        LIMIT p_limit)\n    UPDATE ',
             E'        LIMIT p_limit\n        FOR UPDATE OF e SKIP LOCKED)\n    UPDATE '),
            ('modkit_outbox_complete',
             E'AND x.ordering_seq = f.seq + 1 AND x.held) n))',
             E'AND x.ordering_seq = f.seq + 1 AND x.held\n                FOR UPDATE SKIP LOCKED) n))'),
            ('modkit_outbox_sweep',
             'the worker crashed or its publish outlived the lease',
             'the worker crashed, its publish outlived the lease, or its outcome could not be recorded before the lease ended (the database slow or unavailable)')
        ) AS x(name, old, new) ON x.name = p.proname
        WHERE n.nspname = current_schema()
    LOOP
        v_def := pg_catalog.pg_get_functiondef(f.oid);
        v_found := (length(v_def) - length(replace(v_def, f.old, ''))) / length(f.old);
        IF v_found <> 1 OR strpos(v_def, f.new) > 0 THEN
            RAISE EXCEPTION 'outbox: migration 0042: function % does not read as earlier migrations left it (% places found)',
                f.proname, v_found;
        END IF;
        EXECUTE replace(v_def, f.old, f.new);
    END LOOP;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox: migration 0042: the functions to change are missing from schema %', current_schema();
    END IF;
END $migration$;
