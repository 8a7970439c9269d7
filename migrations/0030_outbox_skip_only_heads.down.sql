-- Back to modkit_outbox_skip_head as migration 0026 wrote it,
-- modkit_outbox_blocked_keys as 0014 wrote it and modkit_outbox_resign as
-- 0004 wrote it with 0009's setting (CREATE OR REPLACE keeps each
-- function's grants).
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

CREATE OR REPLACE FUNCTION @s.modkit_outbox_blocked_keys(p_limit integer)
 RETURNS TABLE(namespace text, topic text, ordering_key text, head_id uuid, head_seq bigint, waiting bigint, last_error text, dead_since timestamp with time zone)
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path = @s, pg_temp
AS $function$
    SELECT d.namespace, d.topic, d.ordering_key, d.id, d.ordering_seq,
        (SELECT count(*) FROM @s.modkit_outbox_events w
         WHERE w.ordering_stream = d.ordering_stream
           AND w.ordering_seq > d.ordering_seq AND w.status IN ('pending', 'processing')),
        d.last_error, d.updated_at
    FROM @s.modkit_outbox_events d
    WHERE d.settled_status = 'dead' AND d.ordering_key IS NOT NULL AND NOT d.head_skipped
    ORDER BY d.settled_at, d.id
    LIMIT p_limit;
$function$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_resign(p_holder uuid, p_roles text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = @s, pg_temp SET jit = off AS $$
    DELETE FROM @s.modkit_outbox_leaders WHERE holder = p_holder AND role = ANY(p_roles);
$$;
$functions$, '@s', s);
END $migration$;
