"""The end of a chaos run: the database checked against every process's journal.

A renew or finish is *stale* when, before it was sent, its delivery had already been claimed
again at a newer generation (a claim line written earlier than the attempt began), or when it
came from a holder the harness stalled, after the stall. A stale attempt must be refused
(lease lost); anything else is accepted and counted.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg

TERMINAL = ("finished", "failed")
# A wait answered later than its own seconds plus this is hung (the HTTP agents'
# bound on a request, which their client's timeout enforces past the wait).
WAIT_BOUND = 30.0
# A wait answered with a delivery whose send began at least this long after the wait
# was sent was parked when the send came: woken by it, not answered by its first look.
WOKEN_MARGIN = 1.0


@dataclass
class ChaosReport:
    committed: int = 0
    rows: int = 0
    settled: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    settled_twice: int = 0
    contradictions: int = 0
    lost: int = 0
    unsettled: int = 0
    unrecorded: int = 0
    rule_violations: int = 0
    stale_renews: int = 0
    stale_renews_accepted: int = 0
    stale_finishes: int = 0
    stale_finishes_accepted: int = 0
    agents_killed: int = 0
    holders_stalled: int = 0
    stalls_refused: int = 0
    connections_dropped: dict[str, int] = field(default_factory=dict)
    reconnects: int = 0
    restarts: int = 0
    takeover_seconds: list[float] = field(default_factory=list)
    settled_by_dead_holder: int = 0
    worker_errors: list[str] = field(default_factory=list)
    # The tenant deleter: a huge step, then its tenant deleted while the fleet works.
    huge_step: dict[str, Any] = field(default_factory=dict)
    probe_reclaim_seconds: float | None = None
    deletion: dict[str, Any] = field(default_factory=dict)
    deletion_failures: list[str] = field(default_factory=list)
    effects_checked: bool = False
    effect_rows: int = 0
    effects_missing: int = 0
    effects_duplicated: int = 0
    effects_stale: int = 0
    # Stuck holders: hung inside holding() past their lease while the reaper ran.
    stuck_checked: bool = False
    stuck_holders: int = 0
    stuck_probes_reclaimed: int = 0
    stuck_rows_held_past_lease: int = 0
    stuck_finishes_refused: int = 0
    stuck_finishes_accepted: int = 0
    stuck_effects_committed: int = 0
    stuck_rows_reclaimed: int = 0
    stuck_rows_settled_by_successor: int = 0
    # Losses of the primary (--failover): planned, done, and what the clients were told.
    failovers_planned: int = 0
    failovers: list[dict[str, Any]] = field(default_factory=list)
    failover_errors: list[str] = field(default_factory=list)
    recovery_seconds: list[float | None] = field(default_factory=list)
    acknowledged_writes: int = 0
    acknowledged_lost: int = 0
    # Agents of the HTTP API: their requests, those not answered in the bound, those
    # answered 503, settles and first settle after each loss, by server; and the
    # harness's probes (admin, API) through each server after each loss.
    http_checked: bool = False
    http_requests: int = 0
    http_hung: int = 0
    http_unavailable: int = 0
    http_connection_errors: int = 0
    http_settles: dict[str, int] = field(default_factory=dict)
    http_recovery_seconds: dict[str, list[float | None]] = field(default_factory=dict)
    probes: list[dict[str, Any]] = field(default_factory=list)
    # The waiting HTTP agents: their waits and waiting claims by server, how they were
    # answered, those not answered within their seconds plus WAIT_BOUND, those in
    # flight at each loss, and those woken by a send (in all, after each loss until
    # the next, and the seconds from each loss to the first).
    waits_checked: bool = False
    http_waits: dict[str, int] = field(default_factory=dict)
    http_wait_answers: dict[str, int] = field(default_factory=dict)
    http_waits_hung: int = 0
    http_waits_at_loss: dict[str, list[int]] = field(default_factory=dict)
    http_waits_at_loss_answers: dict[str, int] = field(default_factory=dict)
    http_waits_at_loss_max_seconds: float | None = None
    http_woken: dict[str, int] = field(default_factory=dict)
    http_woken_after_failover: dict[str, list[int]] = field(default_factory=dict)
    http_first_wake_seconds: dict[str, list[float | None]] = field(default_factory=dict)
    header: str = ""

    MUST_BE_ZERO = (
        "settled_twice",
        "contradictions",
        "lost",
        "unrecorded",
        "rule_violations",
        "stale_renews_accepted",
        "stale_finishes_accepted",
        "effects_missing",
        "effects_duplicated",
        "effects_stale",
        "stuck_finishes_accepted",
        "stuck_effects_committed",
    )

    @property
    def stuck_ok(self) -> bool:
        """Every stuck holder that woke: the probe reclaimed while it hung, its own row
        held past the lease, its finish refused, its row reclaimed and settled by a
        successor."""
        n = self.stuck_holders
        return not self.stuck_checked or (
            n >= 1
            and self.stuck_probes_reclaimed == n
            and self.stuck_rows_held_past_lease == n
            and self.stuck_finishes_refused == n
            and self.stuck_rows_reclaimed == n
            and self.stuck_rows_settled_by_successor == n
        )

    @property
    def stale_writes(self) -> int:
        """Writes accepted from a holder whose lease was no longer its own."""
        return (
            self.stale_renews_accepted
            + self.stale_finishes_accepted
            + self.effects_stale
            + self.stuck_effects_committed
        )

    @property
    def probes_ok(self) -> bool:
        """After each loss, the admin and the API answered through every server."""
        expected = len(self.failovers) * len(self.http_settles)
        return not self.http_checked or (
            len(self.probes) == expected
            and all(p["admin_seconds"] is not None for p in self.probes)
            and all(p["api_seconds"] is not None for p in self.probes)
        )

    @property
    def waits_ok(self) -> bool:
        """Every wait answered within its bound, and after each loss a wait on every
        server woken by a send before the run ended."""
        return not self.waits_checked or (
            self.http_waits_hung == 0
            and all(None not in seconds for seconds in self.http_first_wake_seconds.values())
        )

    @property
    def failovers_ok(self) -> bool:
        """Every planned loss of the primary happened, was recovered from, and lost
        nothing a client had been told was done."""
        return (
            len(self.failovers) == self.failovers_planned
            and not self.failover_errors
            and None not in self.recovery_seconds
            and self.acknowledged_lost == 0
            # Every delivery settled in the end: each part came back after each loss.
            and (self.unsettled == 0 or not self.failovers_planned)
        )

    def summary(self) -> dict[str, Any]:
        """The figures as JSON (``--json``)."""
        return {
            "ok": self.ok,
            "run": self.header,
            "failovers": len(self.failovers),
            "failover_events": self.failovers,
            "failover_errors": self.failover_errors,
            "recovery_seconds": self.recovery_seconds,
            "acknowledged_writes": self.acknowledged_writes,
            "acknowledged_lost": self.acknowledged_lost,
            "settled_twice": self.settled_twice,
            "stale_writes": self.stale_writes,
            "committed": self.committed,
            "settled": self.settled,
            "lost": self.lost,
            "unsettled": self.unsettled,
            "contradictions": self.contradictions,
            "effects_missing": self.effects_missing,
            "effects_duplicated": self.effects_duplicated,
            "reconnects": self.reconnects,
            "worker_errors": self.worker_errors,
            "http_requests": self.http_requests,
            "http_hung": self.http_hung,
            "http_unavailable": self.http_unavailable,
            "http_connection_errors": self.http_connection_errors,
            "http_settles": self.http_settles,
            "http_recovery_seconds": self.http_recovery_seconds,
            "probes_after_failover": self.probes,
            "http_waits": self.http_waits,
            "http_wait_answers": self.http_wait_answers,
            "http_waits_hung": self.http_waits_hung,
            "http_waits_at_loss": self.http_waits_at_loss,
            "http_waits_at_loss_answers": self.http_waits_at_loss_answers,
            "http_waits_at_loss_max_seconds": self.http_waits_at_loss_max_seconds,
            "http_woken": self.http_woken,
            "http_woken_after_failover": self.http_woken_after_failover,
            "http_first_wake_seconds": self.http_first_wake_seconds,
        }

    @property
    def ok(self) -> bool:
        return (
            self.failovers_ok
            and self.probes_ok
            and self.waits_ok
            and self.stuck_ok
            and not self.worker_errors
            and not self.deletion_failures
            and all(getattr(self, n) == 0 for n in self.MUST_BE_ZERO)
        )

    def describe(self, config: Any, server: Any, run_dir: Any) -> None:
        if server.data_dir:
            where = "own embedded server"
        elif server.restartable:
            where = "configured server (restart allowed)"
        else:
            where = "configured server (not restarted: no --allow-restart)"
        self.header = (
            f"{config.agents} agents, {config.producers} producers, {config.targets} targets, "
            f"lease {config.lease} s, reaper every {config.reap_interval} s, "
            f"{config.seconds:g} s of faults, seed {config.seed}, {where}"
            + (f", journals in {run_dir}" if config.journal_dir else "")
        )

    def render(self) -> str:
        takeover = sorted(self.takeover_seconds)
        if takeover:
            timing = (
                f"n={len(takeover)}, p50 {statistics.median(takeover):.1f} s, "
                f"max {takeover[-1]:.1f} s"
            )
        else:
            timing = "n=0"
        drops = ", ".join(f"{role} {n}" for role, n in sorted(self.connections_dropped.items()))
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        lines = [
            f"chaos run: {self.header}",
            f"deliveries committed            {self.committed}",
            f"settled                         {self.settled} ({outcomes})",
            f"settled twice                   {self.settled_twice}   (must be 0)",
            f"settles contradicting the table {self.contradictions}   (must be 0)",
            f"lost                            {self.lost}   (must be 0)",
            f"rows no producer recorded       {self.unrecorded}   (must be 0)",
            f"rows breaking a SPEC §3 rule    {self.rule_violations}   (must be 0)",
            f"unsettled at the end            {self.unsettled}",
            f"stale renews attempted          {self.stale_renews}, accepted "
            f"{self.stale_renews_accepted}   (must be 0)",
            f"stale finishes attempted        {self.stale_finishes}, accepted "
            f"{self.stale_finishes_accepted}   (must be 0)",
            f"agents killed (kill -9)         {self.agents_killed}",
            f"holders stalled till taken over {self.holders_stalled}, refused after SIGCONT "
            f"{self.stalls_refused}",
            f"connections dropped             {sum(self.connections_dropped.values())} "
            f"({drops or 'none'}); reconnects seen by workers {self.reconnects}",
            f"database restarts               {self.restarts}",
            f"holder death -> settled by another agent: {timing}"
            f" (+{self.settled_by_dead_holder} settled by the holder just before it died)",
            f"worker errors                   {len(self.worker_errors)}   (must be 0)",
        ]
        if self.huge_step or self.deletion:
            probe = self.probe_reclaim_seconds
            lines += [
                f"huge step                       {self.huge_step.get('rows')} of "
                f"{self.huge_step.get('targets')} targets in "
                f"{self.huge_step.get('seconds')} s; retry created "
                f"{self.huge_step.get('retry_created')}",
                "healthy lease reclaimed while a tenant held its deletion lock: "
                + ("never" if probe is None else f"{probe:.2f} s after it expired"),
                f"tenant deletion                 {self.deletion.get('state', 'not reached')}, "
                f"rows left {self.deletion.get('rows_left')}",
                f"deletion scenario failures      {len(self.deletion_failures)}   (must be 0)",
            ]
            lines += [f"  {failure}" for failure in self.deletion_failures]
        if self.effects_checked:
            lines[-1:-1] = [
                f"effect rows (holding() writes)  {self.effect_rows}",
                f"settled without an effect row   {self.effects_missing}   (must be 0)",
                f"settled with several effects    {self.effects_duplicated}   (must be 0)",
                f"effects of a stale holder       {self.effects_stale}   (must be 0)",
            ]
        if self.stuck_checked:
            lines[-1:-1] = [
                f"holders stuck in holding()      {self.stuck_holders}; meanwhile other "
                f"expired leases reclaimed {self.stuck_probes_reclaimed}, own rows still held "
                f"past the lease {self.stuck_rows_held_past_lease}",
                f"stuck finishes refused          {self.stuck_finishes_refused}, accepted "
                f"{self.stuck_finishes_accepted}   (must be 0); effects committed "
                f"{self.stuck_effects_committed}   (must be 0)",
                f"stuck rows reclaimed once let go {self.stuck_rows_reclaimed}, settled by a "
                f"successor {self.stuck_rows_settled_by_successor}"
                + ("" if self.stuck_ok else "   (must all equal the stuck holders)"),
            ]
        if self.failovers_planned:
            recovery = [f"{s:.1f}" if s is not None else "never" for s in self.recovery_seconds]
            lines[-1:-1] = [
                f"primary lost (failovers)        {len(self.failovers)} of "
                f"{self.failovers_planned}: "
                + ", ".join(
                    f"{e['node']} {e['kind']} -> {e['new_primary']}" for e in self.failovers
                ),
                f"loss -> first settle after it   {', '.join(recovery) or 'none'} s",
                f"acknowledged writes             {self.acknowledged_writes} (sends, settles, "
                "effects)",
                f"acknowledged, then lost         {self.acknowledged_lost}   (must be 0)",
                f"stale writes accepted           {self.stale_writes}   (must be 0)",
            ]
            lines[-1:-1] = [f"  failover error: {error}" for error in self.failover_errors]
        if self.http_checked:
            admin = [p["admin_seconds"] for p in self.probes]
            api = [p["api_seconds"] for p in self.probes]
            lines[-1:-1] = [
                f"HTTP requests                   {self.http_requests}; no answer within the "
                f"bound {self.http_hung}, 503 {self.http_unavailable}, connection errors "
                f"{self.http_connection_errors}",
                "HTTP settles by server          "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.http_settles.items())),
            ]
            lines[-1:-1] = [
                f"  {name}: loss -> first HTTP settle  "
                + ", ".join("never" if s is None else f"{s:.1f}" for s in seconds)
                for name, seconds in sorted(self.http_recovery_seconds.items())
            ]
            lines[-1:-1] = [
                f"probes after each loss          {len(self.probes)}: admin 200 after "
                f"{_seconds(admin)}, API after {_seconds(api)}"
                + ("" if self.probes_ok else "   (must all answer)"),
            ]
        if self.waits_checked:
            answers = ", ".join(f"{k} {v}" for k, v in sorted(self.http_wait_answers.items()))
            at_loss = ", ".join(
                f"{k} {v}" for k, v in sorted(self.http_waits_at_loss_answers.items())
            )
            slowest = self.http_waits_at_loss_max_seconds
            lines[-1:-1] = [
                "HTTP waits by server            "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.http_waits.items()))
                + f" ({answers or 'none'}); hung {self.http_waits_hung}   (must be 0)",
                f"waits in flight at a loss       "
                f"{sum(sum(n) for n in self.http_waits_at_loss.values())} "
                f"({at_loss or 'none'}), slowest answered after "
                + ("-" if slowest is None else f"{slowest:.1f} s"),
                "waits woken by a send           "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.http_woken.items())),
            ]
            lines[-1:-1] = [
                f"  {name}: loss -> first wait woken  "
                + ", ".join("never" if s is None else f"{s:.1f}" for s in seconds)
                + ("" if None not in seconds else "   (must all be woken)")
                for name, seconds in sorted(self.http_first_wake_seconds.items())
            ]
        lines += [f"  {error}" for error in self.worker_errors]
        lines.append("RESULT: " + ("ok" if self.ok else "FAILED"))
        return "\n".join(lines)


def _seconds(values: list[float | None]) -> str:
    answered = sorted(v for v in values if v is not None)
    never = len(values) - len(answered)
    text = f"max {answered[-1]:.1f} s" if answered else "none"
    return text + (f", never {never}" if never else "")


def _rows(
    conn: psycopg.Connection, excluded: list[str]
) -> dict[str, tuple[str, int, float | None]]:
    rows = conn.execute(
        "SELECT id, status, lease_generation, extract(epoch FROM finished_at) "
        "FROM workflow_agent_deliveries WHERE NOT community_id = ANY(%s::uuid[])",
        [excluded],
    ).fetchall()
    return {
        str(id_): (status, generation, float(at) if at is not None else None)
        for id_, status, generation, at in rows
    }


RULE_VIOLATIONS = """
SELECT count(*) FROM workflow_agent_deliveries
 WHERE status NOT IN ('pending', 'claimed', 'finished', 'failed')
    OR lease_generation < 0
    OR (status = 'claimed') <> (lease_until IS NOT NULL)
    OR (status = 'claimed') <> (claimed_at IS NOT NULL)
    OR (status IN ('finished', 'failed')) <> (finished_at IS NOT NULL)
    OR (status <> 'pending' AND lease_generation = 0)
