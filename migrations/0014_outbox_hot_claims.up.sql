-- A claim's update can be HOT: no index of the events table names a column
-- that a claim changes, so PostgreSQL writes the leased row version on its
-- page without an entry in any index (a heap-only tuple), where it wrote
-- two or three index entries before (the primary key, the locked_until
-- index, and the dedupe index for an event with a key). So can an outcome that puts an event back to pending
-- (a retry or a release). A settling outcome (delivered, dead) still writes
-- its index entries: it leaves the claim index and enters the settled index.
--
-- An update is HOT only when no column that an index reads, in its key or
-- its predicate, changes value, and when the row's page has room for the
-- new version. Before this migration:
--   - the claim index (created_at, id) WHERE status = 'pending' AND NOT held
--     read status, which every claim changes;
--   - the settled index (status, updated_at) WHERE status IN ('delivered',
--     'dead') read status and updated_at;
--   - the locked_until index read locked_until.
-- Now:
--   - two stored generated columns say whether and when an event settled:
--     settled_status (delivered or dead, else NULL) and settled_at (its
--     updated_at once settled, else NULL). A claim (pending -> processing)
--     leaves both NULL, so an index may read them;
--   - the claim index is (created_at, id) WHERE settled_status IS NULL AND
--     NOT held: every pending and leased event that is not held. A claim
--     takes pending events that are due and leases that expired (seed 004's
--     rule) in one walk of it, in created_at order; the leases in flight at
--     its front are read and passed;
--   - the settled index is (settled_status, settled_at) WHERE settled_status
--     IS NOT NULL: the purge, the dead count and the blocked keys read it as
--     they read the old one;
--   - the locked_until index goes: the claim, the sweep and the depth gauge
--     find leases in the claim index (a leased event is never held: a claim
--     clears held);
--   - new rows fill pages to half (fillfactor 50), leaving room for the
--     versions that claims write: at 85, 8% of a drain's updates were HOT,
--     at 50, 45% (nearly every claim; BENCHMARKS.md, "HOT claims").
-- Spec note: seed 004 lists index(status, next_attempt_at) (replaced by
-- migration 0007) and index(locked_until), replaced here by the claim
-- index, which serves the same queries (README, FAQ).
--
-- The claim, the sweep, the depth gauge, the purges and the blocked keys
-- are replaced to read the new indexes; what each returns and changes is
-- unchanged. The functions they replace stay under the suffix _0013,
-- callable by their owner only, so that the down migration can put them
-- back.
--
-- Adding a stored generated column rewrites the table, holding a lock that
-- blocks its reads and writes until the rewrite and the two index builds
-- end: on a large table, purge delivered events first or migrate in a
-- quiet window. Rows written before this migration keep their pages' old
-- fill until they are purged.
ALTER FUNCTION modkit_outbox_claim_plain(uuid, text[], int, int, interval, text[], timestamptz)
    RENAME TO modkit_outbox_claim_plain_0013;
ALTER FUNCTION modkit_outbox_claim_chains(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chains_0013;
ALTER FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep_0013;
ALTER FUNCTION modkit_outbox_depth(text[], timestamptz) RENAME TO modkit_outbox_depth_0013;
ALTER FUNCTION modkit_outbox_purge(text[], interval, int, timestamptz) RENAME TO modkit_outbox_purge_0013;
ALTER FUNCTION modkit_outbox_purge_recorded(text[], interval, int, timestamptz)
    RENAME TO modkit_outbox_purge_recorded_0013;
ALTER FUNCTION modkit_outbox_blocked_keys(int) RENAME TO modkit_outbox_blocked_keys_0013;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_claim_plain_0013(uuid, text[], int, int, interval, text[], timestamptz), '
            'modkit_outbox_claim_chains_0013(uuid, text[], int, int, interval, text[], int[], timestamptz), '
            'modkit_outbox_sweep_0013(text[], int, int, timestamptz), '
            'modkit_outbox_depth_0013(text[], timestamptz), '
            'modkit_outbox_purge_0013(text[], interval, int, timestamptz), '
            'modkit_outbox_purge_recorded_0013(text[], interval, int, timestamptz), '
            'modkit_outbox_blocked_keys_0013(int) FROM %I', r);
    END LOOP;
END $revoke$;

ALTER TABLE modkit_outbox_events
    ADD COLUMN settled_status text
        GENERATED ALWAYS AS (CASE WHEN status IN ('delivered', 'dead') THEN status END) STORED,
    ADD COLUMN settled_at timestamptz
        GENERATED ALWAYS AS (CASE WHEN status IN ('delivered', 'dead') THEN updated_at END) STORED,
    SET (fillfactor = 50);

DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE settled_status IS NULL AND NOT held;
DROP INDEX modkit_outbox_events_settled_idx;
CREATE INDEX modkit_outbox_events_settled_idx
    ON modkit_outbox_events (settled_status, settled_at)
    WHERE settled_status IS NOT NULL;
