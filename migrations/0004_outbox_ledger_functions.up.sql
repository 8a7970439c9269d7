-- The payment-grade write path (seeds 000-002): an append-only attempts
-- ledger, SECURITY DEFINER functions as the only way runtime roles touch the
-- outbox, least-privilege roles, and database-side checks that match the Go
-- validation.
--
-- The functions are created by a DO block so that every object they name is
-- qualified with the schema being migrated (current_schema(), which the modkit
-- migrator sets; with golang-migrate or goose it is the first schema of your
-- search_path) and so that their search_path is pinned to that schema with
-- pg_temp last: a same-named table or function in another schema, or a
-- temporary one, cannot change what they do. They are owned by the role that
-- runs this migration (the "owner"), run with its rights, and are executable
-- only by the roles granted below.

-- How many ledger rows the event has; the next row is ledger_seq + 1, so
-- attempt numbers are allocated in the same row update as the outcome and are
-- gap-free without scanning the ledger.
ALTER TABLE modkit_outbox_events ADD COLUMN ledger_seq int NOT NULL DEFAULT 0;
-- Optional metadata carried from the enqueue to the publish (W3C trace
-- context, correlation ids): a JSON object of strings.
ALTER TABLE modkit_outbox_events ADD COLUMN headers jsonb NULL;
-- Per-key ordering: events of one (namespace, topic, ordering_key) are
-- published one at a time in ordering_seq order, a sequence allocated in the
-- producer's transaction (modkit_outbox_sequences), gap-free. head_skipped
-- marks a dead event an operator (or the publisher's policy) let the
-- events after it pass.
--
-- held marks an event whose predecessor had not settled when it was
-- enqueued: held events stay out of the claim index, so a claim never walks
-- a backlog of blocked events. The predecessor's delivery (or skip) clears
-- its successor's flag in the same statement; modkit_outbox_release_held
-- repairs the rare successor whose enqueue committed while its predecessor
-- settled. The flag is a hint: the claim checks the predecessor all the same.
ALTER TABLE modkit_outbox_events
    ADD COLUMN ordering_key text NULL,
    ADD COLUMN ordering_seq bigint NULL,
    ADD COLUMN head_skipped boolean NOT NULL DEFAULT false,
    ADD COLUMN held boolean NOT NULL DEFAULT false;
CREATE UNIQUE INDEX modkit_outbox_events_ordering_idx
    ON modkit_outbox_events (namespace, topic, ordering_key, ordering_seq) WHERE ordering_key IS NOT NULL;
CREATE INDEX modkit_outbox_events_held_idx
    ON modkit_outbox_events (namespace, topic, ordering_key, ordering_seq) WHERE held;
-- The claim index without held events (the claim filters on NOT held).
DROP INDEX modkit_outbox_events_claim_idx;
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE status IN ('pending', 'processing') AND NOT held;
CREATE TABLE modkit_outbox_sequences (
    namespace    text   NOT NULL,
    topic        text   NOT NULL,
    ordering_key text   NOT NULL,
    last_seq     bigint NOT NULL,
    CONSTRAINT modkit_outbox_sequences_pkey PRIMARY KEY (namespace, topic, ordering_key)
);
REVOKE ALL ON TABLE modkit_outbox_sequences FROM PUBLIC;
-- When the current or last claim began (the ledger's claimed_at); written by
-- the claim in the same row update, kept by the outcome.
ALTER TABLE modkit_outbox_events ADD COLUMN claimed_at timestamptz NULL;

-- Database-side checks matching the Go validation. NOT VALID: rows written
-- before this migration are not re-checked, every new or updated row is.
ALTER TABLE modkit_outbox_events
    ADD CONSTRAINT modkit_outbox_events_name_pattern_check
        CHECK (namespace ~ '^[a-z0-9][a-z0-9._-]{0,127}$' AND topic ~ '^[a-z0-9][a-z0-9._-]{0,127}$') NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_dedupe_key_length_check
        CHECK (octet_length(dedupe_key) <= 512) NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_ordering_check CHECK (
        (ordering_key IS NULL) = (ordering_seq IS NULL)
        AND (ordering_key IS NULL OR (ordering_key <> '' AND octet_length(ordering_key) <= 256 AND ordering_seq > 0))) NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_headers_check
        CHECK (headers IS NULL OR (jsonb_typeof(headers) = 'object' AND pg_column_size(headers) <= 65536)),
    -- A key that carries a tenant prefix (a UUID and "/") belongs to that
    -- tenant: with a tenant_id it must begin with that id in canonical form
    -- (lower-case, hyphenated); without one it must not look like a tenant's.
    ADD CONSTRAINT modkit_outbox_events_tenant_key_check CHECK (
        dedupe_key IS NULL
        OR CASE WHEN tenant_id IS NULL
            THEN dedupe_key !~* '^([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/'
            ELSE starts_with(dedupe_key, tenant_id::text || '/') END) NOT VALID,
    -- The stored (binary jsonb) size. A backstop for writers that bypass the
    -- library (whose Config.MaxPayloadBytes limit, on the JSON text, applies
    -- first); change it with modkit_outbox_set_payload_limit.
    ADD CONSTRAINT modkit_outbox_events_payload_size_check
        CHECK (pg_column_size(payload) <= 4194304) NOT VALID;

-- The attempts ledger: one row per outcome of a claim (delivered, retry,
-- dead, released, lease_expired) and per operator or maintenance transition
-- (swept, replayed, skipped, purged). Append-only: no runtime role may update, delete
-- or truncate it, and a trigger refuses UPDATE, DELETE and TRUNCATE from
-- anyone (only modkit_outbox_prune_attempts, run by the owner, deletes old
-- rows of events that no longer exist).
CREATE TABLE modkit_outbox_attempts (
    event_id    uuid        NOT NULL,
    attempt_no  int         NOT NULL,
    namespace   text        NOT NULL,
    topic       text        NOT NULL,
    outcome     text        NOT NULL,
    -- The event's attempt counter during the claim this row closes (NULL for
    -- rows that close no claim).
    attempt     int         NULL,
    worker      uuid        NULL,
    lease_token uuid        NULL,
    claimed_at  timestamptz NULL,
    finished_at timestamptz NOT NULL,
    -- The publish error, or what an operator or the sweeper did.
    detail      text        NULL,
    -- session_user of an operator action.
    actor       text        NULL,
    CONSTRAINT modkit_outbox_attempts_pkey PRIMARY KEY (event_id, attempt_no),
    CONSTRAINT modkit_outbox_attempts_outcome_check CHECK (outcome IN
        ('delivered', 'retry', 'dead', 'released', 'lease_expired', 'swept', 'replayed', 'skipped', 'purged')),
    CONSTRAINT modkit_outbox_attempts_attempt_no_check CHECK (attempt_no > 0)
) WITH (fillfactor = 100);

CREATE INDEX modkit_outbox_attempts_finished_idx ON modkit_outbox_attempts (finished_at);

CREATE FUNCTION modkit_outbox_attempts_append_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('modkit_outbox.prune_attempts', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'the outbox attempts ledger is append-only: % refused', TG_OP
        USING ERRCODE = 'P0001',
              HINT = 'history is kept; the owner may remove old rows of purged events with modkit_outbox_prune_attempts';
END $$;
REVOKE ALL ON FUNCTION modkit_outbox_attempts_append_only() FROM PUBLIC;

CREATE TRIGGER modkit_outbox_attempts_no_update_delete
    BEFORE UPDATE OR DELETE ON modkit_outbox_attempts
    FOR EACH ROW EXECUTE FUNCTION modkit_outbox_attempts_append_only();
CREATE TRIGGER modkit_outbox_attempts_no_truncate
    BEFORE TRUNCATE ON modkit_outbox_attempts
    FOR EACH STATEMENT EXECUTE FUNCTION modkit_outbox_attempts_append_only();

REVOKE ALL ON TABLE modkit_outbox_events, modkit_outbox_leaders, modkit_outbox_attempts FROM PUBLIC;

DO $migration$
DECLARE
    s     text := quote_ident(current_schema());
    owner text := quote_literal(current_user);
    body  text;
BEGIN
body := $functions$
-- The row the listing, get and settled functions return: an event as
-- operators see it (payload and headers NULL for the reader role).
CREATE TYPE @s.modkit_outbox_event_row AS (
    id uuid, namespace text, topic text, tenant_id uuid, dedupe_key text, payload jsonb, status text,
    attempts int, next_attempt_at timestamptz, locked_by uuid, locked_until timestamptz, last_error text,
    created_at timestamptz, updated_at timestamptz, headers jsonb, ordering_key text, ordering_seq bigint);

-- Functions take p_now only from tests: a test clock is honoured for the
-- owner (and superusers) alone, so a runtime role cannot move time to steal
-- leases or claim early.
CREATE FUNCTION @s.modkit_outbox_clock(p_now timestamptz) RETURNS timestamptz
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
BEGIN
    IF p_now IS NULL THEN
        RETURN pg_catalog.statement_timestamp();
    END IF;
    IF NOT pg_catalog.pg_has_role(session_user, @owner, 'MEMBER') THEN
        RAISE EXCEPTION 'outbox: a test clock may only be used by the outbox owner'
            USING ERRCODE = '42501';
    END IF;
    RETURN p_now;
END $$;

-- Enqueue one event. Returns its id and whether it was a duplicate (then the
-- id is the existing row's, which belongs to the same tenant).
CREATE FUNCTION @s.modkit_outbox_enqueue(
    p_id uuid, p_namespace text, p_topic text, p_tenant uuid, p_key text, p_payload jsonb, p_notify boolean,
    p_headers jsonb, p_ordering_key text, OUT id uuid, OUT duplicate boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_seq bigint;
BEGIN
    IF p_ordering_key IS NOT NULL THEN
        -- The key's next sequence; the row stays locked until the caller's
        -- transaction ends, so producers of one key serialise (and only
        -- they), sequences follow commit order, and a rollback leaves no gap.
        INSERT INTO @s.modkit_outbox_sequences AS q (namespace, topic, ordering_key, last_seq)
        VALUES (p_namespace, p_topic, p_ordering_key, 1)
        ON CONFLICT (namespace, topic, ordering_key) DO UPDATE SET last_seq = q.last_seq + 1
        RETURNING q.last_seq INTO v_seq;
    END IF;
    INSERT INTO @s.modkit_outbox_events AS e (id, namespace, topic, tenant_id, dedupe_key, payload, headers, ordering_key, ordering_seq, held)
    VALUES (p_id, p_namespace, p_topic, p_tenant, p_key, p_payload, p_headers, p_ordering_key, v_seq,
        v_seq > 1 AND EXISTS (
            SELECT 1 FROM @s.modkit_outbox_events p
            WHERE p.namespace = p_namespace AND p.topic = p_topic AND p.ordering_key = p_ordering_key
              AND p.ordering_seq = v_seq - 1
              AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))))
    ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
    RETURNING e.id INTO id;
    duplicate := NOT FOUND;
    IF duplicate AND v_seq IS NOT NULL THEN
        -- A duplicate takes no sequence.
        UPDATE @s.modkit_outbox_sequences SET last_seq = last_seq - 1
        WHERE namespace = p_namespace AND topic = p_topic AND ordering_key = p_ordering_key;
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

-- Enqueue many events. Returns only the duplicates: their position (1-based)
-- and the existing row's id.
CREATE FUNCTION @s.modkit_outbox_enqueue_many(
    p_ids uuid[], p_namespaces text[], p_topics text[], p_tenants uuid[], p_keys text[], p_payloads jsonb[],
    p_notify text[], p_headers jsonb[], p_ordering_keys text[])
RETURNS TABLE (ord bigint, id uuid)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_ids uuid[];
    v_ords bigint[];
    v_dups uuid[];
    r record;
    v_id uuid;
    v_dup boolean;
    v_any boolean := false;
BEGIN
    IF p_ordering_keys IS NOT NULL AND EXISTS (SELECT 1 FROM unnest(p_ordering_keys) AS k WHERE k IS NOT NULL) THEN
        -- With ordering keys, one row at a time through modkit_outbox_enqueue,
        -- taking the keys' sequence locks in key order (so two batches never
        -- deadlock) and each key's sequences in batch order.
        FOR r IN
            SELECT i.* FROM unnest(p_ids, p_namespaces, p_topics, p_tenants, p_keys, p_payloads,
                    coalesce(p_headers, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])), p_ordering_keys)
                WITH ORDINALITY AS i(id, namespace, topic, tenant_id, dedupe_key, payload, headers, okey, ord)
            ORDER BY i.namespace, i.topic, i.okey NULLS FIRST, i.ord
        LOOP
            SELECT e.id, e.duplicate INTO v_id, v_dup FROM @s.modkit_outbox_enqueue(r.id, r.namespace, r.topic, r.tenant_id,
                r.dedupe_key, r.payload, false, r.headers, r.okey) e;
            IF v_dup THEN
                ord := r.ord;
                id := v_id;
                RETURN NEXT;
            ELSE
                v_any := true;
            END IF;
        END LOOP;
        IF v_any AND p_notify IS NOT NULL THEN
            PERFORM pg_catalog.pg_notify('modkit_outbox', t) FROM unnest(p_notify) AS t;
        END IF;
        RETURN;
    END IF;
    WITH ins AS (
        INSERT INTO @s.modkit_outbox_events (id, namespace, topic, tenant_id, dedupe_key, payload, headers)
        SELECT i.id, i.namespace, i.topic, i.tenant_id, i.dedupe_key, i.payload, i.headers
        FROM unnest(p_ids, p_namespaces, p_topics, p_tenants, p_keys, p_payloads,
                coalesce(p_headers, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])))
            WITH ORDINALITY AS i(id, namespace, topic, tenant_id, dedupe_key, payload, headers, ord)
        ORDER BY i.ord
        ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
        RETURNING id)
    SELECT coalesce(pg_catalog.array_agg(ins.id), '{}') INTO v_ids FROM ins;
    IF pg_catalog.cardinality(v_ids) > 0 AND p_notify IS NOT NULL THEN
        PERFORM pg_catalog.pg_notify('modkit_outbox', t) FROM unnest(p_notify) AS t;
    END IF;
    IF pg_catalog.cardinality(v_ids) = pg_catalog.cardinality(p_ids) THEN
        RETURN;
    END IF;
    -- A new statement: it sees the rows this call inserted (a key repeated
    -- within the batch) and rows other transactions committed meanwhile.
    -- A tenant's lookup only ever finds that tenant's row.
    SELECT pg_catalog.array_agg(i.ord ORDER BY i.ord), pg_catalog.array_agg(other.id ORDER BY i.ord) INTO v_ords, v_dups
    FROM unnest(p_ids, p_namespaces, p_topics, p_tenants, p_keys) WITH ORDINALITY AS i(id, namespace, topic, tenant_id, dedupe_key, ord)
    LEFT JOIN LATERAL (
        SELECT e.id FROM @s.modkit_outbox_events e
        WHERE e.namespace = i.namespace AND e.topic = i.topic AND e.dedupe_key = i.dedupe_key
          AND e.tenant_id IS NOT DISTINCT FROM i.tenant_id) other ON true
    WHERE NOT EXISTS (SELECT 1 FROM unnest(v_ids) AS mine(id) WHERE mine.id = i.id);
    IF pg_catalog.array_position(v_dups, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: a dedupe key of this batch conflicts with an event this transaction cannot see'
            USING ERRCODE = 'P7004',
                  HINT = 'a concurrent transaction enqueued it (REPEATABLE READ or SERIALIZABLE isolation) or it was just purged: retry the transaction';
    END IF;
    RETURN QUERY SELECT d.ord, d.id FROM unnest(v_ords, v_dups) AS d(ord, id);
END $$;

-- Claim up to p_limit due events of p_topics ("namespace:topic") for
-- p_worker, oldest first, with a fresh lease token each. An event whose lease
-- expired is repaired in the same statement: its ledger gets a lease_expired
-- row for the lost claim.
CREATE FUNCTION @s.modkit_outbox_claim(
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
CREATE FUNCTION @s.modkit_outbox_complete(
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

-- Record one outcome, raising P7002 (lease lost) when the event is not
-- leased to p_worker under p_token any more, and P7003 when the outcome is
-- not one a worker may record.
CREATE FUNCTION @s.modkit_outbox_complete_one(
    p_worker uuid, p_id uuid, p_token uuid, p_outcome text, p_error text, p_delay_ms bigint, p_now timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
BEGIN
    PERFORM @s.modkit_outbox_complete(p_worker, ARRAY[p_id], ARRAY[p_token], ARRAY[p_outcome], ARRAY[p_error],
        ARRAY[p_delay_ms], p_now);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox: lease lost: event % is not leased to worker % under this token', p_id, p_worker
            USING ERRCODE = 'P7002',
                  HINT = 'the lease expired, or the event was claimed again or settled: the outcome was not recorded';
    END IF;
END $$;

-- Lease repair and dead-lettering for p_topics: an expired lease with
-- attempts left goes back to pending (ledger: lease_expired); an event whose
-- attempts reached p_max_attempts and that no live lease holds becomes dead
-- (ledger: lease_expired when a lease was lost, then swept). Returns each
-- event changed, with repaired = true for the first kind.
CREATE FUNCTION @s.modkit_outbox_sweep(p_topics text[], p_max_attempts int, p_limit int, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (id uuid, topic text, repaired boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    WITH due AS (
        SELECT e.id, e.status AS old_status, e.locked_by AS old_worker, e.lease_token AS old_token,
            e.claimed_at AS old_claimed_at, e.attempts, e.ledger_seq AS old_seq, e.last_error AS old_error,
            e.attempts >= p_max_attempts AS exhausted
        FROM @s.modkit_outbox_events e
        WHERE e.status IN ('pending', 'processing')
          AND ((e.status = 'processing' AND e.locked_until < v_now)
            OR (e.status = 'pending' AND e.attempts >= p_max_attempts))
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        ORDER BY e.created_at, e.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED),
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
            updated_at = v_now
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

-- Delete delivered events of p_topics older than p_retention, at most
-- p_limit; their ledger rows are kept.
CREATE FUNCTION @s.modkit_outbox_purge(p_topics text[], p_retention interval, p_limit int, p_now timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_n bigint;
BEGIN
    DELETE FROM @s.modkit_outbox_events WHERE id IN (
        SELECT e.id FROM @s.modkit_outbox_events e
        WHERE e.status = 'delivered' AND e.updated_at < v_now - p_retention
          AND (e.namespace || ':' || e.topic) = ANY(p_topics)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END $$;

-- An operator's purge: as modkit_outbox_purge, and each purged event's
-- history records it (outcome purged, the session user as actor).
CREATE FUNCTION @s.modkit_outbox_purge_recorded(p_topics text[], p_retention interval, p_limit int, p_now timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
    v_n bigint;
BEGIN
    WITH del AS (
        DELETE FROM @s.modkit_outbox_events WHERE id IN (
            SELECT e.id FROM @s.modkit_outbox_events e
            WHERE e.status = 'delivered' AND e.updated_at < v_now - p_retention
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
    WITH first_held AS (
        SELECT DISTINCT ON (h.namespace, h.topic, h.ordering_key) h.id, h.namespace, h.topic, h.ordering_key, h.ordering_seq
        FROM @s.modkit_outbox_events h
        WHERE h.held AND (h.namespace || ':' || h.topic) = ANY(p_topics)
        ORDER BY h.namespace, h.topic, h.ordering_key, h.ordering_seq),
    free AS (
        SELECT f.id FROM first_held f
        WHERE NOT EXISTS (
            SELECT 1 FROM @s.modkit_outbox_events p
            WHERE p.namespace = f.namespace AND p.topic = f.topic AND p.ordering_key = f.ordering_key
              AND p.ordering_seq = f.ordering_seq - 1
              AND (p.status IN ('pending', 'processing')
                OR (p.status = 'dead' AND NOT p.head_skipped
                    AND NOT ((f.namespace || ':' || f.topic) = ANY(coalesce(p_skip_dead, '{}'))))))
        LIMIT p_limit)
    UPDATE @s.modkit_outbox_events AS e SET held = false FROM free WHERE e.id = free.id AND e.held;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END $$;

-- Maintenance leases (one holder per role).
CREATE FUNCTION @s.modkit_outbox_elect(p_roles text[], p_holder uuid, p_ttl interval, p_now timestamptz DEFAULT NULL)
RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    INSERT INTO @s.modkit_outbox_leaders AS l (role, holder, expires_at, updated_at)
    SELECT r, p_holder, v_now + p_ttl, v_now FROM unnest(p_roles) AS r ORDER BY r
    ON CONFLICT (role) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at, updated_at = EXCLUDED.updated_at
    WHERE l.holder = EXCLUDED.holder OR l.expires_at < v_now
    RETURNING l.role;
END $$;

CREATE FUNCTION @s.modkit_outbox_resign(p_holder uuid, p_roles text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    DELETE FROM @s.modkit_outbox_leaders WHERE holder = p_holder AND role = ANY(p_roles);
$$;

-- Counts per (namespace, topic, status) and how long the oldest due pending
-- event has waited.
CREATE FUNCTION @s.modkit_outbox_stats(p_now timestamptz DEFAULT NULL)
RETURNS TABLE (namespace text, topic text, status text, count bigint, oldest_due_seconds float8)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    SELECT e.namespace, e.topic, e.status, count(*),
        coalesce(extract(epoch FROM v_now - min(e.next_attempt_at) FILTER (WHERE e.status = 'pending' AND e.next_attempt_at <= v_now)), 0)::float8
    FROM @s.modkit_outbox_events e GROUP BY e.namespace, e.topic, e.status ORDER BY e.namespace, e.topic, e.status;
END $$;

-- The gauges of p_topics; stuck counts leases that expired without an
-- outcome (waiting for repair).
CREATE FUNCTION @s.modkit_outbox_depth(p_topics text[], p_now timestamptz DEFAULT NULL)
RETURNS TABLE (topic text, pending bigint, processing bigint, dead bigint, oldest_due_seconds float8, stuck bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    SELECT e.namespace || ':' || e.topic,
        count(*) FILTER (WHERE e.status = 'pending'),
        count(*) FILTER (WHERE e.status = 'processing'),
        count(*) FILTER (WHERE e.status = 'dead'),
        coalesce(extract(epoch FROM v_now - min(e.next_attempt_at) FILTER (WHERE e.status = 'pending' AND e.next_attempt_at <= v_now)), 0)::float8,
        count(*) FILTER (WHERE e.status = 'processing' AND e.locked_until < v_now)
    FROM @s.modkit_outbox_events e
    WHERE e.status IN ('pending', 'processing', 'dead') AND (e.namespace || ':' || e.topic) = ANY(p_topics)
    GROUP BY e.namespace, e.topic;
END $$;

-- Listing: modkit_outbox_list (reader) hides payloads,
-- modkit_outbox_list_payloads (operator) shows them.
CREATE FUNCTION @s.modkit_outbox_list_rows(
    p_payloads boolean, p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid, p_limit int)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
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
$$;

CREATE FUNCTION @s.modkit_outbox_list(
    p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid, p_limit int)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_list_rows(false, p_status, p_namespace, p_topic, p_tenant,
        p_created_after, p_created_before, p_after_created_at, p_after_id, p_limit);
$$;

CREATE FUNCTION @s.modkit_outbox_list_payloads(
    p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid, p_limit int)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_list_rows(true, p_status, p_namespace, p_topic, p_tenant,
        p_created_after, p_created_before, p_after_created_at, p_after_id, p_limit);
$$;

CREATE FUNCTION @s.modkit_outbox_get(p_id uuid)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN false THEN e.payload END, e.status,
        e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
        CASE WHEN false THEN e.headers END, e.ordering_key, e.ordering_seq
    FROM @s.modkit_outbox_events e WHERE e.id = p_id;
$$;

CREATE FUNCTION @s.modkit_outbox_get_payload(p_id uuid)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN true THEN e.payload END, e.status,
        e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
        CASE WHEN true THEN e.headers END, e.ordering_key, e.ordering_seq
    FROM @s.modkit_outbox_events e WHERE e.id = p_id;
$$;

-- Deliveries per bucket (aligned on the Unix epoch) over the last p_window,
-- with enqueue-to-delivery latency quantiles, per topic and in total (the
-- rows whose namespace is NULL). It scans delivered rows: for dashboards
-- refreshing every few seconds, not for tight loops.
CREATE FUNCTION @s.modkit_outbox_series(p_window interval, p_bucket interval, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (at timestamptz, ns text, tp text, bucket_start timestamptz, delivered bigint,
    latency_p50 float8, latency_p95 float8, latency_max float8)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    WITH w AS (
        SELECT coalesce(p_now, now()) AS now,
            date_bin(p_bucket, coalesce(p_now, now()) - p_window, timestamptz 'epoch') AS start)
    SELECT w.now, e.namespace, e.topic, date_bin(p_bucket, e.updated_at, timestamptz 'epoch') AS bucket,
        count(*),
        percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
        percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
        max(extract(epoch FROM e.updated_at - e.created_at))::float8
    FROM @s.modkit_outbox_events e CROSS JOIN w
    WHERE e.status = 'delivered' AND e.updated_at >= w.start AND e.updated_at <= w.now
    GROUP BY GROUPING SETS ((w.now, bucket), (w.now, e.namespace, e.topic, bucket))
    ORDER BY bucket, e.namespace NULLS FIRST, e.topic NULLS FIRST;
$$;

-- Events settled (delivered or dead) since p_since, oldest first, to follow
-- deliveries; modkit_outbox_settled hides payloads and headers,
-- modkit_outbox_settled_payloads (operator) shows them.
CREATE FUNCTION @s.modkit_outbox_settled_rows(p_payloads boolean, p_since timestamptz, p_limit int, p_now timestamptz)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT e.id, e.namespace, e.topic, e.tenant_id, e.dedupe_key, CASE WHEN p_payloads THEN e.payload END, e.status,
        e.attempts, e.next_attempt_at, e.locked_by, e.locked_until, e.last_error, e.created_at, e.updated_at,
        CASE WHEN p_payloads THEN e.headers END, e.ordering_key, e.ordering_seq
    FROM @s.modkit_outbox_events e
    WHERE e.status IN ('delivered', 'dead') AND e.updated_at >= p_since AND e.updated_at <= coalesce(p_now, now())
    ORDER BY e.updated_at, e.id
    LIMIT p_limit;
$$;

CREATE FUNCTION @s.modkit_outbox_settled(p_since timestamptz, p_limit int, p_now timestamptz DEFAULT NULL)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_settled_rows(false, p_since, p_limit, p_now);
$$;

CREATE FUNCTION @s.modkit_outbox_settled_payloads(p_since timestamptz, p_limit int, p_now timestamptz DEFAULT NULL)
RETURNS SETOF @s.modkit_outbox_event_row
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_settled_rows(true, p_since, p_limit, p_now);
$$;

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
         WHERE w.namespace = d.namespace AND w.topic = d.topic AND w.ordering_key = d.ordering_key
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
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq, e.ordering_key, e.ordering_seq),
    release AS (
        UPDATE @s.modkit_outbox_events AS s SET held = false
        FROM upd u
        WHERE s.namespace = u.namespace AND s.topic = u.topic AND s.ordering_key = u.ordering_key
          AND s.ordering_seq = u.ordering_seq + 1 AND s.held)
    INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
    SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'skipped', v_now,
        left('head skipped by ' || coalesce(p_by, 'unknown') || ': the events after it go on', 1024), session_user
    FROM upd u;
    RETURN FOUND;
END $$;

-- An event's ledger, oldest first (kept after the event is purged).
CREATE FUNCTION @s.modkit_outbox_history(p_id uuid)
RETURNS TABLE (attempt_no int, outcome text, attempt int, worker uuid, lease_token uuid, claimed_at timestamptz,
    finished_at timestamptz, detail text, actor text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT a.attempt_no, a.outcome, a.attempt, a.worker, a.lease_token, a.claimed_at, a.finished_at, a.detail, a.actor
    FROM @s.modkit_outbox_attempts a WHERE a.event_id = p_id ORDER BY a.attempt_no;
$$;

-- Replay dead events (by id, or the first p_limit matching the filter): back
-- to pending with their attempts reset. The ledger records who (p_by, and the
-- database session_user) did it; last_error keeps the error that killed it.
CREATE FUNCTION @s.modkit_outbox_replay_rows(p_ids uuid[], p_by text, p_now timestamptz)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
DECLARE
    v_now timestamptz := @s.modkit_outbox_clock(p_now);
BEGIN
    RETURN QUERY
    WITH upd AS (
        UPDATE @s.modkit_outbox_events AS e SET
            status = 'pending', attempts = 0, next_attempt_at = v_now, head_skipped = false,
            ledger_seq = e.ledger_seq + 1, updated_at = v_now
        WHERE e.id = ANY(p_ids) AND e.status = 'dead'
        RETURNING e.id, e.namespace, e.topic, e.ledger_seq),
    ledger AS (
        INSERT INTO @s.modkit_outbox_attempts (event_id, attempt_no, namespace, topic, outcome, finished_at, detail, actor)
        SELECT u.id, u.ledger_seq, u.namespace, u.topic, 'replayed', v_now, left('replayed by ' || coalesce(p_by, 'unknown'), 1024), session_user
        FROM upd u)
    SELECT u.id FROM upd u;
END $$;

CREATE FUNCTION @s.modkit_outbox_replay(p_ids uuid[], p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE sql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_replay_rows(p_ids, p_by, p_now);
$$;

CREATE FUNCTION @s.modkit_outbox_replay_filter(
    p_status text, p_namespace text, p_topic text, p_tenant uuid,
    p_created_after timestamptz, p_created_before timestamptz, p_after_created_at timestamptz, p_after_id uuid, p_limit int, p_by text, p_now timestamptz DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE sql SECURITY DEFINER SET search_path = @s, pg_temp AS $$
    SELECT * FROM @s.modkit_outbox_replay_rows(ARRAY(
        SELECT l.id FROM @s.modkit_outbox_list_rows(false, 'dead', p_namespace, p_topic, p_tenant,
            p_created_after, p_created_before, p_after_created_at, p_after_id, p_limit) l), p_by, p_now);
$$;

-- Owner only: the database's payload limit (stored jsonb size, bytes).
CREATE FUNCTION @s.modkit_outbox_set_payload_limit(p_bytes int) RETURNS void
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
BEGIN
    IF p_bytes IS NULL OR p_bytes < 1024 THEN
        RAISE EXCEPTION 'outbox: the payload limit must be at least 1024 bytes' USING ERRCODE = '22023';
    END IF;
    ALTER TABLE @s.modkit_outbox_events DROP CONSTRAINT modkit_outbox_events_payload_size_check;
    EXECUTE format('ALTER TABLE @s.modkit_outbox_events ADD CONSTRAINT modkit_outbox_events_payload_size_check CHECK (pg_column_size(payload) <= %s) NOT VALID', p_bytes);
END $$;

-- Owner only: delete ledger rows finished before p_before whose event no
-- longer exists (purged). Returns how many.
CREATE FUNCTION @s.modkit_outbox_prune_attempts(p_before timestamptz) RETURNS bigint
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    v_n bigint;
BEGIN
    PERFORM pg_catalog.set_config('modkit_outbox.prune_attempts', 'on', true);
    DELETE FROM @s.modkit_outbox_attempts a
    WHERE a.finished_at < p_before
      AND NOT EXISTS (SELECT 1 FROM @s.modkit_outbox_events e WHERE e.id = a.event_id);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM pg_catalog.set_config('modkit_outbox.prune_attempts', 'off', true);
    RETURN v_n;
END $$;

-- (Re)applies the grants of this schema to the outbox roles that exist. The
-- migration runs it; run it again as the owner after creating the roles by
-- hand (see the README, "Least privilege").
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    fn text;
    granted text[] := '{}';
BEGIN
    FOR fn IN
        SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = '@s'::regnamespace AND p.proname LIKE 'modkit\_outbox\_%'
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', fn);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'modkit_outbox_producer') THEN
        GRANT USAGE ON SCHEMA @s TO modkit_outbox_producer;
        GRANT INSERT (id, namespace, topic, tenant_id, dedupe_key, payload, headers) ON @s.modkit_outbox_events TO modkit_outbox_producer;
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text),
            @s.modkit_outbox_enqueue_many(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[]) TO modkit_outbox_producer;
        granted := granted || 'modkit_outbox_producer'::text;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'modkit_outbox_dispatcher') THEN
        GRANT USAGE ON SCHEMA @s TO modkit_outbox_dispatcher;
        GRANT EXECUTE ON FUNCTION
            @s.modkit_outbox_claim(uuid, text[], int, int, interval, text[], timestamptz),
            @s.modkit_outbox_complete(uuid, uuid[], uuid[], text[], text[], bigint[], timestamptz),
            @s.modkit_outbox_complete_one(uuid, uuid, uuid, text, text, bigint, timestamptz),
            @s.modkit_outbox_sweep(text[], int, int, timestamptz),
            @s.modkit_outbox_purge(text[], interval, int, timestamptz),
            @s.modkit_outbox_release_held(text[], text[], int),
            @s.modkit_outbox_elect(text[], uuid, interval, timestamptz),
            @s.modkit_outbox_resign(uuid, text[]),
            @s.modkit_outbox_depth(text[], timestamptz) TO modkit_outbox_dispatcher;
        granted := granted || 'modkit_outbox_dispatcher'::text;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'modkit_outbox_reader') THEN
        GRANT USAGE ON SCHEMA @s TO modkit_outbox_reader;
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_stats(timestamptz),
            @s.modkit_outbox_depth(text[], timestamptz),
            @s.modkit_outbox_list(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int),
            @s.modkit_outbox_get(uuid), @s.modkit_outbox_history(uuid),
            @s.modkit_outbox_series(interval, interval, timestamptz),
            @s.modkit_outbox_settled(timestamptz, int, timestamptz),
            @s.modkit_outbox_blocked_keys(int) TO modkit_outbox_reader;
        granted := granted || 'modkit_outbox_reader'::text;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'modkit_outbox_operator') THEN
        GRANT USAGE ON SCHEMA @s TO modkit_outbox_operator;
        GRANT EXECUTE ON FUNCTION @s.modkit_outbox_stats(timestamptz),
            @s.modkit_outbox_depth(text[], timestamptz),
            @s.modkit_outbox_list(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int),
            @s.modkit_outbox_list_payloads(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int),
            @s.modkit_outbox_get(uuid), @s.modkit_outbox_get_payload(uuid), @s.modkit_outbox_history(uuid),
            @s.modkit_outbox_series(interval, interval, timestamptz),
            @s.modkit_outbox_settled(timestamptz, int, timestamptz),
            @s.modkit_outbox_settled_payloads(timestamptz, int, timestamptz),
            @s.modkit_outbox_replay(uuid[], text, timestamptz),
            @s.modkit_outbox_replay_filter(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int, text, timestamptz),
            @s.modkit_outbox_purge_recorded(text[], interval, int, timestamptz),
            @s.modkit_outbox_blocked_keys(int), @s.modkit_outbox_skip_head(uuid, text, timestamptz) TO modkit_outbox_operator;
        granted := granted || 'modkit_outbox_operator'::text;
    END IF;
    RETURN granted;
END $$;
$functions$;
EXECUTE replace(replace(body, '@s', s), '@owner', owner);
END $migration$;

-- The runtime roles (cluster-wide, NOLOGIN: grant them to your login roles).
-- Created when the migrating role may create roles; otherwise the migration
-- goes on without them, and the outbox's Migrate logs how to create them
-- (README, "Least privilege") and to run modkit_outbox_grant_roles().
DO $roles$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_operator', 'modkit_outbox_reader'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION
                WHEN insufficient_privilege THEN
                    RAISE WARNING 'outbox: role % was not created (this role may not create roles); create it as shown in the README, "Least privilege", then run SELECT modkit_outbox_grant_roles()', r;
                WHEN duplicate_object OR unique_violation THEN
                    NULL; -- created by a concurrent migration of another schema
            END;
        END IF;
    END LOOP;
END $roles$;

SELECT modkit_outbox_grant_roles();
