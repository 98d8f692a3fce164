"""Handlers for consumer and command tests, importable by dotted path.

They write to ``EFFECTS``, a table the ``effects`` fixture creates in the test database
for the agent's own rows.
"""

from __future__ import annotations

from django.db import connection

from workflow_delivery.consumer import DeliveryContext
from workflow_delivery.protocol import DeliveryRecord, Lease

EFFECTS = "wd_test_consumer_effect"
CREATE_EFFECTS = (
    f"CREATE TABLE {EFFECTS} (delivery_id uuid NOT NULL, generation integer NOT NULL, "
    "pid integer NOT NULL DEFAULT pg_backend_pid())"
)


def write_effect(record: DeliveryRecord, lease: Lease, context: DeliveryContext) -> None:
    """One effect row and the finish, in one lease-fenced transaction."""
    with context.holding() as held, connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECTS} (delivery_id, generation) VALUES (%s, %s)",
            [lease.delivery_id, lease.generation],
        )
        held.finish("finished")


def do_nothing(record: DeliveryRecord, lease: Lease, context: DeliveryContext) -> None:
    """Returns at once: the consumer settles ``finished``."""


def refuse(record: DeliveryRecord, lease: Lease, context: DeliveryContext) -> None:
    raise RuntimeError("this handler always fails")


not_callable = 42
