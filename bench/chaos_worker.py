"""One process of a chaos run: a producer, an agent (hand-written, or a ``Consumer``),
the reaper or the tenant deleter.

Run as ``python bench/chaos_worker.py ROLE CONFIG INDEX``. Each process talks to the database
only through the service API, journals every outcome it observed, survives dropped connections
and a server restart by closing its connection and trying again, and stops politely on SIGTERM.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.chaos_journal import Journal  # noqa: E402

T = TypeVar("T")
STEPS = ["ask", "remind", "close"]


class Resumed:
    """How many times this process was resumed (SIGCONT): the harness resumes a holder
    it stalled, and that holder must check its lease before it reports, wherever in
    its work the stall caught it."""

    count = 0

    @classmethod
    def install(cls) -> None:
        def resumed(signum: int, frame: object) -> None:
            cls.count += 1

        signal.signal(signal.SIGCONT, resumed)


class Stop:
    requested = False

    @classmethod
    def install(cls) -> None:
        def request(signum: int, frame: object) -> None:
            cls.requested = True

        signal.signal(signal.SIGTERM, request)
        signal.signal(signal.SIGINT, request)


def setup_django(config: dict[str, Any], role: str, index: int) -> None:
    separator = "&" if "?" in config["database_url"] else "?"
    # The harness finds this process's connections by their application name.
    os.environ["DATABASE_URL"] = (
        f"{config['database_url']}{separator}application_name=chaos-{role}-{index}"
    )
    os.environ["DJANGO_SETTINGS_MODULE"] = "buzz_project.settings"
    # DEBUG would keep every query in memory for the whole run.
    os.environ["DEBUG"] = "false"
    os.environ.setdefault("SECRET_KEY", "chaos-harness-not-a-secret")
    import django

    django.setup()


def work_seconds(rng: random.Random, config: dict[str, Any]) -> float:
    """How long an agent works on the delivery it just claimed: mostly a blink, now and
    then longer than the lease (a share of ``long_work_share``)."""
    if rng.random() < config["long_work_share"]:
        return config["lease"] * rng.uniform(0.5, 1.6)
    return rng.uniform(0.01, 0.1)


def with_reconnect(journal: Journal, during: str, call: Callable[[], T]) -> T | None:
    """Run ``call`` until it gets an answer from the database; None once stopping.

    Only connection-level failures are retried (a dropped backend, a server going down or
    starting up, a session killed by idle_in_transaction_session_timeout): the connection
    is closed so Django opens a fresh one next time. Anything else is a real error and
    propagates.
    """
    from django.db import connection

    from workflow_delivery.errors import is_connection_lost

    while True:
        try:
            return call()
        except Exception as exc:
            # The one classification of the app (errors.py): a lost session, by its
            # SQLSTATE (25P03 included); anything else, a timeout included, is real.
            if not is_connection_lost(exc):
                raise
            journal.write("conn_error", during=during, error=str(exc).splitlines()[0][:200])
            connection.close()
            if Stop.requested and during == "claim":
                return None
            time.sleep(0.1 + random.random() * 0.2)


def run_producer(config: dict[str, Any], index: int, journal: Journal) -> None:
    from workflow_delivery import services
    from workflow_delivery.models import Community, Event, Workflow, WorkflowRun
    from workflow_delivery.protocol import (
        MESSAGE_KIND,
        MESSAGE_V1_MARKER,
        DeliveryBinding,
        EventCause,
        NewDelivery,
        ScheduleCause,
        WebhookCause,
    )

    tenant = config["communities"][index]
    community_id, workflow_id = uuid.UUID(tenant["id"]), uuid.UUID(tenant["workflow_id"])
    # The HTTP agents' keys are targets too: the producers address them like the others.
    targets = [bytes.fromhex(target) for target in config["targets"]] + http_targets(config)
    rng = random.Random(config["seed"] * 1000 + index)
    host = tenant.get("host") or f"chaos-{index}-{community_id.hex[:8]}.example"

    def ensure_tenant() -> None:
        community, _ = Community.objects.get_or_create(id=community_id, defaults={"host": host})
        Workflow.objects.get_or_create(
            id=workflow_id,
            defaults={"community": community, "name": "chaos", "owner_pubkey": os.urandom(32)},
        )
        services.enroll_agents(community_id, targets)

    with_reconnect(journal, "tenant", ensure_tenant)
    budget = config["deliveries_per_producer"]
    # Spread the budget over most of the fault window (a step has 2.5 targets on average).
    pause = 0.8 * config["seconds"] / max(1, budget / 2.5)
    committed = 0
    while committed < budget and not Stop.requested:
        run_id = uuid.uuid4()
        for step_id in STEPS:
            if committed >= budget or Stop.requested:
                break
            chosen = rng.sample(targets, rng.randint(2, min(3, len(targets))))
            message_id = os.urandom(32)
            created_at = datetime.now(UTC).replace(microsecond=0)
            cause = rng.choice(
                [
                    EventCause(os.urandom(32)),
                    ScheduleCause(created_at),
                    WebhookCause(uuid.uuid4()),
                ]
            )
            batch = [
                NewDelivery(
                    uuid.uuid4(),
                    DeliveryBinding(
                        community_id=community_id,
                        workflow_id=workflow_id,
                        run_id=run_id,
                        step_id=step_id,
                        target_pubkey=target,
                        definition_event_id=bytes(32),
                        message_event_id=message_id,
                        cause=cause,
                    ),
                )
                for target in chosen
            ]

            def commit_step(
                run_id: uuid.UUID = run_id,
                step_id: str = step_id,
                batch: list[NewDelivery] = batch,
                message_id: bytes = message_id,
                created_at: datetime = created_at,
                chosen: list[bytes] = chosen,
            ) -> tuple[bool, list[uuid.UUID]]:
                with services.delivery_identity(community_id, run_id, step_id) as step:
                    existed = step.exists
                    if not existed:
                        # A retry after an ambiguous commit finds the step already there
                        # and reuses the message it stored, as a real producer must.
                        WorkflowRun.objects.get_or_create(
                            id=run_id,
                            defaults={"community_id": community_id, "workflow_id": workflow_id},
                        )
                        Event.objects.create(
                            id=message_id,
                            community_id=community_id,
                            created_at=created_at,
                            kind=MESSAGE_KIND,
                            pubkey=os.urandom(32),
                            content="chaos",
                            tags=[["p", t.hex(), "", MESSAGE_V1_MARKER] for t in chosen],
                        )
                    created = step.commit(created_at, batch)
                return existed, created

            if config.get("send_message") and index % 2:
                # The other producer API: send_message under an idempotency key, whose
                # retry after an ambiguous commit returns what the first call stored.
                key = f"{run_id}:{step_id}"
                sent = with_reconnect(
                    journal,
                    "commit",
                    lambda key=key, chosen=chosen: services.send_message(
                        community_id, targets=chosen, content="chaos", idempotency_key=key
                    ),
                )
                ids = [str(record.id) for record in sent.deliveries]
                journal.write(
                    "commit",
                    community=str(community_id),
                    run=str(sent.run_id),
                    step=sent.step_id,
                    ids=ids,
                    created=ids if sent.created else [],
                    existed=not sent.created,
                )
                committed += len(ids)
                time.sleep(pause * rng.uniform(0.5, 1.5))
                continue
            answer = with_reconnect(journal, "commit", commit_step)
            existed, created = answer
            journal.write(
                "commit",
                community=str(community_id),
                run=str(run_id),
                step=step_id,
                ids=[str(item.id) for item in batch],
                created=[str(value) for value in created],
                existed=existed,
            )
            committed += len(batch)
            time.sleep(pause * rng.uniform(0.5, 1.5))
    journal.write("done", committed=committed)


def run_agent(config: dict[str, Any], index: int, journal: Journal) -> None:
    if config.get("agent_kind") == "consumer":
        run_consumer_agent(config, index, journal)
        return
    from workflow_delivery import services
    from workflow_delivery.protocol import LeaseLost, Outcome, Renewed, Settled

    lease_seconds = config["lease"]
    pairs = [
        (tenant["id"], bytes.fromhex(target))
        for tenant in config["communities"]
        for target in config["targets"]
    ]
    rng = random.Random()

    def finish(lease: Any, outcome: Outcome) -> None:
        t0 = time.time()
        result = with_reconnect(journal, "finish", lambda: services.finish_delivery(lease, outcome))
        if isinstance(result, Settled):
            name = "settled"
        elif isinstance(result, LeaseLost):
            name = "lost"
        else:
            name = f"already:{result.status.value}"
        journal.write(
            "finish",
            id=str(lease.delivery_id),
            gen=lease.generation,
            t0=t0,
            outcome=outcome.value,
            result=name,
        )

    def renew(lease: Any) -> bool:
        t0 = time.time()
        renewed = with_reconnect(
            journal,
            "renew",
            lambda: services.renew_delivery(lease, lease_seconds=lease_seconds),
        )
        journal.write(
            "renew",
            id=str(lease.delivery_id),
            gen=lease.generation,
            t0=t0,
            result="renewed" if isinstance(renewed, Renewed) else "lost",
        )
        return isinstance(renewed, Renewed)

    def hold(lease: Any, work: float) -> None:
        """Work on a claimed delivery for ``work`` seconds, renewing at a third of the
        lease, then settle it."""
        done_at = time.monotonic() + work
        resumes = Resumed.count
        lost = False
        while time.monotonic() < done_at:
            nap = max(0.0, min(lease_seconds / 3, done_at - time.monotonic()))
            woke_late = time.monotonic() + nap + lease_seconds / 3
            time.sleep(nap)
            # A holder that finds it was paused checks its lease before reporting.
            paused = time.monotonic() > woke_late or Resumed.count != resumes
            if time.monotonic() >= done_at and not paused:
                break
            resumes = Resumed.count
            if not renew(lease):
                lost = True
                break
        if not lost and Resumed.count != resumes:
            # Paused after its last check (between the work and the report): it checks
            # again, as it would have had the pause caught it asleep.
            renew(lease)
        # A holder that already acted, or lost its lease, still reports its outcome
        # once; the fence, not the holder's good manners, must refuse it.
        outcome = Outcome.FAILED if rng.random() < 0.1 else Outcome.FINISHED
        finish(lease, outcome)

    while not Stop.requested:
        rng.shuffle(pairs)
        claimed = None
        for community_id, target in pairs:
            claimed = with_reconnect(
                journal,
                "claim",
                lambda c=community_id, t=target: services.claim_delivery(
                    c, t, lease_seconds=lease_seconds
                ),
            )
            if claimed is not None or Stop.requested:
                break
        if claimed is None:
            time.sleep(config["idle_poll"])
            continue
        lease, record = claimed
        work = work_seconds(rng, config)
        journal.write(
            "claim",
            id=str(lease.delivery_id),
            gen=lease.generation,
            community=str(lease.community_id),
            step=record.binding.step_id,
            lease_until=lease.lease_until.isoformat(),
            work=work,
        )
        hold(lease, work)


def http_targets(config: dict[str, Any]) -> list[bytes]:
    """The public keys of the HTTP agents' secret keys (none without HTTP agents); the
    waiting agents' keys are the waker's targets, not the producers'."""
    from workflow_delivery import keys

    return [keys.public_key_bytes(bytes.fromhex(key)) for key in config.get("http_secrets", [])]


