"""Modules whose names moved: each name still read from the old module, with a
``DeprecationWarning`` naming its new place in ``workflow_delivery.services``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType


def moved_names(old: str, current: ModuleType) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``old``, whose public names (``current.__all__``)
    are now ``workflow_delivery.services``'s."""

    def __getattr__(name: str) -> object:
        if name in current.__all__:
            warnings.warn(
                f"{old}.{name} is deprecated; use workflow_delivery.services.{name}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(current, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
