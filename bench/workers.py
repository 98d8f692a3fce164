"""Worker processes of the benchmarks and the parent's side of one measured phase.

Each worker owns one connection, builds its loop, waits on a barrier shared with
every other worker and the parent, then repeats its unit of work until the
parent's stop event, stamping each unit with the (system-wide) monotonic clock.
The parent decides afterwards which units fall inside the measured window.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tqdm import tqdm

from bench import common
from workflow_delivery.conf import DEFAULTS

SERVICE = "service"
BASELINE = "baseline"
# Both, taking turns in slices of the same window, all workers switching together:
# load that comes and goes on the machine then falls on both sides alike.
BOTH = "both"
APIS = (SERVICE, BASELINE)
SLICE_SECONDS = 1.0
LEASE_SECONDS = 60
BARRIER_TIMEOUT = 300.0

# The hand-written baseline: one statement claims, one statement finishes.
_COLUMNS = (
    "d.id, d.community_id, d.workflow_id, d.run_id, d.step_id, d.target_pubkey, "
    "d.definition_event_id, d.message_event_id, d.message_event_created_at, d.cause_kind, "
    "d.cause_event_id, d.cause_scheduled_for, d.cause_webhook_invocation_id, d.status, "
    "d.lease_generation, d.lease_until, d.claimed_at, d.finished_at, d.created_at"
)
BASELINE_CLAIM = f"""
WITH picked AS (
    SELECT id FROM workflow_agent_deliveries
     WHERE community_id = %s AND target_pubkey = %s AND status = 'pending'
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
)
UPDATE workflow_agent_deliveries AS d
   SET status = 'claimed', lease_generation = d.lease_generation + 1,
       claimed_at = now(), lease_until = now() + make_interval(secs => %s)
  FROM picked
 WHERE d.id = picked.id
RETURNING {_COLUMNS}
"""
BASELINE_FINISH = """
UPDATE workflow_agent_deliveries
   SET status = 'finished', finished_at = now(), lease_until = NULL, claimed_at = NULL
 WHERE community_id = %s AND id = %s AND target_pubkey = %s AND lease_generation = %s
   AND status = 'claimed' AND lease_until >= now()
