"""What an ACP agent says in a turn is kept: the runtime (``AcpAgent``) driving the
scripted agent (``tests/support/acp_agent.py``, a real process speaking ACP over stdio) stores
each attempt's streamed text, tool calls and permission requests with the settle of
that attempt, bounded by ``WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES``, and the admin
shows them, escaped, on the delivery's page and its timeline."""

from __future__ import annotations

import time

import pytest
from django.core.checks import run_checks
from django.db import DatabaseError
from django.test import override_settings

from tests.acp.test_acp_runtime import Driving, acp_agent, record, send, settled
from tests.support import admin_pages, factories
from tests.support.consumers import eventually, status
from workflow_delivery.acp import Turn
from workflow_delivery.conf import WorkflowDeliveryConfigurationError
from workflow_delivery.exceptions import ConstraintViolation
from workflow_delivery.models import AgentTurn, WorkflowAgentDelivery
from workflow_delivery.protocol import DeliveryStatus, Outcome
from workflow_delivery.services import (
    claim_delivery,
    finish_delivery,
    keep_agent_turn,
    revoke_agent,
)

pytestmark = pytest.mark.django_db(transaction=True)

# What "transcript 2" says, whole.
SAID_2 = "<b>part 0</b> & <b>part 1</b> & given no; done"


@pytest.fixture
def roster():
    owner = factories.community()
    agent, peer = factories.key32(), factories.key32()
    factories.enroll(owner, [agent, peer])
    return owner, agent, peer


def runtime(owner, agent, **options):
    # A loaded machine may take many seconds to import the agent's SDKs.
    options.setdefault("handshake_timeout", 60)
    return acp_agent(owner, agent, **options)


def turns_of(delivery_id) -> list[AgentTurn]:
    return list(AgentTurn.objects.filter(delivery_id=delivery_id).order_by("attempts"))


def test_a_finished_turn_keeps_its_text_tool_calls_and_permission_requests(roster):
    owner, agent, _ = roster
    delivery = send(owner, agent, "transcript 2")
    with Driving(runtime(owner, agent, max_deliveries=1)) as driving:
        assert eventually(lambda: settled(delivery), 60)
    assert driving.error is None
    assert status(delivery) is DeliveryStatus.FINISHED
    [turn] = turns_of(delivery)
    assert (turn.attempts, turn.generation) == (1, record(owner, delivery).lease_generation)
    assert turn.outcome == "finished" and turn.stop_reason == "end_turn"
    assert turn.text == SAID_2 and turn.said_bytes == len(SAID_2) and not turn.truncated
    assert turn.tool_calls == [
        {"id": "t1", "title": "read <notes>", "kind": "read", "status": "completed"},
        {"id": "t2", "title": "edit config", "kind": "edit", "status": "failed"},
    ]
    # Denied by default: the reject option was chosen.
    assert turn.permissions == [
        {
            "title": "delete <everything>",
            "kind": "delete",
            "options": ["Allow (allow_once)", "Reject (reject_once)"],
            "answer": "denied",
            "option": "no",
        }
    ]


@override_settings(WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES=20)
def test_the_text_is_cut_at_the_bound_and_the_cut_is_noted(roster):
    owner, agent, _ = roster
    delivery = send(owner, agent, "transcript 6")
    with Driving(runtime(owner, agent, max_deliveries=1)):
        assert eventually(lambda: settled(delivery), 60)
    [turn] = turns_of(delivery)
    assert turn.text == "<b>part 0</b> & <b>p"
    assert turn.truncated and turn.said_bytes == 6 * len("<b>part 0</b> & ") + len("given no; done")
    # The tool calls and the permission request come after the cut: still kept.
    assert len(turn.tool_calls) == 2 and len(turn.permissions) == 1


@override_settings(WORKFLOW_DELIVERY_ACP_ALLOW_PERMISSIONS=("delete",))
def test_an_allowed_permission_request_is_kept_with_the_option_given(roster):
    owner, agent, _ = roster
    delivery = send(owner, agent, "transcript 1")
    with Driving(runtime(owner, agent, max_deliveries=1)):
        assert eventually(lambda: settled(delivery), 60)
    [turn] = turns_of(delivery)
    [asked] = turn.permissions
    assert (asked["answer"], asked["option"]) == ("allowed", "yes")
    assert turn.text.endswith("given yes; done")


def test_a_cut_never_splits_a_character():
    turn = Turn(run_id=None, delivery_id=None, blocks=[], max_bytes=5)
    turn.say("ab")
    turn.say("\u00e9\u00e9")  # 4 bytes: only one fits whole
    turn.say("c")
    assert turn.text == "ab\u00e9" and turn.said == 7 and turn.truncated


@override_settings(WORKFLOW_DELIVERY_RETRY_BACKOFF_SECONDS=60)
def test_failed_and_retried_turns_are_kept_with_their_attempt(roster):
    owner, agent, _ = roster
    refused = send(owner, agent, "refuse", key="k-refuse")
    crashed = send(owner, agent, "crash", key="k-crash")
    with Driving(runtime(owner, agent)):
        assert eventually(
            lambda: settled(refused) and record(owner, crashed).last_error is not None, 60
        )
    [failed] = turns_of(refused)
    assert (failed.outcome, failed.stop_reason) == ("failed", "refusal")
    assert failed.text == "stopping: refuse"
    # The agent died mid-turn: what it said before is kept with the retried attempt.
    [retried] = turns_of(crashed)
    assert (retried.outcome, retried.stop_reason, retried.attempts) == ("retried", None, 1)
    assert retried.text == "about to crash"
    assert record(owner, crashed).status is DeliveryStatus.PENDING


