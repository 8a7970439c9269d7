-- Per-user credit quota: a turn reserves its estimate up front and settles
-- it when it is finalised.
CREATE TABLE minichat_quotas (
    tenant_id              uuid   NOT NULL,
    user_id                uuid   NOT NULL,
    credits_limit_micro    bigint NOT NULL CHECK (credits_limit_micro >= 0),
    credits_reserved_micro bigint NOT NULL DEFAULT 0 CHECK (credits_reserved_micro >= 0),
    credits_used_micro     bigint NOT NULL DEFAULT 0 CHECK (credits_used_micro >= 0),
    PRIMARY KEY (tenant_id, user_id)
);

CREATE TABLE minichat_chats (
    id         uuid        PRIMARY KEY,
    tenant_id  uuid        NOT NULL,
    user_id    uuid        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE minichat_turns (
    id                 uuid        PRIMARY KEY,
    chat_id            uuid        NOT NULL REFERENCES minichat_chats (id),
    tenant_id          uuid        NOT NULL,
    user_id            uuid        NOT NULL,
    request_id         text        NOT NULL,
    selected_model     text        NOT NULL,
    effective_model    text,
    state              text        NOT NULL DEFAULT 'running'
        CHECK (state IN ('running', 'completed', 'failed', 'cancelled', 'orphaned')),
    incomplete         boolean     NOT NULL DEFAULT false,
    reserved_micro     bigint      NOT NULL,
    input_tokens       bigint      NOT NULL DEFAULT 0,
    output_tokens      bigint      NOT NULL DEFAULT 0,
    cache_read_tokens  bigint      NOT NULL DEFAULT 0,
    cache_write_tokens bigint      NOT NULL DEFAULT 0,
    reasoning_tokens   bigint      NOT NULL DEFAULT 0,
    tool_calls         integer     NOT NULL DEFAULT 0,
    credits_micro      bigint      NOT NULL DEFAULT 0,
    billing_outcome    text,
    finalised_by       text,
    started_at         timestamptz NOT NULL DEFAULT now(),
    finalised_at       timestamptz,
    UNIQUE (tenant_id, request_id)
);
CREATE INDEX minichat_turns_running ON minichat_turns (started_at) WHERE state = 'running';

-- The usage collector's own table: one row per (tenant, turn, request), so a
-- redelivered event never counts twice.
CREATE TABLE minichat_usage_records (
    tenant_id          uuid        NOT NULL,
    turn_id            uuid        NOT NULL,
    request_id         text        NOT NULL,
    user_id            uuid        NOT NULL,
    chat_id            uuid        NOT NULL,
    event_id           uuid        NOT NULL,
    terminal_state     text        NOT NULL,
    billing_outcome    text        NOT NULL,
    input_tokens       bigint      NOT NULL,
    output_tokens      bigint      NOT NULL,
    cache_read_tokens  bigint      NOT NULL,
    cache_write_tokens bigint      NOT NULL,
    reasoning_tokens   bigint      NOT NULL,
    credits_micro      bigint      NOT NULL,
    recorded_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, turn_id, request_id)
);
