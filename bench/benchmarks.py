"""The service benchmarks. Each returns figures: a measured value, the baseline
it is compared with (measured in the same invocation, on the same database), and
the bar it must meet."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from statistics import mean, median

from tqdm import tqdm

from bench import common
from bench.workers import (
    BARE_TABLE,
    BASELINE,
    BOTH,
    CREATE_BARE_TABLE,
    SERVICE,
    Phase,
    Spec,
    run_phase,
    sleep_window,
)

# Claim + finish cycles one second of a phase may consume at most on this class of
# machine; pending rows are seeded for that, so no phase runs dry.
CYCLES_PER_SECOND_CEILING = 4000
REAP_COMMUNITIES = 4
BATCH = 10
BARE_STEP = 100


@dataclass
class Options:
    seconds: float = 10.0
    warmup: float = 1.0
    workers: int | None = None
    rows: int = 1_000_000
    rounds: int = 2


@dataclass
class Figure:
    """``bar`` is a minimum ratio (``value / baseline``) unless ``bar_below`` is set,
    in which case ``value`` must stay under ``bar``."""

    benchmark: str
    name: str
    value: float
    baseline: float | None
    unit: str
    bar: float | None = None
    bar_below: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline

    @property
    def met(self) -> bool | None:
        if self.bar is None:
            return None
        if self.bar_below:
            return self.value < self.bar
        return self.ratio is not None and self.ratio >= self.bar

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


def _pending_rows(options: Options, windows: float = 1.0) -> int:
    seconds = options.warmup + options.seconds * windows + 2
    return max(2_000, math.ceil(seconds * CYCLES_PER_SECOND_CEILING))


def _notes(phase: Phase) -> list[str]:
    notes = []
    if phase.misses:
        notes.append(f"{phase.misses} claims found nothing (seed ran dry or lost a race)")
    if phase.anomalies:
        notes.append(f"{phase.anomalies} finishes did not settle")
    return notes


def _cycle_phase(
    db: common.BenchDb,
    api: str,
    workers: int,
    options: Options,
    desc: str,
    *,
    history: int = 0,
    neighbour: int = 0,
    ids: str = common.RANDOM_IDS,
    kind: str = "cycle",
) -> Phase:
    """Claim + finish loops (``kind``) on a freshly seeded community of pending rows,
    optionally behind ``history`` terminal rows of the same targets or beside a
    ``neighbour`` community holding that many pending rows; delivery ids are ``ids``."""
    with db.connect() as conn:
        tenant = common.cycle_tenant(
            conn, "cycle", _pending_rows(options), history=history, neighbour=neighbour, ids=ids
        )
    specs = [Spec(kind, api, i, db, tenant) for i in range(workers)]
    return run_phase(specs, seconds=options.seconds, warmup=options.warmup, desc=desc)


def throughput(db: common.BenchDb, options: Options) -> list[Figure]:
    figures = []
    for workers in sorted({1, options.workers or 8}, reverse=True):
        rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
        notes: list[str] = []
        for round_ in range(1, options.rounds + 1):
            desc = f"throughput, {workers} workers #{round_}"
            phase = _cycle_phase(db, BOTH, workers, options, desc)
            for api in rates:
                rates[api].append(phase.rate(api=api))
            notes += _notes(phase)
        figures.append(
            Figure(
                "throughput",
                f"claim+finish, {workers} workers",
                mean(rates[SERVICE]),
                mean(rates[BASELINE]),
                "cycles/s",
                bar=0.95,
                notes=notes,
            )
        )
    return figures


def settle_next(db: common.BenchDb, options: Options) -> list[Figure]:
    """The services' busy loop with ``finish_and_claim_next`` (one statement and one
    commit per delivery) against the hand-written one-statement settle-and-claim loop,
    and against the hand-written two-statement claim+finish cycle; each pair takes
    turns in one window, at 8 workers (and 1)."""
    figures = []
    pairs = (
        ("cycle-chain", "hand-written one-statement settle-and-claim", 0.95),
        ("cycle-chain-two", "hand-written two-statement claim+finish", 1.3),
    )
    for workers in sorted({1, options.workers or 8}, reverse=True):
        for kind, against, bar in pairs:
            rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
            notes: list[str] = []
            for round_ in range(1, options.rounds + 1):
                desc = f"settle_next vs {kind}, {workers} workers #{round_}"
                phase = _cycle_phase(db, BOTH, workers, options, desc, kind=kind)
                for api in rates:
                    rates[api].append(phase.rate(api=api))
                notes += _notes(phase)
            figures.append(
                Figure(
                    "settle_next",
                    f"finish_and_claim_next loop vs {against}, {workers} workers",
                    mean(rates[SERVICE]),
                    mean(rates[BASELINE]),
                    "deliveries/s",
                    bar=bar,
                    notes=notes,
                )
            )
    return figures


def batch(db: common.BenchDb, options: Options) -> list[Figure]:
    """Batch claim of ``BATCH`` + one batch finish against today's single claim +
    finish, both through the service, taking turns in one window."""
    workers = options.workers or 8
    rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
    notes: list[str] = []
    for round_ in range(1, options.rounds + 1):
        with db.connect() as conn:
            # The batch side settles up to BATCH deliveries per unit of work.
            tenant = common.cycle_tenant(conn, "batch", _pending_rows(options) * BATCH // 2)
        specs = [Spec("batch", BOTH, i, db, tenant, step_size=BATCH) for i in range(workers)]
        phase = run_phase(
            specs, seconds=options.seconds, warmup=options.warmup, desc=f"batch #{round_}"
        )
        for api in rates:
            rates[api].append(phase.rate(api=api))
        notes += _notes(phase)
    return [
        Figure(
            "batch",
            f"batch claim of {BATCH} + batch finish vs single claim+finish, {workers} workers",
            mean(rates[SERVICE]),
            mean(rates[BASELINE]),
            "deliveries/s",
            bar=3.0,
            notes=notes,
        )
    ]


# The producer's runs: (Spec kind, step size, figure's label, bar). The first two run
# the producer on the app's defaults (wake-ups on, in the transaction: with no
# consumer idle they send nothing, at the cost of a probe of the idle registry)
# against the hand-written insert; the last turns wake-ups off on the service's side
# only, to show what the default costs against the same insert.
PRODUCER_RUNS = [
    ("produce", 1, "1-target steps", None),
    ("produce", 10, "10-target steps", 0.95),
    ("produce-quiet", 10, "10-target steps, wake-ups off", None),
]


def producer(db: common.BenchDb, options: Options) -> list[Figure]:
    workers = options.workers or 8
    figures = []
    for kind, size, label, bar in PRODUCER_RUNS:
        rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
        for round_ in range(1, options.rounds + 1):
            with db.connect() as conn:
                tenant = common.producer_tenant(conn, "producer")
            specs = [
                Spec(kind, BOTH, i, db, tenant, step_size=size, label=f"r{round_}")
                for i in range(workers)
            ]
            desc = f"producer {label} #{round_}"
            phase = run_phase(specs, seconds=options.seconds, warmup=options.warmup, desc=desc)
            for api in rates:
                rates[api].append(phase.rate(api=api))
        figures.append(
            Figure(
                "producer",
                f"{label}, {workers} workers",
                mean(rates[SERVICE]),
                mean(rates[BASELINE]),
                "deliveries/s",
                bar=bar,
            )
        )
    return figures


def bare(db: common.BenchDb, options: Options) -> list[Figure]:
    """The producer's 100-target steps against inserting the same rows, one
    transaction per step, into a table with the same columns and no rule at all."""
    workers = options.workers or 8
    rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
    for round_ in range(1, options.rounds + 1):
        with db.connect() as conn:
            conn.execute(CREATE_BARE_TABLE)
            conn.execute(f"TRUNCATE {BARE_TABLE}")
            tenant = common.producer_tenant(conn, "bare")
        specs = [
            Spec("bare", BOTH, i, db, tenant, step_size=BARE_STEP, label=f"b{round_}")
            for i in range(workers)
        ]
        desc = f"producer {BARE_STEP}-target vs bare table #{round_}"
        phase = run_phase(specs, seconds=options.seconds, warmup=options.warmup, desc=desc)
        for api in rates:
            rates[api].append(phase.rate(api=api))
    return [
        Figure(
            "bare",
            f"producer, {BARE_STEP}-target steps vs a bare-table insert, {workers} workers",
            mean(rates[SERVICE]),
            mean(rates[BASELINE]),
            "deliveries/s",
            bar=0.2,
        )
    ]


def history(db: common.BenchDb, options: Options, ids: str = common.ORDERED_IDS) -> list[Figure]:
    """Claim+finish behind terminal rows, with the ids ``NewDelivery`` makes by default
    (time-ordered); ``history_random`` uses random ids a producer may choose instead."""
    workers = options.workers or 8
    random_ids = ids == common.RANDOM_IDS
    name = "history_random" if random_ids else "history"
    kind = "random ids, " if random_ids else ""
    # Runs without history bracket the one with it, so a drift in machine load
    # between the phases cancels out instead of landing on one side.
    before = _cycle_phase(db, SERVICE, workers, options, f"{name}: none", ids=ids)
    full = _cycle_phase(
        db,
        SERVICE,
        workers,
        options,
        f"{name}: {options.rows:,}",
        history=options.rows,
        ids=ids,
    )
    after = _cycle_phase(db, SERVICE, workers, options, f"{name}: none again", ids=ids)
    return [
        Figure(
            name,
            f"claim+finish with {options.rows:,} terminal rows vs none, {kind}{workers} workers",
            full.rate(),
            mean([before.rate(), after.rate()]),
            "cycles/s",
            bar=0.95,
            notes=[
                f"cycles/s: {before.rate():,.1f} none, {full.rate():,.1f} with "
                f"{options.rows:,}, {after.rate():,.1f} none again",
                *_notes(before),
                *_notes(full),
                *_notes(after),
            ],
        )
    ]


def isolation(db: common.BenchDb, options: Options) -> list[Figure]:
    workers = options.workers or 8
    busy = options.rows // 5
    rates: dict[str, list[float]] = {"alone": [], "beside": []}
    notes: list[str] = []
    for round_ in range(1, options.rounds + 1):
        for side, neighbour in (("alone", 0), ("beside", busy)):
            desc = f"isolation: {side} #{round_}"
            phase = _cycle_phase(db, SERVICE, workers, options, desc, neighbour=neighbour)
            rates[side].append(phase.rate())
            notes += _notes(phase)
    return [
        Figure(
            "isolation",
            f"quiet community beside {busy:,} pending vs alone, {workers} workers",
            mean(rates["beside"]),
            mean(rates["alone"]),
            "claims/s",
            bar=0.9,
            notes=notes,
        )
    ]


PENDING_LEFT = (
    "SELECT count(*) FROM workflow_agent_deliveries WHERE community_id = %s AND status = 'pending'"
)


def _sweep_beside_workers(
    db: common.BenchDb,
    options: Options,
    *,
    name: str,
    workers: int,
    state: str,
    rows: int,
    what: str,
    sweep: Callable[[Callable[[int, float], None]], int],
    bar: float,
) -> list[Figure]:
    """``workers`` claim+finish loops on a tenant of their own while ``sweep(on_batch)``
    (the reaper, the pruner) works through ``rows`` rows in ``state`` spread over other
    communities: the workers' rate during the sweep against their rate alone, measured
    for ``--seconds`` before and again after it (the mean of the two: the workers' own
    rate drifts as their claims leave dead index entries behind and autovacuum comes
    and goes, which a window on one side only would book to the sweep; the window after
    is left out, and the notes say so, when what is left of the workers' seed would
    not last it); the sweep's total time and its longest batch."""
    with db.connect() as conn:
        common.truncate_deliveries(conn)
        tenant = common.create_tenant(conn, "load")
        for n in range(REAP_COMMUNITIES):
            share = rows // REAP_COMMUNITIES + (n < rows % REAP_COMMUNITIES)
            other = common.create_tenant(conn, f"{name}{n}")
            common.seed_deliveries(conn, other, share, state=state)
        seeded = _pending_rows(options, 4)
        common.seed_deliveries(conn, tenant, seeded, state=common.PENDING)
        common.vacuum(conn)
    batches: list[tuple[int, float]] = []
    swept = 0

    def driver() -> dict[str, tuple[float, float]]:
        nonlocal swept
        began = time.monotonic() - options.warmup
        before = sleep_window(options.seconds, f"{name}: workers alone")
        with tqdm(total=rows, desc=name, unit="row", unit_scale=True, leave=False) as progress:

            def on_batch(count: int, seconds: float) -> None:
                batches.append((count, seconds))
                progress.update(count)

            started = time.monotonic()
            swept = sweep(on_batch)
            ended = time.monotonic()
        windows = {"before": before, name: (started, ended)}
        with db.connect() as conn:
            left = conn.execute(PENDING_LEFT, [tenant.community_id]).fetchone()[0]
        pace = (seeded - left) / (time.monotonic() - began)
        if left > 1.5 * pace * options.seconds:
            windows["after"] = sleep_window(options.seconds, f"{name}: workers alone again")
        return windows

    specs = [Spec("cycle", SERVICE, i, db, tenant) for i in range(workers)]
    phase = run_phase(
        specs, seconds=options.seconds, warmup=options.warmup, desc=name, driver=driver
    )
    start, end = phase.windows[name]
    alone = [phase.rate(window) for window in ("before", "after") if window in phase.windows]
    notes = _notes(phase)
    if len(alone) == 2:
        notes.append(f"workers alone: {alone[0]:,.1f} cycles/s before, {alone[1]:,.1f} after")
    else:
        notes.append(
            f"workers alone: {alone[0]:,.1f} cycles/s before; no window after: their seed "
            "would not have lasted it"
        )
    if swept < rows:
        notes.append(f"{name} took {swept:,} of {rows:,} rows")
    longest = max((seconds for _, seconds in batches), default=0.0)
    return [
        Figure(
            name,
            f"worker rate during the {name} vs without, {workers} workers",
            phase.rate(name),
            mean(alone),
            "cycles/s",
            bar=bar,
            notes=notes,
        ),
        Figure(name, f"{name} of {rows:,} {what}, total", end - start, None, "s"),
        Figure(
            name,
            f"longest {name} batch ({len(batches)} batches)",
            longest,
            None,
            "s",
            bar=1.0,
            bar_below=True,
        ),
    ]


