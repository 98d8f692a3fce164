"""Deprecated: ``workflow_delivery.services`` has the agent roster's changes
(``services.enroll_agents`` and the rest). A name read from here still works, with a
``DeprecationWarning`` naming its new place."""

from __future__ import annotations

import warnings

from .services import roster as _current


def __getattr__(name: str) -> object:
    if name in _current.__all__:
        warnings.warn(
            f"{__name__}.{name} is deprecated; use workflow_delivery.services.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_current, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
