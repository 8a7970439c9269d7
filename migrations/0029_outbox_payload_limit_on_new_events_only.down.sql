-- Back to migration 0018's payload check, at the limit in force.
DO $migration$
DECLARE
    v_limit bigint;
BEGIN
    SELECT substring(pg_catalog.pg_get_constraintdef(c.oid) FROM 'pg_column_size\(payload\) <= (\d+)')::bigint
    INTO v_limit
    FROM pg_catalog.pg_constraint c
    WHERE c.conrelid = (quote_ident(current_schema()) || '.modkit_outbox_events')::regclass
      AND c.conname = 'modkit_outbox_events_payload_size_check';
    DROP FUNCTION modkit_outbox_set_payload_limit(int);
    ALTER FUNCTION modkit_outbox_set_payload_limit_0018(int) RENAME TO modkit_outbox_set_payload_limit;
    PERFORM modkit_outbox_set_payload_limit(coalesce(v_limit, 4194304)::int);
END $migration$;
