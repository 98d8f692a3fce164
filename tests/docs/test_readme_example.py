"""The README's first example, read from the README itself: a community, an enrolled
agent, one message sent and an in-process worker that settles it."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from tests.support.markdown_examples import blocks
from workflow_delivery.history import delivery_history
from workflow_delivery.models import WorkflowAgentDelivery

# The worker runs on connections of its own: the example's rows must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

README = Path(__file__).resolve().parents[2] / "README.md"


def first_example() -> str:
    (code,) = [code for tags, code in blocks(README) if "first" in tags]
    return code


def test_the_readme_example_is_at_most_fifteen_lines_of_code():
    lines = [line for line in first_example().splitlines() if line.strip()]
    assert len(lines) <= 15, lines


def run_example() -> tuple[dict[str, object], str]:
    out = io.StringIO()
    namespace: dict[str, object] = {"__name__": "readme_first_example"}
    with contextlib.redirect_stdout(out):
        exec(compile(first_example(), "README.md", "exec"), namespace)
    return namespace, out.getvalue()


def test_the_readme_example_settles_its_first_delivery():
    namespace, out = run_example()
    delivery = namespace["sent"].deliveries[0]
    assert out.splitlines() == [f"handling {delivery.id}", "finished"]
    row = WorkflowAgentDelivery.objects.get(id=delivery.id)
    assert [entry.kind for entry in delivery_history(row)] == ["committed", "claimed", "finished"]
    assert row.attempts == 1


def test_the_readme_example_runs_again_on_the_same_database():
    first, _ = run_example()
    second, out = run_example()
    assert second["community"].id == first["community"].id
    delivery = second["sent"].deliveries[0]
    assert delivery.id != first["sent"].deliveries[0].id
    assert out.splitlines() == [f"handling {delivery.id}", "finished"]
    assert set(WorkflowAgentDelivery.objects.values_list("status", flat=True)) == {"finished"}
