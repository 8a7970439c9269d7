-- Claims of ordering chains (publishers whose events carry ordering keys),
-- made as cheap as claims without chains, in two parts.
--
-- One lease token a chained claim, as migration 0016 gave the claim without
-- chains. modkit_outbox_claim_chains drew a token for each event it leased:
-- gen_random_uuid() costs about 2.3 us a call on this kind of machine, and
-- an outcome write finds its deliveries with one UPDATE per lease token only
-- when at least eight of them share one (migration 0019); with a token an
-- event, every delivery of an ordered event took the lock and the update by
-- row address instead (BENCHMARKS.md, "A slow machine, and one lease token
-- a chained claim": about 5% off the outcome writes of an ordered drain).
-- Fencing is unchanged: a token still names one claim, every claim draws
-- its own, and an outcome is recorded only for an event leased to the
-- caller under the token presented (with the worker and an unexpired
-- lease). The events of one claim share its token, as they share its
-- worker and lease end.
--
-- The links of a chain stay held while leased. A chained claim leased each
-- link of a chain and cleared its held flag; held is in the claim index's
-- predicate, so every link's update was not heap-only and gave the link
-- new entries in four indexes, three of them unique and checked: 40 of a
-- 59 ms claim of 1,000 events
-- (BENCHMARKS.md, "The links of a chain stay held while leased"). Now held
-- means what its name says, "behind an undelivered event of its key",
-- without the exception "a leased event is never held" that 0014 wrote into
-- the claim, the sweep and the depth gauge:
--   - modkit_outbox_claim_chains leaves held as it is (a head is not held,
--     a link is held behind the events before it in its chain);
--   - modkit_outbox_complete clears held on a delivery (a non-HOT update in
--     any case), and sets it from the predecessor for a retry or a dead
--     outcome of a held event, as it did for a release (a link retried or
--     dead behind a delivered predecessor is therefore not held, and would
--     otherwise never be claimed again); the release of the next event of a
--     delivered one is unchanged, and also frees a link still leased;
--   - modkit_outbox_sweep repairs the expired leases of held links, found
--     in the held index with the held events out of attempts it already
--     read there;
--   - modkit_outbox_depth counts a leased held link as processing.
-- modkit_outbox_release_held, which frees the first held event of a key
-- once its predecessor has settled, may now free a leased link: it then
-- enters the claim index as a lease, as every leased event did before.
-- Claims find expired leases of links as before: a chained claim walks a
-- head's links whatever their held flag, and a link whose head was
-- delivered is freed by that delivery.
--
-- The functions replaced stay under _0019 and _0014 names, callable by
-- their owner only, so that the down migration can put them back. The
-- down migration leaves held as it finds it: a link leased under this
-- migration and still leased then stays held until the delivery of its
-- predecessor (or release_held) frees it, when the old functions see an
-- ordinary lease, and a chained claim of its head takes it again if its
-- lease expires.
ALTER FUNCTION modkit_outbox_claim_chains(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chains_0014;
ALTER FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete_0019;
ALTER FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep_0014;
ALTER FUNCTION modkit_outbox_depth(text[], timestamptz) RENAME TO modkit_outbox_depth_0014;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_claim_chains_0014(uuid, text[], int, int, interval, text[], int[], timestamptz), '
            'modkit_outbox_complete_0019(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz), '
            'modkit_outbox_sweep_0014(text[], int, int, timestamptz), '
            'modkit_outbox_depth_0014(text[], timestamptz) FROM %I', r);
    END LOOP;
END $revoke$;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- The claim with chains (migration 0008's statement, planned for each
-- call); since 0014 one walk of the claim index finds pending events and
-- expired leases. Called by modkit_outbox_claim_chained only when some
-- topic's chain is longer than one (modkit_outbox_claim_plain takes the
-- rest), so the shortcut without chains that 0008 kept here is gone; called
-- without chains, it still claims correctly, each head with no successors.
-- Since migration 0021 the events of a claim share one lease token, and the
-- links of a chain stay held while leased (their update is then
-- heap-only): held means "behind an undelivered event of its key". Callable
-- by the owner only.
CREATE FUNCTION @s.modkit_outbox_claim_chains(p_worker uuid, p_topics text[], p_limit integer, p_max_attempts integer, p_lease interval, p_skip_dead text[], p_chain integer[], p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
 RETURNS TABLE(id uuid, namespace text, topic text, tenant_id uuid, dedupe_key text, payload jsonb, attempts integer, lease_token uuid, locked_until timestamp with time zone, created_at timestamp with time zone, repaired boolean, headers jsonb, ordering_key text, ordering_seq bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET plan_cache_mode TO 'force_custom_plan'
 SET jit TO 'off'
 SET enable_bitmapscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    -- The lease token of this claim, shared by the events it leases.
    v_claim_token uuid := gen_random_uuid();
    v_heads int := 0;       -- how many pending heads to lock
    v_reach int := 0;       -- events the heads counted so far take
    v_links int;
BEGIN
    IF p_worker IS NULL OR p_limit IS NULL OR p_limit < 1 OR p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox: claim needs a worker, a positive limit and a positive lease' USING ERRCODE = '22023';
    END IF;
    IF p_chain IS NOT NULL AND pg_catalog.cardinality(p_chain) <> pg_catalog.cardinality(p_topics) THEN
        RAISE EXCEPTION 'outbox: claim needs one chain length per topic (% topics, % chain lengths)',
            pg_catalog.cardinality(p_topics), pg_catalog.cardinality(p_chain) USING ERRCODE = '22023';
    END IF;
    -- With chains, a claim keeps the heads that fit p_limit with their
    -- chains, often a few of the heads it could lock (16 heads in chains of
    -- 32 fill 500). Locking the others too would write a lock on each (a WAL
    -- record and a dirtied page) and keep other claims off them until
    -- commit; so the heads that fit are counted first, reading no further
    -- than the last one, without locking, and twice as many are locked
    -- (enough to fill the claim when another claim holds some of them). The
    -- count is an estimate: it takes every pending unheld event of a key for
    -- a head, as nearly all of them are. (Since migration 0014 the heads
    -- include expired leases, which the claim's walk also returns.)
    FOR v_links IN
        SELECT CASE WHEN e.ordering_key IS NULL THEN 0 ELSE least(
                coalesce(p_chain[pg_catalog.array_position(p_topics, e.namespace || ':' || e.topic)], 1) - 1,
                coalesce((SELECT q.last_seq FROM @s.modkit_outbox_sequences q
                    WHERE q.stream_id = e.ordering_stream)
                    - e.ordering_seq, 0)) END
        FROM @s.modkit_outbox_events e
        WHERE e.settled_status IS NULL AND NOT e.held
          AND ((e.status = 'pending' AND e.next_attempt_at <= v_now)
            OR (e.status = 'processing' AND e.locked_until < v_now))
          AND e.attempts < p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        ORDER BY e.created_at, e.id
        LIMIT p_limit
    LOOP
        EXIT WHEN v_reach >= p_limit;
        v_heads := v_heads + 1;
        v_reach := v_reach + 1 + v_links;
    END LOOP;
    v_heads := least(p_limit, 2 * v_heads);
    RETURN QUERY
    -- Due events come from one walk of the claim index in its order (since
    -- migration 0014 it holds every pending and leased event that is not
    -- held): pending events that are due and leases that expired.
    WITH due AS (
        SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_stream, e.ordering_seq, e.created_at,
            e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts AS old_attempts, e.ledger_seq AS old_seq
        FROM @s.modkit_outbox_events e
        WHERE e.settled_status IS NULL AND NOT e.held
          AND ((e.status = 'pending' AND e.next_attempt_at <= v_now)
            OR (e.status = 'processing' AND e.locked_until < v_now))
          AND e.attempts < p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
          -- An event with an ordering key waits while the one before it
          -- (sequences are gap-free) is undelivered: pending, leased, or dead
          -- unless skipped (by an operator, or by the publisher's policy,
          -- p_skip_dead). Delivered or purged, it no longer holds it back.
          AND (e.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing')
                    OR (p.status = 'dead' AND NOT p.head_skipped
                        AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
        ORDER BY e.created_at, e.id
        LIMIT v_heads
        FOR UPDATE SKIP LOCKED),
    -- How many successors each head's chain may take: up to p_chain - 1,
    -- as many as its key has (the sequence's last value). Heads are kept in
    -- order while they fit p_limit with their chains, so that when it must
    -- choose, a claim takes runs of fewer keys rather than single events
    -- of more keys: each run saves its key a claim and an outcome write.
    sized AS (
        SELECT d.*, CASE WHEN d.ordering_key IS NULL THEN 0 ELSE least(
                coalesce(p_chain[pg_catalog.array_position(p_topics, d.namespace || ':' || d.topic)], 1) - 1,
                coalesce(q.last_seq - d.ordering_seq, 0)) END AS links_max
        FROM due d
        LEFT JOIN @s.modkit_outbox_sequences q
            ON q.stream_id = d.ordering_stream),
    heads AS (
        SELECT k.* FROM (
            SELECT z.*, pg_catalog.row_number() OVER w AS head_rank, sum(1 + z.links_max) OVER w AS reach
            FROM sized z
            WINDOW w AS (ORDER BY z.created_at, z.id ROWS UNBOUNDED PRECEDING)) k
        WHERE k.reach - k.links_max <= p_limit),
    -- A head's successors, locked; a chain ends at the first one that is
    -- not claimable now (not due, leased, locked by another claim, out of
    -- attempts, dead): link n is kept only when it is successor n.
    links AS (
        SELECT c.*, h.head_rank, c.ordering_seq - h.ordering_seq AS pos,
            pg_catalog.row_number() OVER (PARTITION BY h.head_rank ORDER BY c.ordering_seq) AS n
        FROM heads h
        CROSS JOIN LATERAL (
            SELECT c.id, c.ordering_seq, c.status AS old_status, c.locked_by AS old_worker, c.lease_token AS old_token,
                c.claimed_at AS old_claimed_at, c.attempts AS old_attempts, c.ledger_seq AS old_seq
            FROM @s.modkit_outbox_events c
            WHERE c.ordering_stream = h.ordering_stream
              AND c.ordering_seq > h.ordering_seq AND c.ordering_seq <= h.ordering_seq + h.links_max
              AND ((c.status = 'pending' AND c.next_attempt_at <= v_now)
                OR (c.status = 'processing' AND c.locked_until < v_now))
              AND c.attempts < p_max_attempts
            ORDER BY c.ordering_seq
            FOR UPDATE SKIP LOCKED) c
        WHERE h.ordering_key IS NOT NULL AND h.links_max > 0),
    picked AS (
        SELECT p.* FROM (
            SELECT h.id, h.old_status, h.old_worker, h.old_token, h.old_claimed_at, h.old_attempts, h.old_seq,
                h.head_rank, 0::bigint AS pos
            FROM heads h
            UNION ALL
            SELECT l.id, l.old_status, l.old_worker, l.old_token, l.old_claimed_at, l.old_attempts, l.old_seq,
                l.head_rank, l.pos
            FROM links l WHERE l.pos = l.n) p
        ORDER BY p.head_rank, p.pos
        LIMIT p_limit),
    upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = 'processing',
            attempts = e.attempts + 1,
            locked_by = p_worker,
            locked_until = v_now + p_lease,
            lease_token = v_claim_token,
            ledger_seq = e.ledger_seq + (d.old_status = 'processing')::int,
            claimed_at = v_now,
            updated_at = v_now
            -- held is left as it is: a head is not held, and a link stays
            -- held behind the events before it in the chain (migration 0021).
        FROM picked d WHERE e.id = d.id
        -- The old lease's columns travel in RETURNING: joining two CTEs
        -- would be planned from the stale estimate of one processing row,
        -- as a nested loop over the whole batch.
        RETURNING e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, e.payload, e.attempts,
            e.lease_token, e.locked_until, e.created_at, d.old_status = 'processing' AS repaired, e.headers,
            e.ordering_key, e.ordering_seq, d.old_seq, d.old_attempts, d.old_worker, d.old_token, d.old_claimed_at),
    repair AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.old_seq + 1, u.namespace, u.topic, 'lease_expired', u.old_attempts, u.old_worker, u.old_token,
            u.old_claimed_at, v_now, 'the lease expired before an outcome was recorded; claimed again'
        FROM upd u
        WHERE u.repaired)
    SELECT u.id, u.namespace, u.topic, u.tenant_id, u.dedupe_key, u.payload, u.attempts,
        u.lease_token, u.locked_until, u.created_at, u.repaired, u.headers, u.ordering_key, u.ordering_seq
    FROM upd u;
END $function$;


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
-- outcomes are locked first and written by row address, as before. Since
-- 0021 a leased link of a chain may be held (behind the events before it):
-- a delivery clears held, and a release of an event of an ordering key,
-- or a retry or dead outcome of a held one, leaves it held while its
-- predecessor is undelivered (unless this call delivers it).
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
                    ledger_seq = e.ledger_seq + 1, updated_at = v_now, held = false
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
            -- A delivered event is not held. A released event of an ordering
            -- key (a chain given back after an event before it failed), and
            -- a held one retried or dead (a link of a chain, which stays
            -- held while leased since migration 0021), is held while its
            -- predecessor is undelivered, unless this call delivers it. The
            -- rest keep their flag, as before.
            held = CASE WHEN u.outcome = 'delivered' THEN false
                WHEN e.ordering_key IS NOT NULL AND (u.outcome = 'released' OR e.held) THEN EXISTS (
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

-- Repair expired leases of p_topics (back to pending, or dead on the last
-- attempt) and bury pending events out of attempts; since 0014 both from
-- one walk of the claim index; since 0021 also the expired leases of held
-- chain links, from the held index.
CREATE FUNCTION @s.modkit_outbox_sweep(p_topics text[], p_max_attempts integer, p_limit integer, p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
 RETURNS TABLE(id uuid, topic text, repaired boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET plan_cache_mode TO 'force_custom_plan'
 SET jit TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    -- Due events come from two index scans: expired leases and pending
    -- events out of attempts from one walk of the claim index (since
    -- migration 0014 it holds every pending and leased event that is not
    -- held), held events out of attempts and the expired leases of held
    -- events (since 0021 the links of a chain stay held while leased) from
    -- the held index.
    WITH due_claimable AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            e.attempts >= p_max_attempts AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.settled_status IS NULL AND NOT e.held
          AND ((e.status = 'processing' AND e.locked_until < v_now)
            OR (e.status = 'pending' AND e.attempts >= p_max_attempts))
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        ORDER BY e.created_at, e.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due_held AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            e.attempts >= p_max_attempts AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.held
          AND ((e.status = 'pending' AND e.attempts >= p_max_attempts)
            OR (e.status = 'processing' AND e.locked_until < v_now))
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due AS (
        SELECT * FROM (SELECT * FROM due_claimable UNION ALL SELECT * FROM due_held) u
        ORDER BY u.created_at, u.id
        LIMIT p_limit),
    upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = CASE WHEN d.exhausted THEN 'dead' ELSE 'pending' END,
            next_attempt_at = CASE WHEN d.exhausted THEN e.next_attempt_at ELSE v_now END,
            last_error = CASE WHEN d.exhausted THEN left(
                CASE WHEN d.old_status = 'processing'
                    THEN format('lease of worker %s expired on the final attempt (%s of %s): the worker crashed or its publish outlived the lease', d.old_worker, d.attempts, p_max_attempts)
                    ELSE format('attempts (%s) reached max_attempts (%s)', d.attempts, p_max_attempts) END
                || coalesce('; last publish error: ' || left(d.old_error, 2048), ''), 4096)
                ELSE e.last_error END,
            locked_by = NULL, locked_until = NULL, lease_token = NULL,
            ledger_seq = e.ledger_seq + (d.old_status = 'processing')::int + d.exhausted::int,
            updated_at = v_now,
            -- An event of an ordering key back to pending (the rest of a run
            -- whose dispatcher died) is held while its predecessor is
            -- undelivered, as modkit_outbox_complete holds a released one,
            -- so claims do not walk it before its turn.
            held = CASE WHEN NOT d.exhausted AND e.ordering_key IS NOT NULL THEN EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped)))
                ELSE e.held END
        FROM due d WHERE e.id = d.id
        RETURNING e.id, e.namespace, e.topic, e.last_error, NOT d.exhausted AS repaired, d.exhausted,
            d.old_status, d.old_seq, d.attempts, d.old_worker, d.old_token, d.old_claimed_at),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.old_seq + 1, u.namespace, u.topic, 'lease_expired', u.attempts, u.old_worker, u.old_token,
            u.old_claimed_at, v_now, 'the lease expired before an outcome was recorded; repaired by the sweeper'
        FROM upd u WHERE u.old_status = 'processing'
        UNION ALL
        SELECT u.id, u.old_seq + 1 + (u.old_status = 'processing')::int, u.namespace, u.topic, 'swept', NULL, NULL, NULL,
            NULL, v_now, u.last_error
        FROM upd u WHERE u.exhausted)
    SELECT u.id, u.namespace || ':' || u.topic, u.repaired FROM upd u;
END $function$;

-- Per topic: pending, leased and dead events, how long the oldest due one
-- has waited, and the expired leases; since 0014 from the claim, held and
-- settled indexes. Since 0021 a held event may be leased (a chain link):
-- it counts as processing.
CREATE FUNCTION @s.modkit_outbox_depth(p_topics text[], p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
 RETURNS TABLE(topic text, pending bigint, processing bigint, dead bigint, oldest_due_seconds double precision, stuck bigint)
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET max_parallel_workers_per_gather TO '0'
 SET jit TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    -- One index scan for each index that holds the states counted (since
    -- migration 0014: the claim index for pending and leased events, the
    -- held index, the settled index for dead ones), so that delivered
    -- events, however many are kept, are not read.
    RETURN QUERY
    SELECT e.namespace || ':' || e.topic,
        count(*) FILTER (WHERE e.status = 'pending'),
        count(*) FILTER (WHERE e.status = 'processing'),
        count(*) FILTER (WHERE e.status = 'dead'),
        coalesce(extract(epoch FROM v_now - min(e.next_attempt_at) FILTER (WHERE e.status = 'pending' AND e.next_attempt_at <= v_now)), 0)::float8,
        count(*) FILTER (WHERE e.status = 'processing' AND e.locked_until < v_now)
    FROM (
        SELECT p.namespace, p.topic, p.status, p.next_attempt_at, p.locked_until FROM @s.modkit_outbox_events p
        WHERE p.settled_status IS NULL AND NOT p.held AND (p.namespace || ':' || p.topic) = ANY(p_topics)
        UNION ALL
        SELECT h.namespace, h.topic, h.status, h.next_attempt_at, h.locked_until FROM @s.modkit_outbox_events h
        WHERE h.held AND h.status IN ('pending', 'processing') AND (h.namespace || ':' || h.topic) = ANY(p_topics)
        UNION ALL
        SELECT d.namespace, d.topic, d.status, d.next_attempt_at, d.locked_until FROM @s.modkit_outbox_events d
        WHERE d.settled_status = 'dead' AND (d.namespace || ':' || d.topic) = ANY(p_topics)) e
    GROUP BY e.namespace, e.topic;
END $function$;

$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new functions, and grants them to
-- the outbox roles that exist.
SELECT modkit_outbox_grant_roles();