@override_settings(WORKFLOW_DELIVERY_MAX_ATTEMPTS=1)
def test_a_retry_that_used_the_last_attempt_keeps_the_turn_as_failed(roster):
    owner, agent, _ = roster
    crashed = send(owner, agent, "crash")
    with Driving(runtime(owner, agent)):
        assert eventually(lambda: settled(crashed), 60)
    assert status(crashed) is DeliveryStatus.FAILED
    [turn] = turns_of(crashed)
    assert (turn.outcome, turn.text) == ("failed", "about to crash")


def test_a_lost_lease_stores_nothing(roster):
    owner, agent, _ = roster
    hung = send(owner, agent, "hang")
    runner = runtime(owner, agent, lease_seconds=30)
    with Driving(runner):
        assert eventually(lambda: status(hung) is DeliveryStatus.CLAIMED, 60)
        time.sleep(0.3)
        revoke_agent(owner.id, agent)
        assert eventually(lambda: runner.handler.cancelled_at, 5)
        # The turn ends (cancelled) and the handler has returned before the stop.
        assert eventually(lambda: runner.consumer.stats.lost == 1, 60)
    assert status(hung) is DeliveryStatus.PENDING
    assert turns_of(hung) == []


def test_the_database_keeps_one_turn_per_attempt_and_only_after_its_settle(roster):
    owner, agent, _ = roster
    delivery = send(owner, agent, "anything")
    lease, claimed = claim_delivery(owner.id, agent, lease_seconds=30)
    said = {"attempts": claimed.attempts, "outcome": "finished", "text": "hi", "said_bytes": 2}
    # While the claim is live, no turn of it may be stored.
    with pytest.raises(ConstraintViolation) as refused:
        keep_agent_turn(lease, **said)
    assert refused.value.constraint == "wd_agent_turn_settled"
    finish_delivery(lease, Outcome.FINISHED)
    keep_agent_turn(lease, **said)
    with pytest.raises(ConstraintViolation) as twice:
        keep_agent_turn(lease, **said)
    assert twice.value.constraint == "wd_agent_turn_once"
    turn = AgentTurn.objects.get(delivery_id=delivery)
    assert turn.text == "hi"
    # A stored turn is never changed.
    with pytest.raises(DatabaseError, match="a stored turn is never changed"):
        AgentTurn.objects.filter(pk=turn.pk).update(text="other")


def test_the_stored_text_and_said_bytes_are_bounded_by_the_database(roster):
    owner, agent, _ = roster
    send(owner, agent, "anything")
    lease, _ = claim_delivery(owner.id, agent, lease_seconds=30)
    finish_delivery(lease, Outcome.FINISHED)
    huge = "x" * (1048576 + 1)
    with pytest.raises(ConstraintViolation) as too_long:
        keep_agent_turn(lease, attempts=1, outcome="finished", text=huge, said_bytes=len(huge))
    assert too_long.value.constraint == "wd_agent_turn_text_bytes"
    with pytest.raises(ConstraintViolation) as undercounted:
        keep_agent_turn(lease, attempts=1, outcome="finished", text="four", said_bytes=3)
    assert undercounted.value.constraint == "wd_agent_turn_said_covers_text"
    assert not AgentTurn.objects.exists()


@override_settings(WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES=20)
def test_the_admin_shows_the_turn_escaped_on_the_page_and_its_timeline(roster, client, viewer):
    owner, agent, _ = roster
    delivery = send(owner, agent, "transcript 3")
    with Driving(runtime(owner, agent, max_deliveries=1)):
        assert eventually(lambda: settled(delivery), 60)
    page = client.get(admin_pages.change(WorkflowAgentDelivery, delivery))
    assert page.status_code == 200
    html = page.content.decode()
    # The agent's HTML is shown as text, never as markup.
    assert "<b>part 0</b>" not in html and "read <notes>" not in html
    assert '<pre class="wd-agent-text">&lt;b&gt;part 0&lt;/b&gt; &amp; &lt;b&gt;p</pre>' in html
    assert "cut at the bound: 20 of the" in html
    assert "tool call <code>t1</code>: read &lt;notes&gt; (read): completed" in html
    assert "permission asked for delete &lt;everything&gt; (delete)" in html
    assert "denied (no)" in html
    # The timeline's settle row links to the turn, with the start of what was said.
    assert 'href="#wd-turn-1"' in html and 'id="wd-turn-1"' in html
    assert "<q>&lt;b&gt;part 0&lt;/b&gt; &amp; &lt;b&gt;p</q>" in html


@override_settings(WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES=-1)
def test_a_bad_bound_is_a_clear_error(roster):
    owner, agent, _ = roster
    errors = [error for error in run_checks() if error.id == "workflow_delivery.E023"]
    assert [error.msg for error in errors] == [
        "WORKFLOW_DELIVERY_ACP_TRANSCRIPT_BYTES must be a whole number of bytes from 0 to "
        "1048576 (the most a stored turn holds), got -1."
    ]
    with pytest.raises(WorkflowDeliveryConfigurationError, match="ACP_TRANSCRIPT_BYTES"):
        runtime(owner, agent)
