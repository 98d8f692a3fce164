"""Benchmarks of the consumer runtime: wake latency, recovery after
``kill -9``, the producer's cost of notifications, and consumer throughput.

Each figure has its baseline measured in the same invocation. Consumers run in
spawned processes of their own (their own connections, their own GIL); times that
cross processes use the system-wide monotonic clock, counts of settled rows use the
database clock.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import random
import threading
import time
import uuid
from collections.abc import Callable
from statistics import mean
from typing import Any

from tqdm import tqdm

from bench import common
from bench.benchmarks import Figure, Options, _pending_rows
from bench.workers import (
    BASELINE,
    BASELINE_CLAIM,
    BASELINE_FINISH,
    BASELINE_FINISH_AND_CLAIM,
    BOTH,
    SERVICE,
    Spec,
    run_phase,
)

CONSUMER_PROCESSES = 8
TARGETS_PER_PROCESS = 8
# Idle gaps between single commits of the wake benchmark: the consumer is idle
# (waiting) at each commit, as the figure demands.
WAKE_GAP_SECONDS = (0.02, 0.08)
POLL_BASELINE_SECONDS = 0.05
RECOVERY_BAR_SECONDS = 15.0
START_TIMEOUT = 60.0


def _context() -> Any:
    return mp.get_context("spawn")


def _commit_one(tenant: common.Tenant, target: bytes, step_id: str) -> uuid.UUID:
    from workflow_delivery import services
    from workflow_delivery.protocol import DeliveryBinding, EventCause, NewDelivery

    delivery = NewDelivery(
        uuid.uuid4(),
        DeliveryBinding(
            community_id=tenant.community_id,
            workflow_id=tenant.workflow_id,
            run_id=tenant.run_id,
            step_id=step_id,
            target_pubkey=target,
            definition_event_id=tenant.definition_id,
            message_event_id=tenant.message_id,
            cause=EventCause(tenant.cause_id),
        ),
    )
    services.commit_deliveries(tenant.community_id, tenant.message_created_at, [delivery])
    return delivery.id


# -- processes ------------------------------------------------------------------------


def _consumer_process(
    db: common.BenchDb,
    community_id: uuid.UUID,
    targets: list[bytes],
    events: Any,
    stop: Any,
    options: dict[str, Any],
    behaviour: str,
) -> None:
    """A consumer whose handler reports ``(kind, delivery id, monotonic time)``:
    ``report`` returns at once, ``hold`` never returns (it is killed), ``empty``
    reports nothing."""
    db.setup_django()
    from workflow_delivery.consumer import Consumer

    def handler(record: Any, lease: Any, context: Any) -> None:
        if behaviour == "empty":
            return
        events.put((behaviour, str(record.id), time.monotonic()))
        if behaviour in ("hold", "slow"):
            # ``slow`` works until the consumer stops; its heartbeat must carry it.
            context.stopping.wait()

    consumer = Consumer(community_id, targets, handler, **options)

    def announce() -> None:
        if consumer.listen:
            consumer.listening.wait(START_TIMEOUT)
        events.put(("ready", "", time.monotonic()))

    threading.Thread(target=announce, daemon=True).start()
    stats = consumer.run(stop=stop.is_set)
    events.put(("stats", behaviour, vars(stats)))


def _bare_loop_process(
    db: common.BenchDb, community_id: uuid.UUID, targets: list[bytes], events: Any, stop: Any
) -> None:
    """Today's loop without the runtime: claim, finish, next target, until stopped."""
    db.setup_django()
    from django.db import connections

    from workflow_delivery import services
    from workflow_delivery.protocol import Outcome

    events.put(("ready", "", time.monotonic()))
    n = 0
    try:
        while not stop.is_set():
            claimed = services.claim_delivery(
                community_id, targets[n % len(targets)], lease_seconds=60
            )
            n += 1
            if claimed is not None:
                services.finish_delivery(claimed[0], Outcome.FINISHED)
    finally:
        connections.close_all()


