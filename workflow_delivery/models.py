"""Tables of the delivery inbox and the tenant schema around it.

Every constraint has an explicit ``wd_`` name. The composite, tenant-scoped
foreign keys and the write-fence triggers cannot be said by the ORM: they live
in the migrations as reviewed SQL, so every relation field here is declared
with ``db_constraint=False`` and ``on_delete=DO_NOTHING`` (PostgreSQL decides).
"""

from __future__ import annotations

import uuid

from django.contrib.postgres.functions import TransactionNow
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Cast, Length, Lower
from django.db.models.lookups import Exact, GreaterThanOrEqual, LessThanOrEqual

from .protocol import (
    ERROR_MESSAGE_MAX_LENGTH,
    ERROR_TRACEBACK_MAX_LENGTH,
    ERROR_TYPE_MAX_LENGTH,
    CauseKind,
    DeliveryStatus,
)
from .validation import AGENT_TURN_TEXT_MAX_BYTES

NIL_UUID = uuid.UUID(int=0)
# The longest label an agent of a roster may carry, in characters.
AGENT_LABEL_MAX_LENGTH = 200
# The longest reason an operator may give for retrying a delivery, in characters.
REASON_MAX_LENGTH = 500


class StatementTimestamp(models.Func):
    """The statement's start by the database clock: a lease is judged by the clock of
    the statement that asks, not by the start of the caller's (maybe long) transaction."""

    template = "statement_timestamp()"
    output_field = models.DateTimeField()


CAUSE_KINDS = [kind.value for kind in CauseKind]
STATUSES = [status.value for status in DeliveryStatus]
PENDING, CLAIMED = DeliveryStatus.PENDING.value, DeliveryStatus.CLAIMED.value
TERMINAL_STATUSES = [DeliveryStatus.FINISHED.value, DeliveryStatus.FAILED.value]


def _bytes32(field: str, name: str) -> models.CheckConstraint:
    return models.CheckConstraint(condition=Exact(Length(field), 32), name=name)


def _error_type_valid(field: str, name: str) -> models.CheckConstraint:
    """An exception's type name, or none: 1 to ``ERROR_TYPE_MAX_LENGTH`` characters, not blank."""
    return models.CheckConstraint(
        condition=Q(**{f"{field}__isnull": True})
        | (
            GreaterThanOrEqual(Length(field), 1)
            & LessThanOrEqual(Length(field), ERROR_TYPE_MAX_LENGTH)
            & Q(**{f"{field}__regex": r"\S"})
        ),
        name=name,
    )


def _at_most(field: str, bound: int, name: str) -> models.CheckConstraint:
    return models.CheckConstraint(
        condition=Q(**{f"{field}__isnull": True}) | LessThanOrEqual(Length(field), bound),
        name=name,
    )


def _tenant_fk(to: str, **kwargs) -> models.ForeignKey:
    return models.ForeignKey(
        to, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, **kwargs
    )


class DeletionState(models.TextChoices):
    ACTIVE = "active"
    QUIESCING = "quiescing"
    FENCED = "fenced"
    TOMBSTONE = "tombstone"


class Community(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    host = models.TextField()
    deletion_state = models.TextField(
        choices=DeletionState.choices, default=DeletionState.ACTIVE, db_default="active"
    )
    deletion_fence_generation = models.BigIntegerField(default=0, db_default=0)
    deleted_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=TransactionNow(), editable=False)

    class Meta:
        db_table = "communities"
        verbose_name_plural = "communities"
        ordering = ["host"]
        permissions = [
            ("begin_community_deletion", "Can begin the deletion of a community"),
            ("fence_community", "Can fence a quiescing community"),
            ("tombstone_community", "Can tombstone a fenced community"),
            ("cancel_community_deletion", "Can cancel the deletion of a quiescing community"),
        ]
        constraints = [
            models.CheckConstraint(condition=~Q(id=NIL_UUID), name="wd_community_id_not_nil"),
            models.CheckConstraint(
                condition=Q(host__regex=r"\S"), name="wd_community_host_not_blank"
            ),
            models.UniqueConstraint(Lower("host"), name="wd_community_host_ci_key"),
            models.CheckConstraint(
                condition=Q(deletion_state__in=DeletionState.values),
                name="wd_community_deletion_state_valid",
            ),
            models.CheckConstraint(
                condition=Q(deletion_fence_generation__gte=0),
                name="wd_community_fence_generation_nonneg",
            ),
        ]

    def __str__(self) -> str:
        return self.host


