"""``Statement``: one literal SQL statement with named parameters, compiled once, when
it is defined, into the forms its runners send.

A statement is written with ``%(name)s`` placeholders and ``%%`` for a literal ``%``.
A DB-API cursor gets ``sql`` (``%s`` placeholders) and a list of values in placeholder
order; the connection's lane (``store.lane``) sends ``numbered`` (``$1`` …) straight
to libpq. Either way the caller passes each value once, by name, however often the
statement uses it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

# ``%(name)s`` or ``%%``; any other ``%`` is a mistake in the statement.
_PLACEHOLDER = re.compile(r"%(?:\((\w+)\)s|(%))")
_STRAY = re.compile(r"%(?!\(\w+\)s|%)")


class Statement:
    """A statement, ready for a cursor (``sql``) and for libpq (``numbered``)."""

    __slots__ = ("names", "numbered", "sql", "text")

    def __init__(self, text: str) -> None:
        if _STRAY.search(_PLACEHOLDER.sub("", text)):
            raise ValueError(f"a statement takes %(name)s parameters only: {text}")
        names: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match[2]:
                return "%%"
            names.append(match[1])
            return "%s"

        numbers = itertools.count(1)

        def numbered(match: re.Match[str]) -> str:
            return "%" if match[2] else f"${next(numbers)}"

        self.text = text
        self.sql = _PLACEHOLDER.sub(positional, text)
        # One number per placeholder, as the cursor binds them: a value used twice is
        # bound twice, each time with the type its own context gives it.
        self.numbered = _PLACEHOLDER.sub(numbered, text).encode()
        self.names = tuple(names)

    def args(self, params: Mapping[str, object] | None) -> list[object]:
        """The values of ``params`` in placeholder order."""
        if params is None:
            if self.names:
                raise TypeError(f"the statement takes parameters {sorted(set(self.names))}")
            return []
        return [params[name] for name in self.names]

    def __repr__(self) -> str:
        return f"Statement({self.text.strip()[:60]!r}…)"
