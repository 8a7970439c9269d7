-- An operator may dead-letter pending events (Admin.DeadLetter, the CLI's
-- dead letter): the events of a topic no dispatcher serves (a
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
-- (they are being published: their outcome decides), but a lease that has
-- ended is: a dispatcher that died holding it left the event, and no sweep
-- repairs the leases of a topic no dispatcher serves. Its history then
-- records the lease's end (lease_expired), as the sweep would, first. An event of an
-- ordering key dead-lettered is a dead event of its key like any other: a
-- head holds the key's later events back (unless its topic's publisher
-- skips dead heads) until it is replayed, skipped or purged, and an event
-- held behind its predecessor becomes the key's dead head once that one
-- settles.
--
-- The history's outcome check gains the new outcome. It is added NOT VALID,
-- so that a long history is not read under the table's lock: the rows
-- already there met the narrower check. The change takes that lock
-- briefly, after any read of the history under way (a long
-- modkit_outbox_prune_attempts, say), and outcome writes wait behind it:
-- it gives up after 10 s rather than hold deliveries up; run it again.
SET LOCAL lock_timeout = '10s';
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
    WITH sel AS (
        -- Pending events, and leased ones whose lease has ended (a
        -- dispatcher that died holding them: the sweep of a topic no
        -- dispatcher serves never repairs them). Locked first: a
        -- dispatcher's outcome or claim that commits meanwhile is seen.
        SELECT e.id, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq
        FROM @s.modkit_outbox_events e
        WHERE e.id = ANY(p_ids)
          AND (e.status = 'pending' OR (e.status = 'processing' AND e.locked_until < v_now))
        FOR UPDATE),
    upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = 'dead', locked_by = NULL, locked_until = NULL, lease_token = NULL,
            ledger_seq = e.ledger_seq + 1 + (d.old_status = 'processing')::int, updated_at = v_now,
            -- The publish error it had stays; an earlier dead-lettering's
            -- own words do not pile up.
            last_error = left('dead-lettered by ' || coalesce(p_by, 'unknown') || ' before it was delivered'
                || coalesce('; last publish error: ' || left(CASE WHEN e.last_error LIKE 'dead-lettered by %'
                    THEN substring(e.last_error FROM '; last publish error: (.*)$') ELSE e.last_error END, 2048), ''), 4096)
        FROM sel d WHERE e.id = d.id
        RETURNING e.id, e.namespace, e.topic, d.old_status, d.old_worker, d.old_token, d.old_claimed_at, d.attempts, d.old_seq),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail, actor)
        SELECT u.id, u.old_seq + 1, u.namespace, u.topic, 'lease_expired', u.attempts, u.old_worker, u.old_token,
            u.old_claimed_at, v_now, 'the lease expired before an outcome was recorded; found by a dead-lettering', NULL
        FROM upd u WHERE u.old_status = 'processing'
        UNION ALL
        SELECT u.id, u.old_seq + 1 + (u.old_status = 'processing')::int, u.namespace, u.topic, 'dead_lettered', NULL, NULL, NULL,
            NULL, v_now, left('dead-lettered by ' || coalesce(p_by, 'unknown') || ' before it was delivered', 1024), session_user
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
        SELECT l.id FROM (
            SELECT p.id, p.created_at FROM @s.modkit_outbox_list_rows(false, 'pending', p_namespace, p_topic, p_tenant,
                p_created_after, p_created_before, p_after_created_at, p_after_id, p_limit) p
            UNION ALL
            SELECT x.id, x.created_at FROM @s.modkit_outbox_list_rows(false, 'processing', p_namespace, p_topic, p_tenant,
                p_created_after, p_created_before, p_after_created_at, p_after_id, p_limit) x
            WHERE x.locked_until < @s.modkit_outbox_clock(p_now)) l
        ORDER BY l.created_at, l.id
        LIMIT p_limit), p_by, p_now);
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
