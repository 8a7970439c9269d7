-- Outcome writes run on plans cached for the session, as the claim without
-- chains does since migration 0010, and for the same reason: the write of a
-- few outcomes spent most of its time planning (on a scratch database, a
-- claim of 5 events with its outcome write took 1.98 ms, the claim alone
-- 0.78 ms, and the same write on a cached plan 1.31 ms), and at 2,000
-- events/s a dispatcher writes outcomes more than a hundred times a second.
-- With the statements below, a claim of 5 and its outcome write take
-- 0.94-1.07 ms against 1.41-1.58 ms, and of 500, 24-27 ms against 79-84 ms
-- (BENCHMARKS.md, "Outcome writes on cached plans").
--
-- A cached (generic) plan is costed from the statistics and the table's size
-- when it is made, so each statement is written so that none of its plans
-- can read the table instead of the events it settles, whatever it looked
-- like then:
--   1. the events are looked up and locked one by one, by id, in a LATERAL
--      subquery of the outcomes (only the primary key can answer it, and a
--      LATERAL subquery can only be the inner side of its join), which
--      yields each event's row address (ctid);
--   2. they are updated by row address (a TID scan: no index, no join order
--      to get wrong), which writes their ledger rows from what it returns;
--   3. a delivered event of an ordering key lets its successor into the
--      claim: the successors are found one by one by (stream, sequence), in
--      a LATERAL subquery again, and updated by id.
-- Sequential scans, bitmap scans, sorts of the table, hash joins and merge
-- joins are off for these statements. What the function settles, refuses
-- and returns is unchanged: an outcome is recorded only while the event is
-- leased to the caller under the token presented and unexpired. A repeated
-- id is settled once, as before, now always by the first of its outcomes.
--
-- The function it replaces stays as modkit_outbox_complete_0009 (it was
-- created by 0009), callable by its owner only, so that the down migration
-- can put it back.
ALTER FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete_0009;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_complete_0009(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz) FROM %I', r);
    END LOOP;