RETURNING status
"""
# The hand-written one-statement loop: the held delivery settles and, only if it
# did, the oldest pending delivery of the next target is claimed, in one statement.
BASELINE_FINISH_AND_CLAIM = f"""
WITH settled AS (
    UPDATE workflow_agent_deliveries
       SET status = 'finished', finished_at = now(), lease_until = NULL, claimed_at = NULL
     WHERE community_id = %s AND id = %s AND target_pubkey = %s AND lease_generation = %s
       AND status = 'claimed' AND lease_until >= now()
    RETURNING status
), picked AS (
    SELECT id FROM workflow_agent_deliveries
     WHERE EXISTS (SELECT 1 FROM settled)
       AND community_id = %s AND target_pubkey = %s AND status = 'pending'
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE workflow_agent_deliveries AS d
       SET status = 'claimed', lease_generation = d.lease_generation + 1,
           claimed_at = now(), lease_until = now() + make_interval(secs => %s)
      FROM picked
     WHERE d.id = picked.id
    RETURNING {_COLUMNS}
)
SELECT (SELECT status FROM settled), claimed.* FROM (SELECT 1) AS one LEFT JOIN claimed ON true
"""
_INSERT_ROW = "(%s, %s, %s, %s, %s, %s, %s, %s, %s, 'event', %s)"
BASELINE_INSERT = (
    "INSERT INTO workflow_agent_deliveries (id, community_id, workflow_id, run_id, step_id, "
    "target_pubkey, definition_event_id, message_event_id, message_event_created_at, "
    "cause_kind, cause_event_id) VALUES {rows} "
    "ON CONFLICT (community_id, run_id, step_id, target_pubkey) DO NOTHING RETURNING id"
)


@dataclass
class Spec:
    """What one worker does. ``kind`` is ``cycle`` (claim → finish), ``produce``,
    ``batch`` (batch claim of ``step_size`` + batch finish vs single cycles) or ``bare``
    (the producer vs inserts into a table without rules)."""

    kind: str
    api: str
    index: int
    db: common.BenchDb
    tenant: common.Tenant
    step_size: int = 1
    label: str = "p"


@dataclass
class Samples:
    stamps: list[float] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    second: list[float] = field(default_factory=list)
    apis: list[int] = field(default_factory=list)
    misses: int = 0
    anomalies: int = 0


Unit = Callable[[int], tuple[int, float, float] | None]


def _targets(spec: Spec, n: int) -> list[bytes]:
    if spec.step_size > common.TARGETS:
        # More targets than the benchmark's 64 keys: each step names its own.
        return [j.to_bytes(32, "big") for j in range(spec.step_size)]
    base = spec.index * 8 + n * spec.step_size
    return [common.target_key(base + j) for j in range(spec.step_size)]


def _service_cycle(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    spec.db.setup_django()
    from django.db import connections

    from workflow_delivery import services
    from workflow_delivery.protocol import Outcome, Settled

    community = spec.tenant.community_id

    def unit(n: int) -> tuple[int, float, float] | None:
        target = common.target_key(spec.index * 8 + n)
        started = time.perf_counter()
        claimed = services.claim_delivery(community, target, lease_seconds=LEASE_SECONDS)
        claimed_at = time.perf_counter()
        if claimed is None:
            return None
        result = services.finish_delivery(claimed[0], Outcome.FINISHED)
        finished_at = time.perf_counter()
        return int(isinstance(result, Settled)), claimed_at - started, finished_at - claimed_at

    return unit, connections.close_all


def _baseline_cycle(
    spec: Spec, *, synchronous_commit: str | None = None
) -> tuple[Unit, Callable[[], None]]:
    conn = spec.db.connect()
    if synchronous_commit is not None:
        conn.execute("SELECT set_config('synchronous_commit', %s, false)", [synchronous_commit])
    cursor = conn.cursor()
    community = spec.tenant.community_id

    def unit(n: int) -> tuple[int, float, float] | None:
        target = common.target_key(spec.index * 8 + n)
        started = time.perf_counter()
        cursor.execute(BASELINE_CLAIM, [community, target, LEASE_SECONDS], prepare=True)
        row = cursor.fetchone()
        claimed_at = time.perf_counter()
        if row is None:
            return None
        cursor.execute(BASELINE_FINISH, [community, row[0], target, row[14]], prepare=True)
        settled = cursor.fetchone() is not None
        finished_at = time.perf_counter()
        return int(settled), claimed_at - started, finished_at - claimed_at

    return unit, conn.close


def _service_chain(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    """The services' busy loop: each unit settles the held delivery and claims the next
    (of the next target) with ``finish_and_claim_next``; a plain claim only when
    nothing is held (the start, or after a miss)."""
    spec.db.setup_django()
    from django.db import connections

    from workflow_delivery import services
    from workflow_delivery.protocol import Outcome, Settled

    community = spec.tenant.community_id
    held: list = [None]

    def unit(n: int) -> tuple[int, float, float] | None:
        started = time.perf_counter()
        if held[0] is None:
            target = common.target_key(spec.index * 8 + n)
            claimed = services.claim_delivery(community, target, lease_seconds=LEASE_SECONDS)
            if claimed is None:
                return None
            held[0] = claimed[0]
        claimed_at = time.perf_counter()
        answer = services.finish_and_claim_next(
            held[0],
            Outcome.FINISHED,
            target_pubkey=common.target_key(spec.index * 8 + n + 1),
            lease_seconds=LEASE_SECONDS,
        )
        held[0] = None if answer.next is None else answer.next[0]
        finished_at = time.perf_counter()
        return (
            int(isinstance(answer.result, Settled)),
            claimed_at - started,
            finished_at - claimed_at,
        )

    return unit, connections.close_all


def _baseline_chain(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    """The same loop written by hand: BASELINE_FINISH_AND_CLAIM, prepared."""
    conn = spec.db.connect()
    cursor = conn.cursor()
    community = spec.tenant.community_id
    held: list = [None]

    def unit(n: int) -> tuple[int, float, float] | None:
        started = time.perf_counter()
        if held[0] is None:
            target = common.target_key(spec.index * 8 + n)
            cursor.execute(BASELINE_CLAIM, [community, target, LEASE_SECONDS], prepare=True)
            row = cursor.fetchone()
            if row is None:
                return None
            held[0] = (row[0], target, row[14])
        claimed_at = time.perf_counter()
        delivery_id, target, generation = held[0]
        following = common.target_key(spec.index * 8 + n + 1)
        cursor.execute(
            BASELINE_FINISH_AND_CLAIM,
            [community, delivery_id, target, generation, community, following, LEASE_SECONDS],
            prepare=True,
        )
        row = cursor.fetchone()
        held[0] = None if row[1] is None else (row[1], following, row[15])
        finished_at = time.perf_counter()
        return int(row[0] is not None), claimed_at - started, finished_at - claimed_at

    return unit, conn.close


def _service_produce(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    spec.db.setup_django()
    from django.db import connections

    from workflow_delivery import services
    from workflow_delivery.protocol import DeliveryBinding, EventCause, NewDelivery

    tenant = spec.tenant
    cause = EventCause(tenant.cause_id)

    def unit(n: int) -> tuple[int, float, float]:
        step_id = f"{spec.label}-{spec.index}-{n}"
        started = time.perf_counter()
        batch = [
            NewDelivery(
                uuid.uuid4(),
                DeliveryBinding(
                    community_id=tenant.community_id,
                    workflow_id=tenant.workflow_id,
                    run_id=tenant.run_id,
                    step_id=step_id,
                    target_pubkey=target,
                    definition_event_id=tenant.definition_id,
                    message_event_id=tenant.message_id,
                    cause=cause,
                ),
            )
            for target in _targets(spec, n)
        ]
        created = services.commit_deliveries(tenant.community_id, tenant.message_created_at, batch)
        return len(created), time.perf_counter() - started, 0.0

    return unit, connections.close_all


def _service_batch(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    """Batch claim of ``step_size`` and one batch finish; a unit counts the deliveries."""
    spec.db.setup_django()
    from django.db import connections

    from workflow_delivery import services
    from workflow_delivery.protocol import Outcome, Settled

    community = spec.tenant.community_id

    def unit(n: int) -> tuple[int, float, float] | None:
        target = common.target_key(spec.index * 8 + n)
        started = time.perf_counter()
        claimed = services.claim_deliveries(
            community, target, limit=spec.step_size, lease_seconds=LEASE_SECONDS
        )
        claimed_at = time.perf_counter()
        if not claimed:
            return None
        results = services.finish_deliveries([(lease, Outcome.FINISHED) for lease, _ in claimed])
        finished_at = time.perf_counter()
        settled = sum(isinstance(result, Settled) for result in results)
        return settled, claimed_at - started, finished_at - claimed_at

    return unit, connections.close_all


def _service_single(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    """Today's single claim + finish through the service, as the batch's baseline."""
    return _service_cycle(spec)


# A table of the delivery's columns and nothing else: no key, index, check, foreign
# key or trigger. What an insert of the same rows costs without any rule.
BARE_TABLE = "bench_bare_deliveries"
CREATE_BARE_TABLE = (
    f"CREATE TABLE IF NOT EXISTS {BARE_TABLE} (LIKE workflow_agent_deliveries INCLUDING DEFAULTS)"
)
BARE_INSERT = (
    f"INSERT INTO {BARE_TABLE} (id, community_id, workflow_id, run_id, step_id, "
    "target_pubkey, definition_event_id, message_event_id, message_event_created_at, "
    "cause_kind, cause_event_id) VALUES {rows}"
)


def _bare_produce(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    conn = spec.db.connect()
    cursor = conn.cursor()
    t = spec.tenant
    statement = BARE_INSERT.format(rows=", ".join([_INSERT_ROW] * spec.step_size))

    def unit(n: int) -> tuple[int, float, float]:
        step_id = f"{spec.label}-{spec.index}-{n}"
        started = time.perf_counter()
        params: list[Any] = []
        for target in _targets(spec, n):
            params += [
                uuid.uuid4(), t.community_id, t.workflow_id, t.run_id, step_id, target,
                t.definition_id, t.message_id, t.message_created_at, t.cause_id,
            ]  # fmt: skip
        # One transaction per step, like the producer it is compared with.
        with conn.transaction():
            cursor.execute(statement, params, prepare=True)
        return spec.step_size, time.perf_counter() - started, 0.0

    return unit, conn.close


def _baseline_produce(spec: Spec) -> tuple[Unit, Callable[[], None]]:
    conn = spec.db.connect()
    cursor = conn.cursor()
    t = spec.tenant
    statement = BASELINE_INSERT.format(rows=", ".join([_INSERT_ROW] * spec.step_size))

    def unit(n: int) -> tuple[int, float, float]:
        step_id = f"{spec.label}-{spec.index}-{n}"
        started = time.perf_counter()
        params: list[Any] = []
        for target in _targets(spec, n):
            params += [
                uuid.uuid4(),
                t.community_id,
                t.workflow_id,
                t.run_id,
                step_id,
                target,
                t.definition_id,
                t.message_id,
                t.message_created_at,
                t.cause_id,
            ]
        # One transaction per step, like the producer it stands for.
        with conn.transaction():
            cursor.execute(statement, params, prepare=True)
            created = len(cursor.fetchall())
        return created, time.perf_counter() - started, 0.0

    return unit, conn.close


def _notify_produce(
    on: bool, in_transaction: bool = False
) -> Callable[[Spec], tuple[Unit, Callable[[], None]]]:
    """The service producer with WORKFLOW_DELIVERY_NOTIFY (and _IN_TRANSACTION) set
    before each step, so both sides can take turns in one process. They are set as
    ``override_settings`` sets them (``common.use_setting``): the app remembers a
    setting once read, and a plain assignment would leave both sides sending as
    whichever ran first."""

    def build(spec: Spec) -> tuple[Unit, Callable[[], None]]:
        unit, close = _service_produce(spec)

        def toggled(n: int) -> tuple[int, float, float]:
            common.use_setting("WORKFLOW_DELIVERY_NOTIFY", on)
            common.use_setting("WORKFLOW_DELIVERY_NOTIFY_IN_TRANSACTION", in_transaction)
            return unit(n)

        return toggled, close

    return build


def _timeline_cycle(on: bool) -> Callable[[Spec], tuple[Unit, Callable[[], None]]]:
    """The service cycle with WORKFLOW_DELIVERY_TIMELINE set before each unit (as
    ``override_settings`` sets it), so both sides take turns in one process; the app
    tells the session at the first statement after a change."""

    def build(spec: Spec) -> tuple[Unit, Callable[[], None]]:
        unit, close = _service_cycle(spec)

        def toggled(n: int) -> tuple[int, float, float] | None:
            common.use_setting("WORKFLOW_DELIVERY_TIMELINE", on)
            return unit(n)

        return toggled, close

    return build


_LOOPS = {
    ("cycle", SERVICE): _service_cycle,
    ("cycle", BASELINE): _baseline_cycle,
    # On a server with a synchronous standby (bench/sync_commit.py): the hand-written
    # cycle whose commits wait for the standby ("service") against the same whose
    # commits wait only for the local disk ("baseline"), a lone server's commit.
    ("cycle-sync", SERVICE): _baseline_cycle,
    ("cycle-sync", BASELINE): partial(_baseline_cycle, synchronous_commit="local"),
    # The services' settle-and-claim loop against the same written by hand in one
    # statement, and against the hand-written two-statement cycle.
    ("cycle-chain", SERVICE): _service_chain,
    ("cycle-chain", BASELINE): _baseline_chain,
    ("cycle-chain-two", SERVICE): _service_chain,
    ("cycle-chain-two", BASELINE): _baseline_cycle,
    # The timeline on ("service") against off, the same service cycle otherwise.
    ("cycle-timeline", SERVICE): _timeline_cycle(True),
    ("cycle-timeline", BASELINE): _timeline_cycle(False),
    # The service producer on the app's defaults, whatever an earlier phase of this
    # process set.
    ("produce", SERVICE): _notify_produce(
        DEFAULTS["NOTIFY"], in_transaction=DEFAULTS["NOTIFY_IN_TRANSACTION"]
    ),
    ("produce", BASELINE): _baseline_produce,
    # Wake-ups on (service side: after the commit / in the transaction) against off.
    ("produce-notify", SERVICE): _notify_produce(True),
    ("produce-notify", BASELINE): _notify_produce(False),
    ("produce-notify-tx", SERVICE): _notify_produce(True, in_transaction=True),
    ("produce-notify-tx", BASELINE): _notify_produce(False),
    # The service producer with wake-ups off against the hand-written insert (none).
    ("produce-quiet", SERVICE): _notify_produce(False),
    ("produce-quiet", BASELINE): _baseline_produce,
    # Batch claim + batch finish ("service") against today's single cycle ("baseline").
    ("batch", SERVICE): _service_batch,
    ("batch", BASELINE): _service_single,
    # The producer ("service") against a bare table's insert of the same rows.
    ("bare", SERVICE): _service_produce,
    ("bare", BASELINE): _bare_produce,
}


def worker_main(spec: Spec, barrier: Any, stop: Any, mode: Any, results: Any) -> None:
    # Ctrl-C reaches the whole process group; the parent alone decides to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    closers: list[Callable[[], None]] = []
    samples = Samples()
    try:
        loops: list[Unit | None] = [None, None]
        for code, api in enumerate(APIS):
            if spec.api in (api, BOTH):
                loops[code], close = _LOOPS[spec.kind, api](spec)
                closers.append(close)
        barrier.wait()
        n = 0
        while not stop.is_set():
            code = mode.value if spec.api == BOTH else APIS.index(spec.api)
            outcome = loops[code](n)
            n += 1
            if outcome is None:
                samples.misses += 1
                continue
            units, first, second = outcome
            samples.stamps.append(time.monotonic())
            samples.units.append(units)
            samples.first.append(first)
            samples.second.append(second)
            samples.apis.append(code)
            if spec.kind.startswith("cycle") and units != 1:
                samples.anomalies += 1

    except BaseException:  # noqa: BLE001 - any failure is reported to the parent as text
        barrier.abort()
        results.put((spec.index, traceback.format_exc()))
        return
    finally:
        # Each worker closes its own connections so the database can be dropped.
        for close in closers:
            close()
    results.put((spec.index, samples))


Window = tuple[float, float]


@dataclass
class Phase:
    """Units of work stamped by the workers; ``turns`` holds, for a phase where both
    sides took turns, each side's seconds inside the main window."""

    windows: dict[str, Window]
    samples: list[Samples]
    turns: dict[str, float] = field(default_factory=dict)

    def _in(self, window: str, api: str | None) -> list[tuple[int, float, float]]:
        start, end = self.windows[window]
        code = None if api is None else APIS.index(api)
        return [
            (u, a, b)
            for s in self.samples
            for t, u, a, b, c in zip(s.stamps, s.units, s.first, s.second, s.apis, strict=True)
            if start <= t < end and code in (None, c)
        ]

    def rate(self, window: str = "main", api: str | None = None) -> float:
        start, end = self.windows[window]
        seconds = self.turns[api] if api is not None else end - start
        return sum(u for u, _, _ in self._in(window, api)) / seconds

    def latencies(self, which: str, window: str = "main", api: str | None = None) -> list[float]:
        index = 1 if which == "first" else 2
        return [row[index] for row in self._in(window, api)]

    @property
    def misses(self) -> int:
        return sum(s.misses for s in self.samples)

    @property
    def anomalies(self) -> int:
        return sum(s.anomalies for s in self.samples)


