-- Reads that skip the delivered events a retention keeps. Delivered events
-- stay in the table until their topic's retention purges them, often for
-- days: millions of rows, against a few thousand pending, leased or dead.
-- Since migration 0014 the settled index holds settled events by
-- (settled_status, settled_at), generated columns equal to status and
-- updated_at once an event is delivered or dead (and NULL before). A read
-- that filters on status and updated_at instead cannot use it and reads
-- every row, as modkit_outbox_settled did until migration 0023.
--
-- modkit_outbox_series (Admin.Series: the dashboard's chart, drawn on every
-- load of its overview) counted the deliveries of the last window filtered
-- on status and updated_at. It reads the settled index's range of the
-- window's deliveries instead: the same rows (settled_status = 'delivered'
-- exactly when status = 'delivered', settled_at = updated_at for them), so
-- the same counts and latencies. With 1,000,000 delivered events kept over
-- seven days, an hour's series took 300 ms, whatever the hour held; now 15
-- ms for an hour of 6,800 deliveries, 0.4 ms for an hour without any.
--
-- modkit_outbox_list_rows (Admin.List, the dashboard's and the CLI's lists
-- of events, and Admin.ReplayDead by filter, which replays the dead events
-- it lists) read every row and sorted them by enqueue time, whatever the
-- status asked for: with 1,000,000 delivered events kept among 18,600
-- pending, leased and dead ones, a page of 50 took 220-260 ms. It now
-- takes 6-9 ms for pending events (most of it sorting the 9,000 held
-- ones), 5-8 ms for leased ones, 1-2 ms for dead ones; a ReplayDead by
-- filter of the 2,100 dead ones, 60-90 ms against 260-320 (most of it now
-- the replay's writes). For a status it reads:
--   - pending or processing: the claim index (every pending and leased
--     event that is not held, in (created_at, id) order) and the held index
--     (the held ones, sorted), merged. An event in
--     either state is not settled (settled_status IS NULL), so it is in
--     exactly one of them, held or not; each side's first p_limit events
--     in (created_at, id) order hold the first p_limit of both (ids are
--     unique: the order is total);
--   - dead: the settled index's dead events (settled_status = 'dead'
--     exactly when status = 'dead'), sorted;
--   - any other (NULL for every status, delivered): the statement as it
--     was, which reads the table: no index holds events by enqueue time.
-- The filters (topic, tenant, enqueue times, cursor) are applied as before,
-- so each call returns the same rows in the same order. It is PL/pgSQL so
-- that each status's statement is planned on its own: branches of one SQL
-- statement would plan (and, past jit_above_cost, compile, and start
-- parallel workers for) the whole table's branch on every call. And it
-- runs without JIT: a claim index left large by a burst of events (its
-- pages stay when their entries go) costs the pending events' read past
-- jit_above_cost, whose compilation took 28 of its 35 ms, and the whole
-- table's read gains nothing from it (365-395 ms with or without).
--
-- CREATE OR REPLACE keeps each function's owner and grants.
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
-- Deliveries per bucket (aligned on the Unix epoch) over the last p_window,
-- with enqueue-to-delivery latency quantiles, per topic and in total (the
-- rows whose namespace is NULL). It reads the window's deliveries from the
-- settled index (migration 0024): for dashboards refreshing every few
-- seconds.
CREATE OR REPLACE FUNCTION @s.modkit_outbox_series(p_window interval, p_bucket interval, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (at timestamptz, ns text, tp text, bucket_start timestamptz, delivered bigint,
    latency_p50 float8, latency_p95 float8, latency_max float8)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    WITH w AS (
        SELECT coalesce(p_now, now()) AS now,
            date_bin(p_bucket, coalesce(p_now, now()) - p_window, timestamptz 'epoch') AS start)
    SELECT w.now, e.namespace, e.topic, date_bin(p_bucket, e.updated_at, timestamptz 'epoch') AS bucket,
        count(*),
        percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
        percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
        max(extract(epoch FROM e.updated_at - e.created_at))::float8
    FROM @s.modkit_outbox_events e CROSS JOIN w
    -- The window's bounds are w's, written out so that they bound the
    -- index scan (a bound read from w would be a join condition).
    WHERE e.settled_status = 'delivered'
      AND e.settled_at >= date_bin(p_bucket, coalesce(p_now, now()) - p_window, timestamptz 'epoch')
      AND e.settled_at <= coalesce(p_now, now())
    GROUP BY GROUPING SETS ((w.now, bucket), (w.now, e.namespace, e.topic, bucket))
    ORDER BY bucket, e.namespace NULLS FIRST, e.topic NULLS FIRST;
$$;

-- Listing: modkit_outbox_list (reader) hides payloads,
-- modkit_outbox_list_payloads (operator) shows them. Pending, leased and
-- dead events are read from the indexes that hold them (migration 0024).
CREATE OR REPLACE FUNCTION @s.modkit_outbox_list_rows(
    p_payloads boolean, p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid, p_limit int)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = @s, pg_temp SET jit = off AS $$
BEGIN
    IF p_status IN ('pending', 'processing') THEN
        RETURN QUERY
        SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
            e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
            CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
        FROM ((SELECT c.* FROM @s.modkit_outbox_events c
               WHERE c.settled_status IS NULL AND NOT c.held AND c.status = p_status
                 -- Where the walk of the claim index starts (implied by
                 -- the enqueue time and cursor filters below).
                 AND c.created_at >= greatest(p_created_after, p_after_created_at, '-infinity')
                 AND (p_namespace IS NULL OR c.namespace = p_namespace)
                 AND (p_topic IS NULL OR c.topic = p_topic)
                 AND (p_tenant IS NULL OR c.tenant_id = p_tenant)
                 AND (p_created_after IS NULL OR c.created_at >= p_created_after)
                 AND (p_created_before IS NULL OR c.created_at < p_created_before)
                 AND (p_after_created_at IS NULL OR (c.created_at, c.id) > (p_after_created_at, p_after_id))
               ORDER BY c.created_at, c.id
               LIMIT p_limit)
              UNION ALL
              (SELECT h.* FROM @s.modkit_outbox_events h
               WHERE h.held AND h.settled_status IS NULL AND h.status = p_status
                 AND (p_namespace IS NULL OR h.namespace = p_namespace)
                 AND (p_topic IS NULL OR h.topic = p_topic)
                 AND (p_tenant IS NULL OR h.tenant_id = p_tenant)
                 AND (p_created_after IS NULL OR h.created_at >= p_created_after)
                 AND (p_created_before IS NULL OR h.created_at < p_created_before)
                 AND (p_after_created_at IS NULL OR (h.created_at, h.id) > (p_after_created_at, p_after_id))
               ORDER BY h.created_at, h.id
               LIMIT p_limit)) e
        ORDER BY e.created_at, e.id
        LIMIT p_limit;
    ELSIF p_status = 'dead' THEN
        RETURN QUERY
        SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
            e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
            CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
        FROM @s.modkit_outbox_events e
        WHERE e.settled_status = 'dead'
          AND (p_namespace IS NULL OR e.namespace = p_namespace)
          AND (p_topic IS NULL OR e.topic = p_topic)
          AND (p_tenant IS NULL OR e.tenant_id = p_tenant)
          AND (p_created_after IS NULL OR e.created_at >= p_created_after)
          AND (p_created_before IS NULL OR e.created_at < p_created_before)
          AND (p_after_created_at IS NULL OR (e.created_at, e.id) > (p_after_created_at, p_after_id))
        ORDER BY e.created_at, e.id
        LIMIT p_limit;
    ELSE
        RETURN QUERY
        SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
            e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
            CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
        FROM @s.modkit_outbox_events e
        WHERE (p_status IS NULL OR e.status = p_status)
          AND (p_namespace IS NULL OR e.namespace = p_namespace)
          AND (p_topic IS NULL OR e.topic = p_topic)
          AND (p_tenant IS NULL OR e.tenant_id = p_tenant)
          AND (p_created_after IS NULL OR e.created_at >= p_created_after)
          AND (p_created_before IS NULL OR e.created_at < p_created_before)
          AND (p_after_created_at IS NULL OR (e.created_at, e.id) > (p_after_created_at, p_after_id))
        ORDER BY e.created_at, e.id
        LIMIT p_limit;
    END IF;
END $$;
$functions$, '@s', s);
END $migration$;