"""


def _check_effects(
    conn: psycopg.Connection,
    table: str,
    rows: dict[str, tuple[str, int, float | None]],
    report: ChaosReport,
    http_targets: list[bytes],
) -> None:
    """Exactly one effect row per settled delivery, written by the holder that settled
    it (same generation); an effect row of any other generation is a stale holder's.
    The HTTP agents' deliveries (``http_targets``) have no effect rows: they settle
    through the API, which writes nothing else."""
    report.effects_checked = True
    without = {
        str(row[0])
        for row in conn.execute(
            "SELECT id FROM workflow_agent_deliveries WHERE target_pubkey = ANY(%s)",
            [http_targets],
        )
    }
    effects: dict[str, list[int]] = defaultdict(list)
    for delivery_id, generation in conn.execute(f"SELECT delivery_id, generation FROM {table}"):
        effects[str(delivery_id)].append(generation)
    report.effect_rows = sum(len(found) for found in effects.values())
    for delivery_id, (status, generation, _) in rows.items():
        found = effects.get(delivery_id, [])
        if status in TERMINAL and delivery_id not in without:
            report.effects_missing += not found
            report.effects_duplicated += len(found) > 1
        report.effects_stale += sum(1 for g in found if status not in TERMINAL or g != generation)
    report.effects_stale += sum(len(found) for d, found in effects.items() if d not in rows)


def check(
    conn: psycopg.Connection,
    records: list[dict[str, Any]],
    crashes: list[str],
    *,
    effects_table: str | None = None,
    stuck_effects_table: str | None = None,
    failovers: int = 0,
    http_targets: list[bytes] | None = None,
) -> ChaosReport:
    report = ChaosReport(failovers_planned=failovers)
    # The deleter's tenants have their own checks (below), not the fleet's.
    excluded = [c for r in records if r["op"] == "tenants" for c in r["communities"]]
    table = _rows(conn, excluded)
    report.rule_violations = conn.execute(RULE_VIOLATIONS).fetchone()[0]
    clock_offset = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0]
    clock_offset = float(clock_offset) - time.time()

    committed = {value for r in records if r["op"] == "commit" for value in r["ids"]}
    report.committed = len(committed)
    report.rows = len(table)
    report.lost = len(committed - table.keys())
    report.unrecorded = len(table.keys() - committed)
    statuses = Counter(table[i][0] for i in committed if i in table)
    report.outcomes = {s: statuses[s] for s in TERMINAL}
    report.settled = sum(report.outcomes.values())
    report.unsettled = statuses["pending"] + statuses["claimed"]

    claims: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        if r["op"] == "claim":
            claims[r["id"]].append((r["gen"], r["t"]))

    settles: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["op"] != "finish":
            continue
        status, generation, _ = table.get(r["id"], (None, None, None))
        if r["result"] == "settled":
            settles[r["id"]].append(r)
            if (status, generation) != (r["outcome"], r["gen"]):
                report.contradictions += 1
        elif r["result"].startswith("already:") and r["result"] != f"already:{status}":
            report.contradictions += 1
    report.settled_twice = sum(1 for found in settles.values() if len(found) > 1)

    stalls = {(r["pid"], r["id"], r["gen"]): r["t"] for r in records if r["op"] == "stall"}
    refused_stalls: dict[tuple[int, str, int], list[bool]] = defaultdict(list)
    for r in records:
        if r["op"] not in ("renew", "finish"):
            continue
        superseded = any(g > r["gen"] and t < r["t0"] for g, t in claims[r["id"]])
        stalled_at = stalls.get((r["pid"], r["id"], r["gen"]))
        after_stall = stalled_at is not None and r["t0"] > stalled_at
        if not (superseded or after_stall):
            continue
        accepted = r["result"] != "lost"
        if r["op"] == "renew":
            report.stale_renews += 1
            report.stale_renews_accepted += accepted
        else:
            report.stale_finishes += 1
            report.stale_finishes_accepted += accepted
        if after_stall:
            refused_stalls[r["pid"], r["id"], r["gen"]].append(not accepted)
    report.holders_stalled = sum(1 for r in records if r["op"] == "cont" and r["completed"])
    report.stalls_refused = sum(1 for seen in refused_stalls.values() if seen and all(seen))

    deaths = [r for r in records if r["op"] in ("kill", "stall")]
    report.agents_killed = sum(1 for r in deaths if r["op"] == "kill")
    for death in deaths:
        status, generation, finished_at = table.get(death["id"], (None, None, None))
        if status not in TERMINAL:
            continue
        if generation == death["gen"]:
            report.settled_by_dead_holder += 1
        else:
            report.takeover_seconds.append(finished_at - clock_offset - death["t"])

    report.connections_dropped = dict(Counter(r["role"] for r in records if r["op"] == "drop"))
    report.reconnects = sum(1 for r in records if r["op"] == "conn_error")
    report.restarts = sum(1 for r in records if r["op"] == "restart_end")
    if effects_table is not None:
        _check_effects(conn, effects_table, table, report, http_targets or [])
    report.worker_errors = [
        f"{r['role']}-{r['index']} (pid {r['pid']}): {r['error']}"
        for r in records
        if r["op"] == "error"
    ] + list(crashes)
    _check_deletion(conn, records, report)
    if stuck_effects_table is not None:
        _check_stuck(conn, records, table, stuck_effects_table, report)
    _check_acknowledged(records, table, settles, report)
    if http_targets:
        _check_http(records, settles, report)
    return report


def _check_http(
    records: list[dict[str, Any]],
    settles: dict[str, list[dict[str, Any]]],
    report: ChaosReport,
) -> None:
    """The HTTP agents' request counts (each process's last), settles and first settle
    after each loss by server, and the harness's probes after each loss."""
    report.http_checked = True
    last: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["op"] == "http_stats":
            last[r["pid"]] = r
    report.http_requests = sum(r.get("requests", 0) for r in last.values())
    report.http_hung = sum(r.get("hung", 0) for r in last.values())
    report.http_unavailable = sum(r.get("unavailable", 0) for r in last.values())
    report.http_connection_errors = sum(r.get("connection_errors", 0) for r in last.values())
    by_server: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["op"] == "http_stats":
            by_server.setdefault(r["server"], [])
    for found in settles.values():
        for r in found:
            if "server" in r:
                by_server[r["server"]].append(r["t"])
    report.http_settles = {name: len(times) for name, times in by_server.items()}
    for name, times in by_server.items():
        times.sort()
        report.http_recovery_seconds[name] = [
            next((round(t - e["killed_at"], 2) for t in times if t > e["killed_at"]), None)
            for e in report.failovers
        ]
    report.probes = [
        {
            k: r[k]
            for k in (
                "server",
                "since_loss",
                "admin_first",
                "admin_seconds",
                "api_first",
                "api_seconds",
            )
        }
        for r in records
        if r["op"] == "probe"
    ]
    _check_waits(records, report)


