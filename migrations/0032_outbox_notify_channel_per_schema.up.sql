-- Enqueues announce their topics on a channel of their schema's own.
--
-- Every schema's enqueues announced themselves on one channel,
-- modkit_outbox, so two outboxes in one database (two services, or two
-- copies of one, in schemas of their own) woke each other's dispatchers:
-- each NOTIFY of a topic both had made the other's idle dispatchers claim
-- and find nothing (570 empty claims a second beside 500 enqueues a second
-- in the other schema, in a review's test). The enqueue functions now
-- announce on 'modkit_outbox.' followed by the schema's name, cut to the 63
-- bytes PostgreSQL allows a channel's name (outboxpg.NotifyChannel computes
-- the same name for the driver's INSERT and COPY paths). Dispatchers listen
-- on that channel and on modkit_outbox, where producers of an earlier
-- version still announce, so a rolling upgrade loses no wake-up on the
-- newer dispatchers. Dispatchers of an earlier version listen only on
-- modkit_outbox: until they are upgraded they find at their poll what
-- newer producers enqueue and, once this migration has run, what any
-- producer enqueues through these functions (upgrade the dispatchers
-- first to avoid both).
--
-- Only the channel's literal changes in the two functions that send a
-- NOTIFY: each is recreated from its own definition with that literal
-- replaced (CREATE OR REPLACE keeps its grants, owner and settings).
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
        v_new := replace(v_def, 'pg_notify(''modkit_outbox'', ', format('pg_notify(%L, ', v_channel));
        IF v_new = v_def THEN
            RAISE EXCEPTION 'migration 0032: % sends no NOTIFY on the channel modkit_outbox', v_fn;
        END IF;
        EXECUTE v_new;
    END LOOP;
END $migration$;
