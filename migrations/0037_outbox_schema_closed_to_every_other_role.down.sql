-- Migration 0037 only checked the schema; there is nothing to undo.
SELECT 1;
