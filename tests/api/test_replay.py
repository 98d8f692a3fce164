"""The replay guard: a signed event is recorded once, across communities and
concurrent connections, and its table is pruned past the clock window, purged with its
community and behind the write fence. Its row is written in the operation's own
transaction, so a refused operation keeps none and its retry is judged afresh, and two
identical requests at once run the operation once."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test import Client
from django.utils import timezone

from tests.api.helpers import Agent, answer, rows
from tests.support import factories
from tests.support.races import run_together
from workflow_delivery import services
from workflow_delivery.api import nip98
from workflow_delivery.models import AgentRequestReplay, WorkflowAgentDelivery
from workflow_delivery.store import statements

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("any_host")]


# -- the replay guard table --------------------------------------------------------------


def _admitted(owner, event: bytes, created_at: int, agent: bytes) -> tuple[bool, bool]:
    """``(fresh, recorded)`` of the admission a request of ``agent`` at ``owner``'s host gets."""
    admission = services.admit_request_event(owner.host, event, created_at, pubkey=agent)
    assert admission.community_id == owner.id
    return admission.fresh, admission.recorded


def test_replay_guard_holds_an_event_once_across_communities():
    one, two = factories.community(), factories.community()
    agent = factories.key32()
    factories.enroll(one, [agent])
    factories.enroll(two, [agent])
    event = factories.key32()
    now = int(time.time())
    assert _admitted(one, event, now, agent) == (True, True)
    assert _admitted(one, event, now, agent) == (True, False)
    admitted = services.admit_request_event(two.host.upper(), event, now, pubkey=agent)
    assert (admitted.community_id, admitted.fresh, admitted.recorded) == (two.id, True, False)
    assert admitted.standing == "enabled"
    assert _admitted(one, factories.key32(), now - 120, agent) == (False, False)
    assert AgentRequestReplay.objects.filter(event_id=event).count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_same_event_at_once_from_two_connections_is_recorded_once():
    owner = factories.community()
    agent = factories.key32()
    factories.enroll(owner, [agent])
    event = factories.key32()
    now = int(time.time())
    results = run_together(4, lambda _: _admitted(owner, event, now, agent))
    assert sorted(results) == [(True, False)] * 3 + [(True, True)]
    assert AgentRequestReplay.objects.filter(community=owner).count() == 1


def _replay(owner, age_seconds: int) -> AgentRequestReplay:
    return AgentRequestReplay.objects.create(
        community=owner,
        event_id=factories.key32(),
        event_created_at=timezone.now() - timedelta(seconds=age_seconds),
    )


def test_prune_removes_only_rows_past_the_window(settings):
    settings.WORKFLOW_DELIVERY_API_MAX_CLOCK_SKEW_SECONDS = 60
    owner = factories.community()
    old = [_replay(owner, 600) for _ in range(3)]
    kept = [_replay(owner, 0), _replay(owner, 90)]
    assert services.prune_replay_guard(batch_size=2) == 3
    remaining = set(AgentRequestReplay.objects.values_list("id", flat=True))
    assert remaining == {row.id for row in kept}
    assert not remaining & {row.id for row in old}


def test_prune_skips_a_community_being_deleted():
    healthy, leaving = factories.community(), factories.community()
    _replay(healthy, 600)
    frozen = _replay(leaving, 600)
    factories.move_to(leaving.id, "fenced")
    assert services.prune_replay_guard() == 1
    assert list(AgentRequestReplay.objects.values_list("id", flat=True)) == [frozen.id]


def test_purge_of_a_community_deletes_its_replay_rows():
    owner = factories.community()
    _replay(owner, 0)
    generation = factories.move_to(owner.id, "fenced")
    deleted = services.purge_community(owner.id, generation)
    assert deleted[AgentRequestReplay._meta.db_table] == 1
    assert AgentRequestReplay._meta.db_table in [table for table, _ in statements.PURGE]
    assert not AgentRequestReplay.objects.filter(community=owner).exists()


def test_replay_rows_are_behind_the_write_fence(raw):
    owner = factories.community()
    agent = factories.key32()
    factories.enroll(owner, [agent])
    factories.move_to(owner.id, "fenced")
    from workflow_delivery.exceptions import CommunityWriteFenced

    # A savepoint of its own: the request's transaction is aborted by the refusal.
    with pytest.raises(CommunityWriteFenced), transaction.atomic():
        services.admit_request_event(owner.host, factories.key32(), int(time.time()), pubkey=agent)
    assert connection.in_atomic_block
    assert not AgentRequestReplay.objects.filter(community=owner).exists()


# -- one transaction per request -------------------------------------------------------


def test_a_refused_operation_keeps_no_replay_row(client, agent):
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 30}), 200)
    path = f"v1/deliveries/{claimed['lease']['delivery_id']}"
    stale = {"generation": claimed["lease"]["generation"] + 1}
    answer(agent.call(client, "POST", f"{path}/renew", stale), 409, "lease_lost")
    answer(agent.call(client, "POST", f"{path}/finish", stale | {"outcome": "failed"}), 409)
    answer(agent.call(client, "GET", f"v1/deliveries/{uuid.uuid4()}"), 404, "not_found")
    assert AgentRequestReplay.objects.count() == 1


