-- Back to migration 0018's seven checks on new events, each its own
-- expression, re-created NOT VALID (each existing row satisfied the check
-- that replaced them, which implies them).
ALTER TABLE modkit_outbox_events
    DROP CONSTRAINT modkit_outbox_events_message_check,
    ADD CONSTRAINT modkit_outbox_events_names_check CHECK (status <> 'pending' OR attempts <> 0
        OR (namespace <> '' AND topic <> '')) NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_dedupe_key_check CHECK (status <> 'pending' OR attempts <> 0
        OR dedupe_key IS NULL OR dedupe_key <> '') NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_name_pattern_check CHECK (status <> 'pending' OR attempts <> 0 OR (
        octet_length(namespace) BETWEEN 1 AND 128
        AND btrim(namespace, 'abcdefghijklmnopqrstuvwxyz0123456789._-') = ''
        AND strpos('abcdefghijklmnopqrstuvwxyz0123456789', left(namespace, 1)) > 0
        AND octet_length(topic) BETWEEN 1 AND 128
        AND btrim(topic, 'abcdefghijklmnopqrstuvwxyz0123456789._-') = ''
        AND strpos('abcdefghijklmnopqrstuvwxyz0123456789', left(topic, 1)) > 0)) NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_dedupe_key_length_check CHECK (status <> 'pending' OR attempts <> 0
        OR octet_length(dedupe_key) <= 512) NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_ordering_check CHECK (status <> 'pending' OR attempts <> 0 OR (
        (ordering_key IS NULL) = (ordering_seq IS NULL)
        AND (ordering_key IS NULL OR (ordering_key <> '' AND octet_length(ordering_key) <= 256 AND ordering_seq > 0)))) NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_headers_check CHECK (status <> 'pending' OR attempts <> 0
        OR headers IS NULL OR (jsonb_typeof(headers) = 'object' AND pg_column_size(headers) <= 65536)) NOT VALID,
    ADD CONSTRAINT modkit_outbox_events_tenant_key_check CHECK (status <> 'pending' OR attempts <> 0
        OR dedupe_key IS NULL
        OR CASE WHEN tenant_id IS NULL
            THEN dedupe_key !~* '^([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/'
            ELSE starts_with(dedupe_key, tenant_id::text || '/') END) NOT VALID;

DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0005() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_message_ok(text, text, uuid, text, text, int, text, bigint);
SELECT modkit_outbox_grant_roles();
