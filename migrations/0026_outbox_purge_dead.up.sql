-- Purge dead events. A dead event stayed until an operator replayed it:
-- the documents said "replayed or purged", but Admin.Purge deletes
-- delivered events only, and the operator role may not touch the table. So
-- a poison event could only be published again as it was, and its dedupe
-- key stayed taken, unless the owner deleted it by hand, outside the
-- history.
--
-- modkit_outbox_purge_dead deletes the dead events among p_ids, and
-- modkit_outbox_purge_dead_filter the first p_limit matching a filter (as
-- modkit_outbox_replay_filter selects them); each appends a 'purged' entry
-- to the event's history with who asked (p_by) and the session user, and
-- returns the ids deleted. Events not dead are left alone. Deleting the
-- dead head of an ordering key lets the key's later events go on, as
-- skipping it does (the claim and modkit_outbox_release_held wait only for
-- a predecessor that exists).
--
-- modkit_outbox_skip_head no longer moves the skipped event's updated_at:
-- that is the time of its outcome (settled_at, which Admin.Settled and
-- modkit-outbox tail follow), and a skip moved it, so tail printed the
-- event again as dead, as if it had died anew. The skip is in the history.
--
-- modkit_outbox_grant_roles keeps migration 0025's grants under another
-- name and adds the new functions': the operator may run them.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0025;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
CREATE OR REPLACE FUNCTION @s.modkit_outbox_skip_head(p_id uuid, p_by text, p_now timestamptz DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    WITH upd AS (
        UPDATE @s.modkit_outbox_events AS e SET head_skipped = true, ledger_seq = e.ledger_seq + 1
        WHERE e.id = p_id AND e.status = 'dead' AND e.ordering_key IS NOT NULL AND NOT e.head_skipped
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq, e.ordering_key, e.ordering_stream, e.ordering_seq),
    release AS (
        UPDATE @s.modkit_outbox_events AS s SET held = false
        FROM upd u
        WHERE s.ordering_stream = u.ordering_stream
          AND s.ordering_seq = u.ordering_seq + 1 AND s.held)
    INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
    SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'skipped', v_now,
        left('head skipped by ' || coalesce(p_by, 'unknown') || ': the events after it go on', 1024), session_user
    FROM upd u;
    RETURN FOUND;
END $$;

CREATE FUNCTION @s.modkit_outbox_purge_dead(p_ids uuid[], p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    WITH del AS (
        DELETE FROM @s.modkit_outbox_events AS e
        WHERE e.id = ANY(p_ids) AND e.status = 'dead'
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
        SELECT d.id, d.ledger_seq + 1, d.namespace, d.topic, 'purged', v_now,
            left('purged while dead by ' || coalesce(p_by, 'unknown'), 1024), session_user
        FROM del d)
    SELECT d.id FROM del d;
END $$;

CREATE FUNCTION @s.modkit_outbox_purge_dead_filter(
    p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid,
    p_limit int, p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE sql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_purge_dead(ARRAY(
        SELECT l.id FROM @s.modkit_outbox_list_rows(false, 'dead', p_namespace, p_topic, p_tenant,
            p_created_after, p_created_before, p_after_created_at, p_after_id, p_limit) l), p_by, p_now);
$$;

-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0026 the operator may purge dead events.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0025();
BEGIN
    IF 'modkit_outbox_operator' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_purge_dead(uuid[], text, timestamptz),
            @s.modkit_outbox_purge_dead_filter(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int, text, timestamptz)
            TO modkit_outbox_operator;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new functions, and grants them to
-- the operator role if it exists.
SELECT modkit_outbox_grant_roles();
