-- The reads of the backlog keep to the indexes that hold it, whatever the
-- planner's costs.
--
-- modkit_outbox_backlog (Admin.Backlog and Admin.Unserved: the CLI's stats,
-- the dashboard's overview), modkit_outbox_depth (the dispatchers' gauges,
-- every second or so) and modkit_outbox_sweep (each maintenance pass) read
-- the pending and leased events from the claim index, the held ones from
-- the held index and the dead ones from the settled index, so that the
-- delivered events kept are not read. A trial with 5.4 million events kept
-- and 362,000 pending (most waiting for their retries) found the planner
-- preferring a sequential scan of the whole table for all three: 5.4
-- million rows read (408,000 buffers, 2-9 s) by the sweep and the gauges
-- of a dispatcher serving one quiet topic, on every pass, and by each load
-- of the dashboard's overview, twice; the claim index's bitmap scan read
-- 33,000 buffers (0.7 s) for the same backlog read.
--
-- Sequential scans are turned off inside the three functions, as they are
-- in the claim and outcome functions: the indexes are read whatever the
-- table's statistics say. Nothing else in them changes.
ALTER FUNCTION modkit_outbox_backlog(timestamptz) SET enable_seqscan = off;
ALTER FUNCTION modkit_outbox_depth(text[], timestamptz) SET enable_seqscan = off;
ALTER FUNCTION modkit_outbox_sweep(text[], integer, integer, timestamptz) SET enable_seqscan = off;