def sleep_window(seconds: float, desc: str) -> Window:
    start = time.monotonic()
    end = start + seconds
    shape = "{desc}: {bar} {n:.1f}/{total:.1f} s"
    with tqdm(total=round(seconds, 1), desc=desc, bar_format=shape, leave=False) as bar:
        while (now := time.monotonic()) < end:
            time.sleep(min(0.2, end - now))
            bar.n = round(min(now, end) - start, 1)
            bar.refresh()
    return start, end


def _take_turns(mode: Any, seconds: float, warmup: float, desc: str) -> tuple[Window, dict]:
    """Warm both sides, then hand the workers to each side in turn, one slice at a
    time, for ``seconds`` split evenly between them."""
    for code in range(len(APIS)):
        mode.value = code
        time.sleep(warmup / len(APIS))
    slices = max(2, 2 * round(seconds / SLICE_SECONDS / 2))
    length = seconds / slices
    turns = dict.fromkeys(APIS, 0.0)
    shape = "{desc}: {bar} {n}/{total} turns"
    with tqdm(total=slices, desc=desc, bar_format=shape, leave=False) as bar:
        start = switched = time.monotonic()
        for n in range(slices):
            mode.value = n % len(APIS)
            time.sleep(max(0.0, start + (n + 1) * length - time.monotonic()))
            now = time.monotonic()
            turns[APIS[n % len(APIS)]] += now - switched
            switched = now
            bar.update()
    return (start, switched), turns


