"""The agent's side of the HTTP API: every request signed with the agent's key
(NIP-98), every answer turned into the value the services return.

    client = AgentClient("https://alpha.example/agents/", secret_key)
    while True:
        claimed = client.claim(lease_seconds=30)
        if claimed is None:
            client.wait(timeout=30)
            continue
        lease, record = claimed          # claimed.message: the message event
        ...
        client.finish(lease, "finished")

Imports no Django and no server module: the standard library, the protocol's values
and their wire form (``protocol``, ``wire``, ``exceptions``) and the agent's keys
(``keys``, which needs coincurve). ``pip install 'buzz-workflow-delivery[client]'``
installs exactly that: coincurve, and no Django.
"""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlencode, urlsplit
from uuid import UUID

from . import keys, wire
from .exceptions import AgentApiError, ProtocolError
from .protocol import (
    AlreadyTerminal,
    Claimed,
    DeliveryBinding,
    DeliveryRecord,
    DeliveryStatus,
    Exhausted,
    FinishedAndNext,
    Lease,
    LeaseLost,
    MessageEvent,
    Outcome,
    Renewed,
    Replied,
    Retried,
    Settled,
    WakeHint,
)

__all__ = ["AgentClient"]

# How much of an answer that is not JSON an AgentApiError quotes.
_QUOTED_CHARS = 200

# A kept-alive connection idle longer than this is replaced before use: servers
# close idle connections (uvicorn after 5 s) and a request sent into a closing
# connection cannot be told apart from one the server received.
_IDLE_SECONDS = 2.0


