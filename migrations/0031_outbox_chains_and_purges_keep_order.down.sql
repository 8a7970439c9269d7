-- Back to modkit_outbox_sweep as migration 0021 wrote it and
-- modkit_outbox_purge_dead as 0026 wrote it.
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
CREATE OR REPLACE FUNCTION @s.modkit_outbox_sweep(p_topics text[], p_max_attempts integer, p_limit integer, p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
 RETURNS TABLE(id uuid, topic text, repaired boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET plan_cache_mode TO 'force_custom_plan'
 SET jit TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    -- Due events come from two index scans: expired leases and pending
    -- events out of attempts from one walk of the claim index (since
    -- migration 0014 it holds every pending and leased event that is not
    -- held), held events out of attempts and the expired leases of held
    -- events (since 0021 the links of a chain stay held while leased) from
    -- the held index.
    WITH due_claimable AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            e.attempts >= p_max_attempts AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.settled_status IS NULL AND NOT e.held
          AND ((e.status = 'processing' AND e.locked_until < v_now)
            OR (e.status = 'pending' AND e.attempts >= p_max_attempts))
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        ORDER BY e.created_at, e.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due_held AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            e.attempts >= p_max_attempts AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.held
          AND ((e.status = 'pending' AND e.attempts >= p_max_attempts)
            OR (e.status = 'processing' AND e.locked_until < v_now))
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due AS (
        SELECT * FROM (SELECT * FROM due_claimable UNION ALL SELECT * FROM due_held) u
        ORDER BY u.created_at, u.id
        LIMIT p_limit),
    upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = CASE WHEN d.exhausted THEN 'dead' ELSE 'pending' END,
            next_attempt_at = CASE WHEN d.exhausted THEN e.next_attempt_at ELSE v_now END,
            last_error = CASE WHEN d.exhausted THEN left(
                CASE WHEN d.old_status = 'processing'
                    THEN format('lease of worker %s expired on the final attempt (%s of %s): the worker crashed or its publish outlived the lease', d.old_worker, d.attempts, p_max_attempts)
                    ELSE format('attempts (%s) reached max_attempts (%s)', d.attempts, p_max_attempts) END
                || coalesce('; last publish error: ' || left(d.old_error, 2048), ''), 4096)
                ELSE e.last_error END,
            locked_by = NULL, locked_until = NULL, lease_token = NULL,
            ledger_seq = e.ledger_seq + (d.old_status = 'processing')::int + d.exhausted::int,
            updated_at = v_now,
            -- An event of an ordering key back to pending (the rest of a run
            -- whose dispatcher died) is held while its predecessor is
            -- undelivered, as modkit_outbox_complete holds a released one,
            -- so claims do not walk it before its turn.
            held = CASE WHEN NOT d.exhausted AND e.ordering_key IS NOT NULL THEN EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped)))
                ELSE e.held END
        FROM due d WHERE e.id = d.id
        RETURNING e.id, e.namespace, e.topic, e.last_error, NOT d.exhausted AS repaired, d.exhausted,
            d.old_status, d.old_seq, d.attempts, d.old_worker, d.old_token, d.old_claimed_at),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.old_seq + 1, u.namespace, u.topic, 'lease_expired', u.attempts, u.old_worker, u.old_token,
            u.old_claimed_at, v_now, 'the lease expired before an outcome was recorded; repaired by the sweeper'
        FROM upd u WHERE u.old_status = 'processing'
        UNION ALL
        SELECT u.id, u.old_seq + 1 + (u.old_status = 'processing')::int, u.namespace, u.topic, 'swept', NULL, NULL, NULL,
            NULL, v_now, u.last_error
        FROM upd u WHERE u.exhausted)
    SELECT u.id, u.namespace || ':' || u.topic, u.repaired FROM upd u;
END $function$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_purge_dead(p_ids uuid[], p_by text, p_now timestamptz DEFAULT NULL)
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
$functions$, '@s', s);
END $migration$;