class WorkflowStatus(models.TextChoices):
    ACTIVE = "active"
    DISABLED = "disabled"
    ARCHIVED = "archived"


class Workflow(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    community = _tenant_fk(Community, related_name="workflows")
    name = models.TextField()
    owner_pubkey = models.BinaryField()
    definition = models.JSONField(default=dict)
    definition_event_id = models.BinaryField(null=True, blank=True)
    status = models.TextField(
        choices=WorkflowStatus.choices, default=WorkflowStatus.ACTIVE, db_default="active"
    )
    created_at = models.DateTimeField(db_default=TransactionNow(), editable=False)
    updated_at = models.DateTimeField(db_default=TransactionNow())

    class Meta:
        db_table = "workflows"
        ordering = ["community_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["community", "id"], name="wd_workflow_tenant_key"),
            models.CheckConstraint(
                condition=Q(name__regex=r"\S"), name="wd_workflow_name_not_blank"
            ),
            _bytes32("owner_pubkey", "wd_workflow_owner_pubkey_32_bytes"),
            _bytes32("definition_event_id", "wd_workflow_definition_event_id_32_bytes"),
            models.CheckConstraint(
                condition=Q(status__in=WorkflowStatus.values), name="wd_workflow_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class RunStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    WAITING_APPROVAL = "waiting_approval"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class WorkflowRun(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    community = _tenant_fk(Community, related_name="workflow_runs")
    workflow = _tenant_fk(Workflow, related_name="runs")
    status = models.TextField(
        choices=RunStatus.choices, default=RunStatus.PENDING, db_default="pending"
    )
    definition_event_id = models.BinaryField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=TransactionNow(), editable=False)
    updated_at = models.DateTimeField(db_default=TransactionNow())

    class Meta:
        db_table = "workflow_runs"
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["community", "id"], name="wd_run_tenant_key"),
            models.UniqueConstraint(
                fields=["community", "workflow", "id"], name="wd_run_tenant_workflow_key"
            ),
            models.CheckConstraint(
                condition=Q(status__in=RunStatus.values), name="wd_run_status_valid"
            ),
            _bytes32("definition_event_id", "wd_run_definition_event_id_32_bytes"),
        ]
        indexes = [models.Index(fields=["community", "workflow"], name="wd_run_workflow_idx")]

    def __str__(self) -> str:
        return str(self.id)


class Event(models.Model):
    """A signed message. ``id`` is its 32-byte event id; references use
    ``(community_id, created_at, id)`` as the original system partitions events by time."""

    id = models.BinaryField(primary_key=True)
    community = _tenant_fk(Community, related_name="events")
    created_at = models.DateTimeField()
    kind = models.IntegerField()
    pubkey = models.BinaryField()
    content = models.TextField(blank=True, default="")
    # A message whose content is a JSON value: that value; ``content`` is then its
    # encoding (the text the event id covers). NULL for text content.
    content_json = models.JSONField(null=True, blank=True)
    tags = models.JSONField(default=list)

    class Meta:
        db_table = "events"
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["community", "created_at", "id"], name="wd_event_tenant_key"
            ),
            _bytes32("id", "wd_event_id_32_bytes"),
            _bytes32("pubkey", "wd_event_pubkey_32_bytes"),
            models.CheckConstraint(condition=Q(kind__gte=0), name="wd_event_kind_nonneg"),
            models.CheckConstraint(
                condition=Q(content_json__isnull=True)
                | Q(content_json=Cast("content", models.JSONField())),
                name="wd_event_content_json_is_content",
            ),
        ]

    def __str__(self) -> str:
        return bytes(self.id).hex()


