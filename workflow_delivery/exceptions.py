"""Named facts. Expected outcomes (a miss, a lost lease) are values, not exceptions.

No Django import: the agent's client raises these too and runs without Django. The
one error that is Django's kind, ``WorkflowDeliveryConfigurationError`` (an
``ImproperlyConfigured``), lives with the settings in ``conf`` and is found here by
name on first use.
"""

from __future__ import annotations

from uuid import UUID


class WorkflowDeliveryError(Exception):
    """Base of every error this app raises; never raised directly."""


class ProtocolError(WorkflowDeliveryError, ValueError):
    """Invalid protocol input; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class MessageTooLarge(ProtocolError):
    """A message over one of its bounds: ``setting`` names the
    ``WORKFLOW_DELIVERY_*`` setting, ``limit`` its value, ``size`` what was given."""

    def __init__(self, field: str, setting: str, limit: int, size: int, unit: str) -> None:
        self.setting, self.limit, self.size = setting, limit, size
        super().__init__(field, f"{size} {unit}, over the limit of {limit} ({setting})")


class InvalidLeaseSeconds(ProtocolError):
    """A lease length that is not a positive whole number within the configured maximum."""


class BindingScopeError(ProtocolError):
    """A delivery handed to a commit that does not belong to the committing scope."""


class DeliveryConflict(WorkflowDeliveryError, ValueError):
    """A delivery id already used by another delivery."""


class ReferenceMissing(WorkflowDeliveryError, ValueError):
    """A delivery names a workflow, run or message event that does not exist in its community."""

    def __init__(self, constraint: str, message: str) -> None:
        self.constraint = constraint
        super().__init__(message)


class TargetNotEnrolled(WorkflowDeliveryError, ValueError):
    """A delivery committed to a target that is not an enabled agent of its community's
    roster: ``unknown`` were never enrolled, ``revoked`` were revoked (hex pubkeys).
    Nothing of the statement was written."""

    def __init__(
        self,
        message: str,
        community_id: UUID | None = None,
        unknown: tuple[str, ...] = (),
        revoked: tuple[str, ...] = (),
    ) -> None:
        self.community_id = community_id
        self.unknown = unknown
        self.revoked = revoked
        super().__init__(message)

    @property
    def targets(self) -> tuple[str, ...]:
        return self.unknown + self.revoked


class AgentNotEnrolled(WorkflowDeliveryError, LookupError):
    """The key named is not in the community's agent roster."""


class ConstraintViolation(WorkflowDeliveryError, ValueError):
    """A row broke a named database rule; ``constraint`` is its name."""

    def __init__(self, constraint: str, message: str) -> None:
        self.constraint = constraint
        super().__init__(message)


class CommunityWriteFenced(WorkflowDeliveryError):
    """A write to a community that is not active was refused by the write fence."""

    def __init__(self, message: str, community_id: UUID | None = None) -> None:
        self.community_id = community_id
        super().__init__(message)


class StepMessageConflict(ProtocolError):
    """A commit whose message event differs from the one the step's deliveries carry."""


class IdempotencyConflict(ProtocolError):
    """An idempotency key already used for another message (other content, targets,
    kind, tags, sender or run): a retry must send what the first call sent."""


class StepIdentityClosed(WorkflowDeliveryError, RuntimeError):
    """``StepIdentity.commit`` called after its ``delivery_identity`` block closed."""


class DeliveryTimeout(WorkflowDeliveryError):
    """A statement cancelled by ``lock_timeout`` (55P03) or ``statement_timeout``
    (57014). The session is intact; the caller decides whether to retry. Never a lost
    connection: ``sqlstate`` says which it was."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


class CommunityNotFound(WorkflowDeliveryError, LookupError):
    """The named community does not exist."""


class InvalidLifecycleTransition(WorkflowDeliveryError, ValueError):
    """A community lifecycle move that the rules forbid (a tombstone is permanent)."""


class UnexpectedCommunityState(InvalidLifecycleTransition):
    """The community is not in the state the caller read (someone moved it since)."""


class StaleFenceGeneration(WorkflowDeliveryError):
    """The executor presented a fence generation that is no longer current."""


class PurgeDeadlocked(WorkflowDeliveryError):
    """A purge chosen as a deadlock's victim on every one of its tries (each time by a
    writer outside the app that locked a tenant row before the fence's lock); nothing
    was deleted."""


class ExecutorNotAuthorized(WorkflowDeliveryError, PermissionError):
    """The connection's role may not act as the deletion executor: it lacks EXECUTE on
    ``wd_present_executor`` (the migrating role and the roles granted it have it)."""


class IsolationLevelError(WorkflowDeliveryError):
    """A fenced operation ran outside READ COMMITTED isolation."""


class LeaseNotLive(WorkflowDeliveryError):
    """``holding()`` refused: the lease is not live (expired, reaped, released,
    superseded or settled), so nothing written in the block commits.

    Not ``protocol.LeaseLost``, the result value renew, finish and retry return."""

    def __init__(self, lease: object, message: str | None = None) -> None:
        self.lease = lease
        delivery = getattr(lease, "delivery_id", None)
        generation = getattr(lease, "generation", None)
        super().__init__(
            message or f"the lease on delivery {delivery} (generation {generation}) is not live"
        )


class AgentAuthRefused(WorkflowDeliveryError):
    """A signed agent request (NIP-98) that the API refuses; ``code`` is stable."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


class CommunityNotServed(WorkflowDeliveryError, LookupError):
    """A signed agent request names a host that no community is served at."""

    def __init__(self, host: str) -> None:
        self.host = host
        super().__init__(f"no community is served at host {host!r}")


class CommunityDeleting(WorkflowDeliveryError):
    """A signed agent request for a community whose deletion is in progress: nothing of
    it is recorded; it may be sent again later."""

    def __init__(self, community_id: UUID | None = None) -> None:
        self.community_id = community_id
        super().__init__("the community is being deleted; try again later")


class AgentApiError(WorkflowDeliveryError):
    """An answer of the agent API that is not a result: ``status``, stable ``code``, ``detail``."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        self.status = status
        self.code = code
        self.detail = detail
        super().__init__(f"{status} {code}: {detail}")


def __getattr__(name: str) -> type[Exception]:
    if name == "WorkflowDeliveryConfigurationError":
        from .conf import WorkflowDeliveryConfigurationError

        return WorkflowDeliveryConfigurationError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
