-- The checks on what a producer writes are evaluated on the rows a producer
-- writes, and no longer again on every claim and every outcome.
--
-- PostgreSQL evaluates every CHECK constraint of a table on every row an
-- UPDATE writes, whether or not the columns the check reads changed. The
-- checks on the message columns (namespace, topic, tenant_id, dedupe_key,
-- payload, headers, ordering_key: names, sizes, the tenant's key prefix)
-- cost about 2 us a row even without regular expressions (migration 0017),
-- mostly the tenant id turned into text for the key prefix and the
-- multibyte-aware btrim, strpos and left of the name check, and a drain
-- paid them twice an event, for its claim and for its outcome: 8.7% of the
-- server's CPU in a profile of a drain (BENCHMARKS.md, "Checks on new
-- events only").
--
-- Each of those checks now holds unless the row is a new event:
--   CHECK (status <> 'pending' OR attempts <> 0 OR <the check as before>)
-- Every row anyone but the owner can write is a new event: the producer
-- role may INSERT the message columns only (status and attempts take their
-- defaults, 'pending' and 0), the enqueue functions and COPY write the same
-- columns, and no role but the owner may UPDATE the table. After that, no
-- function changes a message column: claims and outcomes change the
-- state, lease and bookkeeping columns, and the row they write is leased,
-- settled or a retry (attempts > 0), so the short-circuit skips the rest of
-- the check. A row put back to pending with no attempts (an event released
-- before its first attempt counted, a held event let into the claim) is
-- checked again, and passes, since nothing it is checked on has changed.
--
-- The checks on the state columns (status, attempts, the lease, the
-- ordering stream) stay as they are: claims and outcomes change those.
--
-- The constraints keep their names and are re-created NOT VALID: existing
-- rows are not scanned (each satisfied the check it replaces, which implies
-- the new one). The payload limit keeps its value, which
-- modkit_outbox_set_payload_limit may have changed; that function now
-- writes the limit in the same form.
DO $migration$
DECLARE
    v_guard CONSTANT text := 'status <> ''pending'' OR attempts <> 0 OR ';
    v_limit bigint;
BEGIN
    SELECT substring(pg_catalog.pg_get_constraintdef(c.oid) FROM 'pg_column_size\(payload\) <= (\d+)')::bigint
    INTO v_limit
    FROM pg_catalog.pg_constraint c
    WHERE c.conrelid = 'modkit_outbox_events'::regclass AND c.conname = 'modkit_outbox_events_payload_size_check';
    IF v_limit IS NULL THEN
        RAISE EXCEPTION 'outbox migration 0018: modkit_outbox_events_payload_size_check not found or not in the form migration 0004 wrote'
            USING HINT = 'restore the check with SELECT modkit_outbox_set_payload_limit(bytes) before migrating';
    END IF;
    EXECUTE 'ALTER TABLE modkit_outbox_events '
        'DROP CONSTRAINT modkit_outbox_events_names_check, '
        'DROP CONSTRAINT modkit_outbox_events_dedupe_key_check, '
        'DROP CONSTRAINT modkit_outbox_events_name_pattern_check, '
        'DROP CONSTRAINT modkit_outbox_events_dedupe_key_length_check, '
        'DROP CONSTRAINT modkit_outbox_events_ordering_check, '
        'DROP CONSTRAINT modkit_outbox_events_headers_check, '
        'DROP CONSTRAINT modkit_outbox_events_tenant_key_check, '
        'DROP CONSTRAINT modkit_outbox_events_payload_size_check, '
        'ADD CONSTRAINT modkit_outbox_events_names_check CHECK (' || v_guard ||
            '(namespace <> '''' AND topic <> '''')) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_dedupe_key_check CHECK (' || v_guard ||
            'dedupe_key IS NULL OR dedupe_key <> '''') NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_name_pattern_check CHECK (' || v_guard || '('
            'octet_length(namespace) BETWEEN 1 AND 128 '
            'AND btrim(namespace, ''abcdefghijklmnopqrstuvwxyz0123456789._-'') = '''' '
            'AND strpos(''abcdefghijklmnopqrstuvwxyz0123456789'', left(namespace, 1)) > 0 '
            'AND octet_length(topic) BETWEEN 1 AND 128 '
            'AND btrim(topic, ''abcdefghijklmnopqrstuvwxyz0123456789._-'') = '''' '
            'AND strpos(''abcdefghijklmnopqrstuvwxyz0123456789'', left(topic, 1)) > 0)) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_dedupe_key_length_check CHECK (' || v_guard ||
            'octet_length(dedupe_key) <= 512) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_ordering_check CHECK (' || v_guard || '('
            '(ordering_key IS NULL) = (ordering_seq IS NULL) '
            'AND (ordering_key IS NULL OR (ordering_key <> '''' AND octet_length(ordering_key) <= 256 AND ordering_seq > 0)))) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_headers_check CHECK (' || v_guard ||
            'headers IS NULL OR (jsonb_typeof(headers) = ''object'' AND pg_column_size(headers) <= 65536)) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_tenant_key_check CHECK (' || v_guard ||
            'dedupe_key IS NULL '
            'OR CASE WHEN tenant_id IS NULL '
                'THEN dedupe_key !~* ''^([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/'' '
                'ELSE starts_with(dedupe_key, tenant_id::text || ''/'') END) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_payload_size_check CHECK (' || v_guard ||
            'pg_column_size(payload) <= ' || v_limit || ') NOT VALID';
END $migration$;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($function$
-- Owner only: the database's payload limit (stored jsonb size, bytes), on
-- new events (migration 0018).
CREATE OR REPLACE FUNCTION @s.modkit_outbox_set_payload_limit(p_bytes int) RETURNS void
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
BEGIN
    IF p_bytes IS NULL OR p_bytes < 1024 THEN
        RAISE EXCEPTION 'outbox: the payload limit must be at least 1024 bytes' USING ERRCODE = '22023';
    END IF;
    ALTER TABLE @s.modkit_outbox_events DROP CONSTRAINT modkit_outbox_events_payload_size_check;
    EXECUTE format('ALTER TABLE @s.modkit_outbox_events ADD CONSTRAINT modkit_outbox_events_payload_size_check '
        'CHECK (status <> ''pending'' OR attempts <> 0 OR pg_column_size(payload) <= %s) NOT VALID', p_bytes);
END $$;
$function$, '@s', s);
END $migration$;
