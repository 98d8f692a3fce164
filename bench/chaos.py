"""Chaos harness: a fleet of producers, agents and a reaper under injected faults.

    python bench/chaos.py [--agents 8] [--seconds 60] [--lease 3] [--deliveries 1500]
                          [--database-url URL] [--allow-restart] [--consumers]
                          [--failover N [--async]] [--http-agents N] [--json FILE]

Producers commit steps with several targets through ``services.delivery_identity``; agents
claim, renew at a third of the lease and settle; the reaper returns expired leases. Meanwhile
the harness kills agents holding a lease (``kill -9``), stalls holders (SIGSTOP until another
agent has settled their delivery, then SIGCONT), drops connections (``pg_terminate_backend``)
and restarts the database, and stuck holders hang inside ``services.holding()`` past their
lease (the reaper must reclaim other expired leases meanwhile, the stuck finish must be
refused with its effect rolled back, and the row reclaimed once let go). Every process
journals what it saw; at the end the database is checked against the journals and the
figures are printed. Exit status 1 when a figure that
must be 0 is not.

With ``--consumers`` the agents are ``workflow_delivery.consumer.Consumer`` processes (wake-ups,
heartbeats) whose handler writes one row per delivery into an effect table and settles in the
same ``holding()`` block; the check then also demands exactly one effect row per settled
delivery, written at the generation that settled it.

Without ``--database-url`` (or ``DATABASE_URL``) the harness starts a throwaway PostgreSQL of
its own, which it may restart. On a configured server it works in a private database and
restarts the server only with ``--allow-restart``.

With ``--failover N`` it works on the replicated cluster of ``scripts/ha`` (Patroni, a
primary and a synchronous standby, started if it is not running) through its multi-host URL,
with ``Consumer`` agents (``--consumers``), and instead of restarting a server it loses the
primary N times, alternating between the two nodes (so it fails back to the first): each
time the node's Patroni, postmaster and backends are killed (SIGKILL), except once, when
the postmaster and backends are frozen (SIGSTOP) and left so until the standby is
promoted. The lost node then rejoins as the standby. The check adds what the clients
acknowledged and the surviving primary lacks, and the seconds from each loss to the first
settle acknowledged after it. ``--async`` runs it on asynchronous replication, to count
what that loses. ``--json FILE`` writes the figures as JSON.

With ``--http-agents N`` (4 by default with ``--failover``) the demo project is served by
uvicorn and by gunicorn over the run's URL, and N agents of the signed HTTP API, half
through each server, claim and finish deliveries addressed to their own keys, journaled
and checked like the others' (without an effect row). After each loss of the primary the
harness logs in to the admin and makes a signed read through each server until both
answer; the summary adds the HTTP requests, those not answered in time (hung), and these
probes. Half of those agents (the last ones) wait instead: each holds a key of its own,
to which only a waker process sends (``send_message``, about one a second in all, until
20 s after the last loss was recovered from), and parks by turns in a waiting claim
(``claim(wait=10)``) and in ``wait(10)`` followed by a claim. Each wait is journaled with
its answer; the check counts those in flight at each loss, fails the run when one was not
answered within its seconds plus 30, or when after a loss no wait through a server was
woken by a send (answered with a delivery sent a second or more after the wait began)
before the run ended.
"""

from __future__ import annotations

import argparse
import contextlib
import http.cookiejar
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode, urlsplit

ROOT = Path(__file__).resolve().parent.parent
STOP = threading.Event()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench import common  # noqa: E402
from bench.chaos_check import ChaosReport, check  # noqa: E402
from bench.chaos_journal import Held, Journal, last_holding, read_all  # noqa: E402
from bench.chaos_server import ChaosServer, HaTopology, connect  # noqa: E402
from bench.chaos_worker import EFFECTS_TABLE, STUCK_EFFECTS_TABLE  # noqa: E402

