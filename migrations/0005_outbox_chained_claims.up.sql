-- Chained claims for ordering keys. A claim may lease, with the first due
-- event of an ordering key (its head), the next events of that key whose
-- turn comes after it: the dispatcher publishes them one at a time, in
-- sequence, each only after the one before it was delivered, and gives the
-- rest back unpublished (their attempt not counted) as soon as one fails.
-- Without chains every event of a key had to wait for its predecessor's
-- outcome to commit before it could even be claimed, so ordered dispatch ran
-- at about half the rate of unordered dispatch (BENCHMARKS.md).
--
-- modkit_outbox_claim is kept for dispatchers of earlier versions (as a
-- chained claim without chains); modkit_outbox_claim_chained takes, per
-- topic, the longest chain to lease.
-- modkit_outbox_complete now holds a released event again (held = true) when
-- its predecessor is still undelivered, so a chain given back stays out of
-- the claim index until its head is delivered, and records why an event was
-- released in its ledger row.

-- The claim index holds pending events only (it held leased ones too): a
-- claim no longer walks the events in flight, and a claim's update writes no
-- entry into it. Expired leases are found through the locked_until index.
DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE status = 'pending' AND NOT held;

-- Migration 0004's grants stay as they are, under another name; the new
-- modkit_outbox_grant_roles (below) runs them and adds this migration's.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0004;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    owner text := quote_literal(current_user);
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
BEGIN
    IF p_worker IS NULL OR p_limit IS NULL OR p_limit < 1 OR p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox: claim needs a worker, a positive limit and a positive lease' USING ERRCODE = '22023';
    END IF;
    IF p_chain IS NOT NULL AND pg_catalog.cardinality(p_chain) <> pg_catalog.cardinality(p_topics) THEN
        RAISE EXCEPTION 'outbox: claim needs one chain length per topic (% topics, % chain lengths)',
            pg_catalog.cardinality(p_topics), pg_catalog.cardinality(p_chain) USING ERRCODE = '22023';
    END IF;
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

-- The claim of migration 0004, kept for dispatchers of earlier versions: a
-- chained claim without chains.
CREATE OR REPLACE FUNCTION @s.modkit_outbox_claim(
    p_worker uuid, p_topics text[], p_limit int, p_max_attempts int, p_lease interval, p_skip_dead text[],
    p_now timestamptz DEFAULT NULL)
RETURNS TABLE (id uuid, namespace text, topic text, tenant_id uuid, dedupe_key text, payload jsonb, attempts int,
    lease_token uuid, locked_until timestamptz, created_at timestamptz, repaired boolean, headers jsonb,
    ordering_key text, ordering_seq bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM @s.modkit_outbox_claim_chained(p_worker, p_topics, p_limit, p_max_attempts, p_lease,
        p_skip_dead, NULL, p_now);
END $$;

-- Record outcomes ('delivered', 'retry', 'dead', 'released') of p_worker's
-- claims. Each row must still be leased to p_worker under the presented
-- token, unexpired; rows that are not are left alone and not returned. Each
-- recorded outcome appends its ledger row in the same statement. (Since
-- migration 0005, a released event of an ordering key is held again while its
-- predecessor is undelivered, and a release's reason, passed as its error,
-- becomes its ledger row's detail; last_error is left alone.)
CREATE OR REPLACE FUNCTION @s.modkit_outbox_complete(
    p_worker uuid, p_ids uuid[], p_tokens uuid[], p_outcomes text[], p_errors text[], p_delays_ms bigint[],
    p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET plan_cache_mode = force_custom_plan AS $$
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
                WHERE p.namespace = e.namespace AND p.topic = e.topic AND p.ordering_key = e.ordering_key
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))
                  AND NOT (p.id = ANY(v_delivered)))
                ELSE e.held END
        FROM unnest(p_ids, p_tokens, p_outcomes, p_errors, p_delays_ms) AS a(id, token, outcome, err, delay_ms)
        WHERE e.id = a.id AND e.lease_token = a.token AND e.locked_by = p_worker
          AND e.status = 'processing' AND e.locked_until > v_now
        RETURNING e.id, e.ledger_seq, e.namespace, e.topic, a.outcome, a.token, e.claimed_at,
            CASE a.outcome WHEN 'released' THEN e.attempts + 1 ELSE e.attempts END AS attempt,
            CASE WHEN a.outcome IN ('retry', 'dead', 'released') THEN left(a.err, 8192) END AS err,
            e.ordering_key, e.ordering_seq),
    release AS (
        -- A delivered event lets the next one of its key into the claim,
        -- unless that one is settled in this call too (the rest of a run:
        -- leased, so not held), which spares most of a run's index probes.
        UPDATE @s.modkit_outbox_events AS s SET held = false
        FROM (SELECT u.namespace, u.topic, u.ordering_key, u.ordering_seq FROM upd u
              WHERE u.outcome = 'delivered' AND u.ordering_key IS NOT NULL
              EXCEPT
              SELECT u.namespace, u.topic, u.ordering_key, u.ordering_seq - 1 FROM upd u
              WHERE u.ordering_key IS NOT NULL) f
        WHERE s.namespace = f.namespace AND s.topic = f.topic AND s.ordering_key = f.ordering_key
          AND s.ordering_seq = f.ordering_seq + 1 AND s.held),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.ledger_seq, u.namespace, u.topic, u.outcome, u.attempt, p_worker, u.token, u.claimed_at, v_now, u.err
        FROM upd u)
    SELECT u.id FROM upd u;
END $$;

-- (Re)applies the grants of this schema to the outbox roles that exist:
-- migration 0004's grants (its function, renamed above), and
-- modkit_outbox_claim_chained for the dispatcher. The migration runs it; run
-- it again as the owner after creating the roles by hand (see the README,
-- "Least privilege").
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0004();
BEGIN
    IF 'modkit_outbox_dispatcher' = ANY(granted) THEN
        GRANT EXECUTE ON FUNCTION
            @s.modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz)
            TO modkit_outbox_dispatcher;
    END IF;
    RETURN granted;
END $$;
$functions$;
EXECUTE replace(replace(body, '@s', s), '@owner', owner);
END $migration$;

SELECT modkit_outbox_grant_roles();
