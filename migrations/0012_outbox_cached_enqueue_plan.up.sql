-- The enqueue of one event runs on plans cached for the session, as the
-- claim without chains (0010) and the outcome write (0011) do. Its INSERT was
-- planned again on every call: PostgreSQL keeps choosing a fresh plan for a
-- statement whose fresh plans are estimated cheaper than the cached one, and
-- the INSERT's check of an ordering predecessor, with its sequence unknown,
-- is. Planning was a third of the function's time: on a scratch database, 4
-- connections enqueueing one event per transaction (asynchronous commit,
-- so that the server's CPU decides) reached 7,700-8,000 transactions a
-- second against 9,700-10,300 on cached plans, and 8 connections with
-- durable commits 4,300-4,400 against 5,200 (BENCHMARKS.md, "Enqueue on
-- cached plans").
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