def wait_targets(config: dict[str, Any]) -> list[bytes]:
    """The public keys of the waiting HTTP agents, one each."""
    from workflow_delivery import keys

    secrets = config.get("http_wait_secrets", [])
    return [keys.public_key_bytes(bytes.fromhex(key)) for key in secrets]


# An HTTP request not answered within this many seconds is counted as hung (and sent
# again): the recovery goal's bound on a lost primary.
HTTP_BOUND = 30.0
# Refusals of a claim before the producer has written the community and its roster.
NOT_READY = ("unknown_community", "auth_unknown_agent")
# How often an HTTP agent journals its running request counts.
HTTP_STATS_EVERY = 5.0
# Seconds a waiting HTTP agent asks its waits and waiting claims to wait at most.
WAIT_SECONDS = 10


class HttpAgent:
    """What the HTTP agents share: their server, their request counts, and ``call``,
    which sends a request until it is answered."""

    def __init__(self, config: dict[str, Any], server: dict[str, str], journal: Journal) -> None:
        from collections import Counter

        self.config = config
        self.server = server
        self.journal = journal
        self.counts: Counter[str] = Counter()
        self.reported_at = time.monotonic()

    def client(self, tenant: dict[str, Any], secret: bytes) -> Any:
        from urllib.parse import urlsplit

        from workflow_delivery.client import AgentClient

        return AgentClient(
            f"http://{tenant['host']}/agents/",
            secret,
            timeout=HTTP_BOUND,
            connect_to=("127.0.0.1", urlsplit(self.server["url"]).port),
        )

    def report(self, *, every: float | None = None) -> None:
        if every is None or time.monotonic() - self.reported_at > every:
            self.journal.write("http_stats", server=self.server["name"], **self.counts)
            self.reported_at = time.monotonic()

    def call(
        self,
        during: str,
        send: Callable[[], T],
        *,
        starting: bool = False,
        wait: int | None = None,
    ) -> tuple[bool, T | None]:
        """(True, answer) once answered; (False, None) when a claim or a wait is given
        up on (stopping or, ``starting``, a community or roster not written yet). A
        request that asked to ``wait`` is journaled each time it is sent, with what
        answered it and when (``http_wait``)."""
        import http.client

        from workflow_delivery.exceptions import AgentApiError

        while True:
            self.counts["requests"] += 1
            started, sent_at = time.monotonic(), time.time()
            try:
                answer = send()
            except AgentApiError as exc:
                if starting and exc.code in NOT_READY:
                    # The producer creates the community, then enrolls the keys.
                    return False, None
                if exc.status != 503:
                    raise
                self.counts["unavailable"] += 1
                problem, answered = f"503 {exc.code}", "unavailable"
            except TimeoutError:
                self.counts["hung"] += 1
                problem, answered = f"no answer in {HTTP_BOUND:g} s", "hung"
                self.journal.write("http_hung", server=self.server["name"], during=during)
            except (OSError, http.client.HTTPException) as exc:
                self.counts["connection_errors"] += 1
                problem, answered = f"{type(exc).__name__}: {exc}", "connection_error"
            else:
                if wait is not None:
                    self._waited(during, wait, sent_at, started, answer)
                return True, answer
            if wait is not None:
                self._waited(during, wait, sent_at, started, None, answered)
            self.journal.write(
                "http_retry",
                server=self.server["name"],
                during=during,
                seconds=round(time.monotonic() - started, 3),
                error=problem[:200],
            )
            self.report(every=HTTP_STATS_EVERY)
            if Stop.requested and during != "finish":
                return False, None
            time.sleep(0.2 + random.random() * 0.3)

    def _waited(
        self,
        during: str,
        wait: int,
        sent_at: float,
        started: float,
        answer: Any,
        answered: str | None = None,
    ) -> None:
        """One wait or waiting claim: when it was sent, how long it took, and its answer
        (a delivery, empty, 503, a connection error, or none within the bound)."""
        delivery_id = None
        if answered is None:
            if answer is None:
                answered = "empty"
            else:
                answered = "delivery"
                # A waiting claim answers (lease, record); a wait, a hint.
                lease = getattr(answer, "lease", None)
                delivery_id = str(lease.delivery_id if lease else answer.delivery_id)
        self.counts["waits"] += 1
        self.journal.write(
            "http_wait",
            server=self.server["name"],
            kind=during,
            wait=wait,
            sent_at=sent_at,
            seconds=round(time.monotonic() - started, 3),
            answer=answered,
            id=delivery_id,
        )


