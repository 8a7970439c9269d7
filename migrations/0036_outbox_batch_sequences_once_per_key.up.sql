-- A batch's events of one ordering key take their sequences with one write
-- of the key's row, not one an event.
--
-- modkit_outbox_enqueue_many enqueued a batch's events with ordering keys
-- one at a time through modkit_outbox_enqueue, and each updated its key's
-- row in modkit_outbox_sequences. Every update of a row leaves a version
-- that its own open transaction cannot prune, and each later update, and
-- each event's foreign-key check of the row, walked all of them: a batch of
-- n events of one key cost O(n²). 2,000 events of one key took 0.63 s,
-- 8,000 took 4.7 s, and 50,000 did not finish in 40 s (a trial's, and
-- psql's, figures), where 8,000 events without a key took 0.13 s.
--
-- A batch without dedupe keys (no event of it can be a duplicate, so each
-- takes a sequence) now locks and advances each key's row once, by its
-- count of events, and inserts all its events in one INSERT … SELECT,
-- numbering each key's in batch order. A batch with dedupe keys locks each
-- key's row once (FOR UPDATE, which writes no version), numbers the key's
-- events in batch order as it inserts them one at a time (a duplicate
-- takes none), and writes the key's last sequence once at the end of the
-- key. What a batch does is unchanged: keys are locked in (namespace, topic, key)
-- order, so two batches never deadlock on them; a duplicate (an existing
-- dedupe key) takes no sequence, and sequences stay gap-free; an event
-- waits (held) while the one before it is undelivered. Events without an
-- ordering key in such a batch still go through modkit_outbox_enqueue.
--
-- The function replaced is kept, callable by its owner only, as
-- modkit_outbox_enqueue_many_0032 for the down migration.
ALTER FUNCTION modkit_outbox_enqueue_many(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[])
    RENAME TO modkit_outbox_enqueue_many_0032;
DO $revoke$
DECLARE
    r text;
BEGIN
    FOR r IN SELECT rolname FROM pg_catalog.pg_roles
        WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_reader', 'modkit_outbox_operator')
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION '
            'modkit_outbox_enqueue_many_0032(uuid[], text[], text[], uuid[], text[], jsonb[], text[], jsonb[], text[]) FROM %I', r);
    END LOOP;
END $revoke$;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
    channel text := quote_literal(left('modkit_outbox.' || current_schema(), 63));
