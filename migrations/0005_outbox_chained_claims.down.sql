-- Back to migration 0004's claim index, and its claim, outcome and grant
-- functions (the last kept by the up migration under another name).
DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE status IN ('pending', 'processing') AND NOT held;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    owner text := quote_literal(current_user);
    body  text;
BEGIN
body := $functions$
-- Claim up to p_limit due events of p_topics ("namespace:topic") for
-- p_worker, oldest first, with a fresh lease token each. An event whose lease
-- expired is repaired in the same statement: its ledger gets a lease_expired
-- row for the lost claim.
CREATE OR REPLACE FUNCTION @s.modkit_outbox_claim(
    p_worker uuid, p_topics text[], p_limit int, p_max_attempts int, p_lease interval, p_skip_dead text[],
    p_now timestamptz DEFAULT NULL)
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
    RETURN QUERY
    WITH due AS (
        SELECT e.id, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts AS old_attempts, e.ledger_seq AS old_seq
        FROM @s.modkit_outbox_events e
        WHERE e.status IN ('pending', 'processing') AND NOT e.held
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
                WHERE p.namespace = e.namespace AND p.topic = e.topic AND p.ordering_key = e.ordering_key
                  AND p.ordering_seq = e.ordering_seq - 1
                  AND (p.status IN ('pending', 'processing')
                    OR (p.status = 'dead' AND NOT p.head_skipped
                        AND NOT ((e.namespace || ':' || e.topic) = ANY(coalesce(p_skip_dead, '{}')))))))
        ORDER BY e.created_at, e.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
    upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = 'processing',
            attempts = e.attempts + 1,
            locked_by = p_worker,
            locked_until = v_now + p_lease,
            lease_token = gen_random_uuid(),
            ledger_seq = e.ledger_seq + (d.old_status = 'processing')::int,
            claimed_at = v_now,
            updated_at = v_now
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
END $$;

-- Record outcomes ('delivered', 'retry', 'dead', 'released') of p_worker's
-- claims. Each row must still be leased to p_worker under the presented
-- token, unexpired; rows that are not are left alone and not returned. Each
-- recorded outcome appends its ledger row in the same statement.
CREATE OR REPLACE FUNCTION @s.modkit_outbox_complete(
    p_worker uuid, p_ids uuid[], p_tokens uuid[], p_outcomes text[], p_errors text[], p_delays_ms bigint[],
    p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_bad text;
BEGIN
    SELECT o INTO v_bad FROM unnest(p_outcomes) AS o
    WHERE o IS NULL OR o NOT IN ('delivered', 'retry', 'dead', 'released') LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox: % is not an outcome a worker may record', coalesce(v_bad, 'NULL')
            USING ERRCODE = 'P7003', HINT = 'use delivered, retry, dead or released';
    END IF;
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
            updated_at = v_now
        FROM unnest(p_ids, p_tokens, p_outcomes, p_errors, p_delays_ms) AS a(id, token, outcome, err, delay_ms)
        WHERE e.id = a.id AND e.lease_token = a.token AND e.locked_by = p_worker
          AND e.status = 'processing' AND e.locked_until > v_now
        RETURNING e.id, e.ledger_seq, e.namespace, e.topic, a.outcome, a.token, e.claimed_at,
            CASE a.outcome WHEN 'released' THEN e.attempts + 1 ELSE e.attempts END AS attempt,
            CASE WHEN a.outcome IN ('retry', 'dead') THEN left(a.err, 8192) END AS err,
            e.ordering_key, e.ordering_seq),
    release AS (
        -- A delivered event lets the next one of its key into the claim.
        UPDATE @s.modkit_outbox_events AS s SET held = false
        FROM upd u
        WHERE u.outcome = 'delivered' AND u.ordering_key IS NOT NULL
          AND s.namespace = u.namespace AND s.topic = u.topic AND s.ordering_key = u.ordering_key
          AND s.ordering_seq = u.ordering_seq + 1 AND s.held),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts
            (event_id, attempt_no, namespace, topic, outcome, attempt, worker, lease_token, claimed_at, finished_at, detail)
        SELECT u.id, u.ledger_seq, u.namespace, u.topic, u.outcome, u.attempt, p_worker, u.token, u.claimed_at, v_now, u.err
        FROM upd u)
    SELECT u.id FROM upd u;
END $$;

$functions$;
EXECUTE replace(replace(body, '@s', s), '@owner', owner);
END $migration$;

DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0004() RENAME TO modkit_outbox_grant_roles;
SELECT modkit_outbox_grant_roles();

DROP FUNCTION modkit_outbox_claim_chained(uuid, text[], int, int, interval, text[], int[], timestamptz);