END $revoke$;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- Record outcomes ('delivered', 'retry', 'dead', 'released') of p_worker's
-- claims. Each row must still be leased to p_worker under the presented
-- token, unexpired; rows that are not are left alone and not returned. Each
-- recorded outcome appends its ledger row. A released event of an ordering
-- key is held again while its predecessor is undelivered, and a release's
-- reason, passed as its error, becomes its ledger row's detail; last_error
-- is left alone. (Since migration 0011, on plans cached for the session:
-- see the top of that migration.)
CREATE FUNCTION @s.modkit_outbox_complete(
    p_worker uuid, p_ids uuid[], p_tokens uuid[], p_outcomes text[], p_errors text[], p_delays_ms bigint[],
    p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp
    SET plan_cache_mode = force_generic_plan SET jit = off
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
    SET enable_hashjoin = off SET enable_mergejoin = off AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_bad text;
    v_delivered uuid[];
    -- The events found leased to p_worker, with their outcomes.
    v_tids tid[];
    v_tokens uuid[];
    v_outcomes text[];
    v_errors text[];
    v_delays bigint[];
    v_settled uuid[];
    -- The settled events of ordering keys, and the delivered ones among
    -- them: their streams and sequences.
    v_keyed_streams bigint[];
    v_keyed_seqs bigint[];
    v_streams bigint[];
    v_seqs bigint[];
BEGIN
    SELECT o INTO v_bad FROM unnest(p_outcomes) AS o
    WHERE o IS NULL OR o NOT IN ('delivered', 'retry', 'dead', 'released') LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox: % is not an outcome a worker may record', coalesce(v_bad, 'NULL')
            USING ERRCODE = 'P7003', HINT = 'use delivered, retry, dead or released';
    END IF;
    SELECT coalesce(pg_catalog.array_agg(o.id), '{}') INTO v_delivered
    FROM unnest(p_ids, p_outcomes) AS o(id, outcome) WHERE o.outcome = 'delivered';

    -- 1. The events still leased to p_worker under the token presented,
    -- unexpired, locked, by id.
    SELECT pg_catalog.array_agg(l.tid), pg_catalog.array_agg(a.token), pg_catalog.array_agg(a.outcome),
        pg_catalog.array_agg(a.err), pg_catalog.array_agg(a.delay_ms)
    INTO v_tids, v_tokens, v_outcomes, v_errors, v_delays
    FROM (SELECT DISTINCT ON (o.id) o.id, o.token, o.outcome, o.err, o.delay_ms
          FROM unnest(p_ids, p_tokens, p_outcomes, p_errors, p_delays_ms) WITH ORDINALITY
              AS o(id, token, outcome, err, delay_ms, ord)
          ORDER BY o.id, o.ord) a
    CROSS JOIN LATERAL (
        SELECT e.ctid AS tid FROM @s.modkit_outbox_events e
        WHERE e.id = a.id AND e.lease_token = a.token AND e.locked_by = p_worker
          -- Unexpired, as an expression no index holds (migration 0009).
          AND e.status = 'processing' AND coalesce(e.locked_until, '-infinity'::timestamptz) > v_now
        FOR UPDATE) l;
    IF v_tids IS NULL THEN
        RETURN;
    END IF;

    -- 2. Settled by row address (the rows are locked since 1), each with
    -- its ledger row.
    WITH upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = CASE u.outcome WHEN 'delivered' THEN 'delivered' WHEN 'dead' THEN 'dead' ELSE 'pending' END,
            attempts = CASE u.outcome WHEN 'released' THEN e.attempts - 1 ELSE e.attempts END,
            next_attempt_at = CASE u.outcome
                WHEN 'retry' THEN v_now + greatest(coalesce(u.delay_ms, 0), 0) * interval '1 millisecond'
                WHEN 'released' THEN v_now
                ELSE e.next_attempt_at END,
            last_error = CASE WHEN u.outcome IN ('retry', 'dead') THEN left(u.err, 8192) ELSE e.last_error END,
            locked_by = NULL, locked_until = NULL, lease_token = NULL,
            ledger_seq = e.ledger_seq + 1,
            updated_at = v_now,
            -- A released event of an ordering key (a chain given back after
            -- an event before it failed) is held again while its
            -- predecessor is undelivered, unless this call delivers it.
            held = CASE WHEN u.outcome = 'released' AND e.ordering_key IS NOT NULL THEN EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))
                  AND NOT (p.id = ANY(v_delivered)))
                ELSE e.held END
        FROM unnest(v_tids, v_tokens, v_outcomes, v_errors, v_delays) AS u(tid, token, outcome, err, delay_ms)
        WHERE e.ctid = u.tid
        RETURNING e.id, e.ledger_seq, e.namespace, e.topic, u.outcome, u.token, e.claimed_at,
            CASE u.outcome WHEN 'released' THEN e.attempts + 1 ELSE e.attempts END AS attempt,
            CASE WHEN u.outcome IN ('retry', 'dead', 'released') THEN left(u.err, 8192) END AS err,
            e.ordering_key, e.ordering_stream, e.ordering_seq),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.ledger_seq, u.namespace, u.topic, u.outcome, u.attempt, p_worker, u.token, u.claimed_at, v_now, u.err
        FROM upd u)
    SELECT pg_catalog.array_agg(u.id),
        pg_catalog.array_agg(u.ordering_stream) FILTER (WHERE u.ordering_key IS NOT NULL),
        pg_catalog.array_agg(u.ordering_seq) FILTER (WHERE u.ordering_key IS NOT NULL),
        pg_catalog.array_agg(u.ordering_stream) FILTER (WHERE u.outcome = 'delivered' AND u.ordering_key IS NOT NULL),
        pg_catalog.array_agg(u.ordering_seq) FILTER (WHERE u.outcome = 'delivered' AND u.ordering_key IS NOT NULL)
    INTO v_settled, v_keyed_streams, v_keyed_seqs, v_streams, v_seqs
    FROM upd u;

    -- 3. A delivered event lets the next one of its key into the claim,
    -- unless that one was settled in 2 (the rest of a run: leased, so not
    -- held), which spares most of a run's index probes.
    IF v_streams IS NOT NULL THEN
        UPDATE @s.modkit_outbox_events AS s SET held = false
        WHERE s.id = ANY(ARRAY(
            SELECT n.id
            FROM (SELECT d.stream, d.seq FROM unnest(v_streams, v_seqs) AS d(stream, seq)
                  EXCEPT
                  SELECT k.stream, k.seq - 1 FROM unnest(v_keyed_streams, v_keyed_seqs) AS k(stream, seq)) f
            CROSS JOIN LATERAL (
                SELECT x.id FROM @s.modkit_outbox_events x
                WHERE x.ordering_stream = f.stream AND x.ordering_seq = f.seq + 1 AND x.held) n))
          AND s.held;
    END IF;

    RETURN QUERY SELECT unnest(v_settled);
END $$;
$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function, and grants it to
-- the outbox roles that exist.
SELECT modkit_outbox_grant_roles();