def _check_waits(records: list[dict[str, Any]], report: ChaosReport) -> None:
    """The waiting HTTP agents' waits (``http_wait`` lines): by server and answer; hung
    when not answered within their seconds plus ``WAIT_BOUND``; in flight at a loss
    when sent before it and answered after it; woken by a send when answered with a
    delivery whose send (the waker's ``commit`` line, ``t0``) began ``WOKEN_MARGIN``
    seconds or more after the wait was sent."""
    waits = [r for r in records if r["op"] == "http_wait"]
    if not waits:
        return
    report.waits_checked = True
    sends = {i: r["t0"] for r in records if r["op"] == "commit" and "t0" in r for i in r["ids"]}
    servers = sorted({r["server"] for r in waits})
    report.http_waits = dict(Counter(r["server"] for r in waits))
    report.http_wait_answers = dict(Counter(r["answer"] for r in waits))
    report.http_waits_hung = sum(
        1 for r in waits if r["answer"] == "hung" or r["seconds"] > r["wait"] + WAIT_BOUND
    )
    woken = sorted(
        (
            r
            for r in waits
            if r["answer"] == "delivery"
            and r["id"] in sends
            and sends[r["id"]] >= r["sent_at"] + WOKEN_MARGIN
        ),
        key=lambda r: r["sent_at"],
    )
    report.http_woken = {name: sum(1 for r in woken if r["server"] == name) for name in servers}
    losses = [e["killed_at"] for e in report.failovers]
    answers: Counter[str] = Counter()
    slowest: list[float] = []
    for name in servers:
        report.http_waits_at_loss[name] = []
        report.http_woken_after_failover[name] = []
        report.http_first_wake_seconds[name] = []
        mine = [r for r in woken if r["server"] == name]
        for i, lost_at in enumerate(losses):
            in_flight = [
                r
                for r in waits
                if r["server"] == name and r["sent_at"] < lost_at < r["sent_at"] + r["seconds"]
            ]
            report.http_waits_at_loss[name].append(len(in_flight))
            answers.update(r["answer"] for r in in_flight)
            slowest += [r["seconds"] for r in in_flight]
            until = losses[i + 1] if i + 1 < len(losses) else float("inf")
            after = [r for r in mine if r["sent_at"] > lost_at]
            report.http_woken_after_failover[name].append(
                sum(1 for r in after if r["sent_at"] < until)
            )
            report.http_first_wake_seconds[name].append(
                round(min(r["sent_at"] + r["seconds"] for r in after) - lost_at, 2)
                if after
                else None
            )
    report.http_waits_at_loss_answers = dict(answers)
    report.http_waits_at_loss_max_seconds = max(slowest) if slowest else None


