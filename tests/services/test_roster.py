"""The community's agent roster: a delivery reaches only an enabled agent of its
community (the database refuses anything else), the API serves only enabled agents,
and a revocation releases the key's leases so its late renew or finish fails closed."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from io import StringIO

import pytest
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.db import DatabaseError, IntegrityError, connection, connections, transaction
from django.test import Client

from tests.support import factories
from workflow_delivery import errors, services
from workflow_delivery.exceptions import (
    AgentNotEnrolled,
    CommunityNotFound,
    CommunityWriteFenced,
    ProtocolError,
    TargetNotEnrolled,
)
from workflow_delivery.models import (
    AgentRequestReplay,
    CommunityAgent,
    DeliveryTransition,
    WorkflowAgentDelivery,
)
from workflow_delivery.protocol import DeliveryStatus, LeaseLost, NewDelivery, Outcome, Renewed
from workflow_delivery.store import rows

pytestmark = pytest.mark.django_db


def unenrolled_step(**options) -> factories.Step:
    """A step whose targets are not (yet) agents of its community."""
    step = factories.Step(**options)
    CommunityAgent.objects.filter(community=step.community).delete()
    return step


def stored(step: factories.Step) -> list[dict]:
    return list(WorkflowAgentDelivery.objects.filter(community=step.community).values())


# -- commits ---------------------------------------------------------------------------


def test_a_commit_to_a_target_that_is_not_enrolled_is_refused_and_writes_nothing():
    step = unenrolled_step(targets=3)
    factories.enroll(step.community, step.targets[:2])
    stranger = step.targets[2]
    with pytest.raises(TargetNotEnrolled) as caught:
        services.commit_deliveries(step.community.id, step.created_at, step.new_deliveries())
    refusal = caught.value
    assert refusal.community_id == step.community.id
    assert refusal.unknown == (stranger.hex(),) and refusal.revoked == ()
    assert stranger.hex() in str(refusal) and step.targets[0].hex() not in str(refusal)
    # An integrity error, never one a retry loop would take for a lost connection.
    assert isinstance(refusal.__cause__, IntegrityError)
    assert not errors.is_connection_lost(refusal.__cause__)
    assert stored(step) == []


def test_a_refusal_of_many_targets_names_a_few_and_carries_them_all():
    step = unenrolled_step(targets=7)
    with pytest.raises(TargetNotEnrolled) as caught:
        factories.committed(step)
    assert sorted(caught.value.targets) == sorted(target.hex() for target in step.targets)
    assert "and 2 more" in str(caught.value) and len(str(caught.value)) < 600


def test_a_commit_to_a_revoked_target_is_refused_with_the_producers_own_writes():
    step = factories.Step(targets=2)
    services.revoke_agent(step.community.id, step.targets[1])
    scope = (step.community.id, step.run.id, step.step_id)
    with pytest.raises(TargetNotEnrolled) as caught, services.delivery_identity(*scope) as identity:
        factories.workflow(step.community)
        identity.commit(step.created_at, step.new_deliveries())
    assert caught.value.revoked == (step.targets[1].hex(),) and caught.value.unknown == ()
    assert "revoked" in str(caught.value)
    assert stored(step) == []
    assert step.community.workflows.count() == 1


def test_enrolling_the_target_lets_the_same_commit_through():
    step = unenrolled_step(targets=2)
    deliveries = step.new_deliveries()
    with pytest.raises(TargetNotEnrolled):
        services.commit_deliveries(step.community.id, step.created_at, deliveries)
    factories.enroll(step.community, step.targets)
    created = services.commit_deliveries(step.community.id, step.created_at, deliveries)
    assert sorted(created) == sorted(item.id for item in deliveries)


def test_an_agent_of_another_community_is_not_an_agent_of_this_one():
    step = unenrolled_step()
    factories.enroll(factories.community(), step.targets)
    with pytest.raises(TargetNotEnrolled):
        factories.committed(step)
    assert stored(step) == []


def test_the_database_refuses_a_raw_insert_and_a_retarget_to_a_key_not_enrolled(raw):
    step = factories.Step()
    delivery = factories.committed(step)[0]
    other = step.binding(factories.key32(), step_id="raw")
    columns = rows.RECORD_COLUMNS[:13]
    values = [uuid.uuid4(), *sql_values(other, step)]
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        raw.execute(
            f"INSERT INTO workflow_agent_deliveries ({', '.join(columns)}) "
            f"VALUES ({', '.join(['%s'] * len(columns))})",
            values,
        )
    assert caught.value.__cause__.diag.constraint_name == "wd_delivery_target_enrolled"
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        raw.execute(
            "UPDATE workflow_agent_deliveries SET target_pubkey = %s WHERE id = %s",
            [factories.key32(), delivery.id],
        )
    assert caught.value.__cause__.diag.constraint_name == "wd_delivery_target_enrolled"
    assert len(stored(step)) == 1


def sql_values(binding, step: factories.Step) -> list[object]:
    return [
        binding.community_id,
        binding.workflow_id,
        binding.run_id,
        binding.step_id,
        binding.target_pubkey,
        binding.definition_event_id,
        binding.message_event_id,
        step.created_at,
        *rows.cause_columns(binding),
    ]


def test_a_retry_that_creates_nothing_is_not_asked_again():
    """A revocation after the commit leaves the step as it was: a producer's retry
    (every row already there) creates nothing and is not refused."""
    step = factories.Step()
    deliveries = factories.committed(step)
    services.revoke_agent(step.community.id, step.targets[0])
    again = [NewDelivery(uuid.uuid4(), item.binding) for item in deliveries]
    assert services.commit_deliveries(step.community.id, step.created_at, again) == []


# -- the roster's own rules ----------------------------------------------------------------


def test_enroll_is_idempotent_and_keeps_a_revoked_key_revoked():
    owner = factories.community()
    key = factories.key32()
    first = services.enroll_agent(owner.id, key, label="scout")
    assert (first.enabled, first.label, first.revoked_at) == (True, "scout", None)
    assert services.enroll_agent(owner.id, key) == first
    revoked = services.revoke_agent(owner.id, key).entry
    again = services.enroll_agent(owner.id, key)
    assert (again.enabled, again.revoked_at) == (False, revoked.revoked_at)
    assert CommunityAgent.objects.filter(community=owner).count() == 1


def test_revoke_and_reinstate_are_idempotent():
    step = factories.Step()
    key = step.targets[0]
    first = services.revoke_agent(step.community.id, key)
    second = services.revoke_agent(step.community.id, key)
    assert second.entry.revoked_at == first.entry.revoked_at and second.released == ()
    entry = services.reinstate_agent(step.community.id, key)
    assert (entry.enabled, entry.revoked_at) == (True, None)
    assert services.reinstate_agent(step.community.id, key) == entry
    assert len(factories.committed(step)) == 1


def test_bad_roster_input_is_a_clear_error_and_changes_nothing():
    owner = factories.community()
    with pytest.raises(ProtocolError, match="pubkey"):
        services.enroll_agent(owner.id, b"short")
    with pytest.raises(ProtocolError, match="label"):
        services.enroll_agent(owner.id, factories.key32(), label="x" * 201)
    with pytest.raises(CommunityNotFound):
        services.enroll_agent(uuid.uuid4(), factories.key32())
    with pytest.raises(AgentNotEnrolled, match="not an agent"):
        services.revoke_agent(owner.id, factories.key32())
    with pytest.raises(AgentNotEnrolled):
        services.reinstate_agent(owner.id, factories.key32())
    assert not CommunityAgent.objects.exists()


def test_the_roster_is_behind_the_community_write_fence():
    step = factories.Step()
    factories.move_to(step.community.id, "quiescing")
    with pytest.raises(CommunityWriteFenced):
        services.revoke_agent(step.community.id, step.targets[0])
    with pytest.raises(CommunityWriteFenced):
        services.enroll_agent(step.community.id, factories.key32())
    assert list(CommunityAgent.objects.values_list("enabled", flat=True)) == [True]
    generation = factories.move_to(step.community.id, "fenced")
    deleted = services.purge_community(step.community.id, generation)
    assert deleted[CommunityAgent._meta.db_table] == 1


def test_a_revoked_at_without_revocation_cannot_be_stored(raw):
    step = factories.Step()
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        raw.execute(
            "UPDATE community_agents SET enabled = false WHERE community_id = %s",
            [step.community.id],
        )
    assert caught.value.__cause__.diag.constraint_name == "wd_agent_revoked_at_iff_disabled"


# -- revocation releases the key's leases ----------------------------------------------------


def test_revoking_releases_the_keys_leases_so_its_late_renew_and_finish_fail_closed():
    step = factories.Step(targets=2)
    factories.committed(step)
    other = factories.Step(owner=step.community, targets=[step.targets[0]], step_id="s2")
    factories.committed(other)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0], lease_seconds=60)
    kept, _ = services.claim_delivery(step.community.id, step.targets[1], lease_seconds=60)

    revocation = services.revoke_agent(step.community.id, step.targets[0], operator="alice")

    assert revocation.released == (lease.delivery_id,)
    assert revocation.entry.enabled is False and revocation.entry.revoked_at is not None
    row = WorkflowAgentDelivery.objects.get(pk=lease.delivery_id)
    assert (row.status, row.lease_generation) == (DeliveryStatus.PENDING, lease.generation + 1)
    assert services.renew_delivery(lease, lease_seconds=30) == LeaseLost()
    assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()
    entry = DeliveryTransition.objects.filter(delivery_id=lease.delivery_id).last()
    assert (entry.kind, entry.actor) == ("released", "operator:alice")
    # Another key's lease, and the revoked key's pending delivery, are left as they were.
    assert isinstance(services.renew_delivery(kept, lease_seconds=30), Renewed)
    assert (
        WorkflowAgentDelivery.objects.filter(
            community=step.community, target_pubkey=step.targets[0], status="pending"
        ).count()
        == 2
    )


def _commit_in_flight(step: factories.Step) -> Iterator[None]:
    with services.delivery_identity(step.community.id, step.run.id, step.step_id) as s:
        s.commit(step.created_at, step.new_deliveries())
        yield


def _request_in_flight(step: factories.Step) -> Iterator[None]:
    # What the API's one transaction per request does first: admit the signed event.
    with transaction.atomic():
        admission = services.admit_request_event(
            step.community.host, factories.key32(), int(time.time()), pubkey=step.targets[0]
        )
        assert admission.standing == "enabled"
        yield


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("in_flight", [_commit_in_flight, _request_in_flight])
def test_a_revocation_waits_for_the_keys_work_in_flight_and_later_work_sees_it(in_flight):
    step = factories.Step(targets=1)
    later = factories.Step(owner=step.community, targets=step.targets, step_id="later")
    inside, may_finish = threading.Event(), threading.Event()

    def worker() -> None:
        try:
            for _ in in_flight(step):
                inside.set()
                may_finish.wait(10)
        finally:
            connections.close_all()

    revoked: list[object] = []

    def revoker() -> None:
        try:
            revoked.append(services.revoke_agent(step.community.id, step.targets[0]))
        finally:
            connections.close_all()

    first = threading.Thread(target=worker)
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=revoker)
    second.start()
    try:
        assert waits_on_an_advisory_lock(), "the revocation did not wait for the work in flight"
        assert revoked == []
    finally:
        may_finish.set()
        first.join(10)
        second.join(10)
    assert len(revoked) == 1 and revoked[0].entry.enabled is False
    with pytest.raises(TargetNotEnrolled):
        factories.committed(later)
    admission = services.admit_request_event(
        step.community.host, factories.key32(), int(time.time()), pubkey=step.targets[0]
    )
    assert (admission.standing, admission.recorded) == ("revoked", False)


def waits_on_an_advisory_lock(seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND mode = 'ExclusiveLock' AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            if cursor.fetchone()[0]:
                return True
        time.sleep(0.05)
    return False


# -- the agent API ------------------------------------------------------------------------


def http():
    """The signed-request helpers (imported here: they pull in the bench harness, which
    needs psycopg 3)."""
    from tests.support import agent_http

    return agent_http.pubkey, agent_http.secret, agent_http.signed


@pytest.fixture
def api_client(settings) -> Client:
    settings.ALLOWED_HOSTS = ["*"]
    return Client()


def refused(response, code: str) -> None:
    assert response.status_code == 401, response.content
    document = response.json()
    assert document["error"] == code and document["detail"]


@pytest.mark.psycopg3
def test_the_api_refuses_a_revoked_key_and_its_leases_are_gone(api_client):
    pubkey, secret, signed = http()
    key = secret()
    step = factories.Step(targets=[pubkey(key)])
    delivery = factories.committed(step)[0]
    host = step.community.host
    claimed = signed(api_client, "POST", "v1/claim", {}, host=host, secret_key=key)
    assert claimed.status_code == 200
    generation = claimed.json()["lease"]["generation"]

    services.revoke_agent(step.community.id, pubkey(key))
    replays = AgentRequestReplay.objects.count()
    finish = {"generation": generation, "outcome": "finished"}
    path = f"v1/deliveries/{delivery.id}/finish"
    refused(signed(api_client, "POST", path, finish, host=host, secret_key=key), "auth_revoked")
    refused(signed(api_client, "POST", "v1/claim", {}, host=host, secret_key=key), "auth_revoked")
    assert AgentRequestReplay.objects.count() == replays
    row = WorkflowAgentDelivery.objects.get(pk=delivery.id)
    assert (row.status, row.lease_generation) == ("pending", generation + 1)

    services.reinstate_agent(step.community.id, pubkey(key))
    again = signed(api_client, "POST", path, finish, host=host, secret_key=key)
    assert again.status_code == 409 and again.json()["error"] == "lease_lost"
    assert signed(api_client, "POST", "v1/claim", {}, host=host, secret_key=key).status_code == 200


@pytest.mark.psycopg3
def test_the_api_refuses_a_key_that_is_not_in_the_roster(api_client):
    pubkey, secret, signed = http()
    owner = factories.community()
    stranger = secret()
    factories.enroll(factories.community(), [pubkey(stranger)])
    response = signed(api_client, "POST", "v1/claim", {}, host=owner.host, secret_key=stranger)
    refused(response, "auth_unknown_agent")
    assert pubkey(stranger).hex() in response.json()["detail"]
    wait = signed(
        api_client, "GET", "v1/wait", host=owner.host, secret_key=stranger, query="timeout=0"
    )
    refused(wait, "auth_unknown_agent")
    assert not AgentRequestReplay.objects.exists()


# -- the admin and the command -------------------------------------------------------------


def run_action(client, action: str, ids: list) -> list[str]:
    from django.urls import reverse

    response = client.post(
        reverse("admin:workflow_delivery_communityagent_changelist"),
        {"action": action, "_selected_action": [str(i) for i in ids]},
        follow=True,
    )
    return [str(message) for message in response.context["messages"]]


@pytest.mark.parametrize(
    ("action", "codename", "enabled_before"),
    [("revoke_agents", "revoke_agent", True), ("reinstate_agents", "reinstate_agent", False)],
)
def test_a_roster_action_needs_its_own_permission(
    client, django_user_model, action, codename, enabled_before
):
    from django.urls import reverse

    step = factories.Step()
    if not enabled_before:
        services.revoke_agent(step.community.id, step.targets[0])
    agent = CommunityAgent.objects.get(community=step.community)
    user = django_user_model.objects.create_user("roster-viewer", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="view_communityagent"))
    client.force_login(user)
    page = client.get(reverse("admin:workflow_delivery_communityagent_changelist"))
    assert page.status_code == 200 and f'value="{action}"' not in page.content.decode()
    run_action(client, action, [agent.pk])
    assert CommunityAgent.objects.get(pk=agent.pk).enabled is enabled_before

    user.user_permissions.add(Permission.objects.get(codename=codename))
    user = django_user_model.objects.get(pk=user.pk)
    client.force_login(user)
    assert (
        f'value="{action}"'
        in client.get(reverse("admin:workflow_delivery_communityagent_changelist")).content.decode()
    )
    label = "Revoke" if enabled_before else "Reinstate"
    assert run_action(client, action, [agent.pk]) == [f"{label}: 1 done, 0 skipped."]
    assert CommunityAgent.objects.get(pk=agent.pk).enabled is not enabled_before


def test_the_admin_revocation_releases_leases_and_skips_revoked_rows(admin_client):
    step = factories.Step(targets=2)
    factories.committed(step)
    lease, _ = services.claim_delivery(step.community.id, step.targets[0])
    services.revoke_agent(step.community.id, step.targets[1])
    agents = list(
        CommunityAgent.objects.filter(community=step.community).values_list("pk", flat=True)
    )
    reported = run_action(admin_client, "revoke_agents", agents)
    assert reported == ["Revoke: 1 done, 1 skipped (1 already revoked)."]
    assert services.finish_delivery(lease, Outcome.FINISHED) == LeaseLost()


def test_the_command_enrolls_revokes_and_reinstates():
    owner = factories.community()
    key = factories.key32()
    out = StringIO()
    call_command("enroll_agent", owner.host.upper(), key.hex(), "--label", "scout", stdout=out)
    assert f"{key.hex()} (scout): enabled" in out.getvalue()
    out = StringIO()
    call_command("enroll_agent", str(owner.id), key.hex(), "--revoke", stdout=out)
    assert "revoked at" in out.getvalue() and "0 leases released" in out.getvalue()
    assert CommunityAgent.objects.get(community=owner).enabled is False
    call_command("enroll_agent", owner.host, key.hex(), "--reinstate", stdout=StringIO())
    assert CommunityAgent.objects.get(community=owner).enabled is True


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["nowhere.example", "00" * 32], "no community"),
        (["{host}", "abcd"], "64 hex digits"),
        (["{host}", "11" * 32, "--revoke"], "not an agent"),
        (["{host}", "11" * 32, "--revoke", "--label", "x"], "--label is for enrolling"),
    ],
)
def test_the_command_refuses_bad_arguments(arguments, message):
    owner = factories.community()
    with pytest.raises(CommandError, match=message):
        call_command("enroll_agent", *[a.format(host=owner.host) for a in arguments])
    assert not CommunityAgent.objects.exists()