Driver = Callable[[], dict[str, Window]]


def run_phase(
    specs: list[Spec], *, seconds: float, warmup: float, desc: str, driver: Driver | None = None
) -> Phase:
    """Start every worker together and measure. By default the window is ``seconds``
    after ``warmup``; a ``driver`` may instead run its own windows while they work."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(specs) + 1, timeout=BARRIER_TIMEOUT)
    stop = ctx.Event()
    mode = ctx.Value("b", 0, lock=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker_main, args=(spec, barrier, stop, mode, results), daemon=True)
        for spec in specs
    ]
    turns: dict[str, float] = {}
    try:
        for proc in procs:
            proc.start()
        # A worker that fails before the start breaks the barrier; its traceback
        # is in the queue.
        with suppress(threading.BrokenBarrierError):
            barrier.wait()
        if not barrier.broken and specs[0].api == BOTH:
            window, turns = _take_turns(mode, seconds, warmup, desc)
            windows = {"main": window}
        elif not barrier.broken:
            time.sleep(warmup)
            windows = driver() if driver else {"main": sleep_window(seconds, desc)}
        stop.set()
        collected = [results.get(timeout=BARRIER_TIMEOUT) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
    failures = [f"worker {i}:\n{item}" for i, item in collected if isinstance(item, str)]
    if failures:
        raise RuntimeError("\n".join(failures))
    return Phase(windows, [item for _, item in collected], turns)
