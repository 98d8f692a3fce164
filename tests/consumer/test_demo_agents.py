"""The demo's simulated agents on real PostgreSQL: consumers whose handler fails by
raising and settles inside ``holding()``, the crashing agent whose lease the reaper
takes back, and agents on the HTTP API through ``AgentClient(connect_to=...)``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from uuid import UUID

import pytest

from buzz_project.demo import data as demo
from workflow_delivery import keys
from workflow_delivery.client import AgentClient
from workflow_delivery.commandline import StopRequest
from workflow_delivery.consumer import Consumer, DeliveryContext
from workflow_delivery.exceptions import AgentApiError, ProtocolError
from workflow_delivery.models import Community, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryRecord, Lease, Settled
from workflow_delivery.reaper import Reaper

ALPHA = "alpha.demo.buzz"


@pytest.fixture
def alpha(transactional_db) -> Community:
    demo.load_demo_data()
    return Community.objects.get(host=ALPHA)


def pending(community: Community, target: bytes) -> int:
    rows = WorkflowAgentDelivery.objects.filter(community=community, target_pubkey=target)
    return rows.filter(status="pending").count()


class Script:
    """Stands in for the handler's random source: no work time, fixed draws."""

    def __init__(self, draws: list[float]) -> None:
        self.draws = iter(draws)

    def uniform(self, low: float, high: float) -> float:
        return 0.0

    def random(self) -> float:
        return next(self.draws)


def test_demo_targets_are_the_public_keys_of_the_agents_secret_keys(alpha):
    for host in demo.HOSTS:
        expected = [keys.public_key_bytes(demo.agent_secret(host, name)) for name in demo.AGENTS]
        assert demo.agent_pubkeys(host) == expected
    targets = set(WorkflowAgentDelivery.objects.values_list("target_pubkey", flat=True))
    assert {bytes(t) for t in targets} == {k for h in demo.HOSTS for k in demo.agent_pubkeys(h)}


def test_a_consumer_agent_fails_by_raising_and_settles_inside_holding(alpha):
    target = demo.agent_pubkeys(ALPHA)[0]
    assert pending(alpha, target) >= 3
    agent = demo.Agent(alpha.id, target, seed=0)
    # First delivery: failed (draw < 0.1). Second: settled in holding() (draws 0.5,
    # 0.2). Third: returned, so the consumer settles it (draws 0.5, 0.9).
    handle = agent.handler(Script([0.05, 0.5, 0.2, 0.5, 0.9]))
    seen: list[tuple[UUID, DeliveryContext]] = []

    def spy(record: DeliveryRecord, lease: Lease, context: DeliveryContext) -> None:
        seen.append((record.id, context))
        handle(record, lease, context)

    consumer = Consumer(
        alpha.id, [target], spy, lease_seconds=2, poll_interval=0.2, max_deliveries=3, listen=False
    )
    with demo.quiet_simulated_failures():
        stats = consumer.run()

    assert (stats.claimed, stats.failed, stats.finished, stats.lost) == (3, 1, 2, 0)
    statuses = dict(WorkflowAgentDelivery.objects.values_list("id", "status"))
    assert [statuses[delivery_id] for delivery_id, _ in seen] == ["failed", "finished", "finished"]
    assert [context.settled for _, context in seen] == [None, Settled("finished"), None]


def test_simulated_consumers_settle_demo_deliveries_and_stop_on_request(alpha):
    agents = [a for a in demo.demo_agents(2) if isinstance(a, demo.Agent)]
    assert len(agents) == 1  # of two agents, the second is the crashing one
    before = pending(alpha, agents[0].target_pubkey)
    stop = StopRequest()
    ticks: list[dict[str, int]] = []

    def tick(elapsed: float, counts: dict[str, int]) -> None:
        ticks.append(counts)
        if counts.get("claimed", 0) >= 2:
            stop.request("test")

    started = time.monotonic()
    counts = demo.simulate_agents(agents, 15.0, stop, on_tick=tick)
    assert time.monotonic() - started < 10
    assert counts["claimed"] >= 2
    assert (
        counts.get("finished", 0) + counts.get("failed", 0) + counts.get("released", 0)
        == (counts["claimed"])
    )
    assert pending(alpha, agents[0].target_pubkey) == before - counts["claimed"] + counts.get(
        "released", 0
    )