def reap(db: common.BenchDb, options: Options) -> list[Figure]:
    """4 workers' claim+finish rate while the reaper takes ``--rows``/10 expired leases
    of other communities back to pending, with its default rest between batches."""
    from workflow_delivery import services

    return _sweep_beside_workers(
        db,
        options,
        name="reap",
        workers=options.workers or 4,
        state=common.EXPIRED,
        rows=options.rows // 10,
        what="expired leases",
        sweep=lambda on_batch: services.reap_expired_deliveries(on_batch=on_batch),
        bar=0.85,
    )


# The reaper cliff: a few reapable rows in a healthy tenant, measured with
# no rows parked elsewhere and then with rows/10 expired leases parked in a fenced one.
CLIFF_REAPABLE = 5
CLIFF_BATCH = 2
CLIFF_SWEEPS = 30

_REARM = """
UPDATE workflow_agent_deliveries
   SET status = 'claimed', lease_generation = lease_generation + 1,
       claimed_at = now() - interval '2 hours', lease_until = now() - interval '1 hour'
 WHERE community_id = %s
"""


def _cliff_sweeps(conn, tenant: common.Tenant, desc: str) -> list[float]:
    """Seconds per reaper batch over CLIFF_SWEEPS sweeps of the healthy tenant's rows."""
    from django.test.utils import override_settings

    from workflow_delivery import services

    seconds: list[float] = []
    for _ in tqdm(range(CLIFF_SWEEPS), desc=desc, unit="sweep", leave=False):
        conn.execute(_REARM, [tenant.community_id])
        # The same rows are re-armed every sweep: without the attempts cap they stay
        # reclaimable instead of being settled failed after MAX_ATTEMPTS sweeps.
        with override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=None):
            reclaimed = services.reap_expired_deliveries(
                batch_size=CLIFF_BATCH,
                yield_ratio=0,
                on_batch=lambda count, elapsed: seconds.append(elapsed),
            )
        if reclaimed != CLIFF_REAPABLE:
            raise RuntimeError(f"{desc}: reclaimed {reclaimed}, not {CLIFF_REAPABLE}")
    return seconds


