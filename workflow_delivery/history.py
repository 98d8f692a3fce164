"""A delivery's history: its stored timeline entries merged with the ones its row implies.

The timeline table stores what the row cannot say (migration 0017). A delivery's
commit, its latest claim and its holder's settle are implied by the row while no
entry records them: the commit by ``created_at`` (pending, generation 0, by the
producer), the claim by ``last_claimed_at``, ``attempts`` and ``lease_generation``
(by the holder), the settle by ``finished_at`` and the terminal status (by the
holder, carrying no error). Stored entries come first in their own order, between
the commit and the claim: every departure writes the claim it ends before itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from .models import TERMINAL_STATUSES, DeliveryTransition, TransitionKind, WorkflowAgentDelivery

CLAIMED = "claimed"
OPERATOR_RETRIED = TransitionKind.OPERATOR_RETRIED.value


@dataclass(frozen=True)
class HistoryEntry:
    """One step of a delivery's history; ``stored`` tells a timeline row from one the
    delivery's own columns imply."""

    at: datetime
    kind: str
    status_before: str | None
    status_after: str
    generation: int
    attempts: int
    actor: str
    error_type: str | None = None
    error_message: str | None = None
    error_traceback: str | None = None
    stored: bool = True
    reason: str | None = None


def _entry(row: DeliveryTransition) -> HistoryEntry:
    return HistoryEntry(
        at=row.at,
        kind=row.kind,
        status_before=row.status_before,
        status_after=row.status_after,
        generation=row.generation,
        attempts=row.attempts,
        actor=row.actor,
        error_type=row.error_type,
        error_message=row.error_message,
        error_traceback=row.error_traceback,
        reason=row.reason,
    )


def merge(
    delivery: WorkflowAgentDelivery, rows: Iterable[DeliveryTransition]
) -> list[HistoryEntry]:
    """The history of ``delivery`` from its stored entries ``rows`` (oldest first)."""
    stored = [_entry(row) for row in rows]
    history: list[HistoryEntry] = []
    if not any(entry.status_before is None for entry in stored):
        history.append(
            HistoryEntry(
                at=delivery.created_at,
                kind=TransitionKind.COMMITTED.value,
                status_before=None,
                status_after="pending",
                generation=0,
                attempts=0,
                actor="producer",
                stored=False,
            )
        )
    history += stored
    terminal = delivery.status in TERMINAL_STATUSES
    # A settle before an operator's retry is not the row's current one.
    retried = [n for n, entry in enumerate(stored) if entry.kind == OPERATOR_RETRIED]
    current = stored[retried[-1] + 1 :] if retried else stored
    settle_stored = terminal and any(entry.status_after == delivery.status for entry in current)
    claim_stored = any(
        entry.status_after == CLAIMED and entry.attempts == delivery.attempts for entry in stored
    )
    live_or_settled = delivery.status == CLAIMED or (terminal and not settle_stored)
    if (
        live_or_settled
        and not claim_stored
        and delivery.attempts > 0
        and delivery.last_claimed_at is not None
    ):
        history.append(
            HistoryEntry(
                at=delivery.last_claimed_at,
                kind=TransitionKind.CLAIMED.value,
                status_before="pending",
                status_after=CLAIMED,
                generation=delivery.lease_generation,
                attempts=delivery.attempts,
                actor="holder",
                stored=False,
            )
        )
    if terminal and not settle_stored and delivery.finished_at is not None:
        history.append(
            HistoryEntry(
                at=delivery.finished_at,
                kind=delivery.status,
                status_before=CLAIMED,
                status_after=delivery.status,
                generation=delivery.lease_generation,
                attempts=delivery.attempts,
                actor="holder",
                stored=False,
            )
        )
    return history


def delivery_history(
    delivery: WorkflowAgentDelivery, *, using: str | None = None
) -> list[HistoryEntry]:
    """The history the admin shows for ``delivery``, oldest first."""
    rows = DeliveryTransition.objects.using(using or delivery._state.db or "default").filter(
        community_id=delivery.community_id, delivery_id=delivery.id
    )
    return merge(delivery, rows.order_by("id"))


def unrecorded_attempts(history: list[HistoryEntry], delivery: WorkflowAgentDelivery) -> int:
    """Claims the delivery counts that its history does not show (made while the
    timeline was off for their departure)."""
    shown = {entry.attempts for entry in history if entry.status_after == CLAIMED}
    return max(0, delivery.attempts - len(shown - {0}))
