-- The payload limit applies to new events only (migration 0018): its check
-- holds for any row but a pending one with no attempt. But a row goes back
-- to that state later: a first attempt given back unpublished ('released',
-- attempts - 1) and a replay both leave it pending with no attempt. After
-- modkit_outbox_set_payload_limit lowered the limit below an event that
-- was enqueued under the old one, either write refused that event, and
-- with it every other outcome of the same write, over and over.
--
-- A new event is also one with no history yet: every write that puts a
-- row back to pending with no attempt appends a ledger row, so ledger_seq
-- tells the two apart. The check now holds for rows with a history too.
-- What a producer's INSERT may store is unchanged (ledger_seq is not a
-- column a producer writes: 0 by default, and the limit's check still
-- applies to it).
ALTER FUNCTION modkit_outbox_set_payload_limit(int) RENAME TO modkit_outbox_set_payload_limit_0018;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
    v_limit bigint;
BEGIN
    EXECUTE replace($function$
-- Owner only: the database's payload limit (stored jsonb size, bytes), on
-- new events: those with no attempt and no history (migration 0029).
CREATE FUNCTION @s.modkit_outbox_set_payload_limit(p_bytes int) RETURNS void
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
BEGIN
    IF p_bytes IS NULL OR p_bytes < 1024 THEN
        RAISE EXCEPTION 'outbox: the payload limit must be at least 1024 bytes' USING ERRCODE = '22023';
    END IF;
    ALTER TABLE @s.modkit_outbox_events DROP CONSTRAINT modkit_outbox_events_payload_size_check;
    EXECUTE format('ALTER TABLE @s.modkit_outbox_events ADD CONSTRAINT modkit_outbox_events_payload_size_check '
        'CHECK (status <> ''pending'' OR attempts <> 0 OR ledger_seq <> 0 OR pg_column_size(payload) <= %s) NOT VALID', p_bytes);
END $$;
$function$, '@s', s);

    SELECT substring(pg_catalog.pg_get_constraintdef(c.oid) FROM 'pg_column_size\(payload\) <= (\d+)')::bigint
    INTO v_limit
    FROM pg_catalog.pg_constraint c
    WHERE c.conrelid = (s || '.modkit_outbox_events')::regclass AND c.conname = 'modkit_outbox_events_payload_size_check';
    PERFORM modkit_outbox_set_payload_limit(coalesce(v_limit, 4194304)::int);
END $migration$;

-- Revokes PUBLIC's default EXECUTE on the new function (owner only).
SELECT modkit_outbox_grant_roles();
