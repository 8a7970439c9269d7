-- The claim without chains updates the events it locked by row address
-- (ctid) instead of looking each one up again in the primary key. Its first
-- statement finds and locks the due events in one walk of the claim index;
-- the second leased them with `WHERE e.id = ANY(v_ids)`, a descent of the
-- primary key for every event (on PostgreSQL 15 one per array element).
-- The rows stay locked by the claim's transaction between the two
-- statements, so each is still where the first statement found it, and a
-- TID scan reaches it without an index: the outcome write has relied on
-- the same since migration 0011. In psql drains of 100,000 events (claims
-- of 500, alternated with the old function, six rounds each) the claims
-- took 1,003-1,051 ms against 1,098-1,152 ms, the leasing UPDATE's scan
-- 0.18 against 0.61 ms a claim of 500 (BENCHMARKS.md, "A quiet machine
-- after a restart, and the claim leases by row address").
--
-- What the claim leases, in which order, and under which token is
-- unchanged. The claim of ordering chains (modkit_outbox_claim_chains) is
-- not changed: it locks and leases in one statement, whose snapshot does
-- not see a version that a lock took after a concurrent update; by id, the
-- update follows that version, by row address it would skip the event, and
-- a chain's head skipped while its links are leased would let the links be
-- published first.
--
-- The function it replaces stays as modkit_outbox_claim_plain_0016,
-- callable by its owner only (as claim_plain itself is), so that the down
-- migration can put it back.
ALTER FUNCTION modkit_outbox_claim_plain(uuid, text[], int, int, interval, text[], timestamptz)
    RENAME TO modkit_outbox_claim_plain_0016;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- The claim without chains (migration 0010's, on plans cached for the
-- session; one walk of the claim index since 0014; one lease token a claim
-- since 0016; the lease written by row address since 0022): lease up to
-- p_limit due events of p_topics, oldest first,
-- pending ones and expired leases, each only when the event before it of
-- its ordering key (if it has one) no longer holds it back. Called by
-- modkit_outbox_claim_chained, which checks the arguments; callable by the
-- owner only.
CREATE FUNCTION @s.modkit_outbox_claim_plain(p_worker uuid, p_topics text[], p_limit integer, p_max_attempts integer, p_lease interval, p_skip_dead text[], p_now timestamp with time zone)
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


$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function (owner only).
SELECT modkit_outbox_grant_roles();
