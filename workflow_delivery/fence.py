"""Deprecated: ``workflow_delivery.services`` has the community lifecycle and the
deletion executor (``services.transition_community`` and the rest). A name read from
here still works, with a ``DeprecationWarning`` naming its new place."""

from __future__ import annotations

from .deprecation import moved_names
from .services import fence as _current

__getattr__ = moved_names(__name__, _current)