def test_the_same_signed_request_refused_once_is_judged_afresh(client, agent, settings):
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = 60
    body = json.dumps({"lease_seconds": 600}).encode()
    url = f"http://{agent.host}/agents/v1/claim"
    header = nip98.sign_request(agent.secret, url=url, method="POST", body=body)
    before = rows()
    first = agent.call(client, "POST", "v1/claim", raw=body, authorization=header)
    assert answer(first, 400, "invalid_request")["field"] == "lease_seconds"
    assert rows() == before and not AgentRequestReplay.objects.exists()
    settings.WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = 3600
    retried = answer(agent.call(client, "POST", "v1/claim", raw=body, authorization=header), 200)
    assert retried["delivery"]["id"] == str(agent.delivery.id)
    again = agent.call(client, "POST", "v1/claim", raw=body, authorization=header)
    answer(again, 401, "auth_replay")


@pytest.mark.django_db(transaction=True)
def test_a_lease_lost_in_autocommit_keeps_no_replay_row_and_its_retry_is_judged_afresh(
    settings,
):
    """Outside a test transaction each request is one statement in autocommit: the
    refusal raised inside it undoes its replay row, so the same signed request sent
    again is refused for its lease again, not as a replay."""
    settings.ALLOWED_HOSTS = ["*"]
    agent = Agent()
    client = Client()
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 60}), 200)
    before = AgentRequestReplay.objects.count()
    stale = claimed["lease"]["generation"] + 1
    for path, document in (
        (f"v1/deliveries/{agent.delivery.id}/finish", {"generation": stale, "outcome": "failed"}),
        (f"v1/deliveries/{agent.delivery.id}/renew", {"generation": stale}),
    ):
        body = json.dumps(document).encode()
        url = f"http://{agent.host}/agents/{path}"
        header = nip98.sign_request(agent.secret, url=url, method="POST", body=body)
        for _ in range(2):
            sent = agent.call(client, "POST", path, raw=body, authorization=header)
            answer(sent, 409, "lease_lost")
        assert AgentRequestReplay.objects.count() == before
    assert WorkflowAgentDelivery.objects.get(id=agent.delivery.id).status == "claimed"
    # The honest finish settles once; its replay runs nothing.
    path = f"v1/deliveries/{agent.delivery.id}/finish"
    body = json.dumps({"generation": stale - 1, "outcome": "finished"}).encode()
    url = f"http://{agent.host}/agents/{path}"
    header = nip98.sign_request(agent.secret, url=url, method="POST", body=body)
    settled = answer(agent.call(client, "POST", path, raw=body, authorization=header), 200)
    assert settled == {"result": "settled", "outcome": "finished"}
    answer(agent.call(client, "POST", path, raw=body, authorization=header), 401, "auth_replay")
    assert AgentRequestReplay.objects.count() == before + 1
    # A new signature of the same settle: what a retry sees, recorded.
    again = answer(
        agent.call(client, "POST", path, {"generation": stale - 1, "outcome": "failed"}), 200
    )
    assert again == {"result": "already_terminal", "status": "finished"}
    assert AgentRequestReplay.objects.count() == before + 2


def _waiting_on_locks(count: int) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0] >= count:
                return True
        time.sleep(0.02)
    return False


@pytest.mark.django_db(transaction=True)
def test_two_identical_requests_at_once_run_once_and_the_replay_row_waits_for_the_operation(
    settings,
):
    """The replay row is written in the operation's transaction: while the finish
    waits for its row, its replay row is not committed, and the identical request
    sent meanwhile waits on that row, then is refused; the delivery settles once."""
    settings.ALLOWED_HOSTS = ["*"]
    agent = Agent()
    client = Client()
    claimed = answer(agent.call(client, "POST", "v1/claim", {"lease_seconds": 60}), 200)
    path = f"v1/deliveries/{agent.delivery.id}/finish"
    body = json.dumps({"generation": claimed["lease"]["generation"], "outcome": "finished"})
    url = f"http://{agent.host}/agents/{path}"
    header = nip98.sign_request(agent.secret, url=url, method="POST", body=body.encode())
    event_id = bytes.fromhex(json.loads(base64.b64decode(header.split(" ", 1)[1]))["id"])
    answers: list = []

    def send() -> None:
        try:
            response = agent.call(Client(), "POST", path, raw=body.encode(), authorization=header)
            answers.append((response.status_code, response.json()))
        finally:
            connections.close_all()

    locked, release = threading.Event(), threading.Event()

    def lock_the_row() -> None:
        try:
            with transaction.atomic():
                WorkflowAgentDelivery.objects.select_for_update().get(id=agent.delivery.id)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    locker = threading.Thread(target=lock_the_row)
    senders = [threading.Thread(target=send) for _ in range(2)]
    locker.start()
    try:
        assert locked.wait(10)
        senders[0].start()
        assert _waiting_on_locks(1), answers
        senders[1].start()
        assert _waiting_on_locks(2), answers
        # Both wait: the first on the delivery's row, the second on the first's
        # replay row, which is not committed yet.
        assert not AgentRequestReplay.objects.filter(event_id=event_id).exists()
    finally:
        release.set()
        for thread in (locker, *senders):
            if thread.ident is not None:
                thread.join(30)
    codes = sorted(
        (status, document.get("result") or document.get("error")) for status, document in answers
    )
    assert codes == [(200, "settled"), (401, "auth_replay")]
    assert WorkflowAgentDelivery.objects.get(id=agent.delivery.id).status == "finished"
    assert AgentRequestReplay.objects.filter(event_id=event_id).count() == 1
