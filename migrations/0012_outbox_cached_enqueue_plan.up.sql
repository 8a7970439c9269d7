-- The enqueue of one event runs on plans cached for the session, as the
-- claim without chains (0010) and the outcome write (0011) do. Under the
-- default plan_cache_mode a connection may plan a statement afresh on every
-- call (PostgreSQL does so while the fresh plans are estimated cheaper than
-- the cached one), and whether the enqueue's connections did varied from
-- run to run: the same benchmark ran at 5,100-5,300 or at 3,200-3,900
-- enqueues a second. Planning took a fifth to a half of the function's
-- time: on a scratch database, 4 connections enqueueing one event per
-- transaction (asynchronous commit, so that the server's CPU decides)
-- reached 7,700-8,300 transactions a second against 9,650-10,300 on cached
-- plans, and 8 connections with durable commits 4,340-4,420 against
-- 5,180-5,230; under a benchmark's load the function took 357 us a call
-- against 165 us (BENCHMARKS.md, "Enqueue on cached plans").
--
-- A cached (generic) plan is costed from the statistics and the table's size
-- when it is made, and made on a table analyzed while empty it reads the
-- whole table: the ordering predecessor's check and the duplicate's lookup
-- then read every row, once the table is full (80,012 rows read for three
-- enqueues into a table of 40,000 events, on a scratch database). So the
-- function's statements run with sequential and bitmap scans off: each one
-- names its rows by a unique key (the event's dedupe key, the key's stream
-- and sequence, the key's sequence row), and an index scan of that key is
-- then its only plan. What the function writes, returns and refuses is
-- unchanged; the batch enqueue (modkit_outbox_enqueue_many) calls it for
-- events with an ordering key and so runs those on cached plans too.
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text)
    SET enable_seqscan = off;
ALTER FUNCTION modkit_outbox_enqueue(uuid, text, text, uuid, text, jsonb, boolean, jsonb, text)
    SET enable_bitmapscan = off;
