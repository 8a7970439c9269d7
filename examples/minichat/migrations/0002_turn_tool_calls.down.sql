ALTER TABLE minichat_turns
    DROP COLUMN web_search_calls,
    DROP COLUMN code_exec_calls;
