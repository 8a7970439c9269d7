-- Back to waiting for locked rows when letting held events in.
DO $migration$
DECLARE
    f record;
BEGIN
    FOR f IN
        SELECT p.oid, x.old, x.new
        FROM pg_catalog.pg_proc p
        JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
        JOIN (VALUES
            ('modkit_outbox_release_held',
             E'        LIMIT p_limit\n        FOR UPDATE OF e SKIP LOCKED)\n    UPDATE ',
             E'        LIMIT p_limit)\n    UPDATE '),
            ('modkit_outbox_complete',
             E'AND x.ordering_seq = f.seq + 1 AND x.held\n                FOR UPDATE SKIP LOCKED) n))',
             E'AND x.ordering_seq = f.seq + 1 AND x.held) n))'),
            ('modkit_outbox_sweep',
             'the worker crashed, its publish outlived the lease, or its outcome could not be recorded before the lease ended (the database slow or unavailable)',
             'the worker crashed or its publish outlived the lease')
        ) AS x(name, old, new) ON x.name = p.proname
        WHERE n.nspname = current_schema()
    LOOP
        EXECUTE replace(pg_catalog.pg_get_functiondef(f.oid), f.old, f.new);
    END LOOP;
END $migration$;
