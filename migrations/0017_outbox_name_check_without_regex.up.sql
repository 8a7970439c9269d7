-- The check on event names without regular expressions. PostgreSQL
-- evaluates every CHECK constraint of a table on every row an UPDATE
-- writes, whether or not the columns it reads changed, and the name
-- pattern check of migration 0004 ran two regular expressions (namespace
-- and topic) each time: about 4.3 us an update on this kind of machine, so
-- about 40% of a claim's time and a quarter of an outcome write's, for
-- names that no claim or outcome changes (BENCHMARKS.md, "Name checks
-- without regular expressions"). The same rule, ^[a-z0-9][a-z0-9._-]{0,127}$,
-- written with string functions costs about 0.6 us: 1 to 128 bytes, every
-- character one of a-z, 0-9, '.', '_' and '-' (so every character is one
-- byte), the first a letter or a digit. The two forms agreed on 212,210
-- strings (every string of up to three characters from a set of 23 edge
-- characters, lengths around 128, random ones); TestNameCheckMatchesPattern
-- holds them together.
--
-- NOT VALID, as the check it replaces: rows written before migration 0004
-- are not re-checked, every new or updated row is.
ALTER TABLE modkit_outbox_events
    DROP CONSTRAINT modkit_outbox_events_name_pattern_check,
    ADD CONSTRAINT modkit_outbox_events_name_pattern_check CHECK (
        octet_length(namespace) BETWEEN 1 AND 128
        AND btrim(namespace, 'abcdefghijklmnopqrstuvwxyz0123456789._-') = ''
        AND strpos('abcdefghijklmnopqrstuvwxyz0123456789', left(namespace, 1)) > 0
        AND octet_length(topic) BETWEEN 1 AND 128
        AND btrim(topic, 'abcdefghijklmnopqrstuvwxyz0123456789._-') = ''
        AND strpos('abcdefghijklmnopqrstuvwxyz0123456789', left(topic, 1)) > 0) NOT VALID;