class DeliveryQuerySet(models.QuerySet):
    """Read queries named for intent; every write goes through ``services``."""

    def pending(self) -> DeliveryQuerySet:
        return self.filter(status=PENDING)

    def claimed(self) -> DeliveryQuerySet:
        return self.filter(status=CLAIMED)

    def terminal(self) -> DeliveryQuerySet:
        return self.filter(status__in=TERMINAL_STATUSES)

    def expired_leases(self) -> DeliveryQuerySet:
        """Claimed rows whose lease has run out by the database clock."""
        return self.filter(status=CLAIMED, lease_until__lt=StatementTimestamp())

    def in_active_communities(self) -> DeliveryQuerySet:
        return self.filter(community__deletion_state=DeletionState.ACTIVE)

    def in_fenced_communities(self) -> DeliveryQuerySet:
        return self.exclude(community__deletion_state=DeletionState.ACTIVE)

    def for_target(self, community_id, target_pubkey: bytes) -> DeliveryQuerySet:
        return self.filter(community_id=community_id, target_pubkey=target_pubkey)

    def claimable(self) -> DeliveryQuerySet:
        """Pending rows a claim may take now: not backed off past the database clock."""
        return self.filter(
            Q(available_at__isnull=True) | Q(available_at__lte=StatementTimestamp()),
            status=PENDING,
        )