def _hand_loop_process(
    db: common.BenchDb,
    community_id: uuid.UUID,
    targets: list[bytes],
    statements: int,
    events: Any,
    stop: Any,
) -> None:
    """The consumer's busy loop written by hand over the same targets, taken in turn,
    prepared statements on one connection: ``statements`` 1 settles the held delivery
    and claims the next target's in one statement (``BASELINE_FINISH_AND_CLAIM``; a
    plain claim only when nothing is held), 2 claims and then finishes."""
    lease = 60
    with db.connect() as conn:
        cursor = conn.cursor()
        events.put(("ready", "", time.monotonic()))
        held: tuple | None = None
        n = 0
        while not stop.is_set():
            target = targets[n % len(targets)]
            n += 1
            if held is None or statements == 2:
                cursor.execute(BASELINE_CLAIM, [community_id, target, lease], prepare=True)
                row = cursor.fetchone()
                if row is None:
                    continue
                held = (row[0], target, row[14])
                if statements == 2:
                    cursor.execute(BASELINE_FINISH, [community_id, *held], prepare=True)
                    cursor.fetchone()
                    held = None
                continue
            arguments = [community_id, *held, community_id, target, lease]
            cursor.execute(BASELINE_FINISH_AND_CLAIM, arguments, prepare=True)
            row = cursor.fetchone()
            held = None if row[1] is None else (row[1], target, row[15])


class Fleet:
    """Spawned processes sharing one event queue and one stop event."""

    def __init__(self) -> None:
        ctx = _context()
        self.ctx = ctx
        self.events = ctx.Queue()
        self.stop = ctx.Event()
        self.processes: list[Any] = []

    def start(self, target: Callable[..., None], *args: Any) -> Any:
        process = self.ctx.Process(target=target, args=(*args, self.events, self.stop))
        process.daemon = True
        process.start()
        self.processes.append(process)
        return process

    def start_consumer(
        self,
        db: common.BenchDb,
        community_id: uuid.UUID,
        targets: list[bytes],
        behaviour: str,
        **options: Any,
    ) -> Any:
        process = self.ctx.Process(
            target=_consumer_process,
            args=(db, community_id, targets, self.events, self.stop, options, behaviour),
        )
        process.daemon = True
        process.start()
        self.processes.append(process)
        return process

    def wait_for(self, kind: str, count: int = 1, timeout: float = START_TIMEOUT) -> list[tuple]:
        found: list[tuple] = []
        deadline = time.monotonic() + timeout
        while len(found) < count:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue_module.Empty:
                raise RuntimeError(f"timed out waiting for {count} {kind!r} events") from None
            if event[0] == kind:
                found.append(event)
        return found

    def close(self, timeout: float = 30.0) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()


# -- wake latency ----------------------------------------------------------------------


def _wake_samples(
    db: common.BenchDb, options: Options, *, notify: bool, desc: str
) -> tuple[list[float], int]:
    from workflow_delivery.conf import app_settings

    with db.connect() as conn:
        common.truncate_deliveries(conn)
        tenant = common.create_tenant(conn, "wake")
    target = common.target_key(0)
    consumer_options: dict[str, Any] = {"lease_seconds": 60}
    if notify:
        # Only a notification can explain a fast claim: the poll is 30 s away. The
        # consumer runs in a process of its own, on the defaults (wake-ups on): it
        # registers as idle after each miss, so each commit wakes it once.
        consumer_options.update(poll_interval=30.0, listen=True)
    else:
        consumer_options.update(poll_interval=POLL_BASELINE_SECONDS, listen=False)
    previous = app_settings.NOTIFY
    common.use_setting("WORKFLOW_DELIVERY_NOTIFY", notify)
    fleet = Fleet()
    latencies: list[float] = []
    missed = 0
    try:
        fleet.start_consumer(db, tenant.community_id, [target], "report", **consumer_options)
        fleet.wait_for("ready")
        time.sleep(0.3)
        rng = random.Random(7)
        deadline = time.monotonic() + options.seconds
        with tqdm(desc=desc, unit="commit", leave=False) as bar:
            n = 0
            while time.monotonic() < deadline:
                time.sleep(rng.uniform(*WAKE_GAP_SECONDS))
                delivery = _commit_one(tenant, target, f"wake-{n}")
                committed = time.monotonic()
                n += 1
                try:
                    while True:
                        kind, delivery_id, at = fleet.events.get(timeout=5.0)
                        if kind == "report" and delivery_id == str(delivery):
                            latencies.append(max(0.0, at - committed))
                            break
                except queue_module.Empty:
                    missed += 1
                bar.update()
    finally:
        fleet.close()
        common.use_setting("WORKFLOW_DELIVERY_NOTIFY", previous)
    return latencies, missed


