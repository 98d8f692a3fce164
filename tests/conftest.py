from __future__ import annotations

import pytest
from django.db import connection

from tests import factories


@pytest.fixture
def step(db) -> factories.Step:
    return factories.Step(targets=3)


@pytest.fixture
def raw(db):
    """A cursor on the test connection, for statements the ORM would refuse to write."""
    with connection.cursor() as cursor:
        yield cursor
