"""A realistic demo data set, built only through the service API, and simulated agents.

Every id is derived from a name (uuid5, sha256), so loading twice creates nothing new:
tenant rows use ``get_or_create`` and the delivery commit skips identities it already
holds. States are driven only for deliveries created by this load, so a second load
changes nothing either.
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from uuid import UUID

from django.contrib.auth import get_user_model
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

from workflow_delivery import keys, services
from workflow_delivery.client import AgentClient
from workflow_delivery.commandline import StopRequest
from workflow_delivery.consumer import (
    Consumer,
    ConsumerStats,
    DeliveryContext,
    Handler,
    PermanentFailure,
)
from workflow_delivery.consumer import logger as consumer_logger
from workflow_delivery.exceptions import AgentApiError
from workflow_delivery.models import (
    Community,
    DeletionState,
    Event,
    RunStatus,
    Workflow,
    WorkflowAgentDelivery,
    WorkflowRun,
)
from workflow_delivery.protocol import (
    MESSAGE_KIND,
    MESSAGE_V1_MARKER,
    Cause,
    CauseKind,
    Claimed,
    DeliveryBinding,
    DeliveryRecord,
    EventCause,
    Lease,
    LeaseLost,
    NewDelivery,
    Outcome,
    ScheduleCause,
    WebhookCause,
)

logger = logging.getLogger("buzz_project.demo")

NAMESPACE = uuid.UUID("6f1d3c1e-8a55-4d6b-9a53-2f8e0c7b9d10")
HOSTS = ("alpha.demo.buzz", "beta.demo.buzz", "gamma.demo.buzz")
QUIESCING_HOST = "gamma.demo.buzz"
API_MOUNT = "/agents/"  # where buzz_project.urls mounts the agent API
AGENTS = ("scout", "scribe", "sentry")
WORKFLOWS = {
    "triage": CauseKind.EVENT,
    "nightly-digest": CauseKind.SCHEDULE,
    "deploy-hook": CauseKind.WEBHOOK,
}
RUNS_PER_WORKFLOW = 2
RUN_STATUSES = (RunStatus.RUNNING, RunStatus.WAITING_APPROVAL)
STEPS = ("notify", "follow-up")
# Where each delivery ends up, cycled per workflow so every cause kind shows every state.
FATES = ("pending", "claimed", "expired", "finished", "failed")
WORKING_LEASE_SECONDS = 3600
EXPIRING_LEASE_SECONDS = 1


def demo_uuid(*parts: str) -> UUID:
    return uuid.uuid5(NAMESPACE, ":".join(parts))


def demo_key(*parts: str) -> bytes:
    return hashlib.sha256(":".join(("buzz-demo", *parts)).encode()).digest()


def agent_secret(host: str, name: str) -> bytes:
    """The secp256k1 secret key of a demo agent (a sha256 digest is a valid one with
    overwhelming odds); its x-only public key is the delivery target, so the agent
    can sign API requests as itself."""
    return demo_key(host, "agent", name)


@functools.cache
def _agent_pubkeys(host: str) -> tuple[bytes, ...]:
    return tuple(keys.public_key_bytes(agent_secret(host, name)) for name in AGENTS)


def agent_pubkeys(host: str) -> list[bytes]:
    return list(_agent_pubkeys(host))


@dataclass
class DemoReport:
    created: Counter = field(default_factory=Counter)
    skipped_hosts: list[str] = field(default_factory=list)
    stale_hosts: list[str] = field(default_factory=list)
    quiesced_hosts: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        hosts = Community.objects.filter(host__in=HOSTS)
        return {
            "communities": hosts.count(),
            "workflows": Workflow.objects.filter(community__in=hosts).count(),
            "runs": WorkflowRun.objects.filter(community__in=hosts).count(),
            "message events": Event.objects.filter(community__in=hosts).count(),
            "deliveries": WorkflowAgentDelivery.objects.filter(community__in=hosts).count(),
        }


def _cause(kind: CauseKind, name: str, message: Event) -> Cause:
    if kind == CauseKind.EVENT:
        return EventCause(demo_key(name, "cause"))
    if kind == CauseKind.SCHEDULE:
        return ScheduleCause(message.created_at.replace(minute=0, second=0, microsecond=0))
    return WebhookCause(demo_uuid(name, "invocation"))


def _get_or_create(report: DemoReport, model, **kwargs):
    row, created = model.objects.get_or_create(**kwargs)
    report.created[model._meta.verbose_name_plural] += created
    return row


def _message(report: DemoReport, community: Community, name: str, owner: bytes, minutes_ago: int):
    targets = agent_pubkeys(community.host)
    tags = [["p", target.hex(), "", MESSAGE_V1_MARKER] for target in targets]
    tags.append(["p", owner.hex()])  # a plain mention: not a delivery target
    return _get_or_create(
        report,
        Event,
        id=demo_key(name, "message"),
        defaults={
            "community": community,
            "created_at": timezone.now().replace(microsecond=0) - timedelta(minutes=minutes_ago),
            "kind": MESSAGE_KIND,
            "pubkey": owner,
            "content": f"{name}: please take a look",
            "tags": tags,
        },
    )


def _drive(delivery: NewDelivery, fate: str, expiring: list[UUID]) -> None:
    """Move a freshly created delivery to its fate through claim, renew and finish."""
    if fate == "pending":
        return
    binding = delivery.binding
    seconds = EXPIRING_LEASE_SECONDS if fate == "expired" else WORKING_LEASE_SECONDS
    lease, _ = services.claim_delivery(
        binding.community_id,
        binding.target_pubkey,
        delivery_id=delivery.id,
        expected=binding,
        lease_seconds=seconds,
    )
    if fate == "expired":
        expiring.append(delivery.id)
    elif fate in (Outcome.FINISHED, Outcome.FAILED):
        services.renew_delivery(lease, lease_seconds=WORKING_LEASE_SECONDS)
        services.finish_delivery(lease, Outcome(fate))


def _load_step(
    report: DemoReport,
    run: WorkflowRun,
    flow: Workflow,
    step_id: str,
    cause_kind: CauseKind,
    minutes_ago: int,
) -> tuple[list[NewDelivery], set[UUID]]:
    """Commit one step's deliveries, storing its message in the same transaction."""
    community = run.community
    name = f"{community.host}:{flow.name}:{run.id}:{step_id}"
    with services.delivery_identity(community.id, run.id, step_id) as step:
        message = _message(report, community, name, bytes(flow.owner_pubkey), minutes_ago)
        cause = _cause(cause_kind, name, message)
        batch = []
        for target in agent_pubkeys(community.host):
            binding = DeliveryBinding(
                community_id=community.id,
                workflow_id=flow.id,
                run_id=run.id,
                step_id=step_id,
                target_pubkey=target,
                definition_event_id=bytes(flow.definition_event_id),
                message_event_id=bytes(message.id),
                cause=cause,
            )
            binding.validate_message_event(message.kind, bytes(message.id), message.tags)
            batch.append(NewDelivery(demo_uuid(name, target.hex()), binding))
        created = set(step.commit(message.created_at, batch))
    report.created["deliveries"] += len(created)
    return batch, created


