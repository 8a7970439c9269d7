-- Fewer index writes per event: the (status, next_attempt_at) index of
-- migration 0001 goes. Every event wrote an entry into it on enqueue, claim,
-- and outcome (each a new row version, as the status changes), and ordered
-- events, whose runs are spread over the table, wrote them all over it. Its
-- readers get other paths:
-- - the purge, the blocked keys and the dead count read
--   modkit_outbox_events_settled_idx, which holds delivered and dead events
--   by (status, updated_at): one entry an event, written when it settles, at
--   the end of its status's range (the delivery series and the settled feed
--   may read it too; on large tables the planner scanned the table for
--   them, with or without the old index);
-- - the sweep and the depth gauge read pending events from the claim and
--   held indexes and leased ones from the locked_until index (both
--   functions are replaced below to do so).
-- The sweep also holds the events of an ordering key it puts back behind an
-- undelivered predecessor (the rest of a run whose dispatcher died), as the
-- outcome write does since migration 0005; it left them unheld, so claims
-- walked them until their turn.
-- BENCHMARKS.md, "Index set: (status, next_attempt_at) dropped".
--
-- Migration 0004's sweep and depth stay, under other names and callable by
-- their owner only, so that the down migration can put them back.
--
-- Building the new index blocks writes to the table while it reads the
-- delivered events. Where millions are kept, create it first, outside a
-- transaction, with the same definition and CREATE INDEX CONCURRENTLY; this
-- migration then finds it and goes on.
DROP INDEX modkit_outbox_events_status_next_attempt_idx;
CREATE INDEX IF NOT EXISTS modkit_outbox_events_settled_idx
    ON modkit_outbox_events (status, updated_at)
    WHERE status IN ('delivered', 'dead');

ALTER FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep_0004;
ALTER FUNCTION modkit_outbox_depth(text[], timestamptz) RENAME TO modkit_outbox_depth_0004;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION modkit_outbox_sweep_0004(text[], int, int, timestamptz), '
            'modkit_outbox_depth_0004(text[], timestamptz) FROM %I', r);
    END LOOP;
END $revoke$;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- Lease repair and dead-lettering for p_topics: an expired lease with
-- attempts left goes back to pending (ledger: lease_expired); an event whose
-- attempts reached p_max_attempts and that no live lease holds becomes dead
-- (ledger: lease_expired when a lease was lost, then swept). Returns each
-- event changed, with repaired = true for the first kind. (Since migration
-- 0007, an event of an ordering key that goes back to pending is held while
-- its predecessor is undelivered.)
CREATE FUNCTION @s.modkit_outbox_sweep(p_topics text[], p_max_attempts int, p_limit int, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (id uuid, topic text, repaired boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    -- Due events come from index scans, one for each way an event can be
    -- due (migration 0007 dropped the (status, next_attempt_at) index that
    -- a single scan used): expired leases from the locked_until index
    -- (only a processing event has a lease), pending events out of
    -- attempts from the claim index and the held index.
    WITH due_expired AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            e.attempts >= p_max_attempts AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.locked_until < v_now
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        ORDER BY e.locked_until
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due_exhausted AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            true AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.status = 'pending' AND NOT e.held AND e.attempts >= p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        ORDER BY e.created_at, e.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due_exhausted_held AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            true AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.held AND e.status = 'pending' AND e.attempts >= p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due AS (
        SELECT * FROM (
            SELECT * FROM due_expired UNION ALL SELECT * FROM due_exhausted UNION ALL SELECT * FROM due_exhausted_held) u
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
                WHERE p.namespace = e.namespace AND p.topic = e.topic AND p.ordering_key = e.ordering_key
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
END $$;

-- The gauges of p_topics; stuck counts leases that expired without an
-- outcome (waiting for repair).
CREATE FUNCTION @s.modkit_outbox_depth(p_topics text[], p_now timestamptz DEFAULT NULL)
RETURNS TABLE (topic text, pending bigint, processing bigint, dead bigint, oldest_due_seconds float8, stuck bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = @s, pg_temp
-- On large tables the planner gave the four scans a parallel plan, slower
-- (16 against 10 ms on 2 million delivered events) and two workers a read.
SET max_parallel_workers_per_gather = 0 AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    -- One index scan for each state counted (migration 0007 dropped the
    -- (status, next_attempt_at) index that a single scan used), so that
    -- delivered events, however many are kept, are not read.
    RETURN QUERY
    SELECT e.namespace || ':' || e.topic,
        count(*) FILTER (WHERE e.status = 'pending'),
        count(*) FILTER (WHERE e.status = 'processing'),
        count(*) FILTER (WHERE e.status = 'dead'),
        coalesce(extract(epoch FROM v_now - min(e.next_attempt_at) FILTER (WHERE e.status = 'pending' AND e.next_attempt_at <= v_now)), 0)::float8,
        count(*) FILTER (WHERE e.status = 'processing' AND e.locked_until < v_now)
    FROM (
        SELECT p.namespace, p.topic, p.status, p.next_attempt_at, p.locked_until FROM @s.modkit_outbox_events p
        WHERE p.status = 'pending' AND NOT p.held AND (p.namespace || ':' || p.topic) = ANY(p_topics)
        UNION ALL
        SELECT h.namespace, h.topic, h.status, h.next_attempt_at, h.locked_until FROM @s.modkit_outbox_events h
        WHERE h.held AND h.status = 'pending' AND (h.namespace || ':' || h.topic) = ANY(p_topics)
        UNION ALL
        -- Only a processing event has a lease.
        SELECT l.namespace, l.topic, l.status, l.next_attempt_at, l.locked_until FROM @s.modkit_outbox_events l
        WHERE l.locked_until IS NOT NULL AND (l.namespace || ':' || l.topic) = ANY(p_topics)
        UNION ALL
        SELECT d.namespace, d.topic, d.status, d.next_attempt_at, d.locked_until FROM @s.modkit_outbox_events d
        WHERE d.status = 'dead' AND (d.namespace || ':' || d.topic) = ANY(p_topics)) e
    GROUP BY e.namespace, e.topic;
END $$;
$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new functions, and grants them to
-- the outbox roles that exist.
SELECT modkit_outbox_grant_roles();
