-- The outbox's schema is closed to the members of a role that may create
-- objects in it, even when they do not inherit its rights.
--
-- Migration 0037 refuses a schema where a login role may create objects
-- (itself, or through a role it inherits from) unless it is a superuser or
-- can act as the migrating role: the outbox's functions run as their owner,
-- and a function created in their schema whose argument types match a call
-- exactly wins over pg_catalog's. A security review went past that check: a
-- login role that is a NOINHERIT member of a role holding CREATE on the
-- schema has no such privilege of its own, yet may SET ROLE to it, create
-- unnest(text[]) in the schema, and have an ordinary EnqueueBatch run it as
-- the owner. This migration refuses such a schema too; modkit/db's migrator
-- (Client.Migrate, modkit-outbox migrate up) checks the same before
-- migrating anything, and warns when an up-to-date schema is open.
DO $migration$
DECLARE
    v_open text;
BEGIN
    SELECT string_agg(quote_ident(r.rolname), ', ' ORDER BY r.rolname)
    INTO v_open
    FROM pg_catalog.pg_namespace n, pg_catalog.pg_roles r
    WHERE n.nspname = current_schema()
      AND r.rolcanlogin AND NOT r.rolsuper
      AND NOT pg_catalog.pg_has_role(r.oid, current_user, 'MEMBER')
      AND EXISTS (
          SELECT 1 FROM pg_catalog.aclexplode(coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) g
          WHERE g.privilege_type = 'CREATE' AND g.grantee <> 0 AND pg_catalog.pg_has_role(r.oid, g.grantee, 'MEMBER'));
    IF v_open IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: schema % lets % create objects in it (as members of a role that may), whose functions the outbox''s functions could then run as their owner',
            quote_ident(current_schema()), v_open
            USING ERRCODE = '42501',
                  HINT = format('REVOKE CREATE ON SCHEMA %I from the roles they are members of, or migrate the outbox into a schema of its own; then migrate again',
                                current_schema());
    END IF;
END $migration$;