WORKER = ROOT / "bench" / "chaos_worker.py"
REAP_COMMAND = ROOT / "workflow_delivery" / "management" / "commands" / "reap_deliveries.py"
DROP_ROLES = ["agent", "producer", "reaper"]
# Seconds of planned work a holder must have left to be chosen for a stall.
STALL_MARGIN = 0.3
# The superuser who checks the admin after each loss of the primary.
ADMIN_USER = "chaos-admin"
# Seconds a probe request after a loss of the primary may take, and how long the probe
# tries before it counts the server as not recovered.
PROBE_BOUND = 30.0
PROBE_LIMIT = 60.0
# Seconds the waker goes on sending after the last loss of the primary was recovered
# from, so that the waiting agents' next waits have sends to be woken by.
WAKE_AFTER_LOSS = 20.0


@dataclass
class ChaosConfig:
    agents: int = 8
    producers: int = 2
    targets: int = 3
    seconds: float = 60.0
    lease: int = 3
    deliveries: int = 1500
    reap_interval: float = 1.0
    kills: int | None = None
    stalls: int | None = None
    drops: int | None = None
    restart: bool = True
    database_url: str | None = None
    allow_restart: bool = False
    drain_seconds: float | None = None
    long_work_share: float = 0.05
    idle_poll: float = 0.1
    # The tenant deleter (a huge step into a tenant that is then deleted while the
    # fleet works); 0 targets leaves it out.
    huge_step_targets: int = 6000
    consumers: bool = False
    consumer_poll: float = 1.0
    # Holders that hang inside holding() past their lease while the reaper runs.
    stuck_holders: int = 1
    # Agents of the signed HTTP API, half through uvicorn and half through gunicorn
    # (None: 4 with --failover, else none).
    http_agents: int | None = None
    http_idle_poll: float = 0.25
    # Losses of the primary of scripts/ha's cluster (0: a single server as above).
    failover: int = 0
    asynchronous: bool = False
    json_path: Path | None = None
    seed: int = field(default_factory=lambda: random.randrange(1 << 30))
    journal_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.failover:
            # Each loss takes the ttl (10 s) and the rejoin; the next waits for a standby.
            self.seconds = max(self.seconds, 25.0 * self.failover + 10)
            self.restart = False
            self.consumers = True
            if self.drops is None:
                self.drops = 0
            if self.stalls is None:
                self.stalls = 0
        if self.http_agents is None:
            self.http_agents = 4 if self.failover else 0
        if self.kills is None:
            self.kills = max(1, int(self.seconds // 10))
        if self.stalls is None:
            self.stalls = max(1, int(self.seconds // 20))
        if self.drops is None:
            self.drops = max(3, int(self.seconds // 2))
        if self.drain_seconds is None:
            self.drain_seconds = max(30.0, 10.0 * self.lease)


@dataclass
class Stall:
    pid: int
    delivery_id: str
    generation: int
    stopped_at: float
    deadline: float


class Fleet:
    """The worker processes, by role and index; agents that die are replaced."""

    def __init__(self, config_path: Path, log_dir: Path) -> None:
        self.config_path = config_path
        self.log_dir = log_dir
        self.processes: dict[tuple[str, int], subprocess.Popen] = {}
        self.killed: set[int] = set()
        self.crashes: list[str] = []

    def spawn(self, role: str, index: int) -> subprocess.Popen:
        log = (self.log_dir / f"{role}-{index}.log").open("ab")
        command = [sys.executable, str(WORKER), role, str(self.config_path), str(index)]
        env = None
        if role == "reaper" and REAP_COMMAND.exists():
            config = json.loads(self.config_path.read_text())
            command = [sys.executable, str(ROOT / "manage.py"), "reap_deliveries", "--loop"]
            command += ["--interval", str(config["reap_interval"]), "-v", "1"]
            separator = "&" if "?" in config["database_url"] else "?"
            url = f"{config['database_url']}{separator}application_name=chaos-reaper-0"
            env = worker_environment(url)
        # Its own session: a terminal's Ctrl-C reaches the harness, which stops the fleet.
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.processes[role, index] = process
        return process

    def journal(self, role: str, index: int) -> Path:
        process = self.processes[role, index]
        return self.log_dir.parent / "journals" / f"{role}-{index}-{process.pid}.jsonl"

    def of_role(self, role: str) -> list[tuple[int, subprocess.Popen]]:
        return [(i, p) for (r, i), p in self.processes.items() if r == role]

    def supervise(self, *, respawn: bool) -> None:
        """Notice exits; a crash is recorded, and agents and the reaper come back."""
        for (role, index), process in list(self.processes.items()):
            code = process.poll()
            if code is None:
                continue
            if process.pid not in self.killed and code != 0:
                self.crashes.append(f"{role}-{index} (pid {process.pid}) exited with {code}")
                self.killed.add(process.pid)
            if respawn and role in ("agent", "reaper", "http"):
                self.spawn(role, index)

    def stop(self, roles: list[str], timeout: float) -> None:
        chosen = [(key, p) for key, p in self.processes.items() if key[0] in roles]
        for _, process in chosen:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        deadline = time.monotonic() + timeout
        for (role, index), process in chosen:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.crashes.append(f"{role}-{index} (pid {process.pid}) ignored SIGTERM")
                self.killed.add(process.pid)
                process.kill()
                process.wait()
            if process.returncode not in (0, None) and process.pid not in self.killed:
                self.crashes.append(
                    f"{role}-{index} (pid {process.pid}) exited with {process.returncode}"
                )


class Harness:
    def __init__(
        self,
        config: ChaosConfig,
        server: ChaosServer,
        run_dir: Path,
        http_servers: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.http_servers = http_servers or {}
        self.admin_password = ""
        self.server = server
        self.rng = random.Random(config.seed)
        (run_dir / "journals").mkdir()
        (run_dir / "logs").mkdir(exist_ok=True)
        self.journal_dir = run_dir / "journals"
        self.journal = Journal(self.journal_dir / f"harness-0-{os.getpid()}.jsonl", role="harness")
        self.communities = [
            {"id": str(uuid.uuid4()), "workflow_id": str(uuid.uuid4())}
            for _ in range(config.producers)
        ]
        for index, tenant in enumerate(self.communities):
            tenant["host"] = f"chaos-{index}-{tenant['id'][:8]}.example"
        # Half the HTTP agents wait, each on a key of its own that only the waker sends
        # to; the others share one key (two when there are enough of them to serve each
        # through both servers).
        http_agents = config.http_agents if self.http_servers else 0
        waiting = http_agents // 2
        regular = http_agents - waiting
        shared = 0 if not regular else 2 if regular >= 2 * len(self.http_servers) else 1
        self.http_secrets = [os.urandom(32).hex() for _ in range(shared)]
        self.http_wait_secrets = [os.urandom(32).hex() for _ in range(waiting)]
        self.recovered_at: float | None = None
        worker_config = {
            "database_url": server.url,
            "journal_dir": str(self.journal_dir),
            "communities": self.communities,
            "targets": [os.urandom(32).hex() for _ in range(config.targets)],
            "lease": config.lease,
            "seconds": config.seconds,
            "deliveries_per_producer": -(-config.deliveries // config.producers),
            "reap_interval": config.reap_interval,
            "long_work_share": config.long_work_share,
            "idle_poll": config.idle_poll,
            "agent_kind": "consumer" if config.consumers else "loop",
            "consumer_poll": config.consumer_poll,
            # With --failover, every other producer calls send_message instead.
            "send_message": bool(config.failover),
            "seed": config.seed,
            "huge_step_targets": config.huge_step_targets,
            # Early in the window, so the restart at its middle rarely overlaps.
            "deletion_after": 0.15 * config.seconds,
            # After the restart at the middle of the window, so the hang rarely meets it.
            "stuck_after": 0.55 * config.seconds,
            "http_servers": [{"name": n, "url": u} for n, u in self.http_servers.items()],
            "http_secrets": self.http_secrets,
            "http_agents": http_agents,
            "http_waiting_agents": waiting,
            "http_wait_secrets": self.http_wait_secrets,
            "http_idle_poll": config.http_idle_poll,
        }
        config_path = run_dir / "config.json"
        config_path.write_text(json.dumps(worker_config))
        self.fleet = Fleet(config_path, run_dir / "logs")
        self.stalls: list[Stall] = []
        self.topology: HaTopology | None = None
        self.failing: threading.Thread | None = None
        self.failovers = 0
        # Holders stalled and then released: their lease is someone else's now, and
        # their stale renew and finish are what the stall is for, so no later fault
        # picks them (a kill between the two left a run with no stale finish at all).
        self.released: set[int] = set()

    def http_targets(self) -> list[bytes]:
        from workflow_delivery import keys

        secrets = self.http_secrets + self.http_wait_secrets
        return [keys.public_key_bytes(bytes.fromhex(key)) for key in secrets]

    # -- faults ---------------------------------------------------------------------------

    def _holders(self) -> list[tuple[int, subprocess.Popen, Held]]:
        stalled = {stall.pid for stall in self.stalls} | self.released
        holders = []
        for index, process in self.fleet.of_role("agent"):
            if process.poll() is not None or process.pid in stalled:
                continue
            path = self.fleet.journal("agent", index)
            held = last_holding(path) if path.exists() else None
            if held is not None:
                holders.append((index, process, held))
        return holders

    def kill_holder(self) -> bool:
        holders = self._holders()
        if not holders:
            return False
        index, process, (delivery_id, generation, _) = self.rng.choice(holders)
        self.fleet.killed.add(process.pid)
        process.send_signal(signal.SIGKILL)
        self.journal.write("kill", pid=process.pid, id=delivery_id, gen=generation)
        process.wait()
        self.fleet.spawn("agent", index)
        return True

    def stall_holder(self) -> bool:
        # Only a holder with work still ahead of it: one stopped while it reports (its
        # finish sent before the stop, answered after the resume) is refused with no
        # attempt that starts after the stall, so the stall would prove nothing.
        now = time.time()
        holders = [
            (index, process, held)
            for index, process, held in self._holders()
            if held.busy_until is None or held.busy_until - now > STALL_MARGIN
        ]
        if not holders:
            return False
        _, process, (delivery_id, generation, _) = self.rng.choice(holders)
        process.send_signal(signal.SIGSTOP)
        now = time.time()
        self.journal.write("stall", pid=process.pid, id=delivery_id, gen=generation)
        self.stalls.append(
            Stall(process.pid, delivery_id, generation, now, now + 6 * self.config.lease + 20)
        )
        return True

    def release_stalls(self, *, force: bool = False) -> int:
        """SIGCONT a stalled holder once its delivery was settled by a newer holder.
        Returns how many stalls were wasted (the holder had settled just before it)."""
        wasted = 0
        for stall in [s for s in self.stalls if s.pid]:
            state = self._stalled_row(stall)
            settled_by_other = state == "taken over"
            if state == "settled by holder":
                wasted += 1
            elif not (settled_by_other or force or time.time() > stall.deadline):
                continue
            os.kill(stall.pid, signal.SIGCONT)
            self.journal.write(
                "cont",
                pid=stall.pid,
                id=stall.delivery_id,
                gen=stall.generation,
                completed=bool(settled_by_other),
            )
            self.released.add(stall.pid)
            stall.pid = 0
        return wasted

    def _stalled_row(self, stall: Stall) -> str:
        try:
            with connect(self.server.url) as conn:
                row = conn.execute(
                    "SELECT status, lease_generation FROM workflow_agent_deliveries WHERE id = %s",
                    [stall.delivery_id],
                ).fetchone()
        except psycopg.OperationalError:
            return "unknown"
        if row is None or row[0] not in ("finished", "failed"):
            return "open"
        return "taken over" if row[1] > stall.generation else "settled by holder"

    def drop_connection(self, role: str) -> bool:
        try:
            with connect(self.server.url) as conn:
                backends = conn.execute(
                    "SELECT pid, application_name FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name LIKE 'chaos-%%' "
                    "AND pid <> pg_backend_pid()"
                ).fetchall()
                chosen = [b for b in backends if b[1].startswith(f"chaos-{role}-")] or backends
                if not chosen:
                    return False
                pid, name = self.rng.choice(chosen)
                dropped = conn.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]
        except psycopg.OperationalError:
            return False
        if dropped:
            self.journal.write("drop", backend=pid, name=name, role=name.split("-")[1])
        return bool(dropped)

    def fail_over(self) -> bool:
        """Lose the primary in the background (the fleet is supervised meanwhile); False
        while the previous loss is still being recovered from."""
        if self.failing is not None and self.failing.is_alive():
            return False
        # One freeze, on the second loss (the first node's successor), the rest kills.
        kind = "freeze" if self.failovers == min(1, self.config.failover - 1) else "kill"
        self.failovers += 1
        self.failing = threading.Thread(target=self._fail_over, args=(kind,), daemon=True)
        self.failing.start()
        return True

    def _fail_over(self, kind: str) -> None:
        try:
            event = self.topology.fail(kind)
        except (RuntimeError, OSError, psycopg.Error, subprocess.SubprocessError) as exc:
            self.journal.write("failover_error", kind=kind, error=str(exc)[:500])
            return
        self.journal.write("failover", **vars(event))
        for name, url in self.http_servers.items():
            self.probe_server(name, url, event.killed_at)
        self.recovered_at = time.monotonic()

    def probe_server(self, name: str, url: str, lost_at: float) -> None:
        """After a loss of the primary: the admin (a superuser logs in and lists the
        deliveries) and a signed API read, through one server, each tried until it
        answers as it should; journals the first answer and the seconds it took."""
        admin = _until_ok(lambda: admin_answers(url, ADMIN_USER, self.admin_password))
        api = _until_ok(lambda: self._api_answers(url))
        self.journal.write(
            "probe",
            server=name,
            since_loss=round(time.time() - lost_at, 2),
            admin_first=admin[0],
            admin_seconds=admin[1],
            api_first=api[0],
            api_seconds=api[1],
        )

    def _api_answers(self, url: str) -> str:
        from workflow_delivery.client import AgentClient
        from workflow_delivery.exceptions import AgentApiError

        port = int(url.rsplit(":", 1)[1])
        tenant = self.communities[0]
        client = AgentClient(
            f"http://{tenant['host']}/agents/",
            self.http_secrets[0],
            timeout=PROBE_BOUND,
            connect_to=("127.0.0.1", port),
        )
        try:
            # A delivery no one has: 404 not_found once the roster could be read.
            return "ok" if client.get(uuid.uuid4()) is None else "found"
        except AgentApiError as exc:
            return f"{exc.status} {exc.code}"
        except OSError as exc:
            return type(exc).__name__
        finally:
            client.close()

    def restart_database(self) -> None:
        self.journal.write("restart_begin")
        self.server.restart()
        self.journal.write("restart_end")

    # -- the run --------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str]]:
        config = self.config
        events: list[tuple[float, str]] = []
        span = config.seconds

        def spread(count: int, kind: str, start: float, end: float) -> None:
            for i in range(count):
                slot = start + (end - start) * (i + self.rng.uniform(0.2, 0.8)) / count
                events.append((slot * span, kind))

        spread(config.kills, "kill", 0.1, 0.9)
        spread(config.stalls, "stall", 0.1, 0.6)
        spread(config.drops, "drop", 0.05, 0.95)
        if config.restart and self.server.restartable:
            events.append((0.5 * span, "restart"))
        spread(config.failover, "failover", 0.02, 0.9)
        return sorted(events)

    def run(self) -> None:
        config = self.config
        self.fleet.spawn("reaper", 0)
        for index in range(config.agents):
            self.fleet.spawn("agent", index)
        for index in range(config.http_agents if self.http_servers else 0):
            self.fleet.spawn("http", index)
        for index in range(config.producers):
            self.fleet.spawn("producer", index)
        if self.http_wait_secrets:
            self.fleet.spawn("waker", 0)
        if config.huge_step_targets:
            self.fleet.spawn("deleter", 0)
        for index in range(config.stuck_holders):
            self.fleet.spawn("stuck", index)
        started = time.monotonic()
        pending = self.schedule()
        drops = 0
        while pending or time.monotonic() - started < config.seconds:
            if STOP.is_set():
                roles = ["producer", "deleter", "stuck", "waker", "agent", "http", "reaper"]
                self.fleet.stop(roles, timeout=10)
                return
            self.fleet.supervise(respawn=True)
            elapsed = time.monotonic() - started
            if self.release_stalls() and elapsed < config.seconds:
                pending.append((elapsed, "stall"))
                pending.sort()
            if pending and pending[0][0] <= elapsed:
                _, kind = pending[0]
                done = True
                if kind == "kill":
                    done = self.kill_holder()
                elif kind == "stall":
                    done = self.stall_holder()
                elif kind == "drop":
                    done = self.drop_connection(DROP_ROLES[drops % len(DROP_ROLES)])
                    drops += done
                elif kind == "failover":
                    done = self.fail_over()
                else:
                    self.restart_database()
                # A fault that found no victim waits for one, but not past the fault window
                # (a loss of the primary waits for the previous one's recovery, always).
                if done or (elapsed > config.seconds and kind != "failover"):
                    pending.pop(0)
            time.sleep(0.05)
        self._drain()

    def _drain(self) -> None:
        config = self.config
        while self.failing is not None and self.failing.is_alive() and not STOP.is_set():
            self.fleet.supervise(respawn=True)
            time.sleep(0.2)
        # Producers finish their budget on their own; only a straggler is stopped.
        deadline = time.monotonic() + config.seconds / 2 + 30
        while (
            time.monotonic() < deadline
            and not STOP.is_set()
            and any(
                p.poll() is None
                for role in ("producer", "deleter", "stuck")
                for _, p in self.fleet.of_role(role)
            )
        ):
            self.fleet.supervise(respawn=True)
            self.release_stalls()
            time.sleep(0.2)
        self.fleet.stop(["producer", "deleter", "stuck"], timeout=60)
        # The waiting agents' waits after the last loss need sends to be woken by.
        until = (self.recovered_at or 0.0) + WAKE_AFTER_LOSS
        while time.monotonic() < until and not STOP.is_set():
            self.fleet.supervise(respawn=True)
            self.release_stalls()
            time.sleep(0.2)
        self.fleet.stop(["waker"], timeout=60)
        deadline = time.monotonic() + config.drain_seconds
        while time.monotonic() < deadline and not STOP.is_set():
            self.fleet.supervise(respawn=True)
            self.release_stalls()
            if not any(s.pid for s in self.stalls) and self._all_settled():
                break
            time.sleep(0.2)
        self.release_stalls(force=True)
        self.fleet.stop(["agent", "http", "reaper"], timeout=3 * config.lease + 30)

    def _all_settled(self) -> bool:
        committed = {
            value
            for line in read_all(self.journal_dir)
            if line["op"] == "commit"
            for value in line["ids"]
        }
        try:
            with connect(self.server.url) as conn:
                settled = {
                    str(row[0])
                    for row in conn.execute(
                        "SELECT id FROM workflow_agent_deliveries "
                        "WHERE status IN ('finished', 'failed')"
                    )
                }
        except psycopg.OperationalError:
            return False
        return committed <= settled


def _until_ok(probe: Callable[[], str]) -> tuple[str, float | None]:
    """Ask ``probe`` until it answers "ok" (every PROBE_LIMIT seconds at most): its
    first answer, and the seconds until "ok" (None when it never came)."""
    started = time.monotonic()
    first = None
    while True:
        answer = probe()
        first = first or answer
        if answer == "ok":
            return first, round(time.monotonic() - started, 2)
        if time.monotonic() - started > PROBE_LIMIT:
            return first, None
        time.sleep(0.5)


def admin_answers(url: str, user: str, password: str) -> str:
    """Log in to the admin at ``url`` and list the deliveries: "ok", or what went wrong."""
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
    )
    login = f"{url}/admin/login/?next=/admin/"
    try:
        with opener.open(login, timeout=PROBE_BOUND) as page:
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.read().decode())
        if token is None:
            return "no login form"
        form = {"csrfmiddlewaretoken": token[1], "username": user, "password": password}
        request = urllib.request.Request(login, data=urlencode(form).encode())
        with opener.open(request, timeout=PROBE_BOUND) as page:
            if urlsplit(page.url).path != "/admin/":
                return "login refused"
        deliveries = f"{url}/admin/workflow_delivery/workflowagentdelivery/"
        with opener.open(deliveries, timeout=PROBE_BOUND) as page:
            page.read()
            return "ok" if page.status == 200 else str(page.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError as exc:
        return type(exc).__name__


def create_superuser(url: str) -> str:
    """The admin's superuser in the run's database; returns its password."""
    password = uuid.uuid4().hex
    env = {**worker_environment(url), "DJANGO_SUPERUSER_PASSWORD": password}
    command = [sys.executable, str(ROOT / "manage.py"), "createsuperuser", "--noinput"]
    command += ["--username", ADMIN_USER, "--email", "chaos@example.invalid", "-v", "0"]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return password


def start_http_servers(url: str, run_dir: Path, stack: contextlib.ExitStack) -> dict[str, str]:
    """The demo project under uvicorn and under gunicorn over the run's (multi-host)
    URL, each logging into the run's folder; their base URLs by name."""
    # Plain HTTP on loopback: the admin's cookies may not be marked Secure.
    env = {"SESSION_COOKIE_SECURE": "false", "CSRF_COOKIE_SECURE": "false"}
    servers = {}
    for name in common.SERVERS:
        log = stack.enter_context((run_dir / "logs" / f"{name}.log").open("ab"))
        servers[name] = stack.enter_context(
            common.api_server(url, server=name, env=env, output=log)
        )
    return servers


def worker_environment(url: str) -> dict[str, str]:
    # DEBUG would keep every query of a long-running process in memory.
    env = {**os.environ, "DATABASE_URL": url, "DEBUG": "false"}
    env.setdefault("SECRET_KEY", "chaos-harness-not-a-secret")
    return env


def migrate(url: str) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=worker_environment(url),
        check=True,
    )


def create_effects_table(url: str) -> None:
    """The consumers' own rows: one per delivery is what the scenario must leave."""
    with connect(url) as conn:
        conn.execute(
            f"CREATE TABLE {EFFECTS_TABLE} (delivery_id uuid NOT NULL, "
            "generation bigint NOT NULL, pid integer NOT NULL, "
            "written_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )


def create_stuck_effects_table(url: str) -> None:
    """The stuck holders' effects: each is written inside a block that must roll back."""
    with connect(url) as conn:
        conn.execute(
            f"CREATE TABLE {STUCK_EFFECTS_TABLE} (delivery_id uuid NOT NULL, "
            "generation bigint NOT NULL)"
        )


def run(config: ChaosConfig) -> ChaosReport:
    """Run one chaos scenario end to end and return the checked figures."""
    database = f"{os.environ.get('BENCH_DB_PREFIX', 'buzz_chaos')}_{os.getpid()}"
    topology = None
    if config.failover:
        topology = HaTopology(synchronous=not config.asynchronous)
        # libpq tries the next host of the list after this long (a frozen primary
        # accepts the connection and never answers).
        os.environ.setdefault("DATABASE_CONNECT_TIMEOUT", "2")
        server = ChaosServer.shared(topology.start(), database, allow_restart=False)
    elif config.database_url:
        server = ChaosServer.shared(
            config.database_url, database, allow_restart=config.allow_restart
        )
    else:
        server = ChaosServer.embedded(database)
    harness = None
    run_dir = None
    servers = contextlib.ExitStack()
    try:
        if config.journal_dir is not None:
            config.journal_dir.mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix="chaos-run-", dir=config.journal_dir))
        migrate(server.url)
        if config.consumers:
            create_effects_table(server.url)
        if config.stuck_holders:
            create_stuck_effects_table(server.url)
        http_servers = {}
        admin_password = ""
        if config.http_agents:
            admin_password = create_superuser(server.url)
            (run_dir / "logs").mkdir()
            http_servers = start_http_servers(server.url, run_dir, servers)
        harness = Harness(config, server, run_dir, http_servers)
        harness.admin_password = admin_password
        harness.topology = topology
        harness.run()
        with connect(server.url) as conn:
            report = check(
                conn,
                read_all(harness.journal_dir),
                harness.fleet.crashes,
                effects_table=EFFECTS_TABLE if config.consumers else None,
                stuck_effects_table=STUCK_EFFECTS_TABLE if config.stuck_holders else None,
                failovers=config.failover,
                http_targets=harness.http_targets(),
            )
        report.describe(config, server, run_dir)
        return report
    finally:
        if harness is not None:
            harness.release_stalls(force=True)
            for process in harness.fleet.processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
        servers.close()
        server.close()
        if config.journal_dir is None and run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> ChaosConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the fault window")
    parser.add_argument("--lease", type=int, default=3, help="lease seconds (2-5 is realistic)")
    parser.add_argument("--deliveries", type=int, default=1500)
    parser.add_argument("--reap-interval", type=float, default=1.0)
    parser.add_argument("--kills", type=int)
    parser.add_argument("--stalls", type=int)
    parser.add_argument("--drops", type=int)
    parser.add_argument("--no-restart", action="store_true")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL") or None)
    parser.add_argument(
        "--allow-restart",
        action="store_true",
        help="allow restarting the server behind --database-url",
    )
    parser.add_argument(
        "--huge-step",
        type=int,
        help="targets of the deleter's huge step (0: no tenant deletion scenario; "
        "6000 by default, 0 with --failover)",
    )
    parser.add_argument(
        "--failover",
        type=int,
        default=0,
        metavar="N",
        help="run on scripts/ha's replicated cluster and lose its primary N times",
    )
    parser.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="with --failover: asynchronous replication, to count what it loses",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures here")
    parser.add_argument(
        "--consumers",
        action="store_true",
        help="agents are workflow_delivery.consumer.Consumer processes that write one effect "
        "row per delivery through holding(); the check then counts effects too",
    )
    parser.add_argument(
        "--stuck-holders",
        type=int,
        help="holders that hang inside holding() past their lease (0: none; 1 by default, "
        "0 with --failover)",
    )
    parser.add_argument(
        "--http-agents",
        type=int,
        help="agents of the signed HTTP API, half through uvicorn, half through gunicorn "
        "(4 by default with --failover, else none)",
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument("--keep-journals", type=Path, help="keep journals and logs under here")
    args = parser.parse_args(argv)
    if args.agents < 2:
        parser.error("--agents must be at least 2 (a stalled holder needs a successor)")
    if not 1 <= args.lease <= 60:
        parser.error("--lease must be 1 to 60 seconds")
    if args.failover < 0:
        parser.error("--failover must be 0 or more")
    if args.asynchronous and not args.failover:
        parser.error("--async applies only with --failover")
    # The tenant deleter's and the stuck holder's own checks assume one server.
    huge_step = args.huge_step if args.huge_step is not None else (0 if args.failover else 6000)
    stuck = args.stuck_holders if args.stuck_holders is not None else (0 if args.failover else 1)
    config = ChaosConfig(
        agents=args.agents,
        producers=args.producers,
        seconds=args.seconds,
        lease=args.lease,
        deliveries=args.deliveries,
        reap_interval=args.reap_interval,
        kills=args.kills,
        stalls=args.stalls,
        drops=args.drops,
        restart=not args.no_restart,
        database_url=args.database_url,
        allow_restart=args.allow_restart,
        journal_dir=args.keep_journals,
        huge_step_targets=huge_step,
        consumers=args.consumers,
        stuck_holders=stuck,
        failover=args.failover,
        asynchronous=args.asynchronous,
        http_agents=args.http_agents,
        json_path=args.json,
    )
    if args.seed is not None:
        config.seed = args.seed
    return config


def _on_signal(signum: int, frame: object) -> None:
    if STOP.is_set():
        raise KeyboardInterrupt
    STOP.set()
    print(
        f"chaos: {signal.Signals(signum).name}: stopping the fleet, then checking what "
        "was written (again to quit at once)",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    try:
        report = run(config)
    except KeyboardInterrupt:
        print("chaos: interrupted; the fleet and the server were stopped", file=sys.stderr)
        return 130
    print(report.render())
    if config.json_path is not None:
        config.json_path.write_text(json.dumps(report.summary(), indent=2) + "\n")
    if STOP.is_set():
        print("chaos: the run was interrupted before its fault window ended", file=sys.stderr)
        return 130 if report.ok else 1
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
