-- The seven checks on a new event's message columns become one, whose
-- rules live in a function (modkit_outbox_message_ok). What is refused is
-- unchanged, and a refusal still names the constraint of the rule broken
-- (modkit_outbox_events_names_check, ..._tenant_key_check): the function
-- raises the check violation itself.
--
-- Why: PostgreSQL reads every CHECK expression of a table back from its
-- stored text, and plans it, once for each statement that inserts or
-- updates rows, and every constant in that text is stored byte by byte
-- (the name check's alphabet, the tenant key's pattern). The seven checks
-- made that the largest fixed cost of a one-row statement: one-row INSERTs
-- ran at 7,200-7,700/s against 11,700-15,700/s without the seven, and
-- one-row UPDATEs (which evaluate every check as well, though the guard
-- below skips their rules) at 8,100-8,400/s against 12,600-15,300/s
-- (pgbench, local PostgreSQL 15, asynchronous commits; BENCHMARKS.md,
-- "The checks' fixed cost"). With one short expression and a function,
-- whose body PL/pgSQL parses once a session: 9,900-11,600 and
-- 13,400-15,200/s (and, in later rounds of this function as written here,
-- one-row INSERTs at 10,300-13,200/s against the seven checks'
-- 8,200-9,600/s). Enqueues of one event, claims and outcome writes at
-- moderate rates are such statements. A row of a statement of many rows
-- (COPY, a drain's claim) costs no more than before: 100-row INSERTs ran
-- at 57,700-71,400 rows/s against 44,000-58,900.
--
-- The rules, each as migration 0018 wrote it, apply to new events only
-- (status 'pending' with no attempt, see 0018). The payload limit keeps
-- its own constraint (modkit_outbox_set_payload_limit rewrites it); the
-- checks on the state columns stay as they are.
--
-- The function is called with the privileges of the role that writes the
-- row (a producer's INSERT or COPY), so every role may execute it: it reads
-- nothing but its arguments and changes nothing. It runs with its own
-- search_path, so a writer's search_path cannot change what its rules
-- mean. The new constraint is NOT VALID: each existing row satisfied the
-- seven checks it replaces, which imply it.
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($function$
-- Whether a new event's message columns keep the rules of migration 0018's
-- checks; raises the check violation of the first rule broken, naming that
-- rule's constraint. The rules are tried in the order PostgreSQL evaluated
-- the seven constraints (by name), so a row that breaks several is refused
-- under the name it was refused under before. A rule holds when it is true
-- or unknown (NULL), as a CHECK constraint does. Called by
-- modkit_outbox_events_message_check.
CREATE FUNCTION @s.modkit_outbox_message_ok(
    p_namespace text, p_topic text, p_tenant_id uuid, p_dedupe_key text,
    p_headers_type text, p_headers_size int, p_ordering_key text, p_ordering_seq bigint)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_broken text;
BEGIN
    -- One expression, not an IF per rule: PL/pgSQL prepares each
    -- expression once a transaction and evaluates each with a call of its
    -- own (an IF per rule made one-row INSERTs about 7% slower and 100-row
    -- INSERTs 16%; BENCHMARKS.md).
    v_broken := CASE
        WHEN (p_dedupe_key IS NULL OR p_dedupe_key <> '') IS FALSE THEN 'dedupe_key_check'
        WHEN (octet_length(p_dedupe_key) <= 512) IS FALSE THEN 'dedupe_key_length_check'
        WHEN (p_headers_type IS NULL OR (p_headers_type = 'object' AND p_headers_size <= 65536)) IS FALSE THEN 'headers_check'
        WHEN (octet_length(p_namespace) BETWEEN 1 AND 128
            AND btrim(p_namespace, 'abcdefghijklmnopqrstuvwxyz0123456789._-') = ''
            AND strpos('abcdefghijklmnopqrstuvwxyz0123456789', left(p_namespace, 1)) > 0
            AND octet_length(p_topic) BETWEEN 1 AND 128
            AND btrim(p_topic, 'abcdefghijklmnopqrstuvwxyz0123456789._-') = ''
            AND strpos('abcdefghijklmnopqrstuvwxyz0123456789', left(p_topic, 1)) > 0) IS FALSE THEN 'name_pattern_check'
        WHEN (p_namespace <> '' AND p_topic <> '') IS FALSE THEN 'names_check'
        WHEN ((p_ordering_key IS NULL) = (p_ordering_seq IS NULL)
            AND (p_ordering_key IS NULL
                OR (p_ordering_key <> '' AND octet_length(p_ordering_key) <= 256 AND p_ordering_seq > 0))) IS FALSE THEN 'ordering_check'
        WHEN (p_dedupe_key IS NULL
            OR CASE WHEN p_tenant_id IS NULL
                THEN p_dedupe_key !~* '^([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/'
                ELSE starts_with(p_dedupe_key, p_tenant_id::text || '/') END) IS FALSE THEN 'tenant_key_check'
    END;
    IF v_broken IS NULL THEN
        RETURN true;
    END IF;
    RAISE EXCEPTION 'new row for relation "modkit_outbox_events" violates check constraint "modkit_outbox_events_%"', v_broken
        USING ERRCODE = 'check_violation', CONSTRAINT = 'modkit_outbox_events_' || v_broken,
            TABLE = 'modkit_outbox_events',
            HINT = 'write events through the outbox client or the enqueue functions, which check names, keys and headers first';
END $$;
$function$, '@s', s);
END $migration$;

ALTER TABLE modkit_outbox_events
    DROP CONSTRAINT modkit_outbox_events_names_check,
    DROP CONSTRAINT modkit_outbox_events_dedupe_key_check,
    DROP CONSTRAINT modkit_outbox_events_name_pattern_check,
    DROP CONSTRAINT modkit_outbox_events_dedupe_key_length_check,
    DROP CONSTRAINT modkit_outbox_events_ordering_check,
    DROP CONSTRAINT modkit_outbox_events_headers_check,
    DROP CONSTRAINT modkit_outbox_events_tenant_key_check,
    ADD CONSTRAINT modkit_outbox_events_message_check CHECK (status <> 'pending' OR attempts <> 0
        OR modkit_outbox_message_ok(namespace, topic, tenant_id, dedupe_key, jsonb_typeof(headers),
            pg_column_size(headers), ordering_key, ordering_seq)) NOT VALID;

-- Every role that may write an event executes the check's function, so
-- modkit_outbox_grant_roles, which takes EXECUTE on the outbox's functions
-- from PUBLIC, gives this one back.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0005;
DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($function$
-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0020 every role may execute the function of the
-- message check.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0005();
BEGIN
    GRANT EXECUTE ON FUNCTION @s.modkit_outbox_message_ok(text, text, uuid, text, text, int, text, bigint) TO PUBLIC;
    RETURN granted;
END $$;
$function$, '@s', s);
END $migration$;
SELECT modkit_outbox_grant_roles();
