-- The usage event reports tool calls per tool: keep the breakdown on the
-- turn, so the event can be rebuilt from the row alone (see
-- chat.Service.ResendUsage).
ALTER TABLE minichat_turns
    ADD COLUMN web_search_calls integer NOT NULL DEFAULT 0,
    ADD COLUMN code_exec_calls  integer NOT NULL DEFAULT 0;