def _address(value: object) -> tuple[str, int]:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise ProtocolError("connect_to", f"must be an (address, port) pair, not {value!r}")
    address, port = value
    if not (isinstance(address, str) and address):
        raise ProtocolError("connect_to", f"the address must be a host name or IP: {address!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ProtocolError("connect_to", f"the port must be 1 to 65535, not {port!r}")
    return address, port


class AgentClient:
    """One agent (one key) talking to one community's agent API at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        secret_key: bytes | str,
        *,
        timeout: float = 30.0,
        connect_to: tuple[str, int] | None = None,
        community_host: str | None = None,
    ) -> None:
        """``connect_to=(address, port)`` opens the connections there instead of at the
        URL's host, while the Host header and the signed URL stay those of
        ``base_url``: a community's host served by a local server (plain http only,
        since a certificate would be checked against the address).

        ``community_host`` is the community's host when ``base_url`` is an origin
        shared by many communities (the server's ``WORKFLOW_DELIVERY_API_ORIGIN``):
        it is sent as the Host header. Every request signs the community's host
        (this one, else ``base_url``'s) in a ``host`` tag, so the server serves it
        to that community only."""
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ProtocolError("base_url", f"must be an absolute http(s) URL, not {base_url!r}")
        if connect_to is not None:
            address, port = _address(connect_to)
            if parts.scheme != "http":
                raise ProtocolError("connect_to", "works with an http:// base_url only")
            connect_to = (address, port)
        self.connect_to = connect_to
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self._parts = urlsplit(self.base_url)
        if community_host is not None and not (
            isinstance(community_host, str) and community_host and "/" not in community_host
        ):
            raise ProtocolError("community_host", f"must be a host name, not {community_host!r}")
        self._host_header = community_host or self._parts.netloc
        self.community_host = community_host or (self._parts.hostname or "")
        # The key pair derived once: every request is signed with it.
        self._signer = keys.SigningKey(secret_key)
        self.pubkey = self._signer.pubkey
        self.timeout = timeout
        self._connection: http.client.HTTPConnection | None = None
        self._used_at = 0.0

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self, timeout: float) -> http.client.HTTPConnection:
        fresh = time.monotonic() - self._used_at < _IDLE_SECONDS
        if self._connection is None or not fresh:
            self.close()
            factory = (
                http.client.HTTPSConnection
                if self._parts.scheme == "https"
                else http.client.HTTPConnection
            )
            if self.connect_to is None:
                self._connection = factory(self._parts.netloc, timeout=timeout)
            else:
                self._connection = factory(*self.connect_to, timeout=timeout)
        self._connection.timeout = timeout
        if self._connection.sock is not None:
            self._connection.sock.settimeout(timeout)
        return self._connection

    def request(
        self,
        method: str,
        path: str,
        document: dict | None = None,
        *,
        query: dict[str, object] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, dict | None]:
        """Send one signed request; the status and the JSON answer (None when empty)."""
        url = self.base_url + path + (f"?{urlencode(query)}" if query else "")
        body = b"" if document is None else json.dumps(document, separators=(",", ":")).encode()
        authorization = self._signer.sign_request(
            url=url, method=method, body=body, host=self.community_host
        )
        headers = {
            "Host": self._host_header,
            "Authorization": authorization,
            "Accept": "application/json",
        }
        if body:
            headers["Content-Type"] = "application/json"
        target = urlsplit(url)
        connection = self._open(self.timeout if timeout is None else timeout)
        try:
            connection.request(
                method,
                target.path + (f"?{target.query}" if target.query else ""),
                body=body or None,
                headers=headers,
            )
            response = connection.getresponse()
            raw = response.read()
        except BaseException:
            self.close()
            raise
        self._used_at = time.monotonic()
        if response.will_close:
            self.close()
        if not raw:
            return response.status, None
        try:
            return response.status, json.loads(raw)
        except ValueError:
            # Not the API's answer (a proxy's page, Django's ALLOWED_HOSTS refusal).
            quoted = raw[:_QUOTED_CHARS].decode("utf-8", "replace")
            raise AgentApiError(response.status, "not_json", quoted) from None

    @staticmethod
    def _refusal(status: int, document: dict | None) -> AgentApiError:
        document = document or {}
        return AgentApiError(
            status, str(document.get("error", "http_error")), str(document.get("detail", ""))
        )

    def claim(
        self,
        *,
        lease_seconds: int | None = None,
        delivery_id: UUID | str | None = None,
        expected: DeliveryBinding | None = None,
        wait: int | None = None,
    ) -> Claimed | None:
        """Claim this agent's oldest pending delivery (or exactly ``delivery_id``, or only
        one bound as ``expected``); None on a miss. The answer unpacks as ``(lease,
        record)`` and carries the message in ``.message``. With ``wait`` (0-60 seconds)
        the server answers as soon as a delivery is claimable, or None at the end."""
        document: dict[str, object] = {}
        timeout = None
        if wait is not None:
            document["wait"] = wait
            # The request's own timeout outlasts the server's wait.
            timeout = self.timeout + wait
        if lease_seconds is not None:
            document["lease_seconds"] = lease_seconds
        if delivery_id is not None:
            document["delivery_id"] = str(delivery_id)
        if expected is not None:
            document["expected"] = wire.binding_document(expected)
        status, answer = self.request("POST", "v1/claim", document, timeout=timeout)
        if status == 204:
            return None
        if status != 200:
            raise self._refusal(status, answer)
        return self._claimed(answer)

    @staticmethod
    def _claimed(document: dict) -> Claimed:
        delivery = document["delivery"]
        return Claimed(
            lease=wire.parse_lease(document["lease"]),
            record=wire.parse_delivery(delivery),
            message=wire.parse_message(delivery.get("message")),
        )

    def claim_many(self, limit: int, *, lease_seconds: int | None = None) -> list[Claimed]:
        """Claim up to ``limit`` of this agent's oldest pending deliveries (oldest
        first), each under its own lease; [] on a miss."""
        document: dict[str, object] = {"limit": limit}
        if lease_seconds is not None:
            document["lease_seconds"] = lease_seconds
        status, answer = self.request("POST", "v1/claim/batch", document)
        if status != 200:
            raise self._refusal(status, answer)
        return [self._claimed(item) for item in answer["claimed"]]

    def finish_many(
        self, settlements: list[tuple[Lease, Outcome | str]]
    ) -> list[Settled | AlreadyTerminal | LeaseLost]:
        """Settle many leases in one request; one result per pair, in order."""
        document = {
            "settlements": [
                {
                    "delivery_id": str(lease.delivery_id),
                    "generation": lease.generation,
                    "outcome": Outcome(outcome).value,
                }
                for lease, outcome in settlements
            ]
        }
        status, answer = self.request("POST", "v1/finish/batch", document)
        if status != 200:
            raise self._refusal(status, answer)
        return [self._settlement(item) for item in answer["results"]]

    @staticmethod
    def _settlement(document: dict) -> Settled | AlreadyTerminal | LeaseLost:
        if document["result"] == "lease_lost":
            return LeaseLost()
        if document["result"] == "already_terminal":
            return AlreadyTerminal(status=DeliveryStatus(document["status"]))
        return Settled(outcome=Outcome(document["outcome"]))

    def _lease_lost(self, status: int, answer: dict | None) -> bool:
        return status == 409 and (answer or {}).get("error") == "lease_lost"

    def renew(self, lease: Lease, *, lease_seconds: int | None = None) -> Renewed | LeaseLost:
        document: dict[str, object] = {"generation": lease.generation}
        if lease_seconds is not None:
            document["lease_seconds"] = lease_seconds
        status, answer = self.request("POST", f"v1/deliveries/{lease.delivery_id}/renew", document)
        if self._lease_lost(status, answer):
            return LeaseLost()
        if status != 200:
            raise self._refusal(status, answer)
        return Renewed(lease_until=wire.parse_instant(answer["lease_until"]))

    def finish(
        self, lease: Lease, outcome: Outcome | str, *, turn: dict | None = None
    ) -> Settled | AlreadyTerminal | LeaseLost:
        """Settle the lease once. ``turn``: what an ACP agent said in the turn of
        this attempt (``text``, ``said_bytes``, ``stop_reason``, ``tool_calls``,
        ``permissions``), stored with the settle."""
        document: dict[str, object] = {
            "generation": lease.generation,
            "outcome": Outcome(outcome).value,
        }
        return self._finish(lease, document, turn)

    def _finish(
        self, lease: Lease, document: dict[str, object], turn: dict | None
    ) -> Settled | AlreadyTerminal | LeaseLost:
        if turn is not None:
            document["turn"] = turn
        status, answer = self.request("POST", f"v1/deliveries/{lease.delivery_id}/finish", document)
        if self._lease_lost(status, answer):
            return LeaseLost()
        if status != 200:
            raise self._refusal(status, answer)
        return self._settlement(answer)

    def fail(
        self, lease: Lease, reason: str, *, turn: dict | None = None
    ) -> Settled | AlreadyTerminal | LeaseLost:
        """Settle the lease ``failed`` for good, ``reason`` kept as the delivery's last
        error (never retried); ``turn`` as ``finish`` takes it."""
        document: dict[str, object] = {
            "generation": lease.generation,
            "outcome": "failed",
            "error": reason,
        }
        return self._finish(lease, document, turn)

    def retry(
        self,
        lease: Lease,
        error: str,
        *,
        delay_seconds: float | None = None,
        turn: dict | None = None,
    ) -> Retried | Exhausted | LeaseLost:
        """Give the live lease back after a failed attempt, ``error`` kept: pending
        again after the server's backoff (or ``delay_seconds``), or settled failed
        once every attempt is used (``Exhausted``); ``turn`` as ``finish`` takes it."""
        document: dict[str, object] = {"generation": lease.generation, "error": error}
        if delay_seconds is not None:
            document["delay_seconds"] = delay_seconds
        if turn is not None:
            document["turn"] = turn
        status, answer = self.request("POST", f"v1/deliveries/{lease.delivery_id}/retry", document)
        if self._lease_lost(status, answer):
            return LeaseLost()
        if status != 200:
            raise self._refusal(status, answer)
        if answer["result"] == "exhausted":
            return Exhausted(attempts=answer["attempts"])
        return Retried(
            available_at=wire.parse_instant(answer["available_at"]), attempts=answer["attempts"]
        )

    def release(self, lease: Lease) -> bool:
        """Give the live lease back unattempted (pending again at once); False when
        it was no longer live."""
        document = {"generation": lease.generation}
        path = f"v1/deliveries/{lease.delivery_id}/release"
        status, answer = self.request("POST", path, document)
        if self._lease_lost(status, answer):
            return False
        if status != 200:
            raise self._refusal(status, answer)
        return True

    def reply(
        self, lease: Lease, content: str, to: list[str], *, idempotency_key: str
    ) -> Replied | LeaseLost:
        """Reply to the held delivery: a message of its run, tagged as a reply to its
        message, sent to the enrolled agents ``to`` (64 hex each), committed only
        under the live lease. The same ``idempotency_key`` for the same delivery
        sends once. Bad content or a key outside the roster is an ``AgentApiError``."""
        document = {
            "generation": lease.generation,
            "content": content,
            "to": list(to),
            "idempotency_key": idempotency_key,
        }
        status, answer = self.request("POST", f"v1/deliveries/{lease.delivery_id}/reply", document)
        if self._lease_lost(status, answer):
            return LeaseLost()
        if status != 200:
            raise self._refusal(status, answer)
        return Replied(
            message_id=bytes.fromhex(answer["message_id"]),
            run_id=UUID(answer["run_id"]),
            step_id=answer["step_id"],
            created=answer["created"],
            deliveries=tuple(UUID(item) for item in answer["deliveries"]),
        )

    def replies(self, delivery_id: UUID | str) -> list[dict[str, str]] | None:
        """The replies stored so far in the run of one of this agent's deliveries
        (each its ``id``, ``content`` and ``pubkey``); None when the delivery is
        missing or someone else's."""
        status, answer = self.request("GET", f"v1/deliveries/{delivery_id}/replies")
        if status == 404 and (answer or {}).get("error") == "not_found":
            return None
        if status != 200:
            raise self._refusal(status, answer)
        return list(answer["replies"])

    def finish_and_claim_next(
        self, lease: Lease, outcome: Outcome | str, *, lease_seconds: int | None = None
    ) -> FinishedAndNext:
        """Settle the lease once and, in the same request (and statement), claim this
        agent's oldest claimable delivery: the settle's result and the next ``Claimed``
        (with its message), or None when there is none or nothing settled."""
        document: dict[str, object] = {
            "generation": lease.generation,
            "outcome": Outcome(outcome).value,
            "next": True,
        }
        if lease_seconds is not None:
            document["lease_seconds"] = lease_seconds
        status, answer = self.request("POST", f"v1/deliveries/{lease.delivery_id}/finish", document)
        if self._lease_lost(status, answer):
            return FinishedAndNext(result=LeaseLost())
        if status != 200:
            raise self._refusal(status, answer)
        claimed = answer.get("next")
        return FinishedAndNext(
            result=self._settlement(answer),
            next=None if claimed is None else self._claimed(claimed),
        )

    def _read(self, delivery_id: UUID | str) -> dict | None:
        status, answer = self.request("GET", f"v1/deliveries/{delivery_id}")
        if status == 404 and (answer or {}).get("error") == "not_found":
            return None
        if status != 200:
            raise self._refusal(status, answer)
        return answer

    def get(self, delivery_id: UUID | str) -> DeliveryRecord | None:
        """One of this agent's deliveries; None when missing or someone else's."""
        answer = self._read(delivery_id)
        return None if answer is None else wire.parse_delivery(answer)

    def message(self, delivery_id: UUID | str) -> MessageEvent | None:
        """The message one of this agent's deliveries carries; None when the
        delivery is missing or someone else's."""
        answer = self._read(delivery_id)
        return None if answer is None else wire.parse_message(answer.get("message"))

    def wait(self, timeout: int = 30) -> WakeHint | None:
        """Block until a delivery for this agent is committed (a hint to claim now), or
        ``timeout`` seconds (at most 60) pass: then None."""
        status, answer = self.request(
            "GET", "v1/wait", query={"timeout": timeout}, timeout=timeout + self.timeout
        )
        if status == 204:
            return None
        if status != 200:
            raise self._refusal(status, answer)
        return WakeHint(bytes.fromhex(answer["target"]), UUID(answer["delivery_id"]))
