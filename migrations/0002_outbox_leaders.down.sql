DROP TABLE IF EXISTS modkit_outbox_leaders;
