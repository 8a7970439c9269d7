DO $migration$
DECLARE
    r text;
BEGIN
    IF pg_catalog.to_regclass('modkit_schema_migrations') IS NOT NULL THEN
        FOR r IN SELECT rolname FROM pg_catalog.pg_roles
            WHERE rolname IN ('modkit_outbox_producer', 'modkit_outbox_dispatcher', 'modkit_outbox_operator', 'modkit_outbox_reader')
        LOOP
            EXECUTE pg_catalog.format('REVOKE SELECT ON modkit_schema_migrations FROM %I', r);
        END LOOP;
    END IF;
END $migration$;
DROP FUNCTION modkit_outbox_grant_roles();
ALTER FUNCTION modkit_outbox_grant_roles_0035() RENAME TO modkit_outbox_grant_roles;