DROP INDEX modkit_outbox_events_locked_until_idx;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- The claim without chains (migration 0010's, on plans cached for the
-- session): lease up to p_limit due events of p_topics, oldest first,
-- pending ones and expired leases, each only when the event before it of its
-- ordering key (if it has one) no longer holds it back. Since 0014 one walk
-- of the claim index finds both. Called by modkit_outbox_claim_chained,
-- which checks the arguments; callable by the owner only.
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
    -- 1. The due events, locked, from one walk of the claim index in its
    -- order (since migration 0014 it holds every pending and leased event
    -- that is not held): pending events that are due and leases that
    -- expired, the claim's rule in seed 004.
    WITH due AS (
        SELECT e.id, e.created_at, e.status = 'processing' AS expired, e.namespace, e.topic, e.ledger_seq,
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
END $function$;

-- The claim with chains (migration 0008's statement, planned for each
-- call); since 0014 one walk of the claim index finds pending events and
-- expired leases. Called by modkit_outbox_claim_chained only when some
-- topic's chain is longer than one (modkit_outbox_claim_plain takes the
-- rest), so the shortcut without chains that 0008 kept here is gone; called
-- without chains, it still claims correctly, each head with no successors.
-- Callable by the owner only.
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
END $function$;

-- Repair expired leases of p_topics (back to pending, or dead on the last
-- attempt) and bury pending events out of attempts; since 0014 both from
-- one walk of the claim index.
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
    -- held; a leased event is never held, as a claim clears held), held
    -- events out of attempts from the held index.
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
    due_exhausted_held AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            true AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.held AND e.status = 'pending' AND e.attempts >= p_max_attempts
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due AS (
        SELECT * FROM (SELECT * FROM due_claimable UNION ALL SELECT * FROM due_exhausted_held) u
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
-- settled indexes.
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
        WHERE h.held AND h.status = 'pending' AND (h.namespace || ':' || h.topic) = ANY(p_topics)
        UNION ALL
        SELECT d.namespace, d.topic, d.status, d.next_attempt_at, d.locked_until FROM @s.modkit_outbox_events d
        WHERE d.settled_status = 'dead' AND (d.namespace || ':' || d.topic) = ANY(p_topics)) e
    GROUP BY e.namespace, e.topic;
END $function$;

-- Delete up to p_limit events of p_topics delivered more than p_retention
-- ago; since 0014 found in the settled index by settled_at.
CREATE FUNCTION @s.modkit_outbox_purge(p_topics text[], p_retention interval, p_limit integer, p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET jit TO 'off'
AS $function$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_n bigint;
BEGIN
    DELETE FROM @s.modkit_outbox_events WHERE id IN (
        SELECT e.id FROM @s.modkit_outbox_events e
        WHERE e.settled_status = 'delivered' AND e.settled_at < v_now - p_retention
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END $function$;

-- The operator's purge: as modkit_outbox_purge, with a ledger row for each
-- deleted event.
CREATE FUNCTION @s.modkit_outbox_purge_recorded(p_topics text[], p_retention interval, p_limit integer, p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = @s, pg_temp
 SET jit TO 'off'
AS $function$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_n bigint;
BEGIN
    WITH del AS (
        DELETE FROM @s.modkit_outbox_events WHERE id IN (
            SELECT e.id FROM @s.modkit_outbox_events e
            WHERE e.settled_status = 'delivered' AND e.settled_at < v_now - p_retention
              AND (e.namespace || ':' || e.topic) = ANY(p_topics)
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED)
        RETURNING id, namespace, topic, ledger_seq),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
        SELECT d.id, d.ledger_seq + 1, d.namespace, d.topic, 'purged', v_now,
            format('purged by an operator: delivered more than %s ago', p_retention), session_user
        FROM del d)
    SELECT count(*) INTO v_n FROM del;
    RETURN v_n;
END $function$;

-- The ordering keys blocked by a dead head, oldest first; since 0014 found
-- in the settled index by settled_at.
CREATE FUNCTION @s.modkit_outbox_blocked_keys(p_limit integer)
 RETURNS TABLE(namespace text, topic text, ordering_key text, head_id uuid, head_seq bigint, waiting bigint, last_error text, dead_since timestamp with time zone)
 LANGUAGE sql
 STABLE SECURITY DEFINER
 SET search_path = @s, pg_temp
AS $function$
    SELECT d.namespace, d.topic, d.ordering_key, d.id, d.ordering_seq,
        (SELECT count(*) FROM @s.modkit_outbox_events w
         WHERE w.ordering_stream = d.ordering_stream
           AND w.ordering_seq > d.ordering_seq AND w.status IN ('pending', 'processing')),
        d.last_error, d.updated_at
    FROM @s.modkit_outbox_events d
    WHERE d.settled_status = 'dead' AND d.ordering_key IS NOT NULL AND NOT d.head_skipped
    ORDER BY d.settled_at, d.id
    LIMIT p_limit;
$function$;

$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new functions and grants the
-- roles theirs.
SELECT modkit_outbox_grant_roles();
