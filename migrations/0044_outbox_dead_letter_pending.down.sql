-- Back to migration 0041's grants and history check, without the
-- dead-lettering of pending events. Events dead-lettered stay dead, and
-- their history entries stay: the check is put back NOT VALID, as those
-- rows do not meet it.
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0041() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_dead_letter_filter(text, text, text, uuid, timestamptz, timestamptz, timestamptz, uuid, int, text, timestamptz),
    modkit_outbox_dead_letter(uuid[], text, timestamptz);
ALTER TABLE modkit_outbox_attempts DROP CONSTRAINT modkit_outbox_attempts_outcome_check;
ALTER TABLE modkit_outbox_attempts ADD CONSTRAINT modkit_outbox_attempts_outcome_check
    CHECK (outcome IN ('delivered', 'retry', 'dead', 'released', 'lease_expired', 'swept', 'replayed', 'skipped', 'purged')) NOT VALID;
SELECT modkit_outbox_grant_roles();
