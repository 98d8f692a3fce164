"""Helpers of the agent API tests: an agent key with a pending delivery, a key enrolled
with none, the delivery rows as they are stored, and the check of an answer's status
and error code. They sign through ``tests.support.agent_http``, which imports
psycopg 3 (the modules that import this one are left out of the psycopg2 cell)."""

from __future__ import annotations

from django.test import Client

from tests.support import factories
from tests.support.agent_http import pubkey, secret, signed
from workflow_delivery.models import WorkflowAgentDelivery


def enrolled_secret(owner) -> bytes:
    """A new agent key enrolled in ``owner``'s roster, with no delivery."""
    key = secret()
    factories.enroll(owner, [pubkey(key)])
    return key


class Agent:
    """An agent key with one pending delivery in a fresh community."""

    def __init__(self, owner=None) -> None:
        self.secret = secret()
        self.pubkey = pubkey(self.secret)
        self.step = factories.Step(owner=owner, targets=[self.pubkey])
        self.delivery = factories.committed(self.step)[0]
        self.host = self.step.community.host

    def call(self, client: Client, method: str, path: str, document=None, **options):
        options.setdefault("host", self.host)
        options.setdefault("secret_key", self.secret)
        return signed(client, method, path, document, **options)


def rows() -> list[dict]:
    return list(WorkflowAgentDelivery.objects.order_by("id").values())


def answer(response, status: int, code: str | None = None) -> dict | None:
    assert response.status_code == status, response.content
    if code is not None:
        document = response.json()
        assert document["error"] == code, document
        assert document["detail"]
        return document
    return response.json() if response.content else None
