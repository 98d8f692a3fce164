from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import Permission
from django.db import connection

from tests.support import factories
from tests.support.admin_pages import VIEW_PERMISSIONS
from tests.support.locks import LOCK_TIMEOUT, Worker

# Set by `scripts/test --without-system-packages`: the tests that need Debian's chromium,
# chromedriver or pgbouncer are left out, and the run says so at its end.
WITHOUT_SYSTEM_PACKAGES = "BUZZ_TESTS_WITHOUT_SYSTEM_PACKAGES"
SYSTEM_PACKAGE_MARKERS = ("browser", "pooler")
left_out_key = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(WITHOUT_SYSTEM_PACKAGES) != "1":
        return
    left_out = [i for i in items if any(i.get_closest_marker(m) for m in SYSTEM_PACKAGE_MARKERS)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    config.stash[left_out_key] = len(left_out)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    count = config.stash.get(left_out_key, None)
    if count is None:
        return
    terminalreporter.write_sep(
        "!",
        f"{count} browser and pooler tests NOT RUN ({WITHOUT_SYSTEM_PACKAGES}=1): "
        "the admin in Chromium and PgBouncer are untested by this run",
        yellow=True,
        bold=True,
    )


@pytest.fixture
def step(db) -> factories.Step:
    return factories.Step(targets=3)


@pytest.fixture
def raw(db):
    """A cursor on the test connection, for statements the ORM would refuse to write."""
    with connection.cursor() as cursor:
        yield cursor


@pytest.fixture
def worker(transactional_db) -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@pytest.fixture
def lock_timeout(transactional_db) -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('lock_timeout', %s, false)", [LOCK_TIMEOUT])
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")


@pytest.fixture
def viewer(client, django_user_model):
    """A staff user who may view everything and run no action."""
    user = django_user_model.objects.create_user("viewer", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=VIEW_PERMISSIONS))
    client.force_login(user)
    return user
