-- An operator may prune the sequence rows of ordering keys that have no
-- event left (Admin.PruneSequences, the CLI's purge --sequences). Each key
-- ever used kept its row in modkit_outbox_sequences after its events were
-- purged, so that a key used again went on from its last sequence; nothing
-- deleted them, and keys per order or per aggregate grew the table, and
-- its indexes, without bound (a trial: 100,000 keys purged of every event
-- left 100,000 rows, 20 MB, read by every keyed enqueue and chained claim).
--
-- A key keeps its row while any event of it is in the events table,
-- whatever its status: pending, leased, held, dead (skipped or not) or
-- delivered and not purged yet. A key whose row was pruned and that is
-- used again starts again: a new row, a new stream id, sequence 1. A
-- consumer that remembers a key's last sequence sees it go back to 1 (the
-- docs say so).
--
-- The prune never lets an event be lost or misordered, nor fails an
-- enqueue at READ COMMITTED (an enqueue in a REPEATABLE READ or
-- SERIALIZABLE transaction whose snapshot predates a prune of its key gets
-- a serialization failure, which the library reports as ErrConflict):
--   - It locks the rows it will delete FOR UPDATE SKIP LOCKED: a row an
--     enqueue under way holds (its update of last_seq, or the key share
--     lock of its event's foreign-key check) is skipped, and is left for a
--     later run.
--   - It deletes them in a second statement, whose snapshot is taken after
--     the locks: a row whose key got an event committed between the first
--     statement's snapshot and its lock is seen to have one and kept (the
--     foreign key would otherwise fail the delete). While the row is
--     locked, no event of the key can be inserted (its foreign-key check
--     waits), so none is missed.
--   - An enqueue that waits for a row the prune deletes finds no row once
--     the prune commits, and inserts a new one (the enqueue functions
--     update, then insert on conflict; a conflict with a deleted row is
--     retried by PostgreSQL): its event is the key's first, sequence 1.
-- In a REPEATABLE READ or SERIALIZABLE transaction, a key enqueued
-- meanwhile makes the prune fail with a serialization error instead (run it
-- again); it deletes nothing then.
--
-- modkit_outbox_prunable_sequences counts the rows a prune would delete
-- now, for a dry run: it reads every row of the sequences table, and looks
-- each key's events up in their stream index.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0044;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
-- Deletes at most p_limit sequence rows of keys without events, among
-- those whose stream id is above p_after, in stream id order, and returns
-- how many it deleted and the highest stream id it took (0 when it took
-- none): the next call goes on after it, so that a prune in batches reads
-- each row once. Rows an enqueue under way holds are skipped.
CREATE FUNCTION @s.modkit_outbox_prune_sequences(p_limit int, p_after bigint)
RETURNS TABLE (pruned bigint, last_stream bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_streams bigint[];
    v_n bigint;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'outbox: prune sequences limit is %; give at least 1', coalesce(p_limit::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    SELECT coalesce(pg_catalog.array_agg(c.stream_id), '{}') INTO v_streams FROM (
        SELECT q.stream_id FROM @s.modkit_outbox_sequences q
        WHERE q.stream_id > coalesce(p_after, 0)
          AND NOT EXISTS (SELECT 1 FROM @s.modkit_outbox_events e WHERE e.ordering_stream = q.stream_id)
        ORDER BY q.stream_id
        LIMIT p_limit
        FOR UPDATE OF q SKIP LOCKED) c;
    IF pg_catalog.cardinality(v_streams) = 0 THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint;
        RETURN;
    END IF;
    -- A new statement, a new snapshot: events committed before the rows
    -- were locked are seen, and keep their key's row.
    DELETE FROM @s.modkit_outbox_sequences q
    WHERE q.stream_id = ANY(v_streams)
      AND NOT EXISTS (SELECT 1 FROM @s.modkit_outbox_events e WHERE e.ordering_stream = q.stream_id);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN QUERY SELECT v_n, (SELECT pg_catalog.max(x) FROM pg_catalog.unnest(v_streams) AS x);
END $$;

-- How many sequence rows modkit_outbox_prune_sequences would delete now.
CREATE FUNCTION @s.modkit_outbox_prunable_sequences()
RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT count(*) FROM @s.modkit_outbox_sequences q
    WHERE NOT EXISTS (SELECT 1 FROM @s.modkit_outbox_events e WHERE e.ordering_stream = q.stream_id);
$$;

-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0045 the operator may prune the sequences of
-- keys without events, and the reader and operator count them.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0044();
BEGIN
    IF 'modkit_outbox_operator' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_prune_sequences(int, bigint),
            @s.modkit_outbox_prunable_sequences() TO modkit_outbox_operator;
    END IF;
    IF 'modkit_outbox_reader' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_prunable_sequences() TO modkit_outbox_reader;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

SELECT modkit_outbox_grant_roles();