class WorkflowAgentDelivery(models.Model):
    """One canonical delivery of a workflow message to one target agent."""

    id = models.UUIDField(primary_key=True, editable=False)
    community = _tenant_fk(Community, related_name="deliveries")
    workflow = _tenant_fk(Workflow, related_name="deliveries")
    run = _tenant_fk(WorkflowRun, related_name="deliveries")
    step_id = models.TextField()
    target_pubkey = models.BinaryField()
    definition_event_id = models.BinaryField()
    message_event = _tenant_fk(Event, related_name="deliveries")
    message_event_created_at = models.DateTimeField()
    cause_kind = models.TextField(choices=[(kind, kind) for kind in CAUSE_KINDS])
    cause_event_id = models.BinaryField(null=True, blank=True)
    cause_scheduled_for = models.DateTimeField(null=True, blank=True)
    cause_webhook_invocation_id = models.UUIDField(null=True, blank=True)
    status = models.TextField(
        choices=[(status, status) for status in STATUSES], default=PENDING, db_default=PENDING
    )
    lease_generation = models.BigIntegerField(default=0, db_default=0)
    attempts = models.IntegerField(default=0, db_default=0, editable=False)
    # ``attempts`` when an operator last retried it (a failed row back to pending): the
    # attempts cap counts the claims since. Set by that retry only (``wd_delivery_retry_guard``).
    attempts_at_retry = models.IntegerField(default=0, db_default=0, editable=False)
    lease_until = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=TransactionNow(), editable=False)
    # When it was last claimed, kept after the lease ends; set by the database at each
    # claim and by nothing else (``wd_delivery_last_claimed_at_by_claims``).
    last_claimed_at = models.DateTimeField(null=True, blank=True, editable=False)
    # A retried delivery's not-before time (pending only); no claim takes it earlier.
    available_at = models.DateTimeField(null=True, blank=True)
    # The last error its holder reported (services.retry_delivery, finish with error).
    last_error_type = models.TextField(null=True, blank=True)  # noqa: DJ001 (none yet)
    last_error_message = models.TextField(null=True, blank=True)  # noqa: DJ001 (none yet)
    last_error_at = models.DateTimeField(null=True, blank=True)

    objects = DeliveryQuerySet.as_manager()

    class Meta:
        db_table = "workflow_agent_deliveries"
        verbose_name = "workflow agent delivery"
        verbose_name_plural = "workflow agent deliveries"
        ordering = ["-created_at", "id"]
        permissions = [
            ("reap_deliveries", "Can reap expired delivery leases"),
            ("release_delivery", "Can release the lease of a claimed delivery"),
            ("fail_delivery", "Can mark a delivery failed (operator terminal)"),
            ("retry_delivery", "Can retry a failed delivery (back to pending, attempts renewed)"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["community", "id"], name="wd_delivery_tenant_key"),
            models.UniqueConstraint(
                fields=["community", "run", "step_id", "target_pubkey"],
                name="wd_delivery_identity_key",
            ),
            models.CheckConstraint(
                condition=GreaterThanOrEqual(Length("step_id"), 1)
                & LessThanOrEqual(Length("step_id"), 64)
                & Q(step_id__regex=r"\S"),
                name="wd_delivery_step_id_valid",
            ),
            _bytes32("target_pubkey", "wd_delivery_target_pubkey_32_bytes"),
            _bytes32("definition_event_id", "wd_delivery_definition_event_id_32_bytes"),
            _bytes32("message_event_id", "wd_delivery_message_event_id_32_bytes"),
            _bytes32("cause_event_id", "wd_delivery_cause_event_id_32_bytes"),
            models.CheckConstraint(
                condition=Q(cause_kind__in=CAUSE_KINDS)
                & (
                    Q(
                        cause_kind=CauseKind.EVENT.value,
                        cause_event_id__isnull=False,
                        cause_scheduled_for__isnull=True,
                        cause_webhook_invocation_id__isnull=True,
                    )
                    | Q(
                        cause_kind=CauseKind.SCHEDULE.value,
                        cause_event_id__isnull=True,
                        cause_scheduled_for__isnull=False,
                        cause_webhook_invocation_id__isnull=True,
                    )
                    | Q(
                        cause_kind=CauseKind.WEBHOOK.value,
                        cause_event_id__isnull=True,
                        cause_scheduled_for__isnull=True,
                        cause_webhook_invocation_id__isnull=False,
                    )
                ),
                name="wd_delivery_cause_exactly_one",
            ),
            models.CheckConstraint(
                condition=Q(status__in=STATUSES), name="wd_delivery_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(lease_generation__gte=0), name="wd_delivery_lease_generation_nonneg"
            ),
            models.CheckConstraint(
                condition=Q(attempts__gte=0), name="wd_delivery_attempts_nonneg"
            ),
            models.CheckConstraint(
                # A negative ``attempts`` is wd_delivery_attempts_nonneg's to name.
                condition=Q(attempts_at_retry__gte=0)
                & (Q(attempts_at_retry__lte=F("attempts")) | Q(attempts__lt=0)),
                name="wd_delivery_attempts_at_retry_range",
            ),
            models.CheckConstraint(
                condition=Q(
                    status=CLAIMED,
                    lease_until__isnull=False,
                    claimed_at__isnull=False,
                )
                | (~Q(status=CLAIMED) & Q(lease_until__isnull=True, claimed_at__isnull=True)),
                name="wd_delivery_lease_iff_claimed",
            ),
            models.CheckConstraint(
                condition=Q(status__in=TERMINAL_STATUSES, finished_at__isnull=False)
                | (~Q(status__in=TERMINAL_STATUSES) & Q(finished_at__isnull=True)),
                name="wd_delivery_finished_at_iff_terminal",
            ),
            models.CheckConstraint(
                condition=Q(available_at__isnull=True) | Q(status=PENDING),
                name="wd_delivery_available_at_only_pending",
            ),
            models.CheckConstraint(
                condition=Q(
                    last_error_type__isnull=True,
                    last_error_message__isnull=True,
                    last_error_at__isnull=True,
                )
                | Q(
                    last_error_type__isnull=False,
                    last_error_message__isnull=False,
                    last_error_at__isnull=False,
                ),
                name="wd_delivery_last_error_complete",
            ),
            _error_type_valid("last_error_type", "wd_delivery_last_error_type_valid"),
            _at_most(
                "last_error_message",
                ERROR_MESSAGE_MAX_LENGTH,
                "wd_delivery_last_error_message_length",
            ),
        ]
        indexes = [
            models.Index(
                fields=["community", "target_pubkey", "created_at"],
                condition=Q(status=PENDING),
                name="wd_delivery_claim_idx",
            ),
            # Per community, so the reaper reads only the expired rows of the communities
            # it reclaims, never the rows parked in a tenant that is not active.
            models.Index(
                fields=["community", "lease_until"],
                condition=Q(status=CLAIMED),
                name="wd_delivery_reap_community_idx",
            ),
            models.Index(
                fields=["community", "message_event_created_at", "message_event"],
                name="wd_delivery_message_idx",
            ),
            # Retention and the per-status counts of terminal rows read this, never the heap.
            models.Index(
                fields=["community", "status", "finished_at"],
                condition=Q(status__in=TERMINAL_STATUSES),
                name="wd_delivery_settled_idx",
            ),
        ]

    def __str__(self) -> str:
        return str(self.id)


