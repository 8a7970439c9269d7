-- Back to migration 0004's name check with regular expressions.
ALTER TABLE modkit_outbox_events
    DROP CONSTRAINT modkit_outbox_events_name_pattern_check,
    ADD CONSTRAINT modkit_outbox_events_name_pattern_check
        CHECK (namespace ~ '^[a-z0-9][a-z0-9._-]{0,127}$' AND topic ~ '^[a-z0-9][a-z0-9._-]{0,127}$') NOT VALID;