def test_the_crashing_agent_abandons_its_lease_and_the_reaper_takes_it_back(alpha):
    target = demo.agent_pubkeys(ALPHA)[1]
    claimed = WorkflowAgentDelivery.objects.filter(community=alpha, status="claimed")
    held_before = set(claimed.values_list("id", flat=True))
    crasher = demo.CrashingAgent(alpha.id, target, seed=0, lease_seconds=1, restart_seconds=30)

    counts = demo.simulate_agents([crasher], 1.0, StopRequest())

    assert counts == {"claimed": 1, "crashed": 1}
    (abandoned,) = set(claimed.values_list("id", flat=True)) - held_before
    row = WorkflowAgentDelivery.objects.filter(id=abandoned)
    deadline = time.monotonic() + 10
    while not row.expired_leases().exists():  # by the database clock
        assert time.monotonic() < deadline
        time.sleep(0.1)
    Reaper(batch_size=100).sweep()
    assert row.get().status == "pending"


def demo_client(live_server, host: str, secret_key: bytes) -> AgentClient:
    port = int(live_server.url.rsplit(":", 1)[1])
    return AgentClient(
        f"http://{host}:{port}/agents/", secret_key, connect_to=("127.0.0.1", port), timeout=10
    )


@pytest.mark.psycopg3  # the agent API's wait listens with psycopg 3
def test_agent_client_reaches_a_demo_community_through_connect_to(alpha, live_server):
    secret_key = demo.agent_secret(ALPHA, demo.AGENTS[2])
    with demo_client(live_server, ALPHA, secret_key) as client:
        lease, record = client.claim(lease_seconds=2)
        assert record.binding.community_id == alpha.id
        assert record.binding.target_pubkey == demo.agent_pubkeys(ALPHA)[2]
        assert client.finish(lease, "finished") == Settled("finished")
    assert WorkflowAgentDelivery.objects.get(id=record.id).status == "finished"
    # Without connect_to the Host is 127.0.0.1, which serves no community.
    with (
        AgentClient(live_server.url + "/agents/", secret_key) as plain,
        pytest.raises(AgentApiError) as refused,
    ):
        plain.claim()
    assert (refused.value.status, refused.value.code) == (404, "unknown_community")


@pytest.mark.psycopg3  # the agent API's wait listens with psycopg 3
def test_http_agents_settle_demo_deliveries_through_the_api(alpha, live_server):
    port = int(live_server.url.rsplit(":", 1)[1])
    agents = demo.http_agents(2, "127.0.0.1", port)
    assert [a.base_url for a in agents] == [
        f"http://alpha.demo.buzz:{port}/agents/",
        f"http://beta.demo.buzz:{port}/agents/",
    ]
    settled = WorkflowAgentDelivery.objects.terminal()
    before = settled.count()
    stop = StopRequest()

    def tick(elapsed: float, counts: dict[str, int]) -> None:
        if counts.get("http_claimed", 0) >= 3:
            stop.request("test")

    counts = demo.simulate_agents(agents, 15.0, stop, on_tick=tick)
    assert "http_errors" not in counts
    done = counts.get("http_finished", 0) + counts.get("http_failed", 0)
    assert done == counts["http_claimed"] >= 3
    assert settled.count() == before + done


@pytest.mark.parametrize(
    ("base_url", "connect_to", "message"),
    [
        ("http://a.example/", ("127.0.0.1", 0), "port must be 1 to 65535"),
        ("http://a.example/", ("127.0.0.1", "80"), "port must be 1 to 65535"),
        ("http://a.example/", ("", 80), "address must be"),
        ("http://a.example/", "127.0.0.1:80", r"an \(address, port\) pair"),
        ("https://a.example/", ("127.0.0.1", 443), "http:// base_url only"),
    ],
)
def test_agent_client_refuses_a_bad_connect_to(base_url, connect_to, message):
    with pytest.raises(ProtocolError, match=message) as refused:
        AgentClient(base_url, bytes(range(1, 33)), connect_to=connect_to)
    assert refused.value.field == "connect_to"


@pytest.fixture(autouse=True)
def _no_leftover_agents() -> Iterator[None]:
    yield
    assert not [t for t in threading.enumerate() if t.name.startswith("agent-")]
