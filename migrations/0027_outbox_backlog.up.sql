-- Counts of the backlog that do not read the delivered history.
-- modkit_outbox_stats counts every status of every topic by reading the
-- whole table: with a million delivered events kept it took 490-590 ms
-- (BENCHMARKS.md, "Reads past kept deliveries"), and the dashboard's
-- overview ran it on every page load.
--
-- modkit_outbox_backlog returns modkit_outbox_stats's rows for the pending,
-- processing and dead events only, read as modkit_outbox_depth reads them
-- for its topics: one scan of each index that holds those states (the
-- claim index for unheld pending and leased events, the held index, the
-- settled index for dead ones), so that its cost follows the backlog and
-- the dead events, not the delivered events kept.
--
-- modkit_outbox_grant_roles keeps migration 0026's grants under another
-- name and adds the new function's: the reader and the operator may run
-- it, as they may run modkit_outbox_stats.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0026;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
-- Pending, processing and dead events per (namespace, topic, status), with
-- the age of the oldest due pending event, as modkit_outbox_stats returns
-- them for those statuses.
CREATE FUNCTION @s.modkit_outbox_backlog(p_now timestamptz DEFAULT NULL)
RETURNS TABLE (namespace text, topic text, status text, count bigint, oldest_due_seconds float8)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = @s, pg_temp SET max_parallel_workers_per_gather = 0 SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    SELECT e.namespace, e.topic, e.status, count(*),
        coalesce(extract(epoch FROM v_now - min(e.next_attempt_at) FILTER (WHERE e.status = 'pending' AND e.next_attempt_at <= v_now)), 0)::float8
    FROM (
        SELECT p.namespace, p.topic, p.status, p.next_attempt_at FROM @s.modkit_outbox_events p
        WHERE p.settled_status IS NULL AND NOT p.held
        UNION ALL
        SELECT h.namespace, h.topic, h.status, h.next_attempt_at FROM @s.modkit_outbox_events h
        WHERE h.held AND h.status IN ('pending', 'processing')
        UNION ALL
        SELECT d.namespace, d.topic, d.status, d.next_attempt_at FROM @s.modkit_outbox_events d
        WHERE d.settled_status = 'dead') e
    GROUP BY e.namespace, e.topic, e.status
    ORDER BY e.namespace, e.topic, e.status;
END $$;

-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0027 the reader and the operator may count the
-- backlog.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0026();
BEGIN
    IF 'modkit_outbox_reader' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_backlog(timestamptz) TO modkit_outbox_reader;
    END IF;
    IF 'modkit_outbox_operator' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_backlog(timestamptz) TO modkit_outbox_operator;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function, and grants it to
-- the reader and operator roles if they exist.
SELECT modkit_outbox_grant_roles();