def reap_cliff(db: common.BenchDb, options: Options) -> list[Figure]:
    """Batch time of the reaper with 0 vs rows/10 expired leases parked in a fenced
    community: non-active tenants are excluded before any per-row work, so what is
    parked must not slow a batch (bar: at least 0.9x the rate without)."""
    parked = options.rows // 10
    with db.connect() as conn:
        common.truncate_deliveries(conn)
        healthy = common.create_tenant(conn, "healthy")
        frozen = common.create_tenant(conn, "frozen")
        common.seed_deliveries(conn, healthy, CLIFF_REAPABLE, state=common.EXPIRED, progress=False)
        common.vacuum(conn)
        empty = _cliff_sweeps(conn, healthy, "reap cliff: nothing parked")
        common.seed_deliveries(conn, frozen, parked, state=common.EXPIRED, prefix="parked-")
        # One lifecycle step at a time, as the database requires.
        for state in ("quiescing", "fenced"):
            conn.execute(
                "UPDATE communities SET deletion_state = %s WHERE id = %s",
                [state, frozen.community_id],
            )
        common.vacuum(conn)
        loaded = _cliff_sweeps(conn, healthy, f"reap cliff: {parked:,} parked")
    typical_empty, typical_loaded = median(empty), median(loaded)
    notes = [
        f"median batch {typical_empty * 1000:.2f} ms with nothing parked, "
        f"{typical_loaded * 1000:.2f} ms with {parked:,} parked; "
        f"{CLIFF_SWEEPS} sweeps of {CLIFF_REAPABLE} rows at --batch-size {CLIFF_BATCH}"
    ]
    return [
        Figure(
            "reap_cliff",
            f"reaper batches/s with {parked:,} leases parked in a fenced community vs none",
            1 / typical_loaded,
            1 / typical_empty,
            "batches/s",
            bar=0.9,
            notes=notes,
        ),
        Figure(
            "reap_cliff",
            f"median reaper batch with {parked:,} parked",
            typical_loaded * 1000,
            typical_empty * 1000,
            "ms",
        ),
    ]