def _check_acknowledged(
    records: list[dict[str, Any]],
    table: dict[str, tuple[str, int, float | None]],
    settles: dict[str, list[dict[str, Any]]],
    report: ChaosReport,
) -> None:
    """What the clients were told was done (a committed send, a settle, the effect
    committed with it) against what the surviving primary holds, and the seconds from each
    loss of the primary to the first settle acknowledged after it."""
    settled = [r for found in settles.values() for r in found]
    effects = report.effect_rows if report.effects_checked else 0
    report.acknowledged_writes = report.committed + len(settled) + effects
    lost_settles = sum(
        1 for r in settled if table.get(r["id"], (None, None, None))[:2] != (r["outcome"], r["gen"])
    )
    report.acknowledged_lost = report.lost + lost_settles + report.effects_missing
    report.failovers = [r for r in records if r["op"] == "failover"]
    report.failover_errors = [
        f"{r['kind']}: {r['error']}" for r in records if r["op"] == "failover_error"
    ]
    times = sorted(r["t"] for r in settled)
    for event in report.failovers:
        after = next((t for t in times if t > event["killed_at"]), None)
        report.recovery_seconds.append(
            None if after is None else round(after - event["killed_at"], 2)
        )


def _check_stuck(
    conn: psycopg.Connection,
    records: list[dict[str, Any]],
    rows: dict[str, tuple[str, int, float | None]],
    effects_table: str,
    report: ChaosReport,
) -> None:
    """A stuck holder counts once it woke (a lost connection restarts its scenario).
    While it hung, its probe (another expired lease) must have been reclaimed and its
    own row still held at its generation past the lease; its finish must be refused
    and its effect row gone; once let go, its row is reclaimed and settled at a newer
    generation."""
    report.stuck_checked = True
    effects = Counter(
        (str(delivery_id), generation)
        for delivery_id, generation in conn.execute(
            f"SELECT delivery_id, generation FROM {effects_table}"
        )
    )
    report.stuck_effects_committed = sum(effects.values())
    released = {(r["id"], r["gen"]): r for r in records if r["op"] == "stuck_release"}
    for wake in (r for r in records if r["op"] == "stuck_wake"):
        report.stuck_holders += 1
        probe_at = wake["probe_reclaimed_at"]
        report.stuck_probes_reclaimed += probe_at is not None and probe_at < wake["t"]
        report.stuck_rows_held_past_lease += bool(wake["held_past_lease"])
        report.stuck_finishes_refused += wake["result"] == "lost"
        report.stuck_finishes_accepted += wake["result"] != "lost"
        release = released.get((wake["id"], wake["gen"]))
        report.stuck_rows_reclaimed += bool(release and release["reclaimed_at"])
        status, generation, _ = rows.get(wake["id"], (None, None, None))
        report.stuck_rows_settled_by_successor += (
            status in TERMINAL and generation is not None and generation > wake["gen"]
        )