def run_http_agent(config: dict[str, Any], index: int, journal: Journal) -> None:
    """An agent of the signed HTTP API, through one of the harness's servers (uvicorn or
    gunicorn, by index): the first ones claim in every community, work a blink and
    finish; the last ``http_waiting_agents`` wait instead (``run_waiting_agent``). Both
    journal claims and settles as the other agents do. A request refused with 503,
    not answered within ``HTTP_BOUND`` or whose connection failed is sent again (a
    finish's retry answers its recorded outcome); any other refusal is an error."""
    servers = config["http_servers"]
    regular = config["http_agents"] - config.get("http_waiting_agents", 0)
    if index >= regular:
        waiting = index - regular
        agent = HttpAgent(config, servers[waiting % len(servers)], journal)
        run_waiting_agent(config, waiting, agent)
        return
    agent = HttpAgent(config, servers[index % len(servers)], journal)
    secrets = config["http_secrets"]
    secret = bytes.fromhex(secrets[(index // len(servers)) % len(secrets)])
    clients = [agent.client(tenant, secret) for tenant in config["communities"]]
    rng = random.Random()
    # The clients answered once: from then on a refusal is an error.
    ready: set[int] = set()
    try:
        while not Stop.requested:
            agent.report(every=HTTP_STATS_EVERY)
            rng.shuffle(clients)
            claimed = None
            for client in clients:
                answered, claimed = agent.call(
                    "claim",
                    lambda c=client: c.claim(lease_seconds=config["lease"]),
                    starting=id(client) not in ready,
                )
                if answered:
                    ready.add(id(client))
                if claimed is not None:
                    break
                if Stop.requested:
                    break
            if claimed is None:
                time.sleep(config["http_idle_poll"])
                continue
            http_work_and_finish(config, agent, client, claimed, rng)
    finally:
        agent.report()
        for client in clients:
            client.close()


def run_waiting_agent(config: dict[str, Any], waiting: int, agent: HttpAgent) -> None:
    """A waiting agent of the HTTP API: the only holder of its key, to which only the
    waker sends, in one community. It waits by turns in a waiting claim (``claim(wait=
    WAIT_SECONDS)``) and in ``wait(WAIT_SECONDS)`` followed by a claim, so that a wait
    is in flight whenever the primary is lost; each wait is journaled (``http_wait``)."""
    communities = config["communities"]
    secret = bytes.fromhex(config["http_wait_secrets"][waiting])
    client = agent.client(communities[waiting % len(communities)], secret)
    rng = random.Random()
    ready = False
    turn = 0
    try:
        while not Stop.requested:
            agent.report(every=HTTP_STATS_EVERY)
            turn += 1
            if turn % 2:
                answered, claimed = agent.call(
                    "wait_claim",
                    lambda: client.claim(lease_seconds=config["lease"], wait=WAIT_SECONDS),
                    starting=not ready,
                    wait=WAIT_SECONDS,
                )
            else:
                answered, hint = agent.call(
                    "wait", lambda: client.wait(WAIT_SECONDS), starting=not ready, wait=WAIT_SECONDS
                )
                claimed = None
                if hint is not None:
                    answered, claimed = agent.call(
                        "claim", lambda: client.claim(lease_seconds=config["lease"])
                    )
            ready = ready or answered
            if not answered:
                time.sleep(config["http_idle_poll"])
            elif claimed is not None:
                http_work_and_finish(config, agent, client, claimed, rng)
    finally:
        agent.report()
        client.close()


def http_work_and_finish(
    config: dict[str, Any], agent: HttpAgent, client: Any, claimed: Any, rng: random.Random
) -> None:
    """Journal the claim, work a blink, finish (sent until answered) and journal it."""
    from workflow_delivery.protocol import AlreadyTerminal, LeaseLost, Outcome, Settled

    lease, record = claimed
    server = agent.server["name"]
    work = rng.uniform(0.01, 0.1)
    agent.journal.write(
        "claim",
        id=str(lease.delivery_id),
        gen=lease.generation,
        community=str(lease.community_id),
        step=record.binding.step_id,
        lease_until=lease.lease_until.isoformat(),
        work=work,
        server=server,
    )
    time.sleep(work)
    outcome = Outcome.FAILED if rng.random() < 0.1 else Outcome.FINISHED
    t0 = time.time()
    # Sent until answered, even while stopping: an unanswered finish may have
    # been recorded, and only its answer says so.
    _, result = agent.call("finish", lambda: client.finish(lease, outcome))
    if isinstance(result, Settled):
        name = "settled"
    elif isinstance(result, LeaseLost):
        name = "lost"
    elif isinstance(result, AlreadyTerminal):
        name = f"already:{result.status.value}"
    else:
        agent.journal.write("abandon", id=str(lease.delivery_id), gen=lease.generation)
        return
    agent.journal.write(
        "finish",
        id=str(lease.delivery_id),
        gen=lease.generation,
        t0=t0,
        outcome=outcome.value,
        result=name,
        server=server,
    )


def run_waker(config: dict[str, Any], index: int, journal: Journal) -> None:
    """Sends one message at a time to a waiting HTTP agent's key, in that agent's
    community, every second or so until stopped (``send_message`` under an idempotency
    key, resent after a lost connection), journaling each commit and when its first
    attempt began (``t0``): the waits it should wake."""
    from workflow_delivery import services
    from workflow_delivery.exceptions import CommunityNotFound

    communities = config["communities"]
    targets = wait_targets(config)
    rng = random.Random(config["seed"] * 1000 + 999)
    for waiting, target in enumerate(targets):
        community_id = communities[waiting % len(communities)]["id"]
        while not Stop.requested:
            try:
                # The producers create the communities; the waker enrolls its own keys.
                with_reconnect(
                    journal,
                    "tenant",
                    lambda c=community_id, t=target: services.enroll_agents(c, [t]),
                )
                break
            except CommunityNotFound:
                time.sleep(0.2)
    sent = 0
    while not Stop.requested:
        waiting = rng.randrange(len(targets))
        community_id = communities[waiting % len(communities)]["id"]
        key = f"waker-{config['seed']}-{sent}"
        t0 = time.time()
        answer = with_reconnect(
            journal,
            "commit",
            lambda c=community_id, k=key, t=targets[waiting]: services.send_message(
                c, targets=[t], content="wake", idempotency_key=k
            ),
        )
        ids = [str(record.id) for record in answer.deliveries]
        journal.write(
            "commit",
            community=community_id,
            run=str(answer.run_id),
            step=answer.step_id,
            ids=ids,
            created=ids if answer.created else [],
            existed=not answer.created,
            t0=t0,
            waiting=waiting,
        )
        sent += 1
        time.sleep(rng.uniform(0.3, 1.2))


EFFECTS_TABLE = "chaos_effects"


def run_consumer_agent(config: dict[str, Any], index: int, journal: Journal) -> None:
    """An agent built on ``workflow_delivery.consumer.Consumer`` for one community: the
    handler works a while, then writes one effect row and settles in one ``holding()``
    block. Heartbeats are the consumer's own (not journaled)."""
    from django.db import InterfaceError, OperationalError, connection

    from workflow_delivery.consumer import Consumer
    from workflow_delivery.exceptions import LeaseNotLive
    from workflow_delivery.protocol import Outcome

    lease_seconds = config["lease"]
    tenant = config["communities"][index % len(config["communities"])]
    targets = [bytes.fromhex(target) for target in config["targets"]]
    rng = random.Random()

    def handler(record: Any, lease: Any, context: Any) -> None:
        work = work_seconds(rng, config)
        journal.write(
            "claim",
            id=str(lease.delivery_id),
            gen=lease.generation,
            community=str(lease.community_id),
            step=record.binding.step_id,
            lease_until=lease.lease_until.isoformat(),
            work=work,
        )
        # Longer than the lease on purpose now and then: the heartbeat must carry it.
        context.lost.wait(work)
        outcome = Outcome.FAILED if rng.random() < 0.1 else Outcome.FINISHED

        def effect_and_finish() -> str:
            try:
                with context.holding() as held, connection.cursor() as cursor:
                    cursor.execute(
                        f"INSERT INTO {EFFECTS_TABLE} (delivery_id, generation, pid) "
                        "VALUES (%s, %s, %s)",
                        [lease.delivery_id, lease.generation, os.getpid()],
                    )
                    held.finish(outcome)
            except LeaseNotLive:
                return "lost"
            return "settled"

        while True:
            t0 = time.time()
            try:
                result = effect_and_finish()
            except (OperationalError, InterfaceError) as exc:
                # The block's fate is unknown (its commit may have landed): try again on
                # a new connection; the fence refuses the retry if it had.
                journal.write("conn_error", during="holding", error=str(exc).splitlines()[0])
                connection.close()
                if Stop.requested:
                    journal.write("abandon", id=str(lease.delivery_id), gen=lease.generation)
                    raise
                time.sleep(0.1 + random.random() * 0.2)
                continue
            break
        journal.write(
            "finish",
            id=str(lease.delivery_id),
            gen=lease.generation,
            t0=t0,
            outcome=outcome.value,
            result=result,
        )

    consumer = Consumer(
        tenant["id"],
        targets,
        handler,
        lease_seconds=lease_seconds,
        poll_interval=config["consumer_poll"],
        grace_seconds=lease_seconds,
    )
    stats = consumer.run(stop=lambda: Stop.requested)
    journal.write("consumer_stats", **vars(stats))


def run_reaper(config: dict[str, Any], index: int, journal: Journal) -> None:
    from workflow_delivery import services

    while not Stop.requested:
        reaped = with_reconnect(journal, "reap", services.reap_expired_deliveries)
        if reaped:
            journal.write("reap", count=reaped)
        time.sleep(config["reap_interval"])


def _pause_until(deadline: float) -> bool:
    """Sleep until ``deadline`` (time.monotonic); False when a stop came first."""
    while not Stop.requested and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Stop.requested


def run_deleter(config: dict[str, Any], index: int, journal: Journal) -> None:
    """A tenant under deletion while the fleet works, fed by a huge step.

    1. A huge step: one step with ``huge_step_targets`` targets (more than 65,535
       bind parameters would allow row by row) is committed into a doomed community
       in one call, then retried through ``delivery_identity``, which must create none.
    2. A few of its deliveries are claimed with one-second leases and left to expire.
    3. A probe delivery of a healthy community is claimed with a one-second lease.
    4. The doomed community goes quiescing, and the executor then holds its exclusive
       deletion lock (a slow drain) until the reaper has reclaimed the healthy probe:
       the sweep must skip the locked tenant, not wait for it.
    5. Fenced, purged, tombstoned.
    """
    import psycopg

    from workflow_delivery import services
    from workflow_delivery.models import (
        Community,
        Event,
        Workflow,
        WorkflowAgentDelivery,
        WorkflowRun,
    )
    from workflow_delivery.protocol import MESSAGE_KIND, DeliveryBinding, EventCause, NewDelivery

    started = time.monotonic()
    lease = 1
    created_at = datetime.now(UTC).replace(microsecond=0)

    def tenant(label: str) -> dict[str, Any]:
        ids = {"community": uuid.uuid4(), "workflow": uuid.uuid4(), "run": uuid.uuid4()}
        message = os.urandom(32)

        def create() -> None:
            community, _ = Community.objects.get_or_create(
                id=ids["community"], defaults={"host": f"chaos-{label}-{index}.example"}
            )
            Workflow.objects.get_or_create(
                id=ids["workflow"],
                defaults={"community": community, "name": label, "owner_pubkey": os.urandom(32)},
            )
            WorkflowRun.objects.get_or_create(
                id=ids["run"],
                defaults={"community_id": ids["community"], "workflow_id": ids["workflow"]},
            )
            Event.objects.get_or_create(
                id=message,
                defaults={
                    "community_id": ids["community"],
                    "created_at": created_at,
                    "kind": MESSAGE_KIND,
                    "pubkey": os.urandom(32),
                    "content": label,
                    "tags": [],
                },
            )

        with_reconnect(journal, "tenant", create)
        return {**ids, "message": message}

    def deliveries(t: dict[str, Any], targets: list[bytes]) -> list[NewDelivery]:
        return [
            NewDelivery(
                uuid.uuid4(),
                DeliveryBinding(
                    community_id=t["community"],
                    workflow_id=t["workflow"],
                    run_id=t["run"],
                    step_id="huge",
                    target_pubkey=target,
                    definition_event_id=bytes(32),
                    message_event_id=t["message"],
                    cause=EventCause(bytes(32)),
                ),
            )
            for target in targets
        ]

    doomed, probe = tenant("doomed"), tenant("probe")
    journal.write("tenants", communities=[str(doomed["community"]), str(probe["community"])])

    # 1. The huge step, then its retry by another producer path.
    targets = [os.urandom(32) for _ in range(config["huge_step_targets"])]
    with_reconnect(journal, "tenant", lambda: services.enroll_agents(doomed["community"], targets))
    t0 = time.monotonic()
    with_reconnect(
        journal,
        "huge_step",
        lambda: services.commit_deliveries(
            doomed["community"], created_at, deliveries(doomed, targets)
        ),
    )
    seconds = time.monotonic() - t0

    def retry() -> tuple[bool, int]:
        with services.delivery_identity(doomed["community"], doomed["run"], "huge") as step:
            return step.exists, len(step.commit(created_at, deliveries(doomed, targets)))

    exists, retry_created = with_reconnect(journal, "huge_step", retry)
    rows = with_reconnect(
        journal,
        "huge_step",
        lambda: WorkflowAgentDelivery.objects.filter(community_id=doomed["community"]).count(),
    )
    journal.write(
        "huge_step",
        targets=len(targets),
        rows=rows,
        existed_on_retry=exists,
        retry_created=retry_created,
        seconds=round(seconds, 3),
    )

    # 2. A few leases left to expire in the doomed tenant.
    for target in targets[:3]:
        with_reconnect(
            journal,
            "claim",
            lambda t=target: services.claim_delivery(doomed["community"], t, lease_seconds=lease),
        )

    if not _pause_until(started + config["deletion_after"]):
        return
    # 3. The healthy probe.
    probe_target = os.urandom(32)
    with_reconnect(
        journal, "tenant", lambda: services.enroll_agents(probe["community"], [probe_target])
    )
    with_reconnect(
        journal,
        "commit",
        lambda: services.commit_deliveries(
            probe["community"], created_at, deliveries(probe, [probe_target])
        ),
    )
    claimed = with_reconnect(
        journal,
        "claim",
        lambda: services.claim_delivery(probe["community"], probe_target, lease_seconds=lease),
    )
    probe_lease = claimed[0] if claimed else None

    # 4. Quiescing, then the exclusive lock held until the probe is reclaimed.
    generation = with_reconnect(
        journal, "deletion", lambda: services.transition_community(doomed["community"], "quiescing")
    )
    hold_limit = lease + 8 * config["reap_interval"] + 10

    def hold() -> float | None:
        # This session keeps the exclusive lock; a second one watches the probe.
        with (
            services.executor_writes(doomed["community"], generation),
            psycopg.connect(config["database_url"], autocommit=True) as watcher,
        ):
            deadline = time.monotonic() + hold_limit
            while time.monotonic() < deadline and not Stop.requested:
                status = watcher.execute(
                    "SELECT status FROM workflow_agent_deliveries WHERE id = %s",
                    [probe_lease.delivery_id],
                ).fetchone()[0]
                if status == "pending":
                    return time.time()
                time.sleep(0.02)
        return None

    reclaimed_at = with_reconnect(journal, "deletion", hold) if probe_lease else None
    journal.write(
        "probe",
        lease_until=probe_lease.lease_until.timestamp() if probe_lease else None,
        reclaimed_at=reclaimed_at,
        while_locked=reclaimed_at is not None,
        # On time: within a few reaper intervals of the expiry (headroom for a loaded
        # machine), as if no tenant were locked.
        bound=3 * config["reap_interval"] + 2,
    )

    # 5. Fenced, purged, tombstoned.
    generation = with_reconnect(
        journal, "deletion", lambda: services.transition_community(doomed["community"], "fenced")
    )
    deleted = with_reconnect(
        journal, "deletion", lambda: services.purge_community(doomed["community"], generation)
    )
    with_reconnect(
        journal, "deletion", lambda: services.transition_community(doomed["community"], "tombstone")
    )
    journal.write(
        "deletion", community=str(doomed["community"]), deleted=deleted, state="tombstone"
    )


STUCK_EFFECTS_TABLE = "chaos_stuck_effects"


def run_stuck_holder(config: dict[str, Any], index: int, journal: Journal) -> None:
    """A holder that hangs inside ``services.holding()`` past its lease.

    It claims a *probe* delivery and leaves it to expire, claims a second delivery,
    enters ``holding()`` on it, writes an effect row and then sleeps well past both
    leases while the reaper runs. A watcher session meanwhile notes when the reaper
    reclaimed the probe (it must, though another expired row is locked) and whether
    the stuck row was still held at its old generation past its lease (the reaper
    skips a locked row). Awake again, the holder tries to settle: the finish must be
    refused and its effect rolled back. Then the watcher waits for the stuck row to
    be reclaimed now that nobody holds it. A lost connection restarts the scenario.
    """
    import psycopg

    from workflow_delivery import services
    from workflow_delivery.exceptions import LeaseNotLive
    from workflow_delivery.protocol import Outcome

    lease_seconds = config["lease"]
    hang = lease_seconds + 4 * config["reap_interval"] + 2
    pairs = [
        (tenant["id"], bytes.fromhex(target))
        for tenant in config["communities"]
        for target in config["targets"]
    ]
    rng = random.Random()
    if not _pause_until(time.monotonic() + config["stuck_after"]):
        return

    def claim() -> Any:
        while not Stop.requested:
            rng.shuffle(pairs)
            for community_id, target in pairs:
                claimed = with_reconnect(
                    journal,
                    "claim",
                    lambda c=community_id, t=target: services.claim_delivery(
                        c, t, lease_seconds=lease_seconds
                    ),
                )
                if claimed is not None:
                    lease, record = claimed
                    journal.write(
                        "claim",
                        id=str(lease.delivery_id),
                        gen=lease.generation,
                        community=str(lease.community_id),
                        step=record.binding.step_id,
                        lease_until=lease.lease_until.isoformat(),
                    )
                    return lease
            time.sleep(config["idle_poll"])
        return None

    def row(watcher: Any, lease: Any) -> tuple[str, int, bool]:
        return watcher.execute(
            "SELECT status, lease_generation, coalesce(lease_until < now(), false) "
            "FROM workflow_agent_deliveries WHERE id = %s",
            [lease.delivery_id],
        ).fetchone()

    def reclaimed(watcher: Any, lease: Any) -> bool:
        status, generation, _ = row(watcher, lease)
        return generation > lease.generation or status != "claimed"

    def scenario() -> None:
        probe = claim()
        stuck = claim() if probe is not None else None
        if stuck is None:
            return
        probe_reclaimed_at = None
        held_past_lease = False
        with psycopg.connect(config["database_url"], autocommit=True) as watcher:
            t0 = time.time()
            result = "settled"
            try:
                with services.holding(stuck) as held:
                    with connection.cursor() as cursor:
                        cursor.execute(
                            f"INSERT INTO {STUCK_EFFECTS_TABLE} (delivery_id, generation) "
                            "VALUES (%s, %s)",
                            [stuck.delivery_id, stuck.generation],
                        )
                    journal.write(
                        "stuck_enter",
                        id=str(stuck.delivery_id),
                        gen=stuck.generation,
                        probe=str(probe.delivery_id),
                        probe_gen=probe.generation,
                        hang=hang,
                    )
                    wake_at = time.monotonic() + hang
                    while time.monotonic() < wake_at:
                        if probe_reclaimed_at is None and reclaimed(watcher, probe):
                            probe_reclaimed_at = time.time()
                        time.sleep(0.05)
                    status, generation, expired = row(watcher, stuck)
                    held_past_lease = (
                        status == "claimed" and generation == stuck.generation and expired
                    )
                    t0 = time.time()
                    held.finish(Outcome.FINISHED)
            except LeaseNotLive:
                result = "lost"
            journal.write(
                "finish",
                id=str(stuck.delivery_id),
                gen=stuck.generation,
                t0=t0,
                outcome="finished",
                result=result,
            )
            journal.write(
                "stuck_wake",
                id=str(stuck.delivery_id),
                gen=stuck.generation,
                probe_reclaimed_at=probe_reclaimed_at,
                probe_lease_until=probe.lease_until.timestamp(),
                held_past_lease=held_past_lease,
                result=result,
            )
            deadline = time.monotonic() + lease_seconds + 8 * config["reap_interval"] + 10
            reclaimed_at = None
            while time.monotonic() < deadline and not Stop.requested:
                if reclaimed(watcher, stuck):
                    reclaimed_at = time.time()
                    break
                time.sleep(0.05)
            journal.write(
                "stuck_release",
                id=str(stuck.delivery_id),
                gen=stuck.generation,
                reclaimed_at=reclaimed_at,
            )

    from django.db import connection

    from workflow_delivery.errors import is_connection_lost

    for _ in range(3):
        try:
            scenario()
            return
        except Exception as exc:
            if not is_connection_lost(exc):
                raise
            journal.write("conn_error", during="stuck", error=str(exc).splitlines()[0][:200])
            connection.close()
            if Stop.requested:
                return
            time.sleep(0.2 + random.random() * 0.3)


ROLES = {
    "producer": run_producer,
    "agent": run_agent,
    "reaper": run_reaper,
    "deleter": run_deleter,
    "stuck": run_stuck_holder,
    "http": run_http_agent,
    "waker": run_waker,
}


def main(role: str, config_path: str, index: str) -> None:
    config = json.loads(Path(config_path).read_text())
    Stop.install()
    Resumed.install()
    journal = Journal(
        Path(config["journal_dir"]) / f"{role}-{index}-{os.getpid()}.jsonl",
        role=role,
        index=int(index),
        pid=os.getpid(),
    )
    journal.write("start")
    setup_django(config, role, int(index))
    try:
        ROLES[role](config, int(index), journal)
    except Exception as exc:
        journal.write("error", error=f"{type(exc).__name__}: {exc}"[:500])
        raise
    journal.write("stop")


if __name__ == "__main__":
    main(*sys.argv[1:])
