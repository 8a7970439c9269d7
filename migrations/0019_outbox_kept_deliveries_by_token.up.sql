-- Kept deliveries by lease token: modkit_outbox_complete writes the
-- deliveries of kept events (outcome 'delivered', the common one) with one
-- UPDATE per lease token, which finds the events by primary key
-- (id = ANY(ids), a scan of the primary key in id order) and fences each in
-- its WHERE clause: leased to the caller under that token, unexpired. It
-- replaces, for those events, the lock by id (a LATERAL lookup with FOR
-- UPDATE) followed by an update by row address that 0011 introduced, and
-- saves the second visit of each row: about a tenth of an outcome write's
-- time (BENCHMARKS.md, "Kept deliveries by lease token"). A claim
-- without chains draws one lease token for all its events (migration
-- 0016), so an outcome write of a claim's events is usually one statement.
-- A chained claim draws a token for each event: deliveries under a token
-- that fewer than eight of them share take the lock and the update by row
-- address as before (one UPDATE each would cost more than it saves).
--
-- What the function records, returns and refuses is unchanged: an event
-- not leased to the caller under the token presented, or whose lease
-- expired, is left alone and not returned; each written event appends its
-- ledger row; the first outcome given for an event is the one recorded; a
-- delivered event of an ordering key lets the next one into the claim. The
-- other outcomes ('retry', 'dead', 'released', 'delivered_deleted') are
-- written as before. The plan stays bounded by the events given
-- (TestCompletePlanCachedOnAnEmptyTable). The function it replaces stays
-- as modkit_outbox_complete_0015, callable by its owner only, so that the
-- down migration can put it back.
ALTER FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete_0015;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_complete_0015(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz) FROM %I', r);
    END LOOP;
END $revoke$;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- Record outcomes ('delivered', 'delivered_deleted', 'retry', 'dead',
-- 'released') of p_worker's claims. Each row must still be leased to
-- p_worker under the presented token, unexpired; rows that are not are left
-- alone and not returned. Each recorded outcome appends its ledger row. A
-- 'delivered_deleted' event is deleted, and its ledger row records it as
-- delivered. A released event of an ordering key is held again while its
-- predecessor is undelivered, and a release's reason, passed as its error,
-- becomes its ledger row's detail; last_error is left alone. Runs on plans
-- cached for the session (migration 0011). Since migration 0019 the
-- deliveries of kept events are written by one UPDATE per lease token that
-- finds them by primary key and fences them in its WHERE clause; the other
-- outcomes are locked first and written by row address, as before.
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
    -- The events to delete ('delivered_deleted'): their addresses and
    -- tokens.
    v_del_tids tid[];
    v_del_tokens uuid[];
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
    -- The outcomes, each event once (the first outcome given for it).
    v_once_ids uuid[];
    v_once_tokens uuid[];
    v_once_outcomes text[];
    v_once_errors text[];
    v_once_delays bigint[];
    -- The lease tokens whose kept deliveries 2 wrote.
    v_shared uuid[] := '{}';
    v_lease record;
