-- Back to checks evaluated on every row written (migration 0017's), with
-- the payload limit kept at its value. The checks come back NOT VALID
-- (0001 and 0004 created three of them valid): no scan of existing rows.
DO $migration$
DECLARE
    v_limit bigint;
BEGIN
    SELECT substring(pg_catalog.pg_get_constraintdef(c.oid) FROM 'pg_column_size\(payload\) <= (\d+)')::bigint
    INTO v_limit
    FROM pg_catalog.pg_constraint c
    WHERE c.conrelid = 'modkit_outbox_events'::regclass AND c.conname = 'modkit_outbox_events_payload_size_check';
    IF v_limit IS NULL THEN
        RAISE EXCEPTION 'outbox migration 0018 down: modkit_outbox_events_payload_size_check not found or not in the form migration 0018 wrote'
            USING HINT = 'restore the check with SELECT modkit_outbox_set_payload_limit(bytes) before migrating down';
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
        'ADD CONSTRAINT modkit_outbox_events_names_check CHECK (namespace <> '''' AND topic <> '''') NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_dedupe_key_check CHECK (dedupe_key IS NULL OR dedupe_key <> '''') NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_name_pattern_check CHECK ('
            'octet_length(namespace) BETWEEN 1 AND 128 '
            'AND btrim(namespace, ''abcdefghijklmnopqrstuvwxyz0123456789._-'') = '''' '
            'AND strpos(''abcdefghijklmnopqrstuvwxyz0123456789'', left(namespace, 1)) > 0 '
            'AND octet_length(topic) BETWEEN 1 AND 128 '
            'AND btrim(topic, ''abcdefghijklmnopqrstuvwxyz0123456789._-'') = '''' '
            'AND strpos(''abcdefghijklmnopqrstuvwxyz0123456789'', left(topic, 1)) > 0) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_dedupe_key_length_check CHECK (octet_length(dedupe_key) <= 512) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_ordering_check CHECK ('
            '(ordering_key IS NULL) = (ordering_seq IS NULL) '
            'AND (ordering_key IS NULL OR (ordering_key <> '''' AND octet_length(ordering_key) <= 256 AND ordering_seq > 0))) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_headers_check CHECK ('
            'headers IS NULL OR (jsonb_typeof(headers) = ''object'' AND pg_column_size(headers) <= 65536)) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_tenant_key_check CHECK ('
            'dedupe_key IS NULL '
            'OR CASE WHEN tenant_id IS NULL '
                'THEN dedupe_key !~* ''^([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/'' '
                'ELSE starts_with(dedupe_key, tenant_id::text || ''/'') END) NOT VALID, '
        'ADD CONSTRAINT modkit_outbox_events_payload_size_check CHECK (pg_column_size(payload) <= ' || v_limit || ') NOT VALID';
END $migration$;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($function$
CREATE OR REPLACE FUNCTION @s.modkit_outbox_set_payload_limit(p_bytes int) RETURNS void
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
BEGIN
    IF p_bytes IS NULL OR p_bytes < 1024 THEN
        RAISE EXCEPTION 'outbox: the payload limit must be at least 1024 bytes' USING ERRCODE = '22023';
    END IF;
    ALTER TABLE @s.modkit_outbox_events DROP CONSTRAINT modkit_outbox_events_payload_size_check;
    EXECUTE format('ALTER TABLE @s.modkit_outbox_events ADD CONSTRAINT modkit_outbox_events_payload_size_check CHECK (pg_column_size(payload) <= %s) NOT VALID', p_bytes);
END $$;
$function$, '@s', s);
END $migration$;
