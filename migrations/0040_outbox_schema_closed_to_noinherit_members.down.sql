-- Migration 0040 only checked the schema; there is nothing to undo.
SELECT 1;
