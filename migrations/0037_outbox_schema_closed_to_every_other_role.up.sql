-- The outbox's schema is closed to every other role, not only to PUBLIC and
-- the outbox's own roles.
--
-- Migration 0028 refuses a schema where PUBLIC, or one of the outbox's
-- runtime roles, may create objects: the outbox's functions run as their
-- owner, and a function created in their schema whose argument types match
-- exactly wins over pg_catalog's, so a role that may create objects there
-- could have its code run as the owner. Any other role may do the same: a
-- trial granted CREATE on the schema to a login role (a member of
-- modkit_outbox_producer, which the check does not look at), created
-- unnest(text[]) and cardinality(uuid[]) there, and an ordinary
-- EnqueueBatch ran them as the owner, a superuser.
--
-- This migration refuses a schema where any login role may create objects
-- that is not a superuser and cannot act as the migrating role (which owns
-- the functions), itself or through a role it inherits from (the database's
-- owner does, through pg_database_owner, on PostgreSQL 15's public).
-- modkit/db's migrator (Client.Migrate, modkit-outbox migrate up) checks the
-- same before migrating anything, and warns when an up-to-date schema is
-- open; golang-migrate, goose and psql learn of it here.
DO $migration$
DECLARE
    v_open text;
BEGIN
    SELECT CASE WHEN EXISTS (
            SELECT 1 FROM pg_catalog.aclexplode(coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) a
            WHERE a.grantee = 0 AND a.privilege_type = 'CREATE')
        THEN 'PUBLIC' ELSE (
            SELECT string_agg(quote_ident(r.rolname), ', ' ORDER BY r.rolname)
            FROM pg_catalog.pg_roles r
            WHERE r.rolcanlogin AND NOT r.rolsuper
              AND pg_catalog.has_schema_privilege(r.oid, n.oid, 'CREATE')
              AND NOT pg_catalog.pg_has_role(r.oid, current_user, 'MEMBER')) END
    INTO v_open
    FROM pg_catalog.pg_namespace n
    WHERE n.nspname = current_schema();
    IF v_open IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: schema % lets % create objects in it, whose functions the outbox''s functions could then run as their owner',
            quote_ident(current_schema()), v_open
            USING ERRCODE = '42501',
                  HINT = format('REVOKE CREATE ON SCHEMA %I FROM %s, or migrate the outbox into a schema of its own; then migrate again',
                                current_schema(), v_open);
    END IF;
END $migration$;