class TransitionKind(models.TextChoices):
    COMMITTED = "committed"
    CLAIMED = "claimed"
    FINISHED = "finished"
    FAILED = "failed"
    REAPED = "reaped"
    RELEASED = "released"
    OPERATOR_FAILED = "operator_failed"
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    RETRIED = "retried"
    OPERATOR_RETRIED = "operator_retried"


# The kinds whose entry may carry the holder's error (and a retry always does).
ERROR_KINDS = [
    TransitionKind.RETRIED.value,
    TransitionKind.FAILED.value,
    TransitionKind.ATTEMPTS_EXHAUSTED.value,
]


# The kinds that settle a delivery (the admin overview plots them per minute).
SETTLE_KINDS = [
    TransitionKind.FINISHED.value,
    TransitionKind.FAILED.value,
    TransitionKind.OPERATOR_FAILED.value,
    TransitionKind.ATTEMPTS_EXHAUSTED.value,
]


class DeliveryTransition(models.Model):
    """One stored step of a delivery's timeline: a departure from its usual life (a
    reap, a release, a retry, an operator's or the reaper's settle, a claim such a step
    ends, anything under a named actor). Written only by the database (the triggers
    ``wd_delivery_timeline`` and ``wd_delivery_timeline_commit``), so a raw UPDATE is
    recorded too; deleted with its delivery. The commit, the latest claim and the
    holder's settle are the row's own (``history.delivery_history`` merges them)."""

    id = models.BigAutoField(primary_key=True)
    community = _tenant_fk(Community, related_name="+")
    delivery = _tenant_fk(WorkflowAgentDelivery, related_name="timeline")
    at = models.DateTimeField()
    kind = models.TextField(choices=TransitionKind.choices)
    generation = models.BigIntegerField()
    attempts = models.IntegerField()
    status_before = models.TextField(null=True, blank=True)  # noqa: DJ001 (none before a commit)
    status_after = models.TextField()
    actor = models.TextField()
    # The holder's error, on a retry or a failure it reported.
    error_type = models.TextField(null=True, blank=True)  # noqa: DJ001 (most entries)
    error_message = models.TextField(null=True, blank=True)  # noqa: DJ001 (most entries)
    error_traceback = models.TextField(null=True, blank=True)  # noqa: DJ001 (most entries)
    # Why an operator retried it (an ``operator_retried`` entry always says, no other does).
    reason = models.TextField(null=True, blank=True)  # noqa: DJ001 (most entries)

    class Meta:
        db_table = "workflow_delivery_timeline"
        ordering = ["community_id", "delivery_id", "id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(kind__in=TransitionKind.values), name="wd_timeline_kind_valid"
            ),
            models.CheckConstraint(
                condition=Q(actor__regex=r"\S"), name="wd_timeline_actor_not_blank"
            ),
            models.CheckConstraint(
                condition=Q(error_type__isnull=True, error_message__isnull=True)
                & Q(error_traceback__isnull=True)
                | Q(error_type__isnull=False, error_message__isnull=False),
                name="wd_timeline_error_complete",
            ),
            models.CheckConstraint(
                condition=(Q(error_type__isnull=True) & ~Q(kind=TransitionKind.RETRIED))
                | Q(error_type__isnull=False, kind__in=ERROR_KINDS),
                name="wd_timeline_error_kinds",
            ),
            models.CheckConstraint(
                condition=Q(reason__isnull=True) & ~Q(kind=TransitionKind.OPERATOR_RETRIED)
                | Q(
                    reason__isnull=False, reason__regex=r"\S", kind=TransitionKind.OPERATOR_RETRIED
                ),
                name="wd_timeline_reason_of_retry",
            ),
            _at_most("reason", REASON_MAX_LENGTH, "wd_timeline_reason_length"),
            _error_type_valid("error_type", "wd_timeline_error_type_valid"),
            _at_most("error_message", ERROR_MESSAGE_MAX_LENGTH, "wd_timeline_error_message_length"),
            _at_most(
                "error_traceback", ERROR_TRACEBACK_MAX_LENGTH, "wd_timeline_error_traceback_length"
            ),
        ]
        indexes = [
            models.Index(fields=["community", "delivery", "id"], name="wd_timeline_delivery_idx"),
            models.Index(
                fields=["at"], condition=Q(kind__in=SETTLE_KINDS), name="wd_timeline_settle_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} at {self.at}"


class AgentRequestReplay(models.Model):
    """A signed agent request already accepted: its event id, kept while the event
    could still pass the freshness window, so the same event is served only once,
    in whichever community it reached first and in no other."""

    id = models.BigAutoField(primary_key=True)
    community = _tenant_fk(Community, related_name="+")
    event_id = models.BinaryField()
    event_created_at = models.DateTimeField()
    seen_at = models.DateTimeField(db_default=TransactionNow(), editable=False)

    class Meta:
        db_table = "agent_request_replays"
        constraints = [
            models.UniqueConstraint(fields=["event_id"], name="wd_replay_event_once"),
            _bytes32("event_id", "wd_replay_event_id_32_bytes"),
        ]
        indexes = [models.Index(fields=["event_created_at"], name="wd_replay_prune_idx")]

    def __str__(self) -> str:
        return bytes(self.event_id).hex()


class IdleWakeTarget(models.Model):
    """A (community, target) whose consumer found nothing to claim and now waits for a
    wake-up. The producer's insert notifies only the targets registered here and
    deletes their rows in the same statement: one notification per idle episode. An
    unlogged table (migration 0013): a row is a hint, lost with a crash at no cost.

    ``pid`` and ``backend_start`` name the database session that listens for the
    registration's wake-up (by default the inserting session: migration 0024). A row
    whose session is no longer in ``pg_stat_activity`` was left by a consumer that
    died without taking it back: nobody waits for its wake-up."""

    pk = models.CompositePrimaryKey("community_id", "target_pubkey")
    community = _tenant_fk(Community, related_name="+")
    target_pubkey = models.BinaryField()
    registered_at = models.DateTimeField(db_default=TransactionNow(), editable=False)
    pid = models.IntegerField(editable=False)
    backend_start = models.DateTimeField(editable=False)

    class Meta:
        db_table = "workflow_delivery_idle_wake_targets"
        constraints = [_bytes32("target_pubkey", "wd_idle_wake_target_32_bytes")]

    def __str__(self) -> str:
        return bytes(self.target_pubkey).hex()


class CommunityAgent(models.Model):
    """An agent key of a community's roster. A delivery may be committed only to an
    enabled agent of its community, and the agent API serves only enabled agents
    (migration 0016); ``roster`` enrolls, revokes and reinstates them."""

    id = models.BigAutoField(primary_key=True)
    community = _tenant_fk(Community, related_name="agents")
    pubkey = models.BinaryField()
    label = models.TextField(blank=True, default="", db_default="")
    enabled = models.BooleanField(default=True, db_default=True)
    added_at = models.DateTimeField(db_default=TransactionNow(), editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "community_agents"
        verbose_name = "community agent"
        ordering = ["community_id", "added_at", "id"]
        permissions = [
            ("revoke_agent", "Can revoke an agent of a community roster"),
            ("reinstate_agent", "Can reinstate a revoked agent of a community roster"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["community", "pubkey"], name="wd_agent_key"),
            _bytes32("pubkey", "wd_agent_pubkey_32_bytes"),
            models.CheckConstraint(
                condition=Q(enabled=True, revoked_at__isnull=True)
                | Q(enabled=False, revoked_at__isnull=False),
                name="wd_agent_revoked_at_iff_disabled",
            ),
            _at_most("label", AGENT_LABEL_MAX_LENGTH, "wd_agent_label_length"),
        ]

    def __str__(self) -> str:
        return self.label or bytes(self.pubkey).hex()


# The most tool calls, and permission requests, one stored turn lists.
AGENT_TURN_MAX_ENTRIES = 200
AGENT_TURN_STOP_REASON_MAX_LENGTH = 100


class TurnOutcome(models.TextChoices):
    """What the settle stored with a turn did to its delivery."""

    FINISHED = "finished"
    FAILED = "failed"
    RETRIED = "retried"


def _octet_length(field: str) -> models.Func:
    return models.Func(F(field), function="octet_length", output_field=models.IntegerField())


def _json_list(field: str, name: str) -> models.CheckConstraint:
    """A JSON array of at most ``AGENT_TURN_MAX_ENTRIES`` entries."""
    kind = models.Func(F(field), function="jsonb_typeof", output_field=models.TextField())
    size = models.Func(F(field), function="jsonb_array_length", output_field=models.IntegerField())
    return models.CheckConstraint(
        condition=Exact(kind, "array") & LessThanOrEqual(size, AGENT_TURN_MAX_ENTRIES),
        name=name,
    )


class AgentTurn(models.Model):
    """What an ACP agent said in one turn on a delivery (one attempt), stored by the
    runtime in the transaction of the settle that ended the attempt, only if that
    settle counted: the text it streamed (``agent_message_chunk``; at most the
    setting's bytes, ``said_bytes`` counts all it said), its tool calls and the
    permission requests with the answers the policy gave. One per attempt
    (``wd_agent_turn_once``); deleted with its delivery. Written only when the
    delivery has left the claim of that attempt (``wd_agent_turn_settled``)."""

    id = models.BigAutoField(primary_key=True)
    community = _tenant_fk(Community, related_name="+")
    delivery = _tenant_fk(WorkflowAgentDelivery, related_name="agent_turns")
    attempts = models.IntegerField()
    generation = models.BigIntegerField()
    settled_at = models.DateTimeField(db_default=TransactionNow(), editable=False)
    outcome = models.TextField(choices=TurnOutcome.choices)
    stop_reason = models.TextField(null=True, blank=True)  # noqa: DJ001 (a turn that died has none)
    text = models.TextField(blank=True, default="")
    said_bytes = models.IntegerField()
    tool_calls = models.JSONField(default=list)
    permissions = models.JSONField(default=list)

    class Meta:
        db_table = "workflow_delivery_agent_turns"
        ordering = ["community_id", "delivery_id", "attempts"]
        constraints = [
            models.UniqueConstraint(
                fields=["community", "delivery", "attempts"], name="wd_agent_turn_once"
            ),
            models.CheckConstraint(
                condition=Q(outcome__in=TurnOutcome.values), name="wd_agent_turn_outcome_valid"
            ),
            models.CheckConstraint(
                condition=Q(attempts__gte=1, generation__gte=1), name="wd_agent_turn_claimed"
            ),
            models.CheckConstraint(
                condition=LessThanOrEqual(_octet_length("text"), AGENT_TURN_TEXT_MAX_BYTES),
                name="wd_agent_turn_text_bytes",
            ),
            models.CheckConstraint(
                condition=GreaterThanOrEqual(F("said_bytes"), _octet_length("text")),
                name="wd_agent_turn_said_covers_text",
            ),
            _at_most(
                "stop_reason", AGENT_TURN_STOP_REASON_MAX_LENGTH, "wd_agent_turn_stop_reason_length"
            ),
            _json_list("tool_calls", "wd_agent_turn_tool_calls_list"),
            _json_list("permissions", "wd_agent_turn_permissions_list"),
        ]

    def __str__(self) -> str:
        return f"turn of attempt {self.attempts}: {self.outcome}"

    @property
    def truncated(self) -> bool:
        """The text was cut at the bound: the agent said more than is kept."""
        return self.said_bytes > len(self.text.encode())
