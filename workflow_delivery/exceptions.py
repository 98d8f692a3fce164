"""Named facts. Expected outcomes (a miss, a lost lease) are values, not exceptions."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class WorkflowDeliveryError(Exception):
    """Base of every error this app raises; never raised directly."""


class ProtocolError(WorkflowDeliveryError, ValueError):
    """Invalid protocol input; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


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


class ConstraintViolation(WorkflowDeliveryError, ValueError):
    """A row broke a named database rule; ``constraint`` is its name."""

    def __init__(self, constraint: str, message: str) -> None:
        self.constraint = constraint
        super().__init__(message)


class CommunityWriteFenced(WorkflowDeliveryError):
    """A write to a community that is not active was refused by the write fence."""

    def __init__(self, message: str, community_id: str | None = None) -> None:
        self.community_id = community_id
        super().__init__(message)


class CommunityNotFound(WorkflowDeliveryError, LookupError):
    """The named community does not exist."""


class InvalidLifecycleTransition(WorkflowDeliveryError, ValueError):
    """A community lifecycle move that the rules forbid (a tombstone is permanent)."""


class StaleFenceGeneration(WorkflowDeliveryError):
    """The executor presented a fence generation that is no longer current."""


class IsolationLevelError(WorkflowDeliveryError):
    """A fenced operation ran outside READ COMMITTED isolation."""


class AgentAuthRefused(WorkflowDeliveryError):
    """A signed agent request (NIP-98) that the API refuses; ``code`` is stable."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


class AgentApiError(WorkflowDeliveryError):
    """An answer of the agent API that is not a result: ``status``, stable ``code``, ``detail``."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        self.status = status
        self.code = code
        self.detail = detail
        super().__init__(f"{status} {code}: {detail}")


class WorkflowDeliveryConfigurationError(ImproperlyConfigured):
    """A WORKFLOW_DELIVERY_* setting is unusable."""
