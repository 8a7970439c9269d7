-- The outbox's functions run as their owner (SECURITY DEFINER) with the
-- search_path set to the outbox's schema, then pg_temp. PostgreSQL picks
-- the best match among the functions and operators visible there, and one
-- created in that schema whose argument types match exactly (a
-- cardinality(uuid[]), say) wins over pg_catalog's generic one: a role
-- that may create objects in the schema could have its code run as the
-- owner inside a claim or an outcome write, and read or change every
-- event. PostgreSQL 14 and earlier let every role create objects in the
-- public schema (15 no longer does), and a database upgraded from one
-- keeps that grant. So the outbox is not migrated into a schema where
-- PUBLIC, or one of its own runtime roles, may create objects: revoke
-- that, or give the outbox a schema of its own.
DO $migration$
DECLARE
    v_open text;
BEGIN
    SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END, ', '
                      ORDER BY CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE r.rolname END)
    INTO v_open
    FROM pg_catalog.pg_namespace n
    CROSS JOIN LATERAL pg_catalog.aclexplode(coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) a
    LEFT JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
    WHERE n.nspname = current_schema() AND a.privilege_type = 'CREATE'
      AND (a.grantee = 0 OR r.rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher',
                                          'modkit_outbox_reader', 'modkit_outbox_operator'));
    IF v_open IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: schema % lets % create objects in it, whose functions the outbox''s functions could then run as their owner',
            quote_ident(current_schema()), v_open
            USING ERRCODE = '42501',
                  HINT = format('REVOKE CREATE ON SCHEMA %I FROM %s (PostgreSQL 15''s default for public), or migrate the outbox into a schema of its own; then migrate again',
                                current_schema(), v_open);
    END IF;
END $migration$;
