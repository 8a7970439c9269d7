-- The outbox's roles may read the migrations table, so that an application
-- whose login holds only them may keep migrating at start
-- (outbox.WithMigrations, Client.Migrate): on a schema that is up to date
-- Migrate reads the table, finds nothing to apply and does nothing. It
-- failed instead with "permission denied for table modkit_schema_migrations"
-- (a user trial), though the docs say it does nothing then. With migrations
-- to apply, such a login still may not run them (it may create nothing in
-- the schema): Migrate fails, saying that the owner must migrate.
--
-- The table is Client.Migrate's and modkit-outbox migrate up's; files run
-- by golang-migrate, goose or psql keep their own, and nothing is granted.
-- Versions and names of migrations are all it holds.
ALTER FUNCTION modkit_outbox_grant_roles() RENAME TO modkit_outbox_grant_roles_0035;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE replace($functions$
-- Grants the outbox roles that exist what they may run (see migration
-- 0004); since migration 0041 each may read the migrations table.
CREATE FUNCTION @s.modkit_outbox_grant_roles() RETURNS text[]
LANGUAGE plpgsql SET search_path = @s, pg_temp AS $$
DECLARE
    granted text[] := @s.modkit_outbox_grant_roles_0035();
    r text;
BEGIN
    IF pg_catalog.to_regclass('@s.modkit_schema_migrations') IS NOT NULL THEN
        FOREACH r IN ARRAY granted LOOP
            EXECUTE pg_catalog.format('GRANT SELECT ON @s.modkit_schema_migrations TO %I', r);
        END LOOP;
    END IF;
    RETURN granted;
END $$;
$functions$, '@s', s);
END $migration$;

SELECT modkit_outbox_grant_roles();
