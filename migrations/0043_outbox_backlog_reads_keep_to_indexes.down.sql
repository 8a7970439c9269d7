ALTER FUNCTION modkit_outbox_sweep(text[], integer, integer, timestamptz) RESET enable_seqscan;
ALTER FUNCTION modkit_outbox_depth(text[], timestamptz) RESET enable_seqscan;
ALTER FUNCTION modkit_outbox_backlog(timestamptz) RESET enable_seqscan;
