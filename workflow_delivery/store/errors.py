"""A database error translated into the named fact it stands for, by the error
classification of ``workflow_delivery.errors``:

* *timeout*: ``lock_timeout`` (55P03) or ``statement_timeout`` / a cancel (57014):
  the statement was cancelled and the session is fine (``DeliveryTimeout``).
* a constraint or trigger of the app (``wd_…``): its named fact.
* anything else (a lost session included) is not ours to translate: it is re-raised
  as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from uuid import UUID

from django.db import Error as DatabaseError

from ..counters import FENCE_REFUSALS
from ..errors import TIMEOUT_STATES, sqlstate
from ..exceptions import (
    CommunityNotFound,
    CommunityWriteFenced,
    ConstraintViolation,
    DeliveryConflict,
    DeliveryTimeout,
    InvalidLifecycleTransition,
    IsolationLevelError,
    ReferenceMissing,
    StepMessageConflict,
    TargetNotEnrolled,
)
from ..models import WorkflowAgentDelivery

# What the agent API's served statements raise to refuse a request (migration 0018).
REQUEST_REFUSED = "wd_request_refused"

_REFERENCE_CONSTRAINTS = {
    # (No key of its own for the community or the workflow: the run's key holds
    # both, migration 0009.)
    "wd_delivery_run_fk": "run (of that workflow)",
    "wd_delivery_message_event_fk": "message event (at that created_at)",
}
_LIFECYCLE_CONSTRAINTS = {"wd_community_lifecycle_forward", "wd_community_tombstone_permanent"}
_DELIVERY_PRIMARY_KEY = f"{WorkflowAgentDelivery._meta.db_table}_pkey"

_FENCED_COMMUNITY = re.compile(r"community_id=(\S+)")
_NOT_ENROLLED = re.compile(r"community_id=(\S+) unknown=(\S*) revoked=(\S*)")


def _not_enrolled(message: str, detail: str | None) -> TargetNotEnrolled:
    found = _NOT_ENROLLED.fullmatch(detail or "")
    if found is None:
        return TargetNotEnrolled(message)
    community, unknown, revoked = found.groups()
    return TargetNotEnrolled(
        message,
        UUID(community),
        tuple(unknown.split(",")) if unknown else (),
        tuple(revoked.split(",")) if revoked else (),
    )


def domain_error(exc: DatabaseError) -> Exception | None:
    """The named fact a Django database error ``exc`` stands for, or None when it is
    not ours to classify (a lost connection included)."""
    diag = getattr(exc.__cause__, "diag", None)
    constraint = getattr(diag, "constraint_name", None)
    state = sqlstate(exc)
    message = getattr(diag, "message_primary", None) or str(exc)
    if state in TIMEOUT_STATES:
        return DeliveryTimeout(f"{message} (SQLSTATE {state})", state)
    if constraint == "wd_community_write_fence":
        FENCE_REFUSALS.inc()
        found = _FENCED_COMMUNITY.search(getattr(diag, "message_detail", None) or "")
        return CommunityWriteFenced(message, UUID(found.group(1)) if found else None)
    if constraint == "wd_delivery_target_enrolled":
        return _not_enrolled(message, getattr(diag, "message_detail", None))
    if constraint == "wd_agent_community_fk":
        return CommunityNotFound(f"the roster's community does not exist: {message}")
    if constraint == "wd_delivery_one_message_per_step":
        return StepMessageConflict("message_event_id", message)
    if constraint in _LIFECYCLE_CONSTRAINTS:
        return InvalidLifecycleTransition(message)
    if constraint == _DELIVERY_PRIMARY_KEY:
        return DeliveryConflict(
            f"a delivery with this id already exists for another step or target: {message}"
        )
    if constraint in _REFERENCE_CONSTRAINTS:
        return ReferenceMissing(
            constraint,
            f"the {_REFERENCE_CONSTRAINTS[constraint]} named by the delivery does not exist "
            f"in its community ({constraint})",
        )
    if constraint and constraint.startswith("wd_"):
        return ConstraintViolation(constraint, f"{constraint}: {message}")
    if state == "25000" and "READ COMMITTED" in message:
        return IsolationLevelError(message)
    return None


def raise_domain_error(exc: BaseException) -> None:
    """Raise the named fact of a Django database error ``exc`` from it; return when
    there is none, so the caller re-raises ``exc``."""
    if isinstance(exc, DatabaseError):
        error = domain_error(exc)
        if error is not None:
            raise error from exc


@contextmanager
def database_errors() -> Iterator[None]:
    """Turn a Django database error raised inside the block into its named fact
    (``domain_error``); anything unrecognised is re-raised as it is."""
    try:
        yield
    except DatabaseError as exc:
        raise_domain_error(exc)
        raise
