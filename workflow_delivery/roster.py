"""Deprecated: ``workflow_delivery.services`` has the agent roster's changes
(``services.enroll_agents`` and the rest). A name read from here still works, with a
``DeprecationWarning`` naming its new place."""

from __future__ import annotations

from .deprecation import moved_names
from .services import roster as _current

__getattr__ = moved_names(__name__, _current)
