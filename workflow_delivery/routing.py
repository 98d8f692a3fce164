"""Several databases: each community wholly in one of them.

Every key leads with ``community_id``, so a community's rows can live apart from other
communities' rows. ``WORKFLOW_DELIVERY_COMMUNITY_DATABASES`` maps a community id to the
alias holding it (unlisted communities: ``"default"``). Pass that alias as ``using=`` to
the services (``database_for_community`` answers it) and add the router to send the
ORM's reads and writes of a community's rows to the same database::

    DATABASE_ROUTERS = ["workflow_delivery.routing.CommunityRouter"]

The router routes what Django routes with an instance (``save()``, related lookups,
``refresh_from_db``); a manager's ``create()`` or a bare queryset carries no instance, so
name the database there: ``Community.objects.using(database_for_community(id))``.
The router migrates the app's tables on ``default`` and on every alias the mapping names.
Fleet-wide work (the reaper, pruning) sweeps each alias of ``app_databases()``: the
commands' ``--all-databases``.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections

from .conf import app_settings
from .models import WorkflowAgentDelivery

APP_LABEL = "workflow_delivery"


def database_for_community(community_id: UUID | str) -> str:
    mapping = app_settings.COMMUNITY_DATABASES
    return mapping.get(str(community_id), DEFAULT_DB_ALIAS)


def configured_databases() -> list[str]:
    """``default`` and every alias the mapping names, in a stable order."""
    named = sorted(set(app_settings.COMMUNITY_DATABASES.values()) - {DEFAULT_DB_ALIAS})
    return [DEFAULT_DB_ALIAS, *named]


def app_databases() -> list[str]:
    """The aliases whose database holds the app's tables (asked of each database)."""
    table = WorkflowAgentDelivery._meta.db_table
    holding = []
    for alias in connections:
        if connections[alias].vendor != "postgresql":
            continue
        with connections[alias].cursor() as cursor:
            if table in connections[alias].introspection.table_names(cursor):
                holding.append(alias)
    return holding


def _community_of(instance: Any) -> object | None:
    if instance is None or instance._meta.app_label != APP_LABEL:
        return None
    # Read the loaded value only: touching a deferred field would load it, which asks
    # the router again.
    loaded = instance.__dict__
    return (
        loaded.get("id") if instance._meta.model_name == "community" else loaded.get("community_id")
    )


class CommunityRouter:
    """Routes the app's rows by their community (see the module's docstring)."""

    def _route(self, model: type, hints: dict[str, Any]) -> str | None:
        if model._meta.app_label != APP_LABEL:
            return None
        community_id = _community_of(hints.get("instance"))
        return None if community_id is None else database_for_community(community_id)

    def db_for_read(self, model: type, **hints: Any) -> str | None:
        return self._route(model, hints)

    def db_for_write(self, model: type, **hints: Any) -> str | None:
        return self._route(model, hints)

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        first, second = _community_of(obj1), _community_of(obj2)
        if first is None or second is None:
            return None
        return database_for_community(first) == database_for_community(second)

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if app_label != APP_LABEL:
            return None
        return db in configured_databases()
