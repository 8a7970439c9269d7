-- The enqueue functions announce on the channel shared by every schema
-- again, modkit_outbox (0032's up file says why they stopped).
DO $migration$
DECLARE
    v_channel text := left('modkit_outbox.' || current_schema(), 63);
    v_fn regprocedure;
    v_def text;
    v_new text;
BEGIN
    FOREACH v_fn IN ARRAY ARRAY[
        'modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text)'::regprocedure,
        'modkit_outbox_enqueue_many(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[])'::regprocedure]
    LOOP
        v_def := pg_catalog.pg_get_functiondef(v_fn);
        v_new := replace(v_def, format('pg_notify(%L, ', v_channel), 'pg_notify(''modkit_outbox'', ');
        IF v_new = v_def THEN
            RAISE EXCEPTION 'migration 0032 down: % sends no NOTIFY on the channel %', v_fn, v_channel;
        END IF;
        EXECUTE v_new;
    END LOOP;
END $migration$;
