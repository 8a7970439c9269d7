-- A claim reads only its own topics' part of the claim index: the backlog
-- of a topic left out of a claim no longer slows the claim.
--
-- The claim index held the pending and leased events that are not held by
-- (created_at, id, next_attempt_at), and a claim walked it from the front,
-- testing each row's topic against the claim's after reading the row. A
-- dispatcher leaves a topic out of its shared claim while the topic's lane
-- is full (a slow publisher) or paused (a hung one), and no claim takes
-- the events of a topic no dispatcher serves; each claim of the other
-- topics read every due event of such a topic's backlog before its own. A
-- trial (trial H) measured, after VACUUM ANALYZE: a quiet topic's p50 from
-- commit to publish 1.7 ms without a backlog and 58 ms behind 200,000 due
-- events of a slow topic; as the topic test compared each row with every
-- topic of the claim one by one (p_topics is a parameter under the generic
-- plan), a claim of 1,000 topics took 1.4 s behind 152,720 events and 11 s
-- behind 500,000, past LeaseHeadroom, and the quiet topic got nothing.
--
-- The index is now led by (namespace, topic), and the claims walk it once
-- per topic of the claim (a LATERAL join over the topics), merging the
-- walks by (created_at, id): a claim reads the index entries of its own
-- topics (their leases in flight and the due events it takes), and an
-- empty topic costs one index descent. next_attempt_at stays in the key,
-- so that the events waiting for a retry are passed over on their index
-- entries (migration 0038). No column a claim or an outcome changes is
-- added to the index, so claims stay heap-only updates.
--
-- A claim of several topics does not lock more than it leases: it first
-- reads each topic's first p_limit due events without locks and merges
-- them, to learn how many of the claim's p_limit events each topic holds;
-- it then locks that many of each, passing over events another claim has
-- locked (as the walk did). A claim of one topic locks in one walk, as
-- before. modkit_outbox_claim_chains counted its heads before locking
-- already; it now counts them per topic and locks twice as many of each
-- topic (it locked twice as many in all).
--
-- modkit_outbox_list_rows (Admin.List, the dashboard's and the CLI's lists
-- of pending and leased events, dead letter by filter) walked the claim
-- index in enqueue order; it now finds the topics in it (one index descent
-- each, unless the filter names one) and merges their walks, up to the
-- page's size of each: an unfiltered page of 50 pending events read 50
-- entries and would read every pending event with the new index.
--
-- The price: each index entry carries the namespace and the topic, and a
-- claim of many topics with events reads up to p_limit events of each to
-- merge them (the old walk read the claim's p_limit events, and whatever
-- lay in front of them). This migration rebuilds the index under an
-- exclusive lock of the events table: enqueues and claims wait while it
-- builds (0.8 s with 600,000 events, 500,000 of them pending). Figures:
-- BENCHMARKS.md, "Claims that read their own topics".
DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (namespace, topic, created_at, id, next_attempt_at)
    WHERE settled_status IS NULL AND NOT held;

