from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth.models import Permission
from django.db import connection

from tests import factories
from tests.admin_pages import VIEW_PERMISSIONS
from tests.locks import LOCK_TIMEOUT, Worker


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
