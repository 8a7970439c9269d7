-- Back to migration 0038's claim index, (created_at, id, next_attempt_at),
-- and the claim functions as migrations 0031 and 0038 left them (one walk
-- of the index from its front for all the claim's topics), and
-- modkit_outbox_list_rows as migration 0024 wrote it.
DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id, next_attempt_at)
    WHERE settled_status IS NULL AND NOT held;

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
    -- 1. The due events, locked, from one walk of the claim index in its
    -- order (since migration 0014 it holds every pending and leased event
    -- that is not held): pending events that are due and leases that
    -- expired, the claim's rule in seed 004.
    WITH due AS (
        SELECT e.ctid AS tid, e.id, e.created_at, e.status = 'processing' AS expired, e.namespace, e.topic, e.ledger_seq,
            e.attempts, e.locked_by, e.lease_token, e.claimed_at
        FROM @s.modkit_outbox_events e
        WHERE e.settled_status IS NULL AND NOT e.held
          AND ((e.status = 'pending' AND e.next_attempt_at <= v_now)
            OR (e.status = 'processing' AND e.locked_until < v_now))
          AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts
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
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED)
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
          AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts
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
          AND e.next_attempt_at <= v_now AND e.attempts < p_max_attempts
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
        SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
            e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
            CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
        FROM ((SELECT c.* FROM @s.modkit_outbox_events c
               WHERE c.settled_status IS NULL AND NOT c.held AND c.status = p_status
                 -- Where the walk of the claim index starts (implied by
                 -- the enqueue time and cursor filters below).
                 AND c.created_at >= greatest(p_created_after, p_after_created_at, '-infinity')
                 AND (p_namespace IS NULL OR c.namespace = p_namespace)
                 AND (p_topic IS NULL OR c.topic = p_topic)
                 AND (p_tenant IS NULL OR c.tenant_id = p_tenant)
                 AND (p_created_after IS NULL OR c.created_at >= p_created_after)
                 AND (p_created_before IS NULL OR c.created_at < p_created_before)
                 AND (p_after_created_at IS NULL OR (c.created_at, c.id) > (p_after_created_at, p_after_id))
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
