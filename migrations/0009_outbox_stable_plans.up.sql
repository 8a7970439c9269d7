-- Plans that stay fast whatever the statistics and the table's size: three
-- changes, each after a benchmark fell into the plan it removes.
--
-- 1. No JIT compilation on the dispatch and enqueue paths. PostgreSQL
-- compiles a statement to machine code when its estimated cost passes
-- jit_above_cost (100,000 by default). The claim's estimate for expired
-- leases grows with the table: statistics gathered while events were leased
-- say most lease ends are past, so the planner expects to read many rows to
-- find a few. With delivered rows piling up at 2,000 events/s, it passed
-- 100,000 within the first minute (113,000 for a claim of 226 events), and
-- from then on every claim spent 100-120 ms compiling a statement that runs
-- in about 1 ms: the dispatcher fell behind for good (82,704 of 120,000
-- events delivered 15 s after the last commit; BENCHMARKS.md, "JIT on the
-- dispatch path"). These short statements never gain from JIT, so the
-- functions of the enqueue and dispatch paths (and both purges) run with
-- jit = off; the operators' reports keep the server's setting.
--
-- 2. modkit_outbox_complete looks the events it settles up by id, never by
-- a walk of the locked_until index. Its fence, that each event is still
-- leased to the caller and unexpired, used to be written
-- e.locked_until > v_now, a condition the planner can answer from that
-- index. Statistics gathered while a backlog drains (autoanalyze runs when a
-- tenth of the table has changed) make few events look leased, and the
-- planner then walked the index over every leased event once for each
-- outcome of the call instead of looking the outcomes up by id: each call
-- took 400-500 ms instead of a few, and a dispatcher draining 100,000
-- ordered events fell from about 21,000 to 4,000 events/s until the drain
-- ended (BENCHMARKS.md, "Outcome writes after a mid-drain analyze"). The
-- fence is now an expression that no index holds and that does not imply
-- the index's predicate (locked_until IS NOT NULL), so the planner can reach
-- the events only through their primary key or by reading the table; what
-- the fence admits is unchanged.
--
-- 3. The claim reads the claim index and the locked_until index in order,
-- never as bitmaps. Each event claimed and settled leaves a dead entry in
-- both indexes until vacuum: at 2,000 events/s, tens of thousands. A plain
-- index scan marks the dead entries it passes, so the next scan skips them;
-- a bitmap scan never does and checks every one of them against the table,
-- each time. With JIT off alone, claims chose
-- bitmap scans once the statistics said few rows matched, and took 30-100
-- ms: end-to-end latency at 2,000 events/s was p50 47 ms, p99 191 ms. With
-- bitmap scans off too: p50 2.8-3.2 ms, p99 13-27 ms (River, alternated
-- with it: 1.4 and 12-30 ms). The sweep, which runs every SweepInterval
-- and looks for pending events out of attempts among all pending ones,
-- keeps the planner's choice.
--
-- The function it replaces stays as modkit_outbox_complete_0008, callable by
-- its owner only, so that the down migration can put it back.
ALTER FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete_0008;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_complete_0008(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz) FROM %I', r);
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
-- recorded outcome appends its ledger row in the same statement. (Since
-- migration 0005, a released event of an ordering key is held again while its
-- predecessor is undelivered, and a release's reason, passed as its error,
-- becomes its ledger row's detail; last_error is left alone. Since migration
-- 0009, the events are looked up by id whatever the statistics say, and
-- the function runs without JIT.)
CREATE FUNCTION @s.modkit_outbox_complete(
    p_worker uuid, p_ids uuid[], p_tokens uuid[], p_outcomes text[], p_errors text[], p_delays_ms bigint[],
    p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET plan_cache_mode = force_custom_plan SET jit = off AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_bad text;
    v_delivered uuid[];
BEGIN
    SELECT o INTO v_bad FROM unnest(p_outcomes) AS o
    WHERE o IS NULL OR o NOT IN ('delivered', 'retry', 'dead', 'released') LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox: % is not an outcome a worker may record', coalesce(v_bad, 'NULL')
            USING ERRCODE = 'P7003', HINT = 'use delivered, retry, dead or released';
    END IF;
    SELECT coalesce(pg_catalog.array_agg(o.id), '{}') INTO v_delivered
    FROM unnest(p_ids, p_outcomes) AS o(id, outcome) WHERE o.outcome = 'delivered';
    RETURN QUERY
    WITH upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = CASE a.outcome WHEN 'delivered' THEN 'delivered' WHEN 'dead' THEN 'dead' ELSE 'pending' END,
            attempts = CASE a.outcome WHEN 'released' THEN e.attempts - 1 ELSE e.attempts END,
            next_attempt_at = CASE a.outcome
                WHEN 'retry' THEN v_now + greatest(coalesce(a.delay_ms, 0), 0) * interval '1 millisecond'
                WHEN 'released' THEN v_now
                ELSE e.next_attempt_at END,
            last_error = CASE WHEN a.outcome IN ('retry', 'dead') THEN left(a.err, 8192) ELSE e.last_error END,
            locked_by = NULL, locked_until = NULL, lease_token = NULL,
            ledger_seq = e.ledger_seq + 1,
            updated_at = v_now,
            -- A released event of an ordering key (a chain given back after
            -- an event before it failed) is held again while its
            -- predecessor is undelivered, unless this call delivers it.
            held = CASE WHEN a.outcome = 'released' AND e.ordering_key IS NOT NULL THEN EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))
                  AND NOT (p.id = ANY(v_delivered)))
                ELSE e.held END
        FROM unnest(p_ids, p_tokens, p_outcomes, p_errors, p_delays_ms) AS a(id, token, outcome, err, delay_ms)
        WHERE e.id = a.id AND e.lease_token = a.token AND e.locked_by = p_worker
          -- Unexpired, as an expression no index holds and from which the
          -- planner cannot infer locked_until IS NOT NULL (the predicate of
          -- the locked_until index, which it could then read whole): the
          -- events come from their primary key, never from a walk of that
          -- index (see the top of this migration).
          AND e.status = 'processing' AND coalesce(e.locked_until, '-infinity'::timestamptz) > v_now
        RETURNING e.id, e.ledger_seq, e.namespace, e.topic, a.outcome, a.token, e.claimed_at,
            CASE a.outcome WHEN 'released' THEN e.attempts + 1 ELSE e.attempts END AS attempt,
            CASE WHEN a.outcome IN ('retry', 'dead', 'released') THEN left(a.err, 8192) END AS err,
            e.ordering_key, e.ordering_stream, e.ordering_seq),
    release AS (
        -- A delivered event lets the next one of its key into the claim,
        -- unless that one is settled in this call too (the rest of a run:
        -- leased, so not held), which spares most of a run's index probes.
        UPDATE @s.modkit_outbox_events AS s SET held = false
        FROM (SELECT u.ordering_stream, u.ordering_seq FROM upd u
              WHERE u.outcome = 'delivered' AND u.ordering_key IS NOT NULL
              EXCEPT
              SELECT u.ordering_stream, u.ordering_seq - 1 FROM upd u
              WHERE u.ordering_key IS NOT NULL) f
        WHERE s.ordering_stream = f.ordering_stream
          AND s.ordering_seq = f.ordering_seq + 1 AND s.held),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.ledger_seq, u.namespace, u.topic, u.outcome, u.attempt, p_worker, u.token, u.claimed_at, v_now, u.err
        FROM upd u)
    SELECT u.id FROM upd u;
