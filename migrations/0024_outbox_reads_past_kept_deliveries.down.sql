-- Back to migration 0004's modkit_outbox_series (owner and grants kept).
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
$functions$, '@s', s);
END $migration$;
