-- A purge of a run of dead events of one ordering key costs what the run
-- holds, not its square, and a replay no longer takes back a skip.
--
-- modkit_outbox_purge_dead deleted a key's run of dead events one event a
-- round (0031), each round reading every id still left, up to 1,000
-- rounds a call: 2 s for a run of 1,000, 19 s for ten keys of 1,000, 35 s
-- for the first 1,000 of a run of 10,000, all in one statement holding its
-- locks (a statement timeout or a cancelled request rolled it all back).
-- It now deletes in one statement: the selected dead events without a key,
-- and in each stretch of a key's selected dead events with consecutive
-- sequence numbers, the events from the first one that the event before it
-- no longer holds back (gone, delivered, or a skipped dead one) on. What
-- it deletes is what the rounds deleted, without their limit; a dead event
-- behind an event of its key that is not delivered and not purged with it
-- (a dead one, a pending or leased one) is still left. It locks the dead
-- events given before it reads them, so that a replay committed meanwhile
-- is seen.
--
-- modkit_outbox_replay_rows cleared head_skipped. A head skipped with
-- SkipHead lets the events after it go on; replayed and dead again, it was
-- a head that blocked its key once more, and BlockedKeys listed it though
-- the key's later events had been delivered. A replayed event now stays
-- skipped: dead again, the key goes on. (Pending again, it holds back the
-- event right after it if that one is not delivered yet; the key's other
-- events do not wait for it.)
--
-- CREATE OR REPLACE keeps each function's owner and grants.
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
BEGIN
    -- Lock the dead events given first, in one order, so that the
    -- statement below (which takes a snapshot of its own) sees what a
    -- replay or another purge committed meanwhile: read from an older
    -- snapshot, a run whose middle event was just replayed would lose the
    -- events after that one, and free the key's next event to overtake it.
    PERFORM 1 FROM @s.modkit_outbox_events e
    WHERE e.id = ANY(p_ids) AND e.status = 'dead'
    ORDER BY e.id
    FOR UPDATE;
    RETURN QUERY
    WITH sel AS MATERIALIZED (
        SELECT e.id, e.ordering_key, e.ordering_stream, e.ordering_seq
        FROM @s.modkit_outbox_events e
        WHERE e.id = ANY(p_ids) AND e.status = 'dead'),
    -- A key's selected events with consecutive sequence numbers share a
    -- stretch (its first sequence number less its rank).
    stretches AS (
        SELECT s.id, s.ordering_stream,
            s.ordering_seq - pg_catalog.row_number() OVER (PARTITION BY s.ordering_stream ORDER BY s.ordering_seq) AS stretch,
            s.ordering_seq
        FROM sel s WHERE s.ordering_key IS NOT NULL),
    -- A stretch goes from its first event that the event before it no
    -- longer holds back (gone, delivered, a skipped dead one, or the
    -- stretch's own event before it that is a skipped dead one) on: every
    -- event after that one follows an event this statement deletes.
    heads AS (
        SELECT t.ordering_stream, t.stretch, min(t.ordering_seq) AS from_seq
        FROM stretches t
        WHERE NOT EXISTS (
            SELECT 1 FROM @s.modkit_outbox_events p
            WHERE p.ordering_stream = t.ordering_stream AND p.ordering_seq = t.ordering_seq - 1
              AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped)))
        GROUP BY t.ordering_stream, t.stretch),
    victims AS MATERIALIZED (
        SELECT s.id FROM sel s WHERE s.ordering_key IS NULL
        UNION ALL
        SELECT t.id FROM stretches t
        JOIN heads h ON h.ordering_stream = t.ordering_stream AND h.stretch = t.stretch AND t.ordering_seq >= h.from_seq),
    del AS (
        DELETE FROM @s.modkit_outbox_events AS e
        USING victims v
        WHERE e.id = v.id AND e.status = 'dead'
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq, e.ordering_stream, e.ordering_seq),
    -- The event after each one deleted may be claimed now, unless this
    -- statement deletes it too.
    release AS (
        UPDATE @s.modkit_outbox_events AS s SET held = false
        FROM del d
        WHERE s.ordering_stream = d.ordering_stream
          AND s.ordering_seq = d.ordering_seq + 1 AND s.held
          AND NOT EXISTS (SELECT 1 FROM victims v WHERE v.id = s.id)),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
        SELECT d.id, d.ledger_seq + 1, d.namespace, d.topic, 'purged', v_now,
            left('purged while dead by ' || coalesce(p_by, 'unknown'), 1024), session_user
        FROM del d)
    SELECT d.id FROM del d;
END $$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_replay_rows(p_ids uuid[], p_by text, p_now timestamptz)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    WITH upd AS (
        -- head_skipped stays (migration 0033): a skipped head goes on
        -- being skipped if it dies again.
        UPDATE @s.modkit_outbox_events AS e SET
            status = 'pending', attempts = 0, next_attempt_at = v_now,
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
