"""Helpers the service modules share: the attempt cap setting and a transaction
whose writes the timeline records under a named actor."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import transaction

from ..conf import app_settings
from ..exceptions import ProtocolError
from ..store import run, statements
from ..validation import is_whole_number


def max_attempts() -> int | None:
    cap = app_settings.MAX_ATTEMPTS
    if cap is not None and not (is_whole_number(cap) and cap >= 1):
        raise ProtocolError("WORKFLOW_DELIVERY_MAX_ATTEMPTS", f"must be None or >= 1, not {cap!r}")
    return cap


@contextmanager
def transaction_as(actor: str, using: str) -> Iterator[None]:
    """A transaction (or the caller's) whose statements the timeline trigger records as
    done by ``actor``. The setting is transaction-local, and cleared at the end of the
    block in case the transaction is the caller's and goes on."""
    with transaction.atomic(using=using):
        run.fetch(using, statements.SET_ACTOR, {"actor": actor}, savepoint=False)
        yield
        run.fetch(using, statements.SET_ACTOR, {"actor": ""}, savepoint=False)
