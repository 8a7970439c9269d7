-- 0028 only checked the schema: nothing to undo.
SELECT 1;
