-- A claim without chains runs on plans cached for the session instead of
-- plans made for each call.
--
-- Every claim was planned afresh (plan_cache_mode = force_custom_plan), and
-- for a claim of a few events, planning took longer than running: 0.42 ms
-- against 0.35 ms for 5 events. At 2,000 events/s a dispatcher claims
-- about 400 times a second, and each event waits for the claim in flight
-- and then its own, so the claim's time is most of the end-to-end latency.
--
-- Plans were made for each call because a plan cached once (a generic
-- plan) is costed from the statistics of the moment it is made. Cached
-- while the table was empty, the claim's single statement (lock the due
-- events, update them, write the ledger rows of expired leases) joined the
-- locked events to the table the wrong way round: it walked the primary key
-- over the whole table for each claim (706 ms for a claim of 5 events once
-- 300,000 were pending; 31 s for a claim of 500, BENCHMARKS.md, "A generic
-- plan for the plain claim"), until the next ANALYZE made it plan again.
--
-- The claim without chains is now modkit_outbox_claim_plain, three
-- statements none of which can go that way whatever the statistics say:
--   1. the due events' ids are read and locked: two index scans in index
--      order (the claim index for pending events, the locked_until index for
--      expired leases), never a sequential scan, a bitmap scan, a sort of
--      the table or a hash or merge join (the function's settings);
--   2. they are updated by id (WHERE id = ANY(ids): the primary key, the
--      only index that holds the condition), with no join;
--   3. the ledger rows of the expired leases among them are written from
--      the values read in 1.
-- It runs with plan_cache_mode = force_generic_plan: each statement is
-- planned once per connection. On a scratch database, 3,000 claims of 5
-- events from 100,000 pending took 0.61-0.78 ms a call (pgbench, one
-- connection) against 1.10-1.40 ms for the single statement planned each
-- time. Plans cached on an empty table and then used on 300,000 pending
-- events (a prototype of these statements): 0.7 ms for a claim of 5, 8.7
-- ms for a claim of 500. TestClaimPlanCachedOnAnEmptyTable checks that
-- such a claim reads a few rows per event, not the table.
--
-- Claims with chains (some topic's chain longer than one, for ordering keys)
-- keep migration 0008's statement, planned for each call: it is renamed
-- modkit_outbox_claim_chains, callable by its owner only, and
-- modkit_outbox_claim_chained, the function the dispatcher role may call,
-- checks its arguments and calls one or the other. What a claim takes,
-- locks and returns is unchanged.
ALTER FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chains;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_claim_chains(uuid, text[], int, int, interval, text[], int[], timestamptz) FROM %I', r);
    END LOOP;
END $revoke$;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- The claim without chains (see the top of migration 0010): lease up to
-- p_limit due events of p_topics, oldest first, pending ones and expired
-- leases, each only when the event before it of its ordering key (if it has
-- one) no longer holds it back. Called by modkit_outbox_claim_chained, which
-- checks the arguments; callable by the owner only.
CREATE FUNCTION @s.modkit_outbox_claim_plain(
    p_worker uuid, p_topics text[], p_limit int, p_max_attempts int, p_lease interval, p_skip_dead text[],
    p_now timestamptz)
RETURNS TABLE (id uuid, namespace text, topic text, tenant_id uuid, dedupe_key text, payload jsonb, attempts int,
    lease_token uuid, locked_until timestamptz, created_at timestamptz, repaired boolean, headers jsonb,
    ordering_key text, ordering_seq bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp
    SET plan_cache_mode = force_generic_plan SET jit = off
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
    SET enable_hashjoin = off SET enable_mergejoin = off AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_ids uuid[];
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
    -- 1. The due events, locked: pending ones from the claim index (which
    -- holds only pending, unheld events, so leased events in flight are not
    -- walked), expired leases from the locked_until index, each in index
    -- order.
    WITH due_pending AS (
        SELECT e.id, e.created_at, false AS expired, e.namespace, e.topic, e.ledger_seq, e.attempts,
            e.locked_by, e.lease_token, e.claimed_at
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
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing')
                    OR (p.status = 'dead' AND NOT p.head_skipped
                        AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
        ORDER BY e.created_at, e.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due_expired AS (
        SELECT e.id, e.created_at, true AS expired, e.namespace, e.topic, e.ledger_seq, e.attempts,
            e.locked_by, e.lease_token, e.claimed_at
        FROM @s.modkit_outbox_events e
        -- Only a processing event has a lease (modkit_outbox_events_lease_check).
        WHERE e.locked_until < v_now AND NOT e.held
          AND e.attempts < p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
          AND (e.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
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
        LIMIT p_limit)
    SELECT pg_catalog.array_agg(d.id),
        pg_catalog.array_agg(d.id) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.namespace) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.topic) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.ledger_seq) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.attempts) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.locked_by) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.lease_token) FILTER (WHERE d.expired),
        pg_catalog.array_agg(d.claimed_at) FILTER (WHERE d.expired)
    INTO v_ids, v_expired, v_ns, v_topics, v_seqs, v_attempts, v_workers, v_tokens, v_claimed
    FROM due d;
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    -- 2. Leased to p_worker. The rows are locked by this transaction since
    -- 1, so they are as 1 read them. An expired lease's claim takes a
    -- ledger number for the row that records it (3).
    RETURN QUERY
    UPDATE @s.modkit_outbox_events AS e SET
        status = 'processing',
        attempts = e.attempts + 1,
        locked_by = p_worker,
        locked_until = v_now + p_lease,
        lease_token = gen_random_uuid(),
        ledger_seq = e.ledger_seq + (e.status = 'processing')::int,
        claimed_at = v_now,
        updated_at = v_now,
        held = false
    WHERE e.id = ANY(v_ids)
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
END $$;

-- Lease up to p_limit due events of p_topics for p_worker (the claim the
-- dispatcher role calls; migration 0005 added it, and since 0010 it checks
-- the arguments and chooses between two claims). p_chain gives, per topic,
-- the most events of one ordering key to take in sequence; without chains
-- (NULL, or no topic's chain longer than one) the claim is
-- modkit_outbox_claim_plain, on cached plans; with chains it is
-- modkit_outbox_claim_chains (migration 0008's statement), planned for each
-- call.
CREATE FUNCTION @s.modkit_outbox_claim_chained(
    p_worker uuid, p_topics text[], p_limit int, p_max_attempts int, p_lease interval, p_skip_dead text[],
    p_chain int[], p_now timestamptz DEFAULT NULL)
RETURNS TABLE (id uuid, namespace text, topic text, tenant_id uuid, dedupe_key text, payload jsonb, attempts int,
    lease_token uuid, locked_until timestamptz, created_at timestamptz, repaired boolean, headers jsonb,
    ordering_key text, ordering_seq bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET jit = off AS $$
BEGIN
    IF p_worker IS NULL OR p_limit IS NULL OR p_limit < 1 OR p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox: claim needs a worker, a positive limit and a positive lease' USING ERRCODE = '22023';
    END IF;
    IF p_chain IS NOT NULL AND pg_catalog.cardinality(p_chain) <> pg_catalog.cardinality(p_topics) THEN
        RAISE EXCEPTION 'outbox: claim needs one chain length per topic (% topics, % chain lengths)',
            pg_catalog.cardinality(p_topics), pg_catalog.cardinality(p_chain) USING ERRCODE = '22023';
    END IF;
    IF coalesce(1 < ANY(p_chain), false) THEN
        RETURN QUERY SELECT * FROM @s.modkit_outbox_claim_chains(
            p_worker, p_topics, p_limit, p_max_attempts, p_lease, p_skip_dead, p_chain, p_now);
    ELSE
        RETURN QUERY SELECT * FROM @s.modkit_outbox_claim_plain(
            p_worker, p_topics, p_limit, p_max_attempts, p_lease, p_skip_dead, p_now);
    END IF;
END $$;
$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new functions, and grants the new
-- modkit_outbox_claim_chained to the dispatcher role if it exists.
SELECT modkit_outbox_grant_roles();
