"""The README's first example, verbatim: a community, one message sent, an in-process
worker that settles it. ``EXAMPLE`` is exactly the README's code block."""

from __future__ import annotations

import contextlib
import io

import pytest

from workflow_delivery.models import DeliveryTransition

# The worker runs on connections of its own: the example's rows must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLE = """\
from workflow_delivery import keys, services
from workflow_delivery.consumer import Consumer
from workflow_delivery.models import Community

community = Community.objects.create(host="alpha.example")
agent = bytes.fromhex(keys.new_key_pair()[1])  # (secret, public): the agent's keys
sent = services.send_message(
    community.id, targets=[agent], content="please review", idempotency_key="review-1"
)

def handle(record, lease, context):
    print("handling", record.id)

Consumer(community.id, [agent], handle, max_deliveries=1).run()
print(services.get_delivery(community.id, sent.deliveries[0].id).status)  # finished
"""


def test_the_readme_example_settles_its_first_delivery():
    assert len(EXAMPLE.splitlines()) <= 15
    out = io.StringIO()
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(out):
        exec(compile(EXAMPLE, "README.md", "exec"), namespace)
    delivery = namespace["sent"].deliveries[0]
    assert out.getvalue().splitlines() == [f"handling {delivery.id}", "finished"]
    kinds = DeliveryTransition.objects.filter(delivery_id=delivery.id).values_list(
        "kind", flat=True
    )
    assert list(kinds) == ["committed", "claimed", "finished"]
