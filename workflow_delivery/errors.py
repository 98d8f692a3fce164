"""The public classification of database errors: is this a lost session, a timeout?

The rules live in ``store.errors``, with the translation of the rest into named facts.
"""

from __future__ import annotations

from .store.errors import is_connection_lost, is_timeout, sqlstate

__all__ = ["is_connection_lost", "is_timeout", "sqlstate"]
