"""The unit tests need no database: a test here that asks for one fails at its set-up."""

from __future__ import annotations

import pytest

DATABASE_FIXTURES = {"db", "transactional_db", "django_db_setup", "live_server"}


@pytest.fixture(autouse=True)
def _no_database(request: pytest.FixtureRequest) -> None:
    asked = sorted(DATABASE_FIXTURES & set(request.fixturenames))
    if asked or request.node.get_closest_marker("django_db"):
        pytest.fail(
            f"{request.node.nodeid} is a unit test but asks for the database "
            f"({', '.join(asked) or 'django_db mark'}): it belongs in another folder of tests/",
            pytrace=False,
        )
