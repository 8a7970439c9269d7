-- Events of an ordering key find each other by a number, not by three
-- strings. Each key's row in modkit_outbox_sequences gets a stream id
-- (stream_id), and its events carry it (ordering_stream); the unique
-- (namespace, topic, ordering_key, ordering_seq) index and the held index
-- become (ordering_stream, ordering_seq). Every ordered event's claim and
-- outcome write insert an entry into the unique index, and claims, outcomes
-- and enqueues look up a key's neighbouring events in it: comparing two
-- bigints instead of three text columns (each read through the variable-width
-- ones before it, and compared under the database's collation) took about a
-- fifth off the server CPU of ordered dispatch (BENCHMARKS.md, "Stream ids").
--
-- The rule stays what the payment documents ask, one event per key and
-- sequence: stream ids are unique, a key has one (the sequences table's
-- primary key), and a foreign key ties each event's stream to its own
-- (namespace, topic, ordering_key). The key is checked when an event is
-- inserted or its key columns change; claims and outcome writes leave them
-- alone.
--
-- The functions that look events up by key are replaced; the versions they
-- replace stay, under other names and callable by their owner only, so that
-- the down migration can put them back. modkit_outbox_release_held, which
-- every dispatcher runs each poll while it has seen ordered events, now finds
-- each key's first held event with one index descent per key instead of
-- reading every held event (9 against 90 ms with 99,000 held behind 1,000
-- keys).
--
-- The migration updates every event that has an ordering key and builds two
-- indexes over them, blocking writes to the table meanwhile.
ALTER TABLE modkit_outbox_sequences ADD COLUMN stream_id bigint GENERATED ALWAYS AS IDENTITY;
ALTER TABLE modkit_outbox_sequences
    ADD CONSTRAINT modkit_outbox_sequences_stream_key UNIQUE (stream_id),
    -- The target of the events' foreign key.
    ADD CONSTRAINT modkit_outbox_sequences_stream_names_key UNIQUE (stream_id, namespace, topic, ordering_key);
-- Every key with events has a sequence row and a last_seq at least its
-- highest sequence (the enqueue keeps it so; this covers rows written
-- around it).
INSERT INTO modkit_outbox_sequences AS q (namespace, topic, ordering_key, last_seq)
SELECT e.namespace, e.topic, e.ordering_key, max(e.ordering_seq) FROM modkit_outbox_events e
WHERE e.ordering_key IS NOT NULL
GROUP BY e.namespace, e.topic, e.ordering_key
ON CONFLICT (namespace, topic, ordering_key) DO UPDATE SET last_seq = excluded.last_seq
WHERE q.last_seq < excluded.last_seq;

ALTER TABLE modkit_outbox_events ADD COLUMN ordering_stream bigint NULL;
UPDATE modkit_outbox_events AS e SET ordering_stream = q.stream_id
FROM modkit_outbox_sequences q
WHERE e.ordering_key IS NOT NULL
  AND q.namespace = e.namespace AND q.topic = e.topic AND q.ordering_key = e.ordering_key;
ALTER TABLE modkit_outbox_events
    ADD CONSTRAINT modkit_outbox_events_stream_check CHECK ((ordering_key IS NULL) = (ordering_stream IS NULL)),
    ADD CONSTRAINT modkit_outbox_events_stream_fkey FOREIGN KEY (ordering_stream, namespace, topic, ordering_key)
        REFERENCES modkit_outbox_sequences (stream_id, namespace, topic, ordering_key);
DROP INDEX modkit_outbox_events_ordering_idx;
DROP INDEX modkit_outbox_events_held_idx;
CREATE UNIQUE INDEX modkit_outbox_events_stream_idx
    ON modkit_outbox_events (ordering_stream, ordering_seq) WHERE ordering_stream IS NOT NULL;
CREATE INDEX modkit_outbox_events_held_idx
    ON modkit_outbox_events (ordering_stream, ordering_seq) WHERE held;

ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text)
    RENAME TO modkit_outbox_enqueue_0004;
ALTER FUNCTION modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz)
    RENAME TO modkit_outbox_complete_0005;
