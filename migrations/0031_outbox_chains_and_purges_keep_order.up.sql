-- The sweep no longer buries a chain link for attempts its chain's claims
-- charged it, and a purge of dead events no longer lets a key's later
-- events overtake a dead event that stays.
--
-- modkit_outbox_sweep: a claim of a chain charges every event it leases an
-- attempt, links included, though a link is published only after the event
-- before it succeeded. When a chain's lease ended without outcomes (its
-- dispatcher crashed, or its outcome writes failed), each claim of it
-- charged its links again, and after max_attempts such claims the sweep
-- buried the whole chain: events never tried were dead-lettered, and under
-- SkipDeadHeads skipped. modkit_outbox_claim_chains no longer charges a
-- link it takes over from an expired lease, and the sweep gives a held
-- event behind an undelivered event of its key its attempt back instead of
-- burying it (its lease_expired entry says so; it stays pending and held,
-- and is reported with a NULL repaired unless it was leased); the chain's
-- head, charged each time, dies once out of attempts and the links wait
-- behind it. (A link published just before its dispatcher died may so be
-- published again more than max_attempts times in all, as at-least-once
-- delivery allows.)
--
-- modkit_outbox_purge_dead deleted any dead event given; the claim waits
-- only for the event just before an event of an ordering key, and one that
-- is gone holds nothing back. So purging the second of two dead events of
-- a key let the third be published while the first was dead. It now
-- deletes a dead event of a key only when it is the key's head, in rounds,
-- so that a run of dead events purged together goes whole; and it lets the
-- successor of each head it deletes into the claim at once (it waited for
-- a dispatcher's periodic release).
--
-- CREATE OR REPLACE keeps the functions' grants and settings.
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
CREATE OR REPLACE FUNCTION @s.modkit_outbox_sweep(p_topics text[], p_max_attempts integer, p_limit integer, p_now timestamp with time zone DEFAULT NULL::timestamp with time zone)
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
            e.attempts >= p_max_attempts AS exhausted, false AS behind
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
            e.attempts >= p_max_attempts AS exhausted,
            -- Behind an undelivered event of its key (since 0031): a chain
            -- link whose lease ended with its head's.
            e.ordering_key IS NOT NULL AND EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))) AS behind
        FROM @s.modkit_outbox_events e
        WHERE e.held
          AND ((e.status = 'pending' AND e.attempts >= p_max_attempts)
            OR (e.status = 'processing' AND e.locked_until < v_now))
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    -- A held event behind an undelivered event of its key is never
    -- buried for its attempts (since 0031): a chain link is charged an
    -- attempt by each claim of its chain, yet is published only after the
    -- event before it succeeded, so chains whose leases ended (a crashed
    -- dispatcher, outcome writes that failed) used up their links'
    -- attempts, and the sweep buried links never tried. Its attempt is
    -- given back instead; the head of its chain, charged each time, dies
    -- once out of attempts, and the link then waits behind it.
    due AS (
        SELECT u.id, u.created_at, u.old_status, u.old_worker, u.old_token, u.old_claimed_at, u.attempts, u.old_seq,
            u.old_error, u.exhausted AND NOT u.behind AS exhausted, u.behind
        FROM (SELECT * FROM due_claimable UNION ALL SELECT * FROM due_held) u
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
            attempts = CASE WHEN NOT d.behind THEN e.attempts
                WHEN d.old_status = 'processing' THEN e.attempts - 1
                ELSE least(e.attempts, p_max_attempts - 1) END,
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
            d.old_status, d.old_seq, d.attempts, d.old_worker, d.old_token, d.old_claimed_at, d.behind),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.old_seq + 1, u.namespace, u.topic, 'lease_expired', u.attempts, u.old_worker, u.old_token,
            u.old_claimed_at, v_now, 'the lease expired before an outcome was recorded; repaired by the sweeper'
                || CASE WHEN u.behind THEN '; its attempt is not counted: the event before it of its ordering key was not delivered'
                   ELSE '' END
        FROM upd u WHERE u.old_status = 'processing'
        UNION ALL
        SELECT u.id, u.old_seq + 1 + (u.old_status = 'processing')::int, u.namespace, u.topic, 'swept', NULL, NULL, NULL,
            NULL, v_now, u.last_error
        FROM upd u WHERE u.exhausted)
    -- An event given its attempt back without a lease is neither repaired
    -- nor dead: its repaired is NULL (the caller counts it toward the batch
    -- but does not report it).
    SELECT u.id, u.namespace || ':' || u.topic,
        CASE WHEN u.exhausted OR u.old_status = 'processing' THEN u.repaired END
    FROM upd u;
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

CREATE OR REPLACE FUNCTION @s.modkit_outbox_purge_dead(p_ids uuid[], p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_left uuid[] := p_ids;
    v_done uuid[];
    v_rounds int := 0;
BEGIN
    -- Each round deletes the dead events among v_left that are keyless or
    -- their key's head (the event before it no longer holds it back), and
    -- lets each deleted head's successor into the claim. A run of dead
    -- events of one key goes one event a round, each the head once the one
    -- before it is gone; a dead event behind another dead event of its key
    -- that is not purged with it is left (it would let the events after it
    -- overtake that one). At most 1,000 rounds: the rest of a longer run is
    -- left for another call.
    LOOP
        WITH del AS (
            DELETE FROM @s.modkit_outbox_events AS e
            WHERE e.id = ANY(v_left) AND e.status = 'dead'
              AND (e.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))))
            RETURNING e.id, e.namespace, e.topic, e.ledger_seq, e.ordering_stream, e.ordering_seq),
        release AS (
            UPDATE @s.modkit_outbox_events AS s SET held = false
            FROM del d
            WHERE s.ordering_stream = d.ordering_stream
              AND s.ordering_seq = d.ordering_seq + 1 AND s.held
              -- not one this statement may delete
              AND NOT (s.id = ANY(v_left) AND s.status = 'dead')),
        ledger AS (
            INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
            SELECT d.id, d.ledger_seq + 1, d.namespace, d.topic, 'purged', v_now,
                left('purged while dead by ' || coalesce(p_by, 'unknown'), 1024), session_user
            FROM del d)
        SELECT pg_catalog.array_agg(d.id) INTO v_done FROM del d;
        EXIT WHEN v_done IS NULL;
        RETURN QUERY SELECT pg_catalog.unnest(v_done);
        v_rounds := v_rounds + 1;
        EXIT WHEN v_rounds >= 1000;
        v_left := ARRAY(SELECT x FROM pg_catalog.unnest(v_left) AS x WHERE NOT (x = ANY(v_done)));
    END LOOP;
END $$;
$functions$, '@s', s);
END $migration$;