def timeline(db: common.BenchDb, options: Options) -> list[Figure]:
    """Service claim+finish with ``WORKFLOW_DELIVERY_TIMELINE`` on, against the same
    with it off, both taking turns in slices of one window, at 8 workers (and 1)."""
    figures = []
    for workers in sorted({1, options.workers or 8}, reverse=True):
        rates: dict[str, list[float]] = {SERVICE: [], BASELINE: []}
        notes: list[str] = []
        for round_ in range(1, options.rounds + 1):
            desc = f"timeline, {workers} workers #{round_}"
            phase = _cycle_phase(db, BOTH, workers, options, desc, kind="cycle-timeline")
            for api in rates:
                rates[api].append(phase.rate(api=api))
            notes += _notes(phase)
        figures.append(
            Figure(
                "timeline",
                f"claim+finish with the timeline on vs off, {workers} workers",
                mean(rates[SERVICE]),
                mean(rates[BASELINE]),
                "cycles/s",
                bar=0.9,
                notes=notes,
            )
        )
    return figures


def prune(db: common.BenchDb, options: Options) -> list[Figure]:
    """8 workers' claim+finish rate while ``prune_deliveries`` deletes ``--rows``
    terminal rows (with their timeline) of other communities."""
    from workflow_delivery import services

    return _sweep_beside_workers(
        db,
        options,
        name="prune",
        workers=options.workers or 8,
        state=common.TERMINAL,
        rows=options.rows,
        what="terminal rows",
        sweep=lambda on_batch: services.prune_deliveries(older_than="0s", on_batch=on_batch),
        bar=0.7,
    )


def latency(db: common.BenchDb, options: Options) -> list[Figure]:
    figures = []
    for workers in (1, options.workers or 8):
        phase = _cycle_phase(db, BOTH, workers, options, f"latency, {workers} workers")
        for which, op in (("first", "claim"), ("second", "finish")):
            for q in (50, 99):
                value, base = (
                    common.percentile(phase.latencies(which, api=api), q) * 1000
                    for api in (SERVICE, BASELINE)
                )
                figures.append(
                    Figure("latency", f"{op} p{q}, {workers} worker(s)", value, base, "ms")
                )
    return figures


BENCHMARKS: dict[str, Callable[[common.BenchDb, Options], list[Figure]]] = {
    "throughput": throughput,
    "settle_next": settle_next,
    "batch": batch,
    "producer": producer,
    "bare": bare,
    "history": history,
    # The same with random delivery ids (version 4), which producers may still choose.
    "history_random": partial(history, ids=common.RANDOM_IDS),
    "isolation": isolation,
    "reap": reap,
    "reap_cliff": reap_cliff,
    "latency": latency,
    "timeline": timeline,
    "prune": prune,
}
