"""Every function of the app's schema resolves names in pg_catalog, then that schema,
then (explicitly, so last) pg_temp: a function planted in the app's schema can never
stand in for a catalog function, nor a session's temporary table for one of the app's
tables, inside a trigger or a SECURITY DEFINER function. A migration that adds or
replaces a function without that pin fails here."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

pytestmark = pytest.mark.django_db


def unpinned_functions() -> list[tuple[str, list[str] | None]]:
    """The functions of the schema the app was migrated into (an extension's aside)
    whose search_path is not ``pg_catalog, <schema>, pg_temp``, with their settings."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT p.oid::regprocedure::text, p.proconfig
              FROM pg_proc p
             WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
               AND NOT EXISTS (
                   SELECT 1 FROM pg_depend d
                    WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
               )
               AND NOT coalesce(p.proconfig, '{}') @> ARRAY[
                   'search_path=pg_catalog, ' || quote_ident(current_schema()) || ', pg_temp'
               ]
             ORDER BY 1
            """
        )
        return cursor.fetchall()


def app_functions() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT proname FROM pg_proc WHERE pronamespace = "
            "(SELECT oid FROM pg_namespace WHERE nspname = current_schema()) ORDER BY 1"
        )
        return [name for (name,) in cursor.fetchall()]


def test_every_function_of_the_apps_schema_pins_its_search_path():
    # The fence's functions are among them (the check is not vacuous).
    assert {
        "community_write_allowed",
        "wd_enforce_community_write_fence",
        "wd_holds_community_deletion_lock",
        "wd_present_executor",
    } <= set(app_functions())
    assert unpinned_functions() == []


def test_a_function_replaced_without_the_pin_fails_the_check():
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE OR REPLACE FUNCTION wd_community_deletion_key(p_community_id uuid) "
                "RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT "
                "hashtextextended('workflow_delivery.community_deletion:' || "
                "p_community_id::text, 0) $$"
            )
        assert unpinned_functions() == [("wd_community_deletion_key(uuid)", None)]
        transaction.set_rollback(True)
    assert unpinned_functions() == []