def _load_workflow(
    report: DemoReport,
    community: Community,
    flow_index: int,
    flow_name: str,
    cause_kind: CauseKind,
    expiring: list[UUID],
) -> None:
    host = community.host
    flow = _get_or_create(
        report,
        Workflow,
        id=demo_uuid(host, flow_name),
        defaults={
            "community": community,
            "name": flow_name,
            "owner_pubkey": demo_key(host, flow_name, "owner"),
            "definition": {
                "trigger": cause_kind.value,
                "steps": [{"id": step, "action": "send_message"} for step in STEPS],
            },
            "definition_event_id": demo_key(host, flow_name, "definition"),
        },
    )
    fates = iter(FATES * len(AGENTS) * len(STEPS) * RUNS_PER_WORKFLOW)
    for run_index in range(RUNS_PER_WORKFLOW):
        run = _get_or_create(
            report,
            WorkflowRun,
            id=demo_uuid(host, flow_name, f"run-{run_index}"),
            defaults={
                "community": community,
                "workflow": flow,
                "status": RUN_STATUSES[run_index % len(RUN_STATUSES)],
                "definition_event_id": flow.definition_event_id,
            },
        )
        for step_index, step_id in enumerate(STEPS):
            minutes_ago = 90 - 20 * flow_index - 10 * run_index - 3 * step_index
            batch, created = _load_step(report, run, flow, step_id, cause_kind, minutes_ago)
            for delivery, fate in zip(batch, fates, strict=False):
                if delivery.id in created:
                    _drive(delivery, fate, expiring)