def _check_deletion(
    conn: psycopg.Connection, records: list[dict[str, Any]], report: ChaosReport
) -> None:
    """The deleter's scenario: the huge step whole and its retry empty; the healthy
    probe reclaimed on time while the doomed tenant's deletion lock was held; the
    doomed tenant tombstoned with no row left."""
    if not any(r["op"] == "tenants" for r in records):
        return
    failures = report.deletion_failures
    huge = next((r for r in records if r["op"] == "huge_step"), None)
    if huge is None:
        failures.append("the huge step was never committed")
    else:
        report.huge_step = {k: huge[k] for k in ("targets", "rows", "retry_created", "seconds")}
        if huge["rows"] != huge["targets"] or huge["retry_created"] or not huge["existed_on_retry"]:
            failures.append(f"huge step not whole or not idempotent: {report.huge_step}")
    probe = next((r for r in records if r["op"] == "probe"), None)
    if probe is None or not probe["while_locked"]:
        failures.append("the healthy probe was not reclaimed while the tenant was locked")
    else:
        report.probe_reclaim_seconds = probe["reclaimed_at"] - probe["lease_until"]
        bound = probe.get("bound")
        if bound is not None and report.probe_reclaim_seconds > bound:
            failures.append(
                f"the healthy probe took {report.probe_reclaim_seconds:.2f} s (bound {bound} s)"
            )
    deletion = next((r for r in records if r["op"] == "deletion"), None)
    doomed = (next(r for r in records if r["op"] == "tenants"))["communities"][0]
    state, left = conn.execute(
        "SELECT (SELECT deletion_state FROM communities WHERE id = %s), "
        "(SELECT count(*) FROM workflow_agent_deliveries WHERE community_id = %s)",
        [doomed, doomed],
    ).fetchone()
    report.deletion = {"state": state, "rows_left": left}
    if deletion is None or state != "tombstone" or left:
        failures.append(f"the doomed tenant was not deleted: {report.deletion}")
