-- An operator may dead-letter pending events (Admin.DeadLetter, the CLI's
-- events dead-letter): the events of a topic no dispatcher serves (a
-- producer's typo, a service retired), or of a producer's bug, which
-- nothing else could take out of the backlog. purge deleted delivered
-- events only and dead purge dead ones, and the operator role may not
-- write the tables; meanwhile every claim of every topic reads the due
-- events of a topic nobody serves (a trial: 60,000 of them made each claim
-- read 8,140 buffers, 66 ms, and the other topics' deliveries wait about
-- 70 ms instead of 30).
--
-- A dead-lettered event is dead as if its last attempt had failed: its
-- attempts stay, its last error says who dead-lettered it (and keeps the
-- publish error it had), and its history records a "dead_lettered" entry
-- with the operator's name and the database session user. dead replay
-- brings it back; dead purge deletes it. Leased events are not touched
-- (they are being published: their outcome decides). An event of an
-- ordering key dead-lettered is a dead event of its key like any other: a
-- head holds the key's later events back (unless its topic's publisher
-- skips dead heads) until it is replayed, skipped or purged, and an event
-- held behind its predecessor becomes the key's dead head once that one
-- settles.
--
-- The history's outcome check gains the new outcome. It is added NOT VALID,
-- so that a long history is not read under the table's lock: the rows
-- already there met the narrower check.
ALTER TABLE modkit_outbox_attempts DROP CONSTRAINT modkit_outbox_attempts_outcome_check;
ALTER TABLE modkit_outbox_attempts ADD CONSTRAINT modkit_outbox_attempts_outcome_check
    CHECK (outcome IN ('delivered', 'retry', 'dead', 'released', 'lease_expired', 'swept', 'replayed', 'skipped', 'purged',
        'dead_lettered')) NOT VALID;

ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0041;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
CREATE FUNCTION @s.modkit_outbox_dead_letter(p_ids uuid[], p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    WITH upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = 'dead', ledger_seq = e.ledger_seq + 1, updated_at = v_now,
            last_error = left('dead-lettered by ' || coalesce(p_by, 'unknown') || ' before it was delivered'
                || coalesce('; last publish error: ' || left(e.last_error, 2048), ''), 4096)
        WHERE e.id = ANY(p_ids) AND e.status = 'pending'
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
        SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'dead_lettered', v_now,
            left('dead-lettered by ' || coalesce(p_by, 'unknown') || ' before it was delivered', 1024), session_user
        FROM upd u)
    SELECT u.id FROM upd u;
END $$;

CREATE FUNCTION @s.modkit_outbox_dead_letter_filter(
    p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid,
    p_limit int, p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE sql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_dead_letter(ARRAY(
        SELECT l.id FROM @s.modkit_outbox_list_rows(false, 'pending', p_namespace, p_topic, p_tenant,
            p_created_after, p_created_before, p_after_created_at, p_after_id, p_limit) l), p_by, p_now);
$$;

CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0041();
BEGIN
    IF 'modkit_outbox_operator' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_dead_letter(uuid[], text, timestamptz),
            @s.modkit_outbox_dead_letter_filter(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int, text, timestamptz)
            TO modkit_outbox_operator;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

SELECT modkit_outbox_grant_roles();