-- CREATE OR REPLACE keeps the functions' grants and settings.
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
CREATE OR REPLACE FUNCTION @s.modkit_outbox_claim_plain(p_worker uuid, p_topics text[], p_limit integer, p_max_attempts integer, p_lease interval, p_skip_dead text[], p_now timestamp with time zone)
 RETURNS TABLE(id uuid, namespace text, topic text, tenant_id uuid, dedupe_key text, payload jsonb, attempts integer, lease_token uuid, locked_until timestamp with time zone, created_at timestamp with time zone, repaired boolean, headers jsonb, ordering_key text, ordering_seq bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
 SET enable_sort TO 'off'
 SET enable_hashjoin TO 'off'
 SET enable_mergejoin TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    -- The lease token of this claim, shared by the events it leases.
    v_claim_token uuid := gen_random_uuid();
    -- The claim's topics, each once, as namespace and topic, and how many
    -- events of each to lock (since migration 0045).
    v_want_ns text[];
    v_want_topic text[];
    v_take int[];
    v_ids uuid[];
    -- Their row addresses, as 1 locked them.
    v_tids tid[];
    -- The expired leases among them, with what their ledger rows record.
    v_expired uuid[];
    v_ns text[];
    v_topics text[];
    v_seqs bigint[];
    v_attempts int[];
    v_workers uuid[];
    v_tokens uuid[];
    v_claimed timestamptz[];
BEGIN
    -- 0. The claim's topics, each once. A name is namespace:topic, and a
    -- namespace has no ':'.
    SELECT pg_catalog.array_agg(pg_catalog.split_part(t.name, ':', 1)),
        pg_catalog.array_agg(pg_catalog.substr(t.name, pg_catalog.strpos(t.name, ':') + 1))
    INTO v_want_ns, v_want_topic
    FROM (SELECT DISTINCT x AS name FROM pg_catalog.unnest(p_topics) AS x) t;
    IF v_want_ns IS NULL THEN
        RETURN;
    END IF;
    -- The claim index is read per topic (since migration 0045 it is led by
    -- namespace and topic), so a claim reads its own topics' entries only:
    -- the backlog of a topic left out of the claim (its lane full or
    -- paused, or served by no dispatcher) is not read.
    --
    -- 1a. With several topics, which of them hold the claim's p_limit
    -- oldest due events: each topic's first p_limit due events, without
    -- locks, merged by (created_at, id). 1b then locks that many of each
    -- topic, no more: a lock on an event the claim does not lease would
    -- write a WAL record and keep other claims off it until commit.
    IF pg_catalog.cardinality(v_want_ns) = 1 THEN
        v_take := ARRAY[p_limit];
    ELSE
        SELECT pg_catalog.array_agg(w.ns), pg_catalog.array_agg(w.topic), pg_catalog.array_agg(w.n)
        INTO v_want_ns, v_want_topic, v_take
        FROM (
            SELECT f.ns, f.topic, count(*)::int AS n
            FROM (
                SELECT w.ns, w.topic, c.created_at, c.id
                FROM unnest(v_want_ns, v_want_topic) AS w(ns, topic)
                CROSS JOIN LATERAL (
                    SELECT e.created_at, e.id
                    FROM @s.modkit_outbox_events e
                    WHERE e.namespace = w.ns AND e.topic = w.topic
                      AND e.settled_status IS NULL AND NOT e.held
                      AND ((e.status = 'pending' AND e.next_attempt_at <= v_now)
                        OR (e.status = 'processing' AND e.locked_until < v_now))
                      AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts
                      AND (e.ordering_key IS NULL OR NOT EXISTS (
                            SELECT 1 FROM @s.modkit_outbox_events p
                            WHERE p.ordering_stream = e.ordering_stream
                              AND p.ordering_seq = e.ordering_seq - 1
                              AND (p.status IN ('pending', 'processing')
                                OR (p.status = 'dead' AND NOT p.head_skipped
                                    AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
                    ORDER BY e.created_at, e.id
                    LIMIT p_limit) c
                ORDER BY c.created_at, c.id
                LIMIT p_limit) f
            GROUP BY f.ns, f.topic) w;
        IF v_take IS NULL THEN
            RETURN;
        END IF;
    END IF;
    -- 1b. The due events, locked, from a walk of each topic's part of the
    -- claim index in its order (since migration 0014 it holds every pending
    -- and leased event that is not held): pending events that are due and
    -- leases that expired, the claim's rule in seed 004. A walk passes over
    -- the events another claim has locked and takes the next ones of its
    -- topic.
    WITH due AS (
        SELECT c.*
        FROM unnest(v_want_ns, v_want_topic, v_take) AS w(ns, topic, n)
        CROSS JOIN LATERAL (
            SELECT e.ctid AS tid, e.id, e.created_at, e.status = 'processing' AS expired, e.namespace, e.topic, e.ledger_seq,
                e.attempts, e.locked_by, e.lease_token, e.claimed_at
            FROM @s.modkit_outbox_events e
            WHERE e.namespace = w.ns AND e.topic = w.topic
              AND e.settled_status IS NULL AND NOT e.held
              AND ((e.status = 'pending' AND e.next_attempt_at <= v_now)
                OR (e.status = 'processing' AND e.locked_until < v_now))
              AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts
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
            LIMIT w.n
            FOR UPDATE SKIP LOCKED) c)
    SELECT pg_catalog.array_agg(d.id), pg_catalog.array_agg(d.tid),
        pg_catalog.array_agg(d.id) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.namespace) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.topic) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.ledger_seq) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.attempts) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.locked_by) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.lease_token) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.claimed_at) FILTER (WHERE d.expired)
    INTO v_ids, v_tids, v_expired, v_ns, v_topics, v_seqs, v_attempts, v_workers, v_tokens, v_claimed
    FROM due d;
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    -- 2. Leased to p_worker. The rows are locked by this transaction since
    -- 1, so they are as 1 read them and where 1 found them: they are
    -- updated by row address (a TID scan, as the outcome write does since
    -- migration 0011), not looked up again in the primary key. An expired
    -- lease's claim takes a ledger number for the row that records it (3).
    RETURN QUERY
    UPDATE @s.modkit_outbox_events AS e SET
        status = 'processing',
        attempts = e.attempts + 1,
        locked_by = p_worker,
        locked_until = v_now + p_lease,
        lease_token = v_claim_token,
        ledger_seq = e.ledger_seq + (e.status = 'processing')::int,
        claimed_at = v_now,
        updated_at = v_now,
        held = false
    WHERE e.ctid = ANY(v_tids)
    RETURNING e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, e.payload, e.attempts,
        e.lease_token, e.locked_until, e.created_at, coalesce(e.id = ANY(v_expired), false), e.headers,
        e.ordering_key, e.ordering_seq;
    -- 3. The ledger rows of the expired leases.
    IF v_expired IS NOT NULL THEN
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT x.id, x.seq + 1, x.ns, x.topic, 'lease_expired', x.attempt, x.worker, x.token, x.claimed_at, v_now,
            'the lease expired before an outcome was recorded; claimed again'
        FROM unnest(v_expired, v_ns, v_topics, v_seqs, v_attempts, v_workers, v_tokens, v_claimed)
            AS x(id, ns, topic, seq, attempt, worker, token, claimed_at);
    END IF;
