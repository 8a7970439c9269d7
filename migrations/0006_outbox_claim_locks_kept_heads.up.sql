-- A chained claim locks about the heads it keeps, not p_limit heads.
-- Migration 0005's claim locked up to p_limit due heads (first due events of
-- their ordering keys) and kept only those that fit p_limit with their
-- chains: draining 1,000 keys in chains of up to 32, a claim of 500 events
-- locked about 500 heads to keep 16. Each lock is a write (a WAL record and a
-- dirtied page), and until the claim commits other dispatchers skip those
-- keys. The claim below counts the heads that fit before it locks, and locks
-- twice that many (BENCHMARKS.md, "Chained claims lock the heads they keep").
-- A claim without chains skips the run machinery altogether, which cost a
-- claim of 10 events about a quarter of its time (the claim is planned
-- afresh on every call).
--
-- Migration 0005's function stays, under another name and callable by its
-- owner only, so that the down migration can put it back.
ALTER FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chained_0005;
DO $revoke$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'modkit_outbox_dispatcher') THEN
        REVOKE ALL ON FUNCTION modkit_outbox_claim_chained_0005(uuid, text[], int, int, interval, text[], int[], timestamptz)
            FROM modkit_outbox_dispatcher;
    END IF;
END $revoke$;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- Claim as modkit_outbox_claim, and with each claimed head of an ordering
-- key (whose predecessor is settled) also its successors, in sequence, while
-- they are due and unleased (or their lease expired): at most p_chain[i]
-- events of a key of topic p_topics[i] in all (NULL or 1: no chains), at most
-- p_limit events in all, each head with its chain in created_at order of the
-- heads. The caller must publish a key's events in sequence, each only after
-- the one before it was delivered.
CREATE FUNCTION @s.modkit_outbox_claim_chained(
    p_worker uuid, p_topics text[], p_limit int, p_max_attempts int, p_lease interval, p_skip_dead text[],
    p_chain int[], p_now timestamptz DEFAULT NULL)