def wake(db: common.BenchDb, options: Options) -> list[Figure]:
    notified, missed_n = _wake_samples(db, options, notify=True, desc="wake: notify")
    polled, missed_p = _wake_samples(db, options, notify=False, desc="wake: 50 ms poll")
    notes = [f"{len(notified)} notify samples, {len(polled)} poll samples"]
    if missed_n or missed_p:
        notes.append(f"claims not seen within 5 s: notify {missed_n}, poll {missed_p}")
    figures = []
    poll_ms = f"{POLL_BASELINE_SECONDS * 1000:g} ms"
    for q in (50, 99):
        value = common.percentile(notified, q) * 1000
        base = common.percentile(polled, q) * 1000
        figures.append(
            Figure(
                "wake",
                f"commit→claim p{q}, idle consumer: notify vs {poll_ms} poll",
                value,
                base,
                "ms",
                bar=3.0 if q == 99 else None,
                bar_below=True,
                notes=notes if q == 50 else [],
            )
        )
    return figures


# -- recovery --------------------------------------------------------------------------


def _reaper_loop(stop: threading.Event) -> None:
    """The reaper as deployed: a sweep every REAP_INTERVAL_SECONDS."""
    from django.db import connection

    from workflow_delivery import services
    from workflow_delivery.conf import app_settings

    try:
        while not stop.is_set():
            services.reap_expired_deliveries()
            stop.wait(app_settings.REAP_INTERVAL_SECONDS)
    finally:
        connection.close()


def recovery(db: common.BenchDb, options: Options) -> list[Figure]:
    rounds = max(1, options.rounds)
    seconds: list[float] = []
    for round_ in range(1, rounds + 1):
        with db.connect() as conn:
            common.truncate_deliveries(conn)
            tenant = common.create_tenant(conn, "recovery")
        target = common.target_key(0)
        stop_reaper = threading.Event()
        reaper = threading.Thread(target=_reaper_loop, args=(stop_reaper,), daemon=True)
        reaper.start()
        fleet = Fleet()
        try:
            # The consumers' defaults: no lease, poll or grace option is passed.
            holder = fleet.start_consumer(db, tenant.community_id, [target], "hold")
            fleet.wait_for("ready")
            delivery = _commit_one(tenant, target, f"recovery-{round_}")
            fleet.wait_for("hold")
            fleet.start_consumer(db, tenant.community_id, [target], "report")
            fleet.wait_for("ready")
            # Let the holder's heartbeat run a while, as it would in production.
            time.sleep(min(options.seconds, 3.0))
            killed = time.monotonic()
            holder.kill()
            holder.join()
            (event,) = fleet.wait_for("report", timeout=120)
            assert event[1] == str(delivery)
            seconds.append(event[2] - killed)
            print(f"   recovery #{round_}: {seconds[-1]:.1f} s", flush=True)
        finally:
            fleet.close()
            stop_reaper.set()
            reaper.join(10)
    return [
        Figure(
            "recovery",
            f"kill -9 of a holder → claimed by another consumer, defaults, worst of {rounds}",
            max(seconds),
            None,
            "s",
            bar=RECOVERY_BAR_SECONDS,
            bar_below=True,
            notes=[
                "rounds: " + ", ".join(f"{s:.1f}" for s in seconds),
                "consumer defaults (lease 8 s renewed every 2.7 s, poll 2 s) and the reaper "
                "every WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS",
            ],
        )
    ]


