"""The unprivileged role the app runs as, in one place.

docs/howto/operations.md ("Run under an unprivileged role") shows these statements (a
test holds the page's block to them), ``manage.py grant_app_role`` runs them for ``scripts/run``,
and ``tests/store/test_app_role.py`` runs them for its roles. The owner (the role that
migrates) runs them after every migration, so tables a migration adds are granted too.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db.backends.base.base import BaseDatabaseWrapper

# What the role is: a login and nothing more.
ATTRIBUTES = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS"

# Everything it is granted: DML on the app's tables, no TRUNCATE, TRIGGER or ownership,
# no temporary tables (the app needs none; PUBLIC holds TEMPORARY on a new database), no
# CREATE in the app's schema (PUBLIC holds it on a database made by PostgreSQL 14 or
# earlier: a function planted there could stand in for one the owner's functions call),
# and nothing on the deletion executor's presentations.
GRANTS = (
    "GRANT CONNECT ON DATABASE {database} TO {role}",
    "REVOKE TEMPORARY ON DATABASE {database} FROM PUBLIC",
    "REVOKE TEMPORARY ON DATABASE {database} FROM {role}",
    "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
    "REVOKE CREATE ON SCHEMA public FROM {role}",
    "GRANT USAGE ON SCHEMA public TO {role}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
    "REVOKE ALL ON wd_executor_presentations FROM {role}",
    "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}",
)

# The deletion executor's authority (``services.executor_writes``, ``services.purge_community``):
# granted only to an executor role, taken back from a role made without it.
EXECUTOR_FUNCTIONS = "FUNCTION wd_present_executor(uuid, bigint), wd_withdraw_executor()"
EXECUTOR_GRANT = f"GRANT EXECUTE ON {EXECUTOR_FUNCTIONS} TO {{role}}"
EXECUTOR_REVOKE = f"REVOKE EXECUTE ON {EXECUTOR_FUNCTIONS} FROM {{role}}"

# Table privileges that would let it step around the triggers or the schema.
FORBIDDEN_TABLE_PRIVILEGES = ("TRUNCATE", "TRIGGER", "REFERENCES")


class RoleRefused(Exception):
    """The named role exists but is not (and cannot be made, here) an unprivileged one."""


def create_statement(role: str, password: str | None = None) -> str:
    """``CREATE ROLE``; ``password`` is SQL text (a literal, or a placeholder)."""
    return f"CREATE ROLE {role} {ATTRIBUTES}" + (f" PASSWORD {password}" if password else "")


def grant_statements(database: str, role: str, *, executor: bool = False) -> list[str]:
    """The grants, for identifiers already quoted as the caller wants them."""
    statements = [*GRANTS, EXECUTOR_GRANT if executor else EXECUTOR_REVOKE]
    return [statement.format(database=database, role=role) for statement in statements]


def readme_sql(role: str = "buzz_app", database: str = "buzz") -> str:
    """The block docs/howto/operations.md "Run under an unprivileged role" shows."""
    lines = [
        create_statement(role, "'…'"),
        *(grant.format(database=database, role=role) for grant in GRANTS),
    ]
    return "".join(f"{line};\n" for line in lines)


def ensure_app_role(
    connection: BaseDatabaseWrapper,
    role: str,
    password: str | None = None,
    *,
    executor: bool = False,
) -> bool:
    """Create ``role`` (or bring it back to ``ATTRIBUTES``) and grant it ``GRANTS`` on
    the connection's database, as the connection's (owning) role; True when created.
    With ``executor`` it may also act as the deletion executor; without, that is
    taken back.

    Idempotent. A password given is set each time; none leaves the role's as it is.
    Raises ``RoleRefused`` when the role is the connection's own, belongs to another
    role, owns something here, holds a forbidden table privilege, or may still create
    temporary tables or create in the app's schema (PUBLIC's TEMPORARY or CREATE could
    not be revoked by this role).
    """
    quote: Callable[[str], str] = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user")
        if cursor.fetchone()[0] == role:
            raise RoleRefused(f"{role} is the role this connection migrates as, not an app role")
        cursor.execute(
            "SELECT rolsuper OR rolcreatedb OR rolcreaterole OR rolbypassrls OR NOT rolcanlogin "
            "FROM pg_roles WHERE rolname = %s",
            [role],
        )
        found = cursor.fetchone()
        if found is None:
            if password:
                cursor.execute(create_statement(quote(role), "%s"), [password])
            else:
                cursor.execute(create_statement(quote(role)))
        elif found[0]:
            cursor.execute(f"ALTER ROLE {quote(role)} {ATTRIBUTES}")
        if found is not None and password:
            cursor.execute(f"ALTER ROLE {quote(role)} PASSWORD %s", [password])
        database = quote(connection.settings_dict["NAME"])
        for statement in grant_statements(database, quote(role), executor=executor):
            cursor.execute(statement)
        problems = _problems(cursor, role)
    if problems:
        raise RoleRefused(f"{role} is not an unprivileged role: " + "; ".join(problems))
    return found is None


def _problems(cursor, role: str) -> list[str]:
    """What the role holds beyond ``GRANTS`` that would undo the point of it."""
    problems = []
    cursor.execute(
        "SELECT string_agg(r.rolname, ', ' ORDER BY r.rolname) FROM pg_auth_members m "
        "JOIN pg_roles r ON r.oid = m.roleid "
        "WHERE m.member = (SELECT oid FROM pg_roles WHERE rolname = %s)",
        [role],
    )
    if (member_of := cursor.fetchone()[0]) is not None:
        problems.append(f"member of {member_of} (revoke it)")
    cursor.execute(
        "SELECT string_agg(c.relname, ', ' ORDER BY c.relname) FROM pg_class c "
        "WHERE c.relowner = (SELECT oid FROM pg_roles WHERE rolname = %s) "
        "AND c.relkind IN ('r', 'p', 'v', 'm', 'S')",
        [role],
    )
    if (owned := cursor.fetchone()[0]) is not None:
        problems.append(f"owns {owned}")
    checks = " OR ".join(
        f"has_table_privilege(%s, c.oid, '{privilege}')" for privilege in FORBIDDEN_TABLE_PRIVILEGES
    )
    cursor.execute(
        "SELECT string_agg(c.relname, ', ' ORDER BY c.relname) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        f"WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND ({checks})",
        [role] * len(FORBIDDEN_TABLE_PRIVILEGES),
    )
    if (tables := cursor.fetchone()[0]) is not None:
        problems.append(f"holds {', '.join(FORBIDDEN_TABLE_PRIVILEGES)} on {tables} (revoke it)")
    cursor.execute("SELECT has_database_privilege(%s, current_database(), 'TEMPORARY')", [role])
    if cursor.fetchone()[0]:
        problems.append(
            "may create temporary tables (REVOKE TEMPORARY ON DATABASE … FROM PUBLIC, as its owner)"
        )
    cursor.execute("SELECT has_schema_privilege(%s, 'public', 'CREATE')", [role])
    if cursor.fetchone()[0]:
        problems.append(
            "may create in schema public (REVOKE CREATE ON SCHEMA public FROM PUBLIC, "
            "as the schema's owner, and from every role it is a member of)"
        )
    return problems