BEGIN
    SELECT o INTO v_bad FROM unnest(p_outcomes) AS o
    WHERE o IS NULL OR o NOT IN ('delivered', 'delivered_deleted', 'retry', 'dead', 'released') LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox: % is not an outcome a worker may record', coalesce(v_bad, 'NULL')
            USING ERRCODE = 'P7003', HINT = 'use delivered, delivered_deleted, retry, dead or released';
    END IF;
    SELECT coalesce(pg_catalog.array_agg(o.id), '{}') INTO v_delivered
    FROM unnest(p_ids, p_outcomes) AS o(id, outcome) WHERE o.outcome IN ('delivered', 'delivered_deleted');

    -- 1. Each event once, the first outcome given for it, in id order.
    SELECT pg_catalog.array_agg(a.id), pg_catalog.array_agg(a.token), pg_catalog.array_agg(a.outcome),
        pg_catalog.array_agg(a.err), pg_catalog.array_agg(a.delay_ms)
    INTO v_once_ids, v_once_tokens, v_once_outcomes, v_once_errors, v_once_delays
    FROM (SELECT DISTINCT ON (o.id) o.id, o.token, o.outcome, o.err, o.delay_ms
          FROM unnest(p_ids, p_tokens, p_outcomes, p_errors, p_delays_ms) WITH ORDINALITY
              AS o(id, token, outcome, err, delay_ms, ord)
          ORDER BY o.id, o.ord) a;

    -- 2. The deliveries of kept events under a lease token that at least
    -- eight of them share (a claim without chains draws one token for all
    -- its events, migration 0016; a chained claim one for each event, whose
    -- outcomes 3 and 4 write): one UPDATE per token. The primary key finds
    -- the events of the array in id order, and the WHERE clause fences each,
    -- as the lock in 3 does (leased to p_worker under that token,
    -- unexpired); an event that is not is left alone and not returned. Each
    -- written event appends its ledger row. One statement instead of a lock
    -- and an update by row address (BENCHMARKS.md, "Kept deliveries by
    -- lease token"). A write of fewer than eight events (low rates) has no
    -- such token and skips the grouping.
    IF cardinality(v_once_ids) >= 8 THEN
        FOR v_lease IN SELECT k.token, pg_catalog.array_agg(k.id) AS ids
            FROM unnest(v_once_ids, v_once_tokens, v_once_outcomes) AS k(id, token, outcome)
            WHERE k.outcome = 'delivered'
            GROUP BY k.token HAVING count(*) >= 8 ORDER BY k.token
        LOOP
            WITH upd AS (
                UPDATE @s.modkit_outbox_events AS e SET
                    status = 'delivered', locked_by = NULL, locked_until = NULL, lease_token = NULL,
                    ledger_seq = e.ledger_seq + 1, updated_at = v_now
                WHERE e.id = ANY(v_lease.ids) AND e.lease_token = v_lease.token AND e.locked_by = p_worker
                  AND e.status = 'processing' AND coalesce(e.locked_until, '-infinity'::timestamptz) > v_now
                RETURNING e.id, e.ledger_seq, e.namespace, e.topic, e.claimed_at, e.attempts,
                    e.ordering_key, e.ordering_stream, e.ordering_seq),
            ledger AS (
                INSERT INTO @s.modkit_outbox_attempts
                    (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
                SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'delivered', u.attempts, p_worker, v_lease.token,
                    u.claimed_at, v_now, NULL
                FROM upd u)
            SELECT pg_catalog.array_cat(v_settled, pg_catalog.array_agg(u.id)),
                pg_catalog.array_cat(v_keyed_streams, pg_catalog.array_agg(u.ordering_stream) FILTER (WHERE u.ordering_key IS NOT NULL)),
                pg_catalog.array_cat(v_keyed_seqs, pg_catalog.array_agg(u.ordering_seq) FILTER (WHERE u.ordering_key IS NOT NULL)),
                pg_catalog.array_cat(v_streams, pg_catalog.array_agg(u.ordering_stream) FILTER (WHERE u.ordering_key IS NOT NULL)),
                pg_catalog.array_cat(v_seqs, pg_catalog.array_agg(u.ordering_seq) FILTER (WHERE u.ordering_key IS NOT NULL))
            INTO v_settled, v_keyed_streams, v_keyed_seqs, v_streams, v_seqs
            FROM upd u;
            v_shared := v_shared || v_lease.token;
        END LOOP;
    END IF;

    -- 3. The other outcomes: the events still leased to p_worker under the
    -- token presented, unexpired, locked, in id order; those to delete
    -- apart.
    SELECT pg_catalog.array_agg(l.tid) FILTER (WHERE a.outcome <> 'delivered_deleted'),
        pg_catalog.array_agg(a.token) FILTER (WHERE a.outcome <> 'delivered_deleted'),
        pg_catalog.array_agg(a.outcome) FILTER (WHERE a.outcome <> 'delivered_deleted'),
        pg_catalog.array_agg(a.err) FILTER (WHERE a.outcome <> 'delivered_deleted'),
        pg_catalog.array_agg(a.delay_ms) FILTER (WHERE a.outcome <> 'delivered_deleted'),
        pg_catalog.array_agg(l.tid) FILTER (WHERE a.outcome = 'delivered_deleted'),
        pg_catalog.array_agg(a.token) FILTER (WHERE a.outcome = 'delivered_deleted')
    INTO v_tids, v_tokens, v_outcomes, v_errors, v_delays, v_del_tids, v_del_tokens
    FROM (SELECT o.id, o.token, o.outcome, o.err, o.delay_ms
          FROM unnest(v_once_ids, v_once_tokens, v_once_outcomes, v_once_errors, v_once_delays)
              AS o(id, token, outcome, err, delay_ms)
          WHERE NOT coalesce(o.outcome = 'delivered' AND o.token = ANY(v_shared), false)
          ORDER BY o.id) a
    CROSS JOIN LATERAL (
        SELECT e.ctid AS tid FROM @s.modkit_outbox_events e
        WHERE e.id = a.id AND e.lease_token = a.token AND e.locked_by = p_worker
          -- Unexpired, as an expression no index holds (migration 0009).
          AND e.status = 'processing' AND coalesce(e.locked_until, '-infinity'::timestamptz) > v_now
        FOR UPDATE) l;

    -- 4. Settled by row address (the rows are locked since 3), each with
    -- its ledger row: updated (as migration 0011 does), then deleted for
    -- 'delivered_deleted'. The update's statement is 0011's, unchanged.
    IF v_tids IS NOT NULL THEN
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
    SELECT pg_catalog.array_cat(v_settled, pg_catalog.array_agg(u.id)),
        pg_catalog.array_cat(v_keyed_streams, pg_catalog.array_agg(u.ordering_stream) FILTER (WHERE u.ordering_key IS NOT NULL)),
        pg_catalog.array_cat(v_keyed_seqs, pg_catalog.array_agg(u.ordering_seq) FILTER (WHERE u.ordering_key IS NOT NULL)),
        pg_catalog.array_cat(v_streams, pg_catalog.array_agg(u.ordering_stream) FILTER (WHERE u.outcome = 'delivered' AND u.ordering_key IS NOT NULL)),
        pg_catalog.array_cat(v_seqs, pg_catalog.array_agg(u.ordering_seq) FILTER (WHERE u.outcome = 'delivered' AND u.ordering_key IS NOT NULL))
    INTO v_settled, v_keyed_streams, v_keyed_seqs, v_streams, v_seqs
    FROM upd u;
    END IF;

    IF v_del_tids IS NOT NULL THEN
        WITH del AS (
            DELETE FROM @s.modkit_outbox_events AS e
            USING unnest(v_del_tids, v_del_tokens) AS u(tid, token)
            WHERE e.ctid = u.tid
            RETURNING e.id, e.ledger_seq, e.namespace, e.topic, u.token, e.claimed_at, e.attempts,
                e.ordering_key, e.ordering_stream, e.ordering_seq),
        ledger AS (
            INSERT INTO @s.modkit_outbox_attempts
                (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
            SELECT d.id, d.ledger_seq + 1, d.namespace, d.topic, 'delivered', d.attempts, p_worker, d.token, d.claimed_at,
                v_now, 'deleted on delivery'
            FROM del d)
        SELECT pg_catalog.array_cat(v_settled, pg_catalog.array_agg(d.id)),
            pg_catalog.array_cat(v_keyed_streams, pg_catalog.array_agg(d.ordering_stream) FILTER (WHERE d.ordering_key IS NOT NULL)),
            pg_catalog.array_cat(v_keyed_seqs, pg_catalog.array_agg(d.ordering_seq) FILTER (WHERE d.ordering_key IS NOT NULL)),
            pg_catalog.array_cat(v_streams, pg_catalog.array_agg(d.ordering_stream) FILTER (WHERE d.ordering_key IS NOT NULL)),
            pg_catalog.array_cat(v_seqs, pg_catalog.array_agg(d.ordering_seq) FILTER (WHERE d.ordering_key IS NOT NULL))
        INTO v_settled, v_keyed_streams, v_keyed_seqs, v_streams, v_seqs
        FROM del d;
    END IF;

    -- 5. A delivered event lets the next one of its key into the claim,
    -- unless that one was settled in 2 or 4 (the rest of a run: leased, so not
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