BEGIN
    EXECUTE replace(replace($functions$
CREATE FUNCTION @s.modkit_outbox_enqueue_many(
    p_ids uuid[], p_namespaces text[], p_topics text[], p_tenants uuid[], p_keys text[], p_payloads jsonb[],
    p_notify text[], p_headers jsonb[], p_ordering_keys text[])
RETURNS TABLE (ord bigint, id uuid)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = @s, pg_temp SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_ids uuid[];
    v_ords bigint[];
    v_dups uuid[];
    r record;
    v_id uuid;
    v_dup boolean;
    v_any boolean := false;
    -- The ordering key whose row is locked: its names, stream, the last
    -- sequence taken (written back when the key is done) and the one the
    -- row held.
    v_ns text;
    v_topic text;
    v_okey text;
    v_stream bigint;
    v_last bigint;
    v_start bigint;
    v_seq bigint;
    -- The keys of a batch without dedupe keys: names, the last sequence
    -- before the batch's, stream.
    v_key_ns text[] := '{}';
    v_key_topics text[] := '{}';
    v_key_okeys text[] := '{}';
    v_key_starts bigint[] := '{}';
    v_key_streams bigint[] := '{}';
BEGIN
    IF p_ordering_keys IS NOT NULL AND EXISTS (SELECT 1 FROM unnest(p_ordering_keys) AS k WHERE k IS NOT NULL)
        AND NOT EXISTS (SELECT 1 FROM unnest(p_keys) AS k WHERE k IS NOT NULL) THEN
        -- With ordering keys and no dedupe key, nothing can conflict, so
        -- every event takes a sequence: each key's row is locked and
        -- advanced by its count of events, in key order (so two batches
        -- never deadlock), and the events are inserted in one statement,
        -- each key's numbered in batch order from the row's last sequence
        -- (BENCHMARKS.md, "Batches of one ordering key").
        FOR r IN
            SELECT i.namespace, i.topic, i.okey, count(*) AS n
            FROM unnest(p_namespaces, p_topics, p_ordering_keys) AS i(namespace, topic, okey)
            WHERE i.okey IS NOT NULL
            GROUP BY i.namespace, i.topic, i.okey
            ORDER BY i.namespace, i.topic, i.okey
        LOOP
            UPDATE @s.modkit_outbox_sequences AS q SET last_seq = q.last_seq + r.n
            WHERE q.namespace = r.namespace AND q.topic = r.topic AND q.ordering_key = r.okey
            RETURNING q.last_seq - r.n, q.stream_id INTO v_start, v_stream;
            IF NOT FOUND THEN
                INSERT INTO @s.modkit_outbox_sequences AS q (namespace, topic, ordering_key, last_seq)
                VALUES (r.namespace, r.topic, r.okey, r.n)
                ON CONFLICT (namespace, topic, ordering_key) DO UPDATE SET last_seq = q.last_seq + r.n
                RETURNING q.last_seq - r.n, q.stream_id INTO v_start, v_stream;
            END IF;
            v_key_ns := v_key_ns || r.namespace;
            v_key_topics := v_key_topics || r.topic;
            v_key_okeys := v_key_okeys || r.okey;
            v_key_starts := v_key_starts || v_start;
            v_key_streams := v_key_streams || v_stream;
        END LOOP;
        INSERT INTO @s.modkit_outbox_events AS e (id, namespace, topic, tenant_id, dedupe_key, payload, headers,
            ordering_key, ordering_seq, ordering_stream, held)
        SELECT n.id, n.namespace, n.topic, n.tenant_id, NULL, n.payload, n.headers, n.okey, n.seq, n.stream,
            -- The first of a key's events waits while the event before it
            -- is undelivered, as modkit_outbox_enqueue decides; the rest
            -- wait behind the batch's own; an event without a key never.
            coalesce(n.seq > 1 AND (n.seq > n.start + 1 OR EXISTS (
                SELECT 1 FROM @s.modkit_outbox_events p
                WHERE p.ordering_stream = n.stream
                  AND p.ordering_seq = n.seq - 1
                  AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped)))), false)
        FROM (
            SELECT i.id, i.namespace, i.topic, i.tenant_id, i.payload, i.headers, i.okey, i.ord, k.start, k.stream,
                k.start + pg_catalog.row_number() OVER (PARTITION BY i.namespace, i.topic, i.okey ORDER BY i.ord) AS seq
            FROM unnest(p_ids, p_namespaces, p_topics, p_tenants, p_payloads,
                    coalesce(p_headers, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])), p_ordering_keys)
                WITH ORDINALITY AS i(id, namespace, topic, tenant_id, payload, headers, okey, ord)
            LEFT JOIN unnest(v_key_ns, v_key_topics, v_key_okeys, v_key_starts, v_key_streams)
                AS k(namespace, topic, okey, start, stream)
                ON k.namespace = i.namespace AND k.topic = i.topic AND k.okey = i.okey) n
        ORDER BY n.ord;
        IF p_notify IS NOT NULL THEN
            PERFORM pg_catalog.pg_notify(@channel, t) FROM unnest(p_notify) AS t;
        END IF;
        RETURN;
    END IF;
    IF p_ordering_keys IS NOT NULL AND EXISTS (SELECT 1 FROM unnest(p_ordering_keys) AS k WHERE k IS NOT NULL) THEN
        -- With ordering keys and dedupe keys, one row at a time, taking the
        -- keys' sequence locks in key order (so two batches never
        -- deadlock) and each key's sequences in batch order: a duplicate
        -- takes no sequence.
        FOR r IN
            SELECT i.* FROM unnest(p_ids, p_namespaces, p_topics, p_tenants, p_keys, p_payloads,
                    coalesce(p_headers, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])), p_ordering_keys)
                WITH ORDINALITY AS i(id, namespace, topic, tenant_id, dedupe_key, payload, headers, okey, ord)
            ORDER BY i.namespace, i.topic, i.okey NULLS FIRST, i.ord
        LOOP
            IF r.okey IS NULL THEN
                SELECT e.id, e.duplicate INTO v_id, v_dup FROM @s.modkit_outbox_enqueue(r.id, r.namespace, r.topic,
                    r.tenant_id, r.dedupe_key, r.payload, false, r.headers, NULL) e;
            ELSE
                IF v_stream IS NULL OR r.namespace <> v_ns OR r.topic <> v_topic OR r.okey <> v_okey THEN
                    IF v_last <> v_start THEN
                        UPDATE @s.modkit_outbox_sequences SET last_seq = v_last WHERE stream_id = v_stream;
                    END IF;
                    -- The key's row, locked until the caller's transaction
                    -- ends, as modkit_outbox_enqueue's update locks it. A
                    -- new key's row starts at 0; a known one is locked
                    -- without an insert attempt, which would draw a stream
                    -- id (an identity value) every time.
                    SELECT q.last_seq, q.stream_id INTO v_last, v_stream FROM @s.modkit_outbox_sequences q
                    WHERE q.namespace = r.namespace AND q.topic = r.topic AND q.ordering_key = r.okey
                    FOR UPDATE;
                    IF NOT FOUND THEN
                        INSERT INTO @s.modkit_outbox_sequences AS q (namespace, topic, ordering_key, last_seq)
                        VALUES (r.namespace, r.topic, r.okey, 0)
                        ON CONFLICT (namespace, topic, ordering_key) DO UPDATE SET last_seq = q.last_seq
                        RETURNING q.last_seq, q.stream_id INTO v_last, v_stream;
                    END IF;
                    v_start := v_last;
                    v_ns := r.namespace;
                    v_topic := r.topic;
                    v_okey := r.okey;
                END IF;
                v_seq := v_last + 1;
                INSERT INTO @s.modkit_outbox_events AS e (id, namespace, topic, tenant_id, dedupe_key, payload, headers,
                    ordering_key, ordering_seq, ordering_stream, held)
                VALUES (r.id, r.namespace, r.topic, r.tenant_id, r.dedupe_key, r.payload, r.headers, r.okey, v_seq, v_stream,
                    v_seq > 1 AND EXISTS (
                        SELECT 1 FROM @s.modkit_outbox_events p
                        WHERE p.ordering_stream = v_stream
                          AND p.ordering_seq = v_seq - 1
                          AND (p.status IN ('pending', 'processing') OR (p.status = 'dead' AND NOT p.head_skipped))))
                ON CONFLICT (namespace, topic, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
                RETURNING e.id INTO v_id;
                -- A duplicate takes no sequence.
                v_dup := NOT FOUND;
                IF v_dup THEN
                    SELECT e.id INTO v_id FROM @s.modkit_outbox_events e
                    WHERE e.namespace = r.namespace AND e.topic = r.topic AND e.dedupe_key = r.dedupe_key
                      AND e.tenant_id IS NOT DISTINCT FROM r.tenant_id;
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'outbox: dedupe key % of %:% conflicts with an event this transaction cannot see',
                            r.dedupe_key, r.namespace, r.topic
                            USING ERRCODE = 'P7004',
                                  HINT = 'a concurrent transaction enqueued it (REPEATABLE READ or SERIALIZABLE isolation) or it was just purged: retry the transaction';
                    END IF;
                ELSE
                    v_last := v_seq;
                END IF;
            END IF;
            IF v_dup THEN
                ord := r.ord;
                id := v_id;
                RETURN NEXT;
            ELSE
                v_any := true;
            END IF;
        END LOOP;
        IF v_last <> v_start THEN
            UPDATE @s.modkit_outbox_sequences SET last_seq = v_last WHERE stream_id = v_stream;
        END IF;
        IF v_any AND p_notify IS NOT NULL THEN
            PERFORM pg_catalog.pg_notify(@channel, t) FROM unnest(p_notify) AS t;
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
        PERFORM pg_catalog.pg_notify(@channel, t) FROM unnest(p_notify) AS t;
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
$functions$, '@s', s), '@channel', channel);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function and grants it to
-- the producer role, if it exists (migration 0004's grants name it).
SELECT modkit_outbox_grant_roles();