ALTER FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz)
    RENAME TO modkit_outbox_claim_chained_0006;
ALTER FUNCTION modkit_outbox_sweep(text[], int, int, timestamptz) RENAME TO modkit_outbox_sweep_0007;
ALTER FUNCTION modkit_outbox_release_held(text[], text[], int) RENAME TO modkit_outbox_release_held_0004;
ALTER FUNCTION modkit_outbox_blocked_keys(int) RENAME TO modkit_outbox_blocked_keys_0004;
ALTER FUNCTION modkit_outbox_skip_head(uuid, text, timestamptz) RENAME TO modkit_outbox_skip_head_0004;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_enqueue_0004(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text), '
            'modkit_outbox_complete_0005(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz), '
            'modkit_outbox_claim_chained_0006(uuid, text[], int, int, interval, text[], int[], timestamptz), '
            'modkit_outbox_sweep_0007(text[], int, int, timestamptz), '
            'modkit_outbox_release_held_0004(text[], text[], int), '
            'modkit_outbox_blocked_keys_0004(int), '
            'modkit_outbox_skip_head_0004(uuid, text, timestamptz) FROM %I', r);
    END LOOP;
END $revoke$;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    body  text;
BEGIN
body := $functions$
-- Enqueue one event. Returns its id and whether it was a duplicate (then the
-- id is the existing row's, which belongs to the same tenant).
CREATE FUNCTION @s.modkit_outbox_enqueue(
    p_id uuid, p_namespace text, p_topic text, p_tenant uuid, p_key text, p_payload jsonb, p_notify boolean,
    p_headers jsonb, p_ordering_key text, OUT id uuid, OUT duplicate boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_seq bigint;
    v_stream bigint;
BEGIN
    IF p_ordering_key IS NOT NULL THEN
        -- The key's next sequence; the row stays locked until the caller's
        -- transaction ends, so producers of one key serialise (and only
        -- they), sequences follow commit order, and a rollback leaves no gap.
        -- A known key is updated without an insert attempt, which would
        -- draw a stream id (an identity value) every time.
        UPDATE @s.modkit_outbox_sequences AS q SET last_seq = q.last_seq + 1
        WHERE q.namespace = p_namespace AND q.topic = p_topic AND q.ordering_key = p_ordering_key
        RETURNING q.last_seq, q.stream_id INTO v_seq, v_stream;
        IF NOT FOUND THEN
            INSERT INTO @s.modkit_outbox_sequences AS q (namespace, topic, ordering_key, last_seq)
            VALUES (p_namespace, p_topic, p_ordering_key, 1)
            ON CONFLICT (namespace, topic, ordering_key) DO UPDATE SET last_seq = q.last_seq + 1
            RETURNING q.last_seq, q.stream_id INTO v_seq, v_stream;
        END IF;
    END IF;
    INSERT INTO @s.modkit_outbox_events AS e (id, namespace, topic, tenant_id, dedupe_key, payload, headers, ordering_key, ordering_seq,
        ordering_stream, held)
    VALUES (p_id, p_namespace, p_topic, p_tenant, p_key, p_payload, p_headers, p_ordering_key, v_seq, v_stream,
        v_seq > 1 AND EXISTS (
            SELECT 1 FROM @s.modkit_outbox_events p
            WHERE p.ordering_stream = v_stream
              AND p.ordering_seq = v_seq - 1
              AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))))
    ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
    RETURNING e.id INTO id;
    duplicate := NOT FOUND;
    IF duplicate AND v_seq IS NOT NULL THEN
        -- A duplicate takes no sequence.
        UPDATE @s.modkit_outbox_sequences SET last_seq = last_seq - 1 WHERE stream_id = v_stream;
    END IF;
    IF NOT duplicate THEN
        IF p_notify THEN
            PERFORM pg_catalog.pg_notify('modkit_outbox', p_namespace || ':' || p_topic);
        END IF;
        RETURN;
    END IF;
    SELECT e.id INTO id FROM @s.modkit_outbox_events e
    WHERE e.namespace = p_namespace AND e.topic = p_topic AND e.dedupe_key = p_key
      AND e.tenant_id IS NOT DISTINCT FROM p_tenant;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox: dedupe key % of %:% conflicts with an event this transaction cannot see', p_key, p_namespace, p_topic
            USING ERRCODE = 'P7004',
                  HINT = 'a concurrent transaction enqueued it (REPEATABLE READ or SERIALIZABLE isolation) or it was just purged: retry the transaction';
    END IF;
