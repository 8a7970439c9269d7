-- Which outcomes a worker recorded under the lease tokens it presented. A
-- dispatcher's outcome write that commits and whose answer is lost (the
-- connection drops after the commit) is tried again; the retry finds those
-- leases ended by the first write's commit and records nothing, and the
-- dispatcher reported the outcomes as leases lost: a warning that the
-- events would be delivered again, which they would not be, a lease_lost
-- count and an OnOutcome report for deliveries that were recorded. The
-- ledger tells: each recorded outcome appends a row with the worker and the
-- token. modkit_outbox_recorded_outcomes reads it for the outcomes the
-- retry did not record, and the dispatcher role may run it.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0034;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
-- The positions (from 1) of the pairs of p_ids and p_tokens whose event's
-- history holds an outcome a worker records ('delivered', also for an event
-- deleted on delivery; 'retry', 'dead', 'released') written by p_worker
-- under that lease token. A token is drawn afresh for each claim, so such a
-- row is the outcome of that claim. Read by primary key, event by event.
CREATE FUNCTION @s.modkit_outbox_recorded_outcomes(p_worker uuid, p_ids uuid[], p_tokens uuid[])
RETURNS SETOF bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = @s, pg_temp SET jit = off SET enable_seqscan = off AS $$
    SELECT u.ord
    FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS u(id, token, ord)
    WHERE EXISTS (
        SELECT 1 FROM @s.modkit_outbox_attempts a
        WHERE a.event_id = u.id AND a.lease_token = u.token AND a.worker = p_worker
          AND a.outcome IN ('delivered', 'retry', 'dead', 'released'))
$$;

-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0035 the dispatcher may ask which outcomes it
-- recorded.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0034();
BEGIN
    IF 'modkit_outbox_dispatcher' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_recorded_outcomes(uuid, uuid[], uuid[]) TO modkit_outbox_dispatcher;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function, and grants it to
-- the dispatcher role if it exists.
SELECT modkit_outbox_grant_roles();