def _load_community(report: DemoReport, host: str, expiring: list[UUID]) -> None:
    community = _get_or_create(report, Community, id=demo_uuid(host), defaults={"host": host})
    if community.deletion_state != DeletionState.ACTIVE:
        # Its data was loaded before it was fenced, and a fenced tenant takes no writes.
        report.skipped_hosts.append(host)
        return
    # The keys an older demo gave its agents (bare digests, not signing keys); any
    # other target is a key someone enrolled and served, and is none of the demo's.
    older_keys = [demo_key(host, "agent", name) for name in AGENTS]
    stale = WorkflowAgentDelivery.objects.filter(community=community, target_pubkey__in=older_keys)
    if stale.exists():
        # Loaded by an older demo: its messages name those targets, so new deliveries
        # could not be bound to them.
        report.stale_hosts.append(host)
        return
    # The demo agents are the community's roster: deliveries go only to enrolled keys.
    for name in AGENTS:
        services.enroll_agent(
            community.id, keys.public_key_bytes(agent_secret(host, name)), label=name
        )
    for flow_index, (flow_name, cause_kind) in enumerate(WORKFLOWS.items()):
        _load_workflow(report, community, flow_index, flow_name, cause_kind, expiring)


def _wait_until_expired(delivery_ids: list[UUID], using: str) -> None:
    """Leases of one second, waited out by the database clock (which is what the
    reaper compares with), so no lease is ever forged into the past."""
    expired = WorkflowAgentDelivery.objects.using(using).filter(id__in=delivery_ids)
    while expired.expired_leases().count() < len(delivery_ids):
        time.sleep(0.1)


def load_demo_data(*, using: str = DEFAULT_DB_ALIAS) -> DemoReport:
    """Create (or complete) the demo data set and return what was created."""
    if connections[using].in_atomic_block:
        raise RuntimeError(
            "the demo waits for leases to expire by the database clock, which stands "
            "still inside a transaction: load it in autocommit mode"
        )
    report = DemoReport()
    expiring: list[UUID] = []
    for host in HOSTS:
        _load_community(report, host, expiring)
    _wait_until_expired(expiring, using)
    quiescing = Community.objects.using(using).get(host=QUIESCING_HOST)
    if quiescing.deletion_state == DeletionState.ACTIVE:
        services.transition_community(quiescing.id, DeletionState.QUIESCING, using=using)
        report.quiesced_hosts.append(QUIESCING_HOST)
    return report


def ensure_superuser(username: str, password: str) -> bool:
    """Create the local superuser, or reset its password; True when created."""
    user, created = get_user_model().objects.get_or_create(username=username)
    user.is_staff = user.is_superuser = user.is_active = True
    user.set_password(password)
    user.save()
    return created


class SimulatedFailure(PermanentFailure):
    """Raised by a simulated handler for the one delivery in ten it fails (for good:
    a ``PermanentFailure``, so it is not retried)."""