END $function$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_claim_chains(p_worker uuid, p_topics text[], p_limit integer, p_max_attempts integer, p_lease interval, p_skip_dead text[], p_chain integer[], p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
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
    -- The claim's topics, each once, as namespace and topic, with their
    -- chain lengths and how many heads each has among those counted
    -- (since migration 0045).
    v_want_ns text[];
    v_want_topic text[];
    v_want_chain int[];
    v_count int[];
    v_ord int;
BEGIN
    IF p_worker IS NULL OR p_limit IS NULL OR p_limit < 1 OR p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox: claim needs a worker, a positive limit and a positive lease' USING ERRCODE = '22023';
    END IF;
    IF p_chain IS NOT NULL AND pg_catalog.cardinality(p_chain) <> pg_catalog.cardinality(p_topics) THEN
        RAISE EXCEPTION 'outbox: claim needs one chain length per topic (% topics, % chain lengths)',
            pg_catalog.cardinality(p_topics), pg_catalog.cardinality(p_chain) USING ERRCODE = '22023';
    END IF;
    -- The claim's topics, each once (with the chain length given first for
    -- it). A name is namespace:topic, and a namespace has no ':'.
    SELECT pg_catalog.array_agg(pg_catalog.split_part(t.name, ':', 1)),
        pg_catalog.array_agg(pg_catalog.substr(t.name, pg_catalog.strpos(t.name, ':') + 1)),
        pg_catalog.array_agg(p_chain[t.ord])
    INTO v_want_ns, v_want_topic, v_want_chain
    FROM (SELECT x.name, min(x.ord) AS ord
          FROM pg_catalog.unnest(p_topics) WITH ORDINALITY AS x(name, ord)
          GROUP BY x.name) t;
    IF v_want_ns IS NULL THEN
        RETURN;
    END IF;
    v_count := pg_catalog.array_fill(0, ARRAY[pg_catalog.cardinality(v_want_ns)]);
    -- The claim index is read per topic (since migration 0045 it is led by
    -- namespace and topic), so a claim reads its own topics' entries only:
    -- the backlog of a topic left out of the claim (its lane full or
    -- paused, or served by no dispatcher) is not read. Each topic's walk
    -- reads at most p_limit due events, merged by (created_at, id).
    --
    -- With chains, a claim keeps the heads that fit p_limit with their
    -- chains, often a few of the heads it could lock (16 heads in chains of
    -- 32 fill 500). Locking the others too would write a lock on each (a WAL
    -- record and a dirtied page) and keep other claims off them until
    -- commit; so the heads that fit are counted first, per topic, reading
    -- no further than the last one, without locking, and twice as many of
    -- each topic are locked (enough to fill the claim when another claim
    -- holds some of them). The count is an estimate: it takes every pending
    -- unheld event of a key for a head, as nearly all of them are. (Since
    -- migration 0014 the heads include expired leases, which the claim's
    -- walk also returns.)
    FOR v_ord, v_links IN
        SELECT c.ord, CASE WHEN c.ordering_key IS NULL THEN 0 ELSE least(
                coalesce(c.chain, 1) - 1,
                coalesce((SELECT q.last_seq FROM @s.modkit_outbox_sequences q
                    WHERE q.stream_id = c.ordering_stream)
                    - c.ordering_seq, 0)) END
        FROM (
            SELECT w.ord, w.chain, e.created_at, e.id, e.ordering_key, e.ordering_stream, e.ordering_seq
            FROM unnest(v_want_ns, v_want_topic, v_want_chain) WITH ORDINALITY AS w(ns, topic, chain, ord)
            CROSS JOIN LATERAL (
                SELECT e.created_at, e.id, e.ordering_key, e.ordering_stream, e.ordering_seq
                FROM @s.modkit_outbox_events e
                WHERE e.namespace = w.ns AND e.topic = w.topic
                  AND e.settled_status IS NULL AND NOT e.held
                  AND ((e.status = 'pending' AND e.next_attempt_at <= v_now)
                    OR (e.status = 'processing' AND e.locked_until < v_now))
                  AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts
                ORDER BY e.created_at, e.id
                LIMIT p_limit) e
            ORDER BY e.created_at, e.id
            LIMIT p_limit) c
        ORDER BY c.created_at, c.id
    LOOP
        EXIT WHEN v_reach >= p_limit;
        v_heads := v_heads + 1;
        v_reach := v_reach + 1 + v_links;
        v_count[v_ord] := v_count[v_ord] + 1;
    END LOOP;
    IF v_heads = 0 THEN
        RETURN;
    END IF;
    v_heads := least(p_limit, 2 * v_heads);
    RETURN QUERY
    -- Due events come from a walk of each topic's part of the claim index
    -- in its order (since migration 0014 it holds every pending and leased
    -- event that is not held): pending events that are due and leases that
    -- expired; a walk passes over the events another claim has locked and
    -- takes the next ones of its topic.
    WITH due AS (
        SELECT c.*
        FROM unnest(v_want_ns, v_want_topic, v_want_chain, v_count) AS w(ns, topic, chain, n)
        CROSS JOIN LATERAL (
            SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_stream, e.ordering_seq, e.created_at,
                e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
                e.claimed_at AS old_claimed_at, e.attempts AS old_attempts, e.ledger_seq AS old_seq, w.chain
            FROM @s.modkit_outbox_events e
            WHERE e.namespace = w.ns AND e.topic = w.topic
              AND e.settled_status IS NULL AND NOT e.held
              AND ((e.status = 'pending' AND e.next_attempt_at <= v_now)
                OR (e.status = 'processing' AND e.locked_until < v_now))
              AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts
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
            LIMIT least(p_limit, 2 * w.n)
            FOR UPDATE SKIP LOCKED) c
        ORDER BY c.created_at, c.id
        LIMIT v_heads),
    -- How many successors each head's chain may take: up to p_chain - 1,
    -- as many as its key has (the sequence's last value). Heads are kept in
    -- order while they fit p_limit with their chains, so that when it must
    -- choose, a claim takes runs of fewer keys rather than single events
    -- of more keys: each run saves its key a claim and an outcome write.
    sized AS (
        SELECT d.*, CASE WHEN d.ordering_key IS NULL THEN 0 ELSE least(
                coalesce(d.chain, 1) - 1,
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
            -- A link taken over from an expired lease is not charged again
            -- (since 0031): its predecessor, this claim's event before it,
            -- was not delivered, so it was published at most after an
            -- outcome that was never recorded; the head is charged.
            attempts = e.attempts + CASE WHEN d.pos > 0 AND d.old_status = 'processing' THEN 0 ELSE 1 END,
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
            e.ordering_key, e.ordering_seq, d.old_seq, d.old_attempts, d.old_worker, d.old_token, d.old_claimed_at, d.pos),
    repair AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.old_seq + 1, u.namespace, u.topic, 'lease_expired', u.old_attempts, u.old_worker, u.old_token,
            u.old_claimed_at, v_now, 'the lease expired before an outcome was recorded; claimed again'
                || CASE WHEN u.pos > 0 THEN ' behind the event before it of its ordering key, which was not delivered: '
                    || 'its attempt is not counted again' ELSE '' END
        FROM upd u
        WHERE u.repaired)
    SELECT u.id, u.namespace, u.topic, u.tenant_id, u.dedupe_key, u.payload, u.attempts,
        u.lease_token, u.locked_until, u.created_at, u.repaired, u.headers, u.ordering_key, u.ordering_seq
    FROM upd u;
END $function$;

CREATE OR REPLACE FUNCTION @s.modkit_outbox_list_rows(p_payloads boolean, p_status text, p_namespace text, p_topic text, p_tenant uuid, p_created_after timestamp with time zone, p_created_before timestamp with time zone, p_after_created_at timestamp with time zone, p_after_id uuid, p_limit integer)
 RETURNS SETOF @s.modkit_outbox_event_row
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET jit TO 'off'
AS $function$
BEGIN
    IF p_status IN ('pending', 'processing') THEN
        RETURN QUERY
        -- Since migration 0045 the claim index is led by namespace and
        -- topic: the topics with events in it are found one index descent
        -- each (unless the filter names one), and each topic's part of it
        -- is walked in enqueue order, up to p_limit events, and merged.
        WITH RECURSIVE walk AS (
            (SELECT c.namespace, c.topic FROM @s.modkit_outbox_events c
             WHERE c.settled_status IS NULL AND NOT c.held
               AND (p_namespace IS NULL OR c.namespace = p_namespace)
               AND (p_topic IS NULL OR c.topic = p_topic)
             ORDER BY c.namespace, c.topic
             LIMIT 1)
            UNION ALL
            SELECT n.namespace, n.topic FROM walk w
            CROSS JOIN LATERAL (
                SELECT c.namespace, c.topic FROM @s.modkit_outbox_events c
                WHERE c.settled_status IS NULL AND NOT c.held
                  AND (c.namespace, c.topic) > (w.namespace, w.topic)
                  AND (p_namespace IS NULL OR c.namespace = p_namespace)
                  AND (p_topic IS NULL OR c.topic = p_topic)
                ORDER BY c.namespace, c.topic
                LIMIT 1) n),
        topics AS (
            SELECT p_namespace AS namespace, p_topic AS topic WHERE p_namespace IS NOT NULL AND p_topic IS NOT NULL
            UNION ALL
            SELECT w.namespace, w.topic FROM walk w WHERE p_namespace IS NULL OR p_topic IS NULL)
        SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
            e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
            CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
        FROM ((SELECT c.* FROM topics t
               CROSS JOIN LATERAL (
                 SELECT c.* FROM @s.modkit_outbox_events c
                 WHERE c.namespace = t.namespace AND c.topic = t.topic
                   AND c.settled_status IS NULL AND NOT c.held AND c.status = p_status
                   -- Where the walk of the claim index starts (implied by
                   -- the enqueue time and cursor filters below).
                   AND c.created_at >= greatest(p_created_after, p_after_created_at, '-infinity')
                   AND (p_tenant IS NULL OR c.tenant_id = p_tenant)
                   AND (p_created_after IS NULL OR c.created_at >= p_created_after)
                   AND (p_created_before IS NULL OR c.created_at < p_created_before)
                   AND (p_after_created_at IS NULL OR (c.created_at, c.id) > (p_after_created_at, p_after_id))
                 ORDER BY c.created_at, c.id
                 LIMIT p_limit) c
               ORDER BY c.created_at, c.id
               LIMIT p_limit)
              UNION ALL
              (SELECT h.* FROM @s.modkit_outbox_events h
               WHERE h.held AND h.settled_status IS NULL AND h.status = p_status
                 AND (p_namespace IS NULL OR h.namespace = p_namespace)
                 AND (p_topic IS NULL OR h.topic = p_topic)
                 AND (p_tenant IS NULL OR h.tenant_id = p_tenant)
                 AND (p_created_after IS NULL OR h.created_at >= p_created_after)
                 AND (p_created_before IS NULL OR h.created_at < p_created_before)
                 AND (p_after_created_at IS NULL OR (h.created_at, h.id) > (p_after_created_at, p_after_id))
               ORDER BY h.created_at, h.id
               LIMIT p_limit)) e
        ORDER BY e.created_at, e.id
        LIMIT p_limit;
    ELSIF p_status = 'dead' THEN
        RETURN QUERY
        SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
            e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
            CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
        FROM @s.modkit_outbox_events e
        WHERE e.settled_status = 'dead'
          AND (p_namespace IS NULL OR e.namespace = p_namespace)
          AND (p_topic IS NULL OR e.topic = p_topic)
          AND (p_tenant IS NULL OR e.tenant_id = p_tenant)
          AND (p_created_after IS NULL OR e.created_at >= p_created_after)
          AND (p_created_before IS NULL OR e.created_at < p_created_before)
          AND (p_after_created_at IS NULL OR (e.created_at, e.id) > (p_after_created_at, p_after_id))
        ORDER BY e.created_at, e.id
        LIMIT p_limit;
    ELSE
        RETURN QUERY
        SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
            e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
            CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
        FROM @s.modkit_outbox_events e
        WHERE (p_status IS NULL OR e.status = p_status)
          AND (p_namespace IS NULL OR e.namespace = p_namespace)
          AND (p_topic IS NULL OR e.topic = p_topic)
          AND (p_tenant IS NULL OR e.tenant_id = p_tenant)
          AND (p_created_after IS NULL OR e.created_at >= p_created_after)
          AND (p_created_before IS NULL OR e.created_at < p_created_before)
          AND (p_after_created_at IS NULL OR (e.created_at, e.id) > (p_after_created_at, p_after_id))
        ORDER BY e.created_at, e.id
        LIMIT p_limit;
    END IF;
END $function$;
$functions$, '@s', s);
END $migration$;
