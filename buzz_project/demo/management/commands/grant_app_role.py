"""Create (or correct) the unprivileged role the demo's app runs as, and grant it DML."""

from __future__ import annotations

import os
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections

from buzz_project.demo.app_role import RoleRefused, ensure_app_role

PASSWORD_VARIABLE = "APP_DATABASE_PASSWORD"


class Command(BaseCommand):
    help = (
        "As the role that migrated (DATABASE_URL's), create ROLE if it does not exist "
        "(LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS) and grant it the documented "
        "DML grants on every table and sequence of the database (no temporary tables, "
        "nothing on the executor's presentations): the role of docs/howto/operations.md "
        "'Run under an unprivileged role'. Run it again after each migration. Its password becomes "
        f"{PASSWORD_VARIABLE} when that is set."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("role", help="the application role, e.g. buzz_app")
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="database alias")
        parser.add_argument(
            "--executor",
            action="store_true",
            help="also let ROLE act as the deletion executor (purge a community); "
            "without it that is taken back",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        role = options["role"]
        connection = connections[options["database"]]
        if connection.settings_dict["USER"] == role:
            raise CommandError(
                f"connected as {role} itself: run this as the owner (unset APP_DATABASE_ROLE)"
            )
        try:
            created = ensure_app_role(
                connection,
                role,
                os.environ.get(PASSWORD_VARIABLE) or None,
                executor=options["executor"],
            )
        except RoleRefused as exc:
            raise CommandError(str(exc)) from exc
        database = connection.settings_dict["NAME"]
        executor = " (may act as the deletion executor)" if options["executor"] else ""
        self.stdout.write(
            f"app role {role} {'created' if created else 'kept'}; granted on {database}{executor}"
        )
