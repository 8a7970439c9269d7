-- Only a key's head may be skipped, and only heads are listed as blocking;
-- a stopping dispatcher resigns its maintenance leases in role order.
--
-- modkit_outbox_skip_head accepted any dead event with an ordering key, and
-- modkit_outbox_blocked_keys listed every such event as a blocked key's
-- head. When two events of a key were dead (seq 1 and 2, say: a chain whose
-- leases expired on their last attempt dies whole), both were listed, and
-- skipping seq 2 let seq 3 be published while seq 1 was dead and not
-- skipped: the claim waits only for the event just before (seq 2, now
-- skipped). A head is now a dead event whose predecessor (the event just
-- before it, as the claim reads it) does not hold it back: delivered,
-- purged, or dead and skipped. skip_head refuses any other event (false:
-- Admin.SkipHead's ErrNotFound), and blocked_keys lists heads only; once a
-- head is skipped, the dead event after it becomes the key's head.
--
-- modkit_outbox_resign deleted its rows in the order a bitmap scan found
-- them, while modkit_outbox_elect locks them in role order (its conflicts
-- lock the row even when its WHERE fails): a dispatcher resigning several
-- roles could deadlock with another's election (reproduced with pgbench,
-- 8 roles). It now locks its rows in role order first.
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
          -- The key's head: the event before it no longer holds it back.
          AND NOT EXISTS (
            SELECT 1 FROM @s.modkit_outbox_events p
            WHERE p.ordering_stream = e.ordering_stream
              AND p.ordering_seq = e.ordering_seq - 1
              AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped)))
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

-- The ordering keys blocked by a dead head, oldest first (found in the
-- settled index by settled_at since 0014); since 0030 heads only.
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
      AND NOT EXISTS (
        SELECT 1 FROM @s.modkit_outbox_events p
        WHERE p.ordering_stream = d.ordering_stream
          AND p.ordering_seq = d.ordering_seq - 1
          AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped)))
    ORDER BY d.settled_at, d.id
    LIMIT p_limit;
$function$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_resign(p_holder uuid, p_roles text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = @s, pg_temp SET jit = off AS $$
    DELETE FROM @s.modkit_outbox_leaders AS l
    USING (SELECT m.role FROM @s.modkit_outbox_leaders m
           WHERE m.holder = p_holder AND m.role = ANY(p_roles)
           ORDER BY m.role
           FOR UPDATE) AS mine
    WHERE l.role = mine.role AND l.holder = p_holder;
$$;
$functions$, '@s', s);
END $migration$;