RETURNS TABLE (id uuid, namespace text, topic text, tenant_id uuid, dedupe_key text, payload jsonb, attempts int,
    lease_token uuid, locked_until timestamptz, created_at timestamptz, repaired boolean, headers jsonb,
    ordering_key text, ordering_seq bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
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
    -- Without chains (no topic's chain longer than one) the claim is the
    -- due events and their update: the chained statement below without its
    -- run machinery, which costs a claim of 10 events about a quarter of its
    -- time (every call is planned afresh, force_custom_plan).
    IF NOT coalesce(1 < ANY(p_chain), false) THEN
        RETURN QUERY
        -- Due events come from two index scans: pending ones from the claim
        -- index (which holds only pending, unheld events, so leased events in
        -- flight are not walked), expired leases from the locked_until index.
        WITH due_pending AS (
            SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_seq, e.created_at,
                e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
                e.claimed_at AS old_claimed_at, e.attempts AS old_attempts, e.ledger_seq AS old_seq
            FROM @s.modkit_outbox_events e
            WHERE e.status = 'pending' AND NOT e.held AND e.next_attempt_at <= v_now
              AND e.attempts < p_max_attempts
              AND (e.namespace || ':' || e.topic) = ANY(p_topics)
              -- An event with an ordering key waits while the one before it
              -- (sequences are gap-free) is undelivered: pending, leased, or dead
              -- unless skipped (by an operator, or by the publisher's policy,
              -- p_skip_dead). Delivered or purged, it no longer holds it back.
              AND (e.ordering_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM @s.modkit_outbox_events p
                    WHERE p.namespace = e.namespace AND p.topic = e.topic AND p.ordering_key = e.ordering_key
                      AND p.ordering_seq = e.ordering_seq - 1
                      AND (p.status IN ('pending', 'processing')
                        OR (p.status = 'dead' AND NOT p.head_skipped
                            AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
            ORDER BY e.created_at, e.id
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED),
        due_expired AS (
            SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_seq, e.created_at,
                e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
                e.claimed_at AS old_claimed_at, e.attempts AS old_attempts, e.ledger_seq AS old_seq
            FROM @s.modkit_outbox_events e
            -- Only a processing event has a lease (modkit_outbox_events_lease_check);
            -- naming its status here would steer the planner off the
            -- locked_until index, onto every leased event.
            WHERE e.locked_until < v_now AND NOT e.held
              AND e.attempts < p_max_attempts
              AND (e.namespace || ':' || e.topic) = ANY(p_topics)
              -- An event with an ordering key waits while the one before it
              -- (sequences are gap-free) is undelivered: pending, leased, or dead
              -- unless skipped (by an operator, or by the publisher's policy,
              -- p_skip_dead). Delivered or purged, it no longer holds it back.
              AND (e.ordering_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM @s.modkit_outbox_events p
                    WHERE p.namespace = e.namespace AND p.topic = e.topic AND p.ordering_key = e.ordering_key
                      AND p.ordering_seq = e.ordering_seq - 1
                      AND (p.status IN ('pending', 'processing')
                        OR (p.status = 'dead' AND NOT p.head_skipped
                            AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
            ORDER BY e.locked_until
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED),
        due AS (
            SELECT * FROM (SELECT * FROM due_pending UNION ALL SELECT * FROM due_expired) u
            ORDER BY u.created_at, u.id
            LIMIT p_limit),
        upd AS (
            UPDATE @s.modkit_outbox_events AS e SET
                status = 'processing',
                attempts = e.attempts + 1,
                locked_by = p_worker,
                locked_until = v_now + p_lease,
                lease_token = gen_random_uuid(),
                ledger_seq = e.ledger_seq + (d.old_status = 'processing')::int,
                claimed_at = v_now,
                updated_at = v_now,
                held = false
            FROM due d WHERE e.id = d.id
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
        RETURN;
    END IF;
    -- With chains, a claim keeps the heads that fit p_limit with their
    -- chains, often a few of the heads it could lock (16 heads in chains of
    -- 32 fill 500). Locking the others too would write a lock on each (a WAL
    -- record and a dirtied page) and keep other claims off them until
    -- commit; so the heads that fit are counted first, reading no further
    -- than the last one, without locking, and twice as many are locked
    -- (enough to fill the claim when another claim holds some of them). The
    -- count is an estimate: it takes every pending unheld event of a key for
    -- a head, as nearly all of them are.
    FOR v_links IN
        SELECT CASE WHEN e.ordering_key IS NULL THEN 0 ELSE least(
                coalesce(p_chain[pg_catalog.array_position(p_topics, e.namespace || ':' || e.topic)], 1) - 1,
                coalesce((SELECT q.last_seq FROM @s.modkit_outbox_sequences q
                    WHERE q.namespace = e.namespace AND q.topic = e.topic AND q.ordering_key = e.ordering_key)
                    - e.ordering_seq, 0)) END
        FROM @s.modkit_outbox_events e
        WHERE e.status = 'pending' AND NOT e.held AND e.next_attempt_at <= v_now
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
    -- Due events come from two index scans: pending ones from the claim
    -- index (which holds only pending, unheld events, so leased events in
    -- flight are not walked), expired leases from the locked_until index.
    WITH due_pending AS (
        SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_seq, e.created_at,
            e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts AS old_attempts, e.ledger_seq AS old_seq
        FROM @s.modkit_outbox_events e
        WHERE e.status = 'pending' AND NOT e.held AND e.next_attempt_at <= v_now
          AND e.attempts < p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
          -- An event with an ordering key waits while the one before it
          -- (sequences are gap-free) is undelivered: pending, leased, or dead
          -- unless skipped (by an operator, or by the publisher's policy,
          -- p_skip_dead). Delivered or purged, it no longer holds it back.
          AND (e.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.namespace = e.namespace AND p.topic = e.topic AND p.ordering_key = e.ordering_key
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing')
                    OR (p.status = 'dead' AND NOT p.head_skipped
                        AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
        ORDER BY e.created_at, e.id
        LIMIT v_heads
        FOR UPDATE SKIP LOCKED),
    due_expired AS (
        SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_seq, e.created_at,
            e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts AS old_attempts, e.ledger_seq AS old_seq
        FROM @s.modkit_outbox_events e
        -- Only a processing event has a lease (modkit_outbox_events_lease_check);
        -- naming its status here would steer the planner off the
        -- locked_until index, onto every leased event.
        WHERE e.locked_until < v_now AND NOT e.held
          AND e.attempts < p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
          -- An event with an ordering key waits while the one before it
          -- (sequences are gap-free) is undelivered: pending, leased, or dead
          -- unless skipped (by an operator, or by the publisher's policy,
          -- p_skip_dead). Delivered or purged, it no longer holds it back.
          AND (e.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.namespace = e.namespace AND p.topic = e.topic AND p.ordering_key = e.ordering_key
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing')
                    OR (p.status = 'dead' AND NOT p.head_skipped
                        AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
        ORDER BY e.locked_until
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due AS (
        SELECT * FROM (SELECT * FROM due_pending UNION ALL SELECT * FROM due_expired) u
        ORDER BY u.created_at, u.id
        LIMIT p_limit),
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
            ON q.namespace = d.namespace AND q.topic = d.topic AND q.ordering_key = d.ordering_key),
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
            WHERE c.namespace = h.namespace AND c.topic = h.topic AND c.ordering_key = h.ordering_key
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
            lease_token = gen_random_uuid(),
            ledger_seq = e.ledger_seq + (d.old_status = 'processing')::int,
            claimed_at = v_now,
            updated_at = v_now,
            held = false
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
END $$;
$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function, and grants it to the
-- dispatcher role if that exists.
SELECT modkit_outbox_grant_roles();
