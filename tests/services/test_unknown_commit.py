"""A commit whose answer never arrives (the connection dies during COMMIT, as when the
primary is lost): the client cannot know whether it landed, so it sends the call again.
``send_message`` with the same idempotency key and ``finish_delivery`` with the same
lease then return what was stored and store nothing twice.

Between a client process and the server sits a TCP proxy that, once armed, forwards the
client's statements and the server's answers until the server reports the transaction
over (ReadyForQuery, idle, after a statement ran), then drops that last answer and
cuts both sockets: the transaction is committed on the server and the client only sees
its connection die.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.db import connection

from tests.support import factories
from workflow_delivery.models import Event, WorkflowAgentDelivery

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.psycopg3]


class CommitEater:
    """A TCP proxy to the test server; ``armed``, it swallows the answer that ends the
    next transaction (a statement's preparation alone ends none) and closes the
    connection."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.armed = threading.Event()
        self.eaten = threading.Event()
        # Whether a transaction that only read (send_message's look-up of its derived
        # ids, say) is passed through: the answer eaten is then a write's.
        self.pass_reads = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.target
            if host.startswith("/"):
                # The embedded server listens on a Unix socket in that directory.
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                server.connect(f"{host}/.s.PGSQL.{port}")
            else:
                server = socket.create_connection(self.target)
            self.sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def _answers(self, server: socket.socket, client: socket.socket) -> None:
        """The server's messages, forwarded an answer at a time (up to ReadyForQuery)."""
        buffer, answer, completed = b"", b"", False
        try:
            while data := server.recv(65536):
                buffer += data
                # The startup's first byte may be 'S' or 'N' (SSL refused): a lone byte.
                if buffer[:1] == b"N" and len(buffer) == 1:
                    client.sendall(buffer)
                    buffer = b""
                    continue
                while len(buffer) >= 5:
                    kind, length = buffer[:1], struct.unpack("!I", buffer[1:5])[0]
                    if len(buffer) < 1 + length:
                        break
                    message, buffer = buffer[: 1 + length], buffer[1 + length :]
                    answer += message
                    # A statement ran (CommandComplete), not just a preparation; with
                    # reads passed over, only one that wrote counts (its tag not SELECT).
                    if kind == b"C" and not (self.pass_reads and message[5:].startswith(b"SELECT")):
                        completed = True
                    if kind != b"Z":
                        continue
                    if self.armed.is_set() and message[5:6] == b"I" and completed:
                        # The transaction is over on the server: its answer is lost.
                        self.armed.clear()
                        self.eaten.set()
                        # shutdown, not just close: the other thread's recv holds them open.
                        for sock in (client, server):
                            sock.shutdown(socket.SHUT_RDWR)
                            sock.close()
                        return
                    client.sendall(answer)
                    answer, completed = b"", False
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


# The client: connects through the proxy, says "ready", waits for "go", makes the call
# whose answer is eaten, then the same call again; prints what it saw as JSON.
CLIENT = """
import json, os, sys
from django.db import connection
from workflow_delivery import services
from workflow_delivery.errors import is_connection_lost
from workflow_delivery.protocol import Outcome
args = json.loads(os.environ["UNKNOWN_COMMIT_CALL"])

def call():
    if args["call"] == "send":
        sent = services.send_message(
            args["community"], targets=args["targets"], content="hello",
            idempotency_key="unknown-commit",
        )
        return {"created": sent.created, "ids": sorted(str(d.id) for d in sent.deliveries)}
    result = services.finish_delivery(lease, Outcome.FINISHED)
    return {"result": type(result).__name__, "status": str(getattr(result, "status", ""))}

if args["call"] == "finish":
    lease, _ = services.claim_delivery(args["community"], bytes.fromhex(args["targets"][0]))
connection.ensure_connection()
print("ready", flush=True)
sys.stdin.readline()
seen = {}
try:
    seen["first"] = call()
except Exception as exc:
    seen["first_error"] = type(exc).__name__
    seen["first_lost"] = is_connection_lost(exc)
    connection.close()
print(json.dumps(seen), flush=True)
sys.stdin.readline()
seen["retry"] = call()
print(json.dumps(seen), flush=True)
"""


@pytest.fixture
def eater():
    settings = connection.settings_dict
    proxy = CommitEater(settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 5432))
    try:
        yield proxy
    finally:
        proxy.close()


def _client(eater: CommitEater, **args) -> tuple[subprocess.Popen, dict]:
    settings = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{settings['USER']}@127.0.0.1:{eater.port}/{settings['NAME']}",
        "DEBUG": "true",
        "DATABASE_CONN_MAX_AGE": "0",
        "UNKNOWN_COMMIT_CALL": json.dumps(args),
    }
    process = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "-v", "0", "-c", CLIENT],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "ready"
    eater.armed.set()
    process.stdin.write("go\n")
    process.stdin.flush()
    first = json.loads(process.stdout.readline())
    return process, first


def _retry(process: subprocess.Popen) -> dict:
    try:
        process.stdin.write("go\n")
        process.stdin.flush()
        seen = json.loads(process.stdout.readline())
        assert process.wait(timeout=30) == 0
        return seen
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_send_whose_commit_answer_was_lost_is_resent_and_stored_once(eater):
    eater.pass_reads = True
    owner = factories.community()
    targets = [factories.key32() for _ in range(3)]
    factories.enroll(owner, targets)
    process, first = _client(
        eater, call="send", community=str(owner.id), targets=[t.hex() for t in targets]
    )
    assert eater.eaten.is_set()
    assert first == {"first_error": "OperationalError", "first_lost": True}
    # The commit landed although the client never heard so.
    stored = sorted(str(i) for i in WorkflowAgentDelivery.objects.values_list("id", flat=True))
    assert len(stored) == 3

    seen = _retry(process)
    assert seen["retry"] == {"created": False, "ids": stored}
    assert WorkflowAgentDelivery.objects.count() == 3
    assert Event.objects.filter(community=owner).count() == 1


def test_a_finish_whose_commit_answer_was_lost_is_resent_and_settles_once(eater):
    step = factories.Step(targets=1)
    factories.committed(step)
    (target,) = step.targets
    process, first = _client(
        eater, call="finish", community=str(step.community.id), targets=[target.hex()]
    )
    assert eater.eaten.is_set()
    assert first == {"first_error": "OperationalError", "first_lost": True}
    row = WorkflowAgentDelivery.objects.get()
    assert (row.status, row.lease_generation) == ("finished", 1)
    finished_at = row.finished_at

    seen = _retry(process)
    assert seen["retry"] == {"result": "AlreadyTerminal", "status": "finished"}
    row.refresh_from_db()
    assert (row.status, row.lease_generation, row.finished_at) == ("finished", 1, finished_at)
