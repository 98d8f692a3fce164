"""Every rule of SPEC §3 is PostgreSQL's own: raw SQL that breaks one fails by name."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction

from tests.support import factories
from workflow_delivery.models import Community, Event, Workflow, WorkflowAgentDelivery, WorkflowRun

INSERT = """
INSERT INTO workflow_agent_deliveries (
    id, community_id, workflow_id, run_id, step_id, target_pubkey, definition_event_id,
    message_event_id, message_event_created_at, cause_kind, cause_event_id,
    cause_scheduled_for, cause_webhook_invocation_id, status, lease_generation,
    lease_until, claimed_at, finished_at
) VALUES (
    %(id)s, %(community_id)s, %(workflow_id)s, %(run_id)s, %(step_id)s, %(target_pubkey)s,
    %(definition_event_id)s, %(message_event_id)s, %(message_event_created_at)s, %(cause_kind)s,
    %(cause_event_id)s, %(cause_scheduled_for)s, %(cause_webhook_invocation_id)s, %(status)s,
    %(lease_generation)s, %(lease_until)s, %(claimed_at)s, %(finished_at)s
)
"""


def valid_row(step: factories.Step, **overrides) -> dict:
    row = {
        "id": uuid.uuid4(),
        "community_id": step.community.id,
        "workflow_id": step.workflow.id,
        "run_id": step.run.id,
        "step_id": step.step_id,
        "target_pubkey": step.targets[0],
        "definition_event_id": step.definition_event_id,
        "message_event_id": bytes(step.message.id),
        "message_event_created_at": step.created_at,
        "cause_kind": "event",
        "cause_event_id": factories.key32(),
        "cause_scheduled_for": None,
        "cause_webhook_invocation_id": None,
        "status": "pending",
        "lease_generation": 0,
        "lease_until": None,
        "claimed_at": None,
        "finished_at": None,
    }
    row.update(overrides)
    return row


def violation(raw, row: dict) -> str:
    """Insert ``row`` by raw SQL and return the name of the constraint that refused it."""
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        raw.execute(INSERT, row)
    return caught.value.__cause__.diag.constraint_name


def test_valid_row_is_accepted(step, raw):
    raw.execute(INSERT, valid_row(step))
    assert WorkflowAgentDelivery.objects.filter(community=step.community).count() == 1


@pytest.mark.parametrize(
    ("column", "constraint"),
    [
        ("target_pubkey", "wd_delivery_target_pubkey_32_bytes"),
        ("definition_event_id", "wd_delivery_definition_event_id_32_bytes"),
        ("cause_event_id", "wd_delivery_cause_event_id_32_bytes"),
    ],
)
@pytest.mark.parametrize("length", [31, 33])
def test_byte_columns_must_hold_exactly_32_bytes(step, raw, column, constraint, length):
    assert violation(raw, valid_row(step, **{column: b"\x01" * length})) == constraint


@pytest.mark.parametrize("length", [31, 33])
def test_message_event_id_must_hold_exactly_32_bytes(step, raw, length):
    name = violation(raw, valid_row(step, message_event_id=b"\x01" * length))
    assert name == "wd_delivery_message_event_id_32_bytes"


@pytest.mark.parametrize("step_id", ["", " ", "\t \n", "x" * 65])
def test_step_id_must_be_1_to_64_non_blank_characters(step, raw, step_id):
    assert violation(raw, valid_row(step, step_id=step_id)) == "wd_delivery_step_id_valid"


def test_step_id_of_64_characters_is_accepted(step, raw):
    raw.execute(INSERT, valid_row(step, step_id="s" * 64))


@pytest.mark.parametrize(
    "cause",
    [
        {"cause_event_id": None},
        {"cause_scheduled_for": factories.whole_second_now()},
        {"cause_kind": "schedule"},
        {"cause_kind": "webhook", "cause_webhook_invocation_id": uuid.uuid4()},
        {"cause_kind": "webhook", "cause_event_id": None, "cause_scheduled_for": None},
        {"cause_kind": "carrier-pigeon"},
    ],
    ids=["none", "two", "wrong-one", "webhook-with-event", "webhook-without-id", "unknown-kind"],
)
def test_exactly_one_cause_matching_its_kind(step, raw, cause):
    assert violation(raw, valid_row(step, **cause)) == "wd_delivery_cause_exactly_one"


def test_each_cause_kind_alone_is_accepted(step, raw):
    raw.execute(INSERT, valid_row(step))
    raw.execute(
        INSERT,
        valid_row(
            step,
            target_pubkey=step.targets[1],
            cause_kind="schedule",
            cause_event_id=None,
            cause_scheduled_for=factories.whole_second_now(),
        ),
    )
    raw.execute(
        INSERT,
        valid_row(
            step,
            target_pubkey=step.targets[2],
            cause_kind="webhook",
            cause_event_id=None,
            cause_webhook_invocation_id=uuid.uuid4(),
        ),
    )
    assert WorkflowAgentDelivery.objects.filter(community=step.community).count() == 3


def test_status_outside_the_four_is_refused(step, raw):
    assert violation(raw, valid_row(step, status="done")) == "wd_delivery_status_valid"


def test_lease_without_claimed_is_refused(step, raw):
    now = factories.whole_second_now()
    row = valid_row(step, lease_until=now, claimed_at=now)
    assert violation(raw, row) == "wd_delivery_lease_iff_claimed"


def test_claimed_without_lease_is_refused(step, raw):
    assert violation(raw, valid_row(step, status="claimed")) == "wd_delivery_lease_iff_claimed"
    row = valid_row(step, status="claimed", lease_until=factories.whole_second_now())
    assert violation(raw, row) == "wd_delivery_lease_iff_claimed"


def test_finished_at_on_a_non_terminal_row_is_refused(step, raw):
    row = valid_row(step, finished_at=factories.whole_second_now())
    assert violation(raw, row) == "wd_delivery_finished_at_iff_terminal"


def test_terminal_row_without_finished_at_is_refused(step, raw):
    name = violation(raw, valid_row(step, status="failed"))
    assert name == "wd_delivery_finished_at_iff_terminal"


def test_negative_generation_is_refused(step, raw):
    name = violation(raw, valid_row(step, lease_generation=-1))
    assert name == "wd_delivery_lease_generation_nonneg"


def test_duplicate_identity_is_refused(step, raw):
    raw.execute(INSERT, valid_row(step))
    assert violation(raw, valid_row(step)) == "wd_delivery_identity_key"


def test_same_target_in_another_step_is_accepted(step, raw):
    raw.execute(INSERT, valid_row(step))
    raw.execute(INSERT, valid_row(step, step_id="step-2"))


def test_reference_to_another_communitys_workflow_is_refused(step, raw):
    other = factories.Step()
    row = valid_row(step, workflow_id=other.workflow.id)
    assert violation(raw, row) == "wd_delivery_run_fk"


def test_a_workflow_that_is_not_the_runs_workflow_is_refused(step, raw):
    """The run's key carries the workflow: no key of the workflow's own is needed."""
    sibling = factories.workflow(step.community)
    assert violation(raw, valid_row(step, workflow_id=sibling.id)) == "wd_delivery_run_fk"


def test_a_community_that_does_not_exist_is_refused(step, raw):
    row = valid_row(step, community_id=uuid.uuid4())
    assert violation(raw, row) in {"wd_delivery_run_fk", "wd_delivery_message_event_fk"}


def test_a_workflow_that_does_not_exist_is_refused(step, raw):
    assert violation(raw, valid_row(step, workflow_id=uuid.uuid4())) == "wd_delivery_run_fk"


def test_reference_to_another_communitys_run_is_refused(step, raw):
    other = factories.Step()
    assert violation(raw, valid_row(step, run_id=other.run.id)) == "wd_delivery_run_fk"


def test_run_of_another_workflow_is_refused(step, raw):
    sibling = factories.run(factories.workflow(step.community))
    assert violation(raw, valid_row(step, run_id=sibling.id)) == "wd_delivery_run_fk"


def test_reference_to_another_communitys_message_event_is_refused(step, raw):
    other = factories.Step()
    row = valid_row(
        step,
        message_event_id=bytes(other.message.id),
        message_event_created_at=other.created_at,
    )
    assert violation(raw, row) == "wd_delivery_message_event_fk"


def test_message_event_at_another_created_at_is_refused(step, raw):
    row = valid_row(step, message_event_created_at=step.created_at + timedelta(seconds=1))
    assert violation(raw, row) == "wd_delivery_message_event_fk"


def test_run_in_another_communitys_workflow_is_refused(raw, db):
    mine, theirs = factories.Step(), factories.Step()
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        WorkflowRun.objects.create(community=mine.community, workflow=theirs.workflow)
    assert caught.value.__cause__.diag.constraint_name == "wd_run_workflow_fk"


def _stored(step: factories.Step, raw) -> uuid.UUID:
    row = valid_row(step)
    raw.execute(INSERT, row)
    return row["id"]


def test_deleting_a_run_deletes_its_deliveries(step, raw):
    delivery_id = _stored(step, raw)
    WorkflowRun.objects.filter(pk=step.run.pk).delete()
    assert not WorkflowAgentDelivery.objects.filter(pk=delivery_id).exists()


def test_deleting_a_workflow_deletes_its_runs_and_deliveries(step, raw):
    delivery_id = _stored(step, raw)
    raw.execute("DELETE FROM workflows WHERE id = %s", [step.workflow.id])
    assert not WorkflowRun.objects.filter(pk=step.run.pk).exists()
    assert not WorkflowAgentDelivery.objects.filter(pk=delivery_id).exists()


def test_deleting_the_message_event_deletes_its_deliveries(step, raw):
    delivery_id = _stored(step, raw)
    raw.execute("DELETE FROM events WHERE id = %s", [bytes(step.message.id)])
    assert not WorkflowAgentDelivery.objects.filter(pk=delivery_id).exists()


def test_deleting_a_community_with_deliveries_is_refused(step, raw):
    _stored(step, raw)
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        raw.execute("DELETE FROM communities WHERE id = %s", [step.community.id])
    assert caught.value.__cause__.diag.constraint_name.startswith("wd_")
    assert Community.objects.filter(pk=step.community.pk).exists()


def test_community_id_cannot_be_nil(raw, db):
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        raw.execute(
            "INSERT INTO communities (id, host) VALUES (%s, 'nil.example')", [uuid.UUID(int=0)]
        )
    assert caught.value.__cause__.diag.constraint_name == "wd_community_id_not_nil"


def test_community_host_is_unique_case_insensitively(db):
    factories.community("Relay.Example")
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        factories.community("relay.EXAMPLE")
    assert caught.value.__cause__.diag.constraint_name == "wd_community_host_ci_key"


@pytest.mark.parametrize(
    ("statement", "constraint"),
    [
        ("UPDATE communities SET deletion_state = 'gone'", "wd_community_deletion_state_valid"),
        (
            "UPDATE communities SET deletion_fence_generation = -1",
            "wd_community_fence_generation_nonneg",
        ),
    ],
)
def test_community_columns_are_checked(db, raw, statement, constraint):
    factories.community()
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        raw.execute(statement)
    assert caught.value.__cause__.diag.constraint_name == constraint


def test_workflow_and_run_status_are_checked(step, raw):
    for table, constraint in [
        ("workflows", "wd_workflow_status_valid"),
        ("workflow_runs", "wd_run_status_valid"),
    ]:
        with pytest.raises(IntegrityError) as caught, transaction.atomic():
            raw.execute(f"UPDATE {table} SET status = 'bogus'")
        assert caught.value.__cause__.diag.constraint_name == constraint


def test_event_tags_must_be_lists_of_strings(step, raw):
    for tags in ['{"p": 1}', "[1]", '[["p", 1]]']:
        with pytest.raises(IntegrityError) as caught, transaction.atomic():
            raw.execute("UPDATE events SET tags = %s::jsonb", [tags])
        assert caught.value.__cause__.diag.constraint_name == "wd_event_tags_string_lists"


def test_lease_generation_never_decreases(step, raw):
    row = valid_row(step, lease_generation=3)
    raw.execute(INSERT, row)
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        raw.execute(
            "UPDATE workflow_agent_deliveries SET lease_generation = 2 WHERE id = %s", [row["id"]]
        )
    assert caught.value.__cause__.diag.constraint_name == "wd_delivery_lease_generation_monotonic"


def test_terminal_outcome_never_changes(step, raw):
    row = valid_row(step, status="finished", finished_at=factories.whole_second_now())
    raw.execute(INSERT, row)
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        raw.execute(
            "UPDATE workflow_agent_deliveries SET status = 'failed' WHERE id = %s", [row["id"]]
        )
    assert caught.value.__cause__.diag.constraint_name == "wd_delivery_terminal_once"


NAMED_CONSTRAINTS = {
    "communities": {
        "wd_community_id_not_nil",
        "wd_community_host_not_blank",
        "wd_community_deletion_state_valid",
        "wd_community_fence_generation_nonneg",
    },
    "workflows": {
        "wd_workflow_tenant_key",
        "wd_workflow_community_fk",
        "wd_workflow_status_valid",
        "wd_workflow_owner_pubkey_32_bytes",
    },
    "workflow_runs": {
        "wd_run_tenant_key",
        "wd_run_tenant_workflow_key",
        "wd_run_community_fk",
        "wd_run_workflow_fk",
        "wd_run_status_valid",
    },
    "events": {
        "wd_event_tenant_key",
        "wd_event_community_fk",
        "wd_event_id_32_bytes",
        "wd_event_tags_string_lists",
    },
    "workflow_agent_deliveries": {
        "wd_delivery_tenant_key",
        "wd_delivery_identity_key",
        "wd_delivery_run_fk",
        "wd_delivery_message_event_fk",
        "wd_delivery_step_id_valid",
        "wd_delivery_target_pubkey_32_bytes",
        "wd_delivery_definition_event_id_32_bytes",
        "wd_delivery_message_event_id_32_bytes",
        "wd_delivery_cause_event_id_32_bytes",
        "wd_delivery_cause_exactly_one",
        "wd_delivery_status_valid",
        "wd_delivery_lease_generation_nonneg",
        "wd_delivery_lease_iff_claimed",
        "wd_delivery_finished_at_iff_terminal",
    },
}


@pytest.mark.parametrize("table", sorted(NAMED_CONSTRAINTS))
def test_named_constraints_are_installed(db, raw, table):
    raw.execute("SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass", [table])
    installed = {name for (name,) in raw.fetchall()}
    assert NAMED_CONSTRAINTS[table] <= installed


def test_foreign_keys_have_their_on_delete_rules(db, raw):
    raw.execute(
        """
        SELECT conname, confdeltype, array_length(conkey, 1)
          FROM pg_constraint WHERE contype = 'f' AND conname LIKE 'wd_%%'
        """
    )
    rules = {name: (action, width) for name, action, width in raw.fetchall()}
    # The community and the workflow are held by the run's key (migration 0009).
    assert "wd_delivery_workflow_fk" not in rules
    assert "wd_delivery_community_fk" not in rules
    assert rules["wd_delivery_run_fk"] == ("c", 3)
    assert rules["wd_delivery_message_event_fk"] == ("c", 3)
    assert rules["wd_run_workflow_fk"] == ("c", 2)
    # Every foreign key between tenant tables carries community_id.
    raw.execute(
        """
        SELECT c.conname FROM pg_constraint c
         WHERE c.contype = 'f' AND c.confrelid <> 'communities'::regclass
           AND c.conrelid::regclass::text IN
               ('workflows', 'workflow_runs', 'events', 'workflow_agent_deliveries')
           AND NOT EXISTS (
               SELECT 1 FROM pg_attribute a
                WHERE a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)
                  AND a.attname = 'community_id')
        """
    )
    assert raw.fetchall() == []


def test_partial_indexes_have_their_predicates(db, raw):
    raw.execute(
        """
        SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid),
               pg_get_expr(indpred, indrelid)
          FROM pg_index WHERE indrelid = 'workflow_agent_deliveries'::regclass
        """
    )
    indexes = {name: (definition, predicate) for name, definition, predicate in raw.fetchall()}
    claim_def, claim_pred = indexes["wd_delivery_claim_idx"]
    assert "(community_id, target_pubkey, created_at)" in claim_def
    assert claim_pred == "(status = 'pending'::text)"
    reap_def, reap_pred = indexes["wd_delivery_reap_community_idx"]
    assert "(community_id, lease_until)" in reap_def
    assert reap_pred == "(status = 'claimed'::text)"


def test_claim_uses_the_partial_index(step, raw):
    # A realistic table: many targets, most rows settled, so the planner's choice
    # is the index's merit and not an artefact of an empty table.
    raw.execute(
        "INSERT INTO community_agents (community_id, pubkey) "
        "SELECT %s, sha256(int4send(n)) FROM generate_series(0, 63) AS n",
        [step.community.id],
    )
    raw.execute(
        """
        INSERT INTO workflow_agent_deliveries (
            id, community_id, workflow_id, run_id, step_id, target_pubkey,
            definition_event_id, message_event_id, message_event_created_at,
            cause_kind, cause_event_id, status, finished_at)
        SELECT gen_random_uuid(), %s, %s, %s, 'step-' || n, sha256(int4send(n %% 64)),
               %s, %s, %s, 'event', sha256(int4send(n)),
               CASE WHEN n %% 10 = 0 THEN 'pending' ELSE 'finished' END,
               CASE WHEN n %% 10 = 0 THEN NULL ELSE now() END
          FROM generate_series(1, 5000) AS n
        """,
        [
            step.community.id,
            step.workflow.id,
            step.run.id,
            step.definition_event_id,
            bytes(step.message.id),
            step.created_at,
        ],
    )
    raw.execute("ANALYZE workflow_agent_deliveries")
    raw.execute(
        """
        EXPLAIN SELECT id FROM workflow_agent_deliveries
         WHERE community_id = %s AND target_pubkey = sha256(int4send(7)) AND status = 'pending'
         ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
        """,
        [step.community.id],
    )
    plan = "\n".join(line for (line,) in raw.fetchall())
    assert "wd_delivery_claim_idx" in plan


def test_models_map_the_tables_of_the_spec(db):
    assert Community._meta.db_table == "communities"
    assert Workflow._meta.db_table == "workflows"
    assert WorkflowRun._meta.db_table == "workflow_runs"
    assert Event._meta.db_table == "events"
    assert WorkflowAgentDelivery._meta.db_table == "workflow_agent_deliveries"
    assert connection.vendor == "postgresql"
