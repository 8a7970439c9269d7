-- Back to migration 0025's grants, without the purge of dead events, and
-- modkit_outbox_skip_head as migration 0008 wrote it.
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0025() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_purge_dead_filter(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int, text, timestamptz),
    modkit_outbox_purge_dead(uuid[], text, timestamptz);
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
        UPDATE @s.modkit_outbox_events AS e SET head_skipped = true, ledger_seq = e.ledger_seq + 1, updated_at = v_now
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
$functions$, '@s', s);
END $migration$;
SELECT modkit_outbox_grant_roles();