# -- producer with notifications on / off ----------------------------------------------


def notify(db: common.BenchDb, options: Options) -> list[Figure]:
    from workflow_delivery.wakeups import WakeListener

    workers = options.workers or 8
    figures = []
    # A session listens throughout, as a deployed consumer would, but registers as
    # idle for nothing: these producers find no idle target and send no
    # notification, which is what a producer with busy or absent consumers pays.
    stop = threading.Event()
    received = [0]

    def drain() -> None:
        with WakeListener() as listener:
            while not stop.is_set():
                received[0] += len(listener.wait(0.2))

    listening = threading.Thread(target=drain, daemon=True)
    listening.start()
    modes = [
        ("produce-notify-tx", "in the transaction", 0.9),
        ("produce-notify", "after commit", None),
    ]
    try:
        for kind, mode, bar in modes:
            for size in (1, 10):
                rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
                for round_ in range(1, options.rounds + 1):
                    with db.connect() as conn:
                        tenant = common.producer_tenant(conn, "notify")
                    specs = [
                        Spec(kind, BOTH, i, db, tenant, step_size=size, label=f"r{round_}")
                        for i in range(workers)
                    ]
                    desc = f"notify {mode}, {size}-target #{round_}"
                    phase = run_phase(
                        specs, seconds=options.seconds, warmup=options.warmup, desc=desc
                    )
                    for api in rates:
                        rates[api].append(phase.rate(api=api))
                figures.append(
                    Figure(
                        "notify",
                        f"producer {size}-target steps, wake-ups {mode} vs off, {workers} workers",
                        mean(rates[SERVICE]),
                        mean(rates[BASELINE]),
                        "deliveries/s",
                        bar=bar,
                    )
                )
    finally:
        stop.set()
        listening.join(5)
    figures[0].notes.append(f"the listening session received {received[0]:,} notifications")
    return figures


# -- consumer throughput ---------------------------------------------------------------


def _finished_between(db: common.BenchDb, start: Any, end: Any) -> int:
    with db.connect() as conn:
        return conn.execute(
            "SELECT count(*) FROM workflow_agent_deliveries "
            "WHERE finished_at >= %s AND finished_at < %s",
            [start, end],
        ).fetchone()[0]


def _database_now(db: common.BenchDb) -> Any:
    with db.connect() as conn:
        return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def _throughput_window(
    db: common.BenchDb,
    options: Options,
    side: str,
    desc: str,
    *,
    processes: int | None = None,
    hand_written: int | None = None,
) -> tuple[float, list[dict[str, int]]]:
    """Deliveries/s settled by the processes of one side, and (consumer side) each
    consumer's counts: the ones with an empty handler, plus one whose handler runs
    through the whole window on a delivery of its own, so a heartbeat that loses
    its race against the load shows as a lost lease. The baseline side is the
    services' claim+finish loop, or with ``hand_written`` (1 or 2) that many
    hand-written statements a delivery (``_hand_loop_process``)."""
    processes = processes or options.workers or CONSUMER_PROCESSES
    with db.connect() as conn:
        tenant = common.cycle_tenant(conn, "consume", _pending_rows(options))
        slow_tenant = common.create_tenant(conn, "slow")
    fleet = Fleet()
    stats: list[dict[str, int]] = []
    try:
        for index in range(processes):
            targets = [
                common.target_key(index * TARGETS_PER_PROCESS + j)
                for j in range(TARGETS_PER_PROCESS)
            ]
            if side == SERVICE:
                # The consumer's defaults (lease, heartbeat, poll), as deployed.
                fleet.start_consumer(db, tenant.community_id, targets, "empty", grace_seconds=5)
            elif hand_written:
                fleet.start(_hand_loop_process, db, tenant.community_id, targets, hand_written)
            else:
                fleet.start(_bare_loop_process, db, tenant.community_id, targets)
        ready = processes
        if side == SERVICE:
            slow_target = common.target_key(0)
            fleet.start_consumer(db, slow_tenant.community_id, [slow_target], "slow")
            ready += 1
        fleet.wait_for("ready", ready)
        if side == SERVICE:
            _commit_one(slow_tenant, slow_target, "slow-0")
            fleet.wait_for("slow")
        time.sleep(options.warmup)
        start = _database_now(db)
        time.sleep(options.seconds)
        end = _database_now(db)
    finally:
        fleet.close()
    count = _finished_between(db, start, end)
    if side == SERVICE:
        stats = [event[2] for event in _drain(fleet) if event[0] == "stats"]
    return count / (end - start).total_seconds(), stats


