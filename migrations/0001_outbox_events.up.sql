-- The transactional outbox table of seed 004 §1.6, plus the fencing token of
-- the payment hardening (lease_token). Rows are written only by the modkit
-- outbox package; updated_at is set by that code on every transition (no
-- trigger, as the seed requires).
CREATE TABLE modkit_outbox_events (
    id              uuid        PRIMARY KEY,
    namespace       text        NOT NULL,
    topic           text        NOT NULL,
    tenant_id       uuid        NULL,
    dedupe_key      text        NULL,
    payload         jsonb       NOT NULL,
    status          text        NOT NULL DEFAULT 'pending',
    attempts        int         NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    locked_by       uuid        NULL,
    locked_until    timestamptz NULL,
    last_error      text        NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- Fresh on every claim; ack and nack must present it (fencing).
    lease_token     uuid        NULL,

    CONSTRAINT modkit_outbox_events_status_check
        CHECK (status IN ('pending', 'processing', 'delivered', 'dead')),
    CONSTRAINT modkit_outbox_events_attempts_check CHECK (attempts >= 0),
    CONSTRAINT modkit_outbox_events_names_check
        CHECK (namespace <> '' AND topic <> ''),
    CONSTRAINT modkit_outbox_events_dedupe_key_check
        CHECK (dedupe_key IS NULL OR dedupe_key <> ''),
    -- A lease is all three columns or none of them, and only processing rows
    -- hold one.
    CONSTRAINT modkit_outbox_events_lease_check CHECK (
        (locked_by IS NULL AND locked_until IS NULL AND lease_token IS NULL)
        OR (status = 'processing' AND locked_by IS NOT NULL
            AND locked_until IS NOT NULL AND lease_token IS NOT NULL)
    )
) WITH (
    -- Every event is updated twice (claim, outcome); leave room for HOT
    -- updates and keep the table vacuumed while it churns.
    fillfactor = 85,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);

-- The seed's minimum indexes.
CREATE INDEX modkit_outbox_events_status_next_attempt_idx
    ON modkit_outbox_events (status, next_attempt_at);
-- Only leased rows have a locked_until; NULLs would only bloat the index.
CREATE INDEX modkit_outbox_events_locked_until_idx
    ON modkit_outbox_events (locked_until) WHERE locked_until IS NOT NULL;

-- Idempotent enqueue: at most one row per (namespace, topic, dedupe_key), for
-- as long as the row exists.
CREATE UNIQUE INDEX modkit_outbox_events_dedupe_idx
    ON modkit_outbox_events (namespace, topic, dedupe_key)
    WHERE dedupe_key IS NOT NULL;

-- The claim walks this index in the seed's deterministic order. Delivered and
-- dead rows are not in it, so a table full of history does not slow claims.
CREATE INDEX modkit_outbox_events_claim_idx
    ON modkit_outbox_events (created_at, id)
    WHERE status IN ('pending', 'processing');