END $$;

$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function, and grants it to
-- the outbox roles that exist.
SELECT modkit_outbox_grant_roles();

-- The dispatch and enqueue paths without JIT, and the claim without bitmap
-- scans (see the top).
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text) SET jit = off;
ALTER FUNCTION modkit_outbox_enqueue_many(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[]) SET jit = off;
ALTER FUNCTION modkit_outbox_claim(uuid, text[], int, int, interval, text[], timestamptz) SET jit = off;
ALTER FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz) SET jit = off;
ALTER FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz) SET enable_bitmapscan = off;
ALTER FUNCTION modkit_outbox_complete_one(uuid, uuid, uuid, text, text, bigint, timestamptz) SET jit = off;
ALTER FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz) SET jit = off;
ALTER FUNCTION modkit_outbox_purge(text[], interval, int, timestamptz) SET jit = off;
ALTER FUNCTION modkit_outbox_purge_recorded(text[], interval, int, timestamptz) SET jit = off;
ALTER FUNCTION modkit_outbox_release_held(text[], text[], int) SET jit = off;
ALTER FUNCTION modkit_outbox_elect(text[], uuid, interval, timestamptz) SET jit = off;
ALTER FUNCTION modkit_outbox_resign(uuid, text[]) SET jit = off;
ALTER FUNCTION modkit_outbox_depth(text[], timestamptz) SET jit = off;
