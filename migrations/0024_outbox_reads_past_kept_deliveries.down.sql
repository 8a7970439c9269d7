-- Back to migration 0004's modkit_outbox_series and modkit_outbox_list_rows
-- (owners and grants kept).
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
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
    WHERE e.status = 'delivered' AND e.updated_at >= w.start AND e.updated_at <= w.now
    GROUP BY GROUPING SETS ((w.now, bucket), (w.now, e.namespace, e.topic, bucket))
    ORDER BY bucket, e.namespace NULLS FIRST, e.topic NULLS FIRST;
$$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_list_rows(
    p_payloads boolean, p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid, p_limit int)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
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
$$;
$functions$, '@s', s);
END $migration$;