class _QuietSimulatedFailures(logging.Filter):
    """Keeps the consumer's traceback of a simulated failure off the console (the
    progress line counts it); any other handler error is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], SimulatedFailure))


@contextmanager
def quiet_simulated_failures() -> Iterator[None]:
    quiet = _QuietSimulatedFailures()
    consumer_logger.addFilter(quiet)
    try:
        yield
    finally:
        consumer_logger.removeFilter(quiet)


class AgentTally:
    """Counts of what the simulated agents did, shared between their threads: the
    consumers' own stats plus what the other agents add."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self._consumers: list[ConsumerStats] = []

    def add(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def watch(self, stats: ConsumerStats) -> None:
        with self._lock:
            self._consumers.append(stats)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = Counter(self.counts)
            for stats in self._consumers:
                for name in CONSUMER_COUNTS:
                    counts[name] += getattr(stats, name)
        return {name: value for name, value in counts.items() if value}


CONSUMER_COUNTS = tuple(f.name for f in fields(ConsumerStats))
Until = Callable[[], bool]


def _pause(until: Until, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not until() and (remaining := deadline - time.monotonic()) > 0:
        time.sleep(min(remaining, 0.05))


@dataclass(frozen=True, slots=True)
class Agent:
    """A simulated agent: a ``Consumer`` of one demo identity. Its handler works a
    moment, fails one delivery in ten by raising, and settles half of the others
    itself inside ``holding()`` (a lease-fenced settle); the consumer settles the
    rest, renews the leases and hands back what is in flight when it stops."""

    community_id: UUID
    target_pubkey: bytes
    seed: int
    lease_seconds: int = 2

    def handler(self, rng: random.Random) -> Handler:
        def handle(record: DeliveryRecord, lease: Lease, context: DeliveryContext) -> None:
            context.stopping.wait(rng.uniform(0.05, 0.4))  # the work; cut short at stop
            if rng.random() < 0.1:
                raise SimulatedFailure(f"simulated failure on {record.id}")
            if rng.random() < 0.5:
                with context.holding() as held:
                    held.finish(Outcome.FINISHED)

        return handle

    def run(self, until: Until, tally: AgentTally) -> None:
        try:
            consumer = Consumer(
                self.community_id,
                [self.target_pubkey],
                self.handler(random.Random(self.seed)),
                lease_seconds=self.lease_seconds,
                poll_interval=0.2,
                grace_seconds=1.0,
            )
            tally.watch(consumer.stats)
            consumer.run(stop=until)
        except Exception:
            logger.exception("simulated agent %s stopped on an error", self.target_pubkey.hex())
            tally.add("errors")
        finally:
            connections.close_all()


@dataclass(frozen=True, slots=True)
class CrashingAgent:
    """The agent that crashes, kept beside the consumers: a ``Consumer`` hands its
    leases back when it stops, so it cannot show a crash. This one claims through the
    service calls, works a moment, then abandons the lease as a killed process would
    and restarts a second later; the lease runs out and a running reaper returns the
    delivery to pending for another agent."""

    community_id: UUID
    target_pubkey: bytes
    seed: int
    lease_seconds: int = 2
    restart_seconds: float = 1.0

    def run(self, until: Until, tally: AgentTally) -> None:
        rng = random.Random(self.seed)
        try:
            while not until():
                claimed = services.claim_delivery(
                    self.community_id, self.target_pubkey, lease_seconds=self.lease_seconds
                )
                if claimed is None:
                    _pause(until, 0.2)
                    continue
                tally.add("claimed")
                _pause(until, rng.uniform(0.05, 0.4))
                tally.add("crashed")  # the lease is left to run out
                _pause(until, self.restart_seconds)
        except Exception:
            logger.exception("crashing agent %s stopped on an error", self.target_pubkey.hex())
            tally.add("errors")
        finally:
            # Each thread has its own connection; a leaked one would outlive the run.
            connections.close_all()


@dataclass(frozen=True, slots=True)
class HttpAgent:
    """A simulated agent on the agent HTTP API: an ``AgentClient`` signing as one
    demo identity, talking to the community's host while connecting to the local
    server at ``connect_to``. It claims, works a moment, renews now and then and
    finishes (one in ten failed), claiming its next delivery with the finish: one
    request per delivery while it is busy. With nothing to claim, its claim waits for
    at most a second: under a WSGI server every waiting request holds a server
    thread. A delivery claimed with its last finish, as it stops, is left to its
    lease's end."""

    base_url: str
    secret_key: bytes
    connect_to: tuple[str, int]
    seed: int
    lease_seconds: int = 2

    def run(self, until: Until, tally: AgentTally) -> None:
        rng = random.Random(self.seed)
        with AgentClient(self.base_url, self.secret_key, connect_to=self.connect_to) as client:
            claimed: Claimed | None = None
            while not until():
                try:
                    claimed = self._one(client, rng, until, tally, claimed)
                except (OSError, http.client.HTTPException, AgentApiError) as exc:
                    logger.warning("HTTP agent at %s: %s; retrying in 1 s", self.base_url, exc)
                    tally.add("http_errors")
                    claimed = None
                    _pause(until, 1.0)

    def _one(
        self,
        client: AgentClient,
        rng: random.Random,
        until: Until,
        tally: AgentTally,
        claimed: Claimed | None,
    ) -> Claimed | None:
        """Work on ``claimed`` (or on what a waiting claim gives) and settle it; the
        delivery claimed with the settle, if any."""
        if claimed is None:
            claimed = client.claim(lease_seconds=self.lease_seconds, wait=1)
            if claimed is None:
                return None
        lease = claimed.lease
        tally.add("http_claimed")
        _pause(until, rng.uniform(0.05, 0.4))
        if rng.random() < 0.5:
            renewed = client.renew(lease, lease_seconds=self.lease_seconds)
            tally.add("http_lost" if isinstance(renewed, LeaseLost) else "http_renewed")
        outcome = Outcome.FAILED if rng.random() < 0.1 else Outcome.FINISHED
        answer = client.finish_and_claim_next(lease, outcome, lease_seconds=self.lease_seconds)
        result = answer.result
        tally.add("http_lost" if isinstance(result, LeaseLost) else f"http_{outcome.value}")
        return None if until() else answer.next


SimulatedAgent = Agent | CrashingAgent | HttpAgent


def _identities(order: list[int]) -> list[tuple[Community, int]]:
    """(community, agent index) over the active demo communities, interleaved so a few
    agents already spread over every active community."""
    active = Community.objects.filter(host__in=HOSTS, deletion_state=DeletionState.ACTIVE)
    communities = list(active.order_by("host"))
    return [(c, index) for index in order for c in communities]


def demo_agents(count: int) -> list[Agent | CrashingAgent]:
    """``count`` agents over the demo identities of the active demo communities:
    consumers, the last one a crashing agent when there are two or more."""
    identities = _identities(list(range(len(AGENTS))))
    if not identities:
        return []
    agents: list[Agent | CrashingAgent] = []
    for i in range(count):
        community, index = identities[i % len(identities)]
        kind = CrashingAgent if count >= 2 and i == count - 1 else Agent
        agents.append(kind(community.id, agent_pubkeys(community.host)[index], seed=i))
    return agents


def http_agents(count: int, address: str, port: int) -> list[HttpAgent]:
    """``count`` HTTP agents over the demo identities (the last agents of each
    community first, so they differ from a few ``demo_agents``), for the demo
    server listening at ``address:port``."""
    identities = _identities(list(reversed(range(len(AGENTS)))))
    if not identities:
        return []
    agents = []
    for i in range(count):
        community, index = identities[i % len(identities)]
        agents.append(
            HttpAgent(
                f"http://{community.host}:{port}{API_MOUNT}",
                agent_secret(community.host, AGENTS[index]),
                (address, port),
                seed=i,
            )
        )
    return agents


def start_agents(
    agents: Sequence[SimulatedAgent], until: Until, tally: AgentTally
) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=agent.run, args=(until, tally), name=f"agent-{i}", daemon=True)
        for i, agent in enumerate(agents)
    ]
    for thread in threads:
        thread.start()
    return threads


def simulate_agents(
    agents: Sequence[SimulatedAgent],
    seconds: float,
    stop: StopRequest,
    on_tick: Callable[[float, dict[str, int]], None] | None = None,
) -> dict[str, int]:
    """Run the agents in threads for ``seconds`` or until ``stop``; return the tally."""
    tally = AgentTally()
    started = time.monotonic()
    deadline = started + seconds

    def until() -> bool:
        return bool(stop) or time.monotonic() >= deadline

    with quiet_simulated_failures():
        threads = start_agents(agents, until, tally)
        while not until():
            stop.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            if on_tick is not None:
                on_tick(min(seconds, time.monotonic() - started), tally.snapshot())
        for thread in threads:
            thread.join()
    return tally.snapshot()
