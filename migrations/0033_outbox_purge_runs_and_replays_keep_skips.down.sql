-- Back to modkit_outbox_purge_dead as migration 0031 wrote it and
-- modkit_outbox_replay_rows as 0004 did.
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
CREATE OR REPLACE FUNCTION @s.modkit_outbox_purge_dead(p_ids uuid[], p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_left uuid[] := p_ids;
    v_done uuid[];
    v_rounds int := 0;
BEGIN
    -- Each round deletes the dead events among v_left that are keyless or
    -- their key's head (the event before it no longer holds it back), and
    -- lets each deleted head's successor into the claim. A run of dead
    -- events of one key goes one event a round, each the head once the one
    -- before it is gone; a dead event behind another dead event of its key
    -- that is not purged with it is left (it would let the events after it
    -- overtake that one). At most 1,000 rounds: the rest of a longer run is
    -- left for another call.
    LOOP
        WITH del AS (
            DELETE FROM @s.modkit_outbox_events AS e
            WHERE e.id = ANY(v_left) AND e.status = 'dead'
              AND (e.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))))
            RETURNING e.id, e.namespace, e.topic, e.ledger_seq, e.ordering_stream, e.ordering_seq),
        release AS (
            UPDATE @s.modkit_outbox_events AS s SET held = false
            FROM del d
            WHERE s.ordering_stream = d.ordering_stream
              AND s.ordering_seq = d.ordering_seq + 1 AND s.held
              -- not one this statement may delete
              AND NOT (s.id = ANY(v_left) AND s.status = 'dead')),
        ledger AS (
            INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
            SELECT d.id, d.ledger_seq + 1, d.namespace, d.topic, 'purged', v_now,
                left('purged while dead by ' || coalesce(p_by, 'unknown'), 1024), session_user
            FROM del d)
        SELECT pg_catalog.array_agg(d.id) INTO v_done FROM del d;
        EXIT WHEN v_done IS NULL;
        RETURN QUERY SELECT pg_catalog.unnest(v_done);
        v_rounds := v_rounds + 1;
        EXIT WHEN v_rounds >= 1000;
        v_left := ARRAY(SELECT x FROM pg_catalog.unnest(v_left) AS x WHERE NOT (x = ANY(v_done)));
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_replay_rows(p_ids uuid[], p_by text, p_now timestamptz)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    WITH upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = 'pending', attempts = 0, next_attempt_at = v_now, head_skipped = false,
            ledger_seq = e.ledger_seq + 1, updated_at = v_now
        WHERE e.id = ANY(p_ids) AND e.status = 'dead'
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
        SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'replayed', v_now, left('replayed by ' || coalesce(p_by, 'unknown'), 1024), session_user
        FROM upd u)
    SELECT u.id FROM upd u;
END $$;
$functions$, '@s', s);
END $migration$;