END $$;

-- Record outcomes ('delivered', 'retry', 'dead', 'released') of p_worker's
-- claims. Each row must still be leased to p_worker under the presented
-- token, unexpired; rows that are not are left alone and not returned. Each
-- recorded outcome appends its ledger row in the same statement. (Since
-- migration 0005, a released event of an ordering key is held again while its
-- predecessor is undelivered, and a release's reason, passed as its error,
-- becomes its ledger row's detail; last_error is left alone.)
CREATE FUNCTION @s.modkit_outbox_complete(
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
                WHERE p.ordering_stream = e.ordering_stream
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
            SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_stream, e.ordering_seq, e.created_at,
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
                    WHERE p.ordering_stream = e.ordering_stream
                      AND p.ordering_seq = e.ordering_seq - 1
                      AND (p.status IN ('pending', 'processing')
                        OR (p.status = 'dead' AND NOT p.head_skipped
                            AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
            ORDER BY e.created_at, e.id
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED),
        due_expired AS (
            SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_stream, e.ordering_seq, e.created_at,
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
                    WHERE q.stream_id = e.ordering_stream)
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
        SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_stream, e.ordering_seq, e.created_at,
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
                WHERE p.ordering_stream = e.ordering_stream
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing')
                    OR (p.status = 'dead' AND NOT p.head_skipped
                        AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
        ORDER BY e.created_at, e.id
        LIMIT v_heads
        FOR UPDATE SKIP LOCKED),
    due_expired AS (
        SELECT e.id, e.namespace, e.topic, e.ordering_key, e.ordering_stream, e.ordering_seq, e.created_at,
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
END $$;

-- Lease repair and dead-lettering for p_topics: an expired lease with
-- attempts left goes back to pending (ledger: lease_expired); an event whose
-- attempts reached p_max_attempts and that no live lease holds becomes dead
-- (ledger: lease_expired when a lease was lost, then swept). Returns each
-- event changed, with repaired = true for the first kind. (Since migration
-- 0007, an event of an ordering key that goes back to pending is held while
-- its predecessor is undelivered.)
CREATE FUNCTION @s.modkit_outbox_sweep(p_topics text[], p_max_attempts int, p_limit int, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (id uuid, topic text, repaired boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    -- Due events come from index scans, one for each way an event can be
    -- due (migration 0007 dropped the (status, next_attempt_at) index that
    -- a single scan used): expired leases from the locked_until index
    -- (only a processing event has a lease), pending events out of
    -- attempts from the claim index and the held index.
    WITH due_expired AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            e.attempts >= p_max_attempts AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.locked_until < v_now
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        ORDER BY e.locked_until
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    due_exhausted AS (
        SELECT e.id, e.created_at, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            true AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.status = 'pending' AND NOT e.held AND e.attempts >= p_max_attempts
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
        SELECT * FROM (
            SELECT * FROM due_expired UNION ALL SELECT * FROM due_exhausted UNION ALL SELECT * FROM due_exhausted_held) u
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
END $$;

-- Clears the held flag of events of p_topics whose predecessor has settled
-- (delivered, purged, skipped, or dead under p_skip_dead) but which are
-- still held: their enqueue committed while the predecessor settled, so the
-- settling statement could not see them. Only the first held event of a key
-- can be such an event. The dispatcher runs it every PollInterval.
CREATE FUNCTION @s.modkit_outbox_release_held(p_topics text[], p_skip_dead text[], p_limit int) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_n bigint;
BEGIN
    -- The first held event of each stream comes from one descent of the
    -- held index per stream (a loose index scan). Migration 0004's DISTINCT
    -- ON read every held entry: 90 ms for 99,000 events held behind 1,000
    -- keys, on every poll of every dispatcher, and more as the backlog grew.
    -- A stream is one key of one topic, so its first held event is the
    -- key's; the topics are filtered after.
    WITH RECURSIVE first_held AS (
        (SELECT h.ordering_stream, h.ordering_seq FROM @s.modkit_outbox_events h
         WHERE h.held
         ORDER BY h.ordering_stream, h.ordering_seq
         LIMIT 1)
        UNION ALL
        SELECT n.ordering_stream, n.ordering_seq FROM first_held f
        CROSS JOIN LATERAL (
            SELECT h.ordering_stream, h.ordering_seq FROM @s.modkit_outbox_events h
            WHERE h.held AND h.ordering_stream > f.ordering_stream
            ORDER BY h.ordering_stream, h.ordering_seq
            LIMIT 1) n),
    free AS (
        SELECT e.id FROM first_held f
        JOIN @s.modkit_outbox_events e ON e.ordering_stream = f.ordering_stream AND e.ordering_seq = f.ordering_seq
        WHERE e.held AND (e.namespace || ':' || e.topic) = ANY(p_topics)
          AND NOT EXISTS (
            SELECT 1 FROM @s.modkit_outbox_events p
            WHERE p.ordering_stream = e.ordering_stream
              AND p.ordering_seq = e.ordering_seq - 1
              AND (p.status IN ('pending', 'processing')
                OR (p.status = 'dead' AND NOT p.head_skipped
                    AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}'))))))
        LIMIT p_limit)
    UPDATE @s.modkit_outbox_events AS e SET held = false FROM free WHERE e.id = free.id AND e.held;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END $$;

-- Keys whose earliest undelivered event is dead (and not skipped): the dead
-- head and how many events wait behind it. They stay blocked unless the
-- publisher skips dead heads, an operator skips the head
-- (modkit_outbox_skip_head) or replays it.
CREATE FUNCTION @s.modkit_outbox_blocked_keys(p_limit int)
RETURNS TABLE (namespace text, topic text, ordering_key text, head_id uuid, head_seq bigint, waiting bigint,
    last_error text, dead_since timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT d.namespace, d.topic, d.ordering_key, d.id, d.ordering_seq,
        (SELECT count(*) FROM @s.modkit_outbox_events w
         WHERE w.ordering_stream = d.ordering_stream
           AND w.ordering_seq > d.ordering_seq AND w.status IN ('pending', 'processing')),
        d.last_error, d.updated_at
    FROM @s.modkit_outbox_events d
    WHERE d.status = 'dead' AND d.ordering_key IS NOT NULL AND NOT d.head_skipped
    ORDER BY d.updated_at, d.id
    LIMIT p_limit;
$$;

-- Let the events after a dead head of an ordering key go on without it. The
-- head stays dead (replay it later if need be); its history records the
-- skip with p_by and the session user. Returns false when p_id is not a
-- dead event with an ordering key that is not skipped already.
CREATE FUNCTION @s.modkit_outbox_skip_head(p_id uuid, p_by text, p_now timestamptz DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    WITH upd AS (
        UPDATE @s.modkit_outbox_events AS e SET head_skipped = true, ledger_seq = e.ledger_seq + 1, updated_at = v_now
        WHERE e.id = p_id AND e.status = 'dead' AND e.ordering_key IS NOT NULL AND NOT e.head_skipped
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq, e.ordering_key, e.ordering_stream, e.ordering_seq),
    release AS (
        UPDATE @s.modkit_outbox_events AS s SET held = false
        FROM upd u
        WHERE s.ordering_stream = u.ordering_stream
          AND s.ordering_seq = u.ordering_seq + 1 AND s.held)
    INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
    SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'skipped', v_now,
        left('head skipped by ' || coalesce(p_by, 'unknown') || ': the events after it go on', 1024), session_user
    FROM upd u;
    RETURN FOUND;
END $$;
$functions$;
EXECUTE replace(body, '@s', s);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new functions, and grants them to
-- the outbox roles that exist.
SELECT modkit_outbox_grant_roles();
