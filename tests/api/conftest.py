"""Fixtures of the agent API tests. Every module here has the wake listener stopped at
its end; the in-process modules also ask for ``any_host`` (their pytestmark), and take
pytest-django's ``client`` and this ``agent`` as arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from workflow_delivery.api.wake import hub

if TYPE_CHECKING:
    from tests.api.helpers import Agent


@pytest.fixture(autouse=True, scope="module")
def stop_wake_listener():
    """The wait view starts this process's LISTEN connection; close it before the
    test database is dropped."""
    yield
    hub.stop()


@pytest.fixture
def any_host(settings):
    """Every Host allowed: the in-process tests name each community by its host."""
    settings.ALLOWED_HOSTS = ["*"]


@pytest.fixture
def agent() -> Agent:
    # Imported here, not at the top: helpers imports psycopg 3, and test_docs_page.py,
    # which shares this conftest, runs in the psycopg2 cell too.
    from tests.api.helpers import Agent

    return Agent()
