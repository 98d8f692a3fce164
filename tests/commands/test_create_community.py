"""A community is created by a command or the admin's one add form, both through
``services.create_community``: a host checked, a duplicate (in any case) refused
by name or reported, nothing else changed."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.urls import reverse

from workflow_delivery import services
from workflow_delivery.exceptions import ProtocolError
from workflow_delivery.models import Community

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command("create_community", *args, stdout=out)
    return out.getvalue()


def test_the_command_creates_an_active_community_once():
    first = run("--host", "Acme.Example")
    community = Community.objects.get()
    assert (community.host, community.deletion_state) == ("acme.example", "active")
    assert first.strip() == f"created community {community.id} for acme.example"
    second = run("--host", "ACME.example")
    assert second.strip() == (
        f"community {community.id} has the host acme.example already (active): nothing created"
    )
    assert list(Community.objects.values_list("id", flat=True)) == [community.id]


@pytest.mark.parametrize(
    "host", ["", " acme.example", "acme.example:8000", "acme..example", "-acme.example", "a b"]
)
def test_the_command_refuses_a_host_that_is_not_one(host):
    with pytest.raises(CommandError, match=r"host: .* is not a host name"):
        run(f"--host={host}")
    assert not Community.objects.exists()


def test_the_service_reports_a_taken_host():
    made = services.create_community("one.example")
    again = services.create_community("ONE.example")
    assert made.created and not again.created
    assert again.id == made.id
    with pytest.raises(ProtocolError, match="host"):
        services.create_community(42)


def test_the_admin_add_form_creates_only_a_community(admin_client):
    before = Community.objects.count()
    page = admin_client.get(reverse("admin:workflow_delivery_community_add"))
    assert page.status_code == 200
    answer = admin_client.post(
        reverse("admin:workflow_delivery_community_add"),
        {"host": "New.Example", "deletion_state": "tombstone", "deleted_at": "2020-01-01"},
    )
    assert answer.status_code == 302
    community = Community.objects.get(host="new.example")
    assert community.deletion_state == "active" and community.deleted_at is None
    assert Community.objects.count() == before + 1


@pytest.mark.parametrize(
    ("host", "error"),
    [("taken.example", "has the host taken.example already"), ("bad host", "is not a host name")],
)
def test_the_admin_add_form_refuses_a_duplicate_or_bad_host_by_name(admin_client, host, error):
    taken = services.create_community("TAKEN.example")
    answer = admin_client.post(reverse("admin:workflow_delivery_community_add"), {"host": host})
    assert answer.status_code == 200
    assert error in answer.content.decode()
    assert list(Community.objects.values_list("id", flat=True)) == [taken.id]


def test_the_add_form_needs_the_add_permission(client, viewer):
    url = reverse("admin:workflow_delivery_community_add")
    assert client.get(url).status_code == 403
    assert client.post(url, {"host": "x.example"}).status_code == 403
    viewer.user_permissions.add(Permission.objects.get(codename="add_community"))
    assert client.post(url, {"host": "x.example"}).status_code == 302
    assert Community.objects.filter(host="x.example").exists()
