-- Back to migration 0020's grants, without the paged reads of settled
-- events, and modkit_outbox_settled reading as migration 0004 wrote it.
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
CREATE OR REPLACE FUNCTION @s.modkit_outbox_settled_rows(p_payloads boolean, p_since timestamptz, p_limit int,
    p_now timestamptz)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
        e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
        CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
    FROM @s.modkit_outbox_events e
    WHERE e.status IN ('delivered', 'dead') AND e.updated_at >= p_since AND e.updated_at <= coalesce(p_now, now())
    ORDER BY e.updated_at, e.id
    LIMIT p_limit;
$$;
$functions$, '@s', s);
END $migration$;
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0020() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_settled_page(timestamptz, timestamptz, uuid, int, timestamptz),
    modkit_outbox_settled_page_payloads(timestamptz, timestamptz, uuid, int, timestamptz),
    modkit_outbox_settled_page_rows(boolean, timestamptz, timestamptz, uuid, int, timestamptz);
SELECT modkit_outbox_grant_roles();
