-- Which topics a running dispatcher serves. An event enqueued for a topic
-- that no dispatcher has a publisher for (a producer's typo, a service not
-- deployed yet) waited without a word anywhere: Enqueue cannot know, and
-- the counts showed only a growing age. Every running dispatcher takes part
-- in the maintenance election of each of its topics, so each topic it
-- serves has a maintenance lease that has not expired (role
-- "maintenance:<namespace>:<topic>"; names cannot hold a colon).
--
-- modkit_outbox_served_topics lists those topics, for Admin.Unserved, the
-- CLI's stats and the dashboard. modkit_outbox_grant_roles keeps migration
-- 0027's grants under another name and lets the reader and the operator
-- run the new function, as they may count the backlog.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0027;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
-- The (namespace, topic) pairs whose maintenance lease a dispatcher holds
-- now, by the database's clock (or the test clock p_now).
CREATE FUNCTION @s.modkit_outbox_served_topics(p_now timestamptz DEFAULT NULL)
RETURNS TABLE (namespace text, topic text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = @s, pg_temp AS $$
    SELECT split_part(l.role, ':', 2), split_part(l.role, ':', 3)
    FROM @s.modkit_outbox_leaders l
    WHERE l.role LIKE 'maintenance:%:%' AND l.expires_at > @s.modkit_outbox_clock(p_now)
    ORDER BY 1, 2
$$;

-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0034 the reader and the operator may list the
-- topics served.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0027();
BEGIN
    IF 'modkit_outbox_reader' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_served_topics(timestamptz) TO modkit_outbox_reader;
    END IF;
    IF 'modkit_outbox_operator' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_served_topics(timestamptz) TO modkit_outbox_operator;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function, and grants it to
-- the reader and operator roles if they exist.
SELECT modkit_outbox_grant_roles();
