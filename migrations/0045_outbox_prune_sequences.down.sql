-- Back to migration 0044's grants, without the prune of sequence rows.
-- Rows pruned stay pruned: their keys start again at sequence 1 when used.
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0044() RENAME TO modkit_outbox_grant_roles;
DROP FUNCTION modkit_outbox_prunable_sequences(), modkit_outbox_prune_sequences(int, bigint);
SELECT modkit_outbox_grant_roles();
