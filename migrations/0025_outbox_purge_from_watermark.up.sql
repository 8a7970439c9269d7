-- The dispatchers' purge walks from a watermark instead of from the oldest
-- delivered event. modkit_outbox_purge deletes a topic's delivered events
-- settled before now - retention, found in the settled index
-- (settled_status, settled_at) from its oldest entry on: no index is led by
-- topic (one would be written by every delivery, a non-HOT update, and slow
-- each). So every pass also walks the delivered events that other topics
-- keep past this cutoff: those of a longer retention, of a retention that
-- keeps them forever (an audit topic), or of another service sharing the
-- table. With 860,000 of them a pass took 575 ms, every SweepInterval (30 s)
-- and per retention, and a topic kept forever grows it without bound.
--
-- modkit_outbox_purge_from starts the walk at p_from (NULL: at the oldest)
-- and returns the cutoff it purged below (clock - p_retention, in the
-- database's or the test clock), which the dispatcher keeps as its
-- watermark. The rule (modkit/outbox/maintenance.go): after a call that
-- purged fewer than p_limit events, every delivered event of p_topics
-- settled in [p_from, cutoff) that the call could see is gone. An event
-- settled below the cutoff later than that can only be one whose settled_at
-- was stamped before its transaction committed (an outcome write takes the
-- clock when its statement starts; a transactional handler's write commits
-- with the handler's transaction, within the claim's lease), or one written
-- under a test clock moved back, or one a concurrent transaction held
-- locked (SKIP LOCKED). So the next pass starts at the previous cutoff
-- minus a margin of at least ten minutes (and of several leases), and a
-- full walk (p_from NULL) runs on a dispatcher's first pass and at least
-- once an hour, for what the margin misses. The bound is
-- coalesce(p_from, '-infinity') rather than an OR, so that it bounds the
-- index scan in the generic plan PL/pgSQL may cache too; with p_from NULL
-- the function deletes what modkit_outbox_purge deletes.
--
-- modkit_outbox_purge stays as it is, for clients of earlier versions (and
-- for a client on a schema without this migration, which keeps walking
-- from the oldest). modkit_outbox_grant_roles keeps migration 0023's grants
-- under another name and adds the new function's: the dispatcher may run
-- it.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0023;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
-- Delete up to p_limit events of p_topics delivered more than p_retention
-- ago and at or after p_from (NULL: any time), found in the settled index
-- from p_from on; return how many, and the cutoff (clock - p_retention)
-- they were settled before.
CREATE FUNCTION @s.modkit_outbox_purge_from(p_topics text[], p_retention interval, p_limit int,
    p_from timestamptz, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (purged bigint, cutoff timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET jit = off AS $$
DECLARE
    v_cutoff timestamptz := @s.modkit_outbox_clock(p_now) - p_retention;
    v_n bigint;
BEGIN
    DELETE FROM @s.modkit_outbox_events WHERE id IN (
        SELECT e.id FROM @s.modkit_outbox_events e
        WHERE e.settled_status = 'delivered' AND e.settled_at < v_cutoff
          AND e.settled_at >= coalesce(p_from, '-infinity'::timestamptz)
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    purged := v_n;
    cutoff := v_cutoff;
    RETURN NEXT;
END $$;

-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0025 the dispatcher may purge from a watermark.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0023();
BEGIN
    IF 'modkit_outbox_dispatcher' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_purge_from(text[], interval, int, timestamptz, timestamptz)
            TO modkit_outbox_dispatcher;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function, and grants it to
-- the dispatcher role if it exists.
SELECT modkit_outbox_grant_roles();