def _drain(fleet: Fleet) -> list[tuple]:
    events = []
    while True:
        try:
            events.append(fleet.events.get(timeout=0.5))
        except queue_module.Empty:
            return events


def consumer(db: common.BenchDb, options: Options) -> list[Figure]:
    processes = options.workers or CONSUMER_PROCESSES
    rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
    stats: list[dict[str, int]] = []
    for round_ in range(1, options.rounds + 1):
        for side in (BASELINE, SERVICE):
            desc = f"consumer {side} #{round_}"
            rate, counts = _throughput_window(db, options, side, desc)
            rates[side].append(rate)
            stats += counts
    total = {key: sum(s.get(key, 0) for s in stats) for key in ("lost", "renewed", "renew_busy")}
    return [
        Figure(
            "consumer",
            f"Consumer (empty handler) vs bare claim+finish loop, {processes} processes",
            mean(rates[SERVICE]),
            mean(rates[BASELINE]),
            "deliveries/s",
            bar=0.9,
        ),
        Figure(
            "consumer",
            "leases lost by consumers under that load (defaults, one handler runs throughout)",
            total["lost"],
            None,
            "leases",
            bar=1,
            bar_below=True,
            notes=[
                f"{len(stats)} consumers reported; {total['renewed']} renewals, "
                f"{total['renew_busy']} busy"
            ],
        ),
    ]


def consumer_next(db: common.BenchDb, options: Options) -> list[Figure]:
    """The ``Consumer``'s busy loop (empty handler, the defaults: each settle claims
    the next delivery in the same statement) against the same targets drained by
    hand-written loops: one statement a delivery (settle and claim), and two (claim,
    finish); at 8 processes (``--workers``) and 1. Each round runs the three sides in
    turn, in windows of their own."""
    figures = []
    for processes in sorted({1, options.workers or CONSUMER_PROCESSES}, reverse=True):
        rates: dict[str | int, list[float]] = {SERVICE: [], 1: [], 2: []}
        for round_ in range(1, options.rounds + 1):
            for side in (1, SERVICE, 2):
                desc = f"consumer_next {side}, {processes} processes #{round_}"
                if side == SERVICE:
                    rate, _ = _throughput_window(db, options, SERVICE, desc, processes=processes)
                else:
                    rate, _ = _throughput_window(
                        db, options, BASELINE, desc, processes=processes, hand_written=side
                    )
                rates[side].append(rate)
        for statements, against, bar in (
            (1, "hand-written one-statement settle-and-claim loop", 0.95),
            (2, "hand-written two-statement claim+finish loop", 1.3),
        ):
            figures.append(
                Figure(
                    "consumer_next",
                    f"Consumer (empty handler) vs {against}, "
                    f"{processes} process{'es' if processes > 1 else ''}",
                    mean(rates[SERVICE]),
                    mean(rates[statements]),
                    "deliveries/s",
                    bar=bar,
                )
            )
    return figures


CONSUMER_BENCHMARKS: dict[str, Callable[[common.BenchDb, Options], list[Figure]]] = {
    "wake": wake,
    "recovery": recovery,
    "notify": notify,
    "consumer": consumer,
    "consumer_next": consumer_next,
}
