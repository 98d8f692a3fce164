"""Creating a community: the first step of its lifecycle (``services.fence`` takes the rest)."""

from __future__ import annotations

import re

from django.db import DEFAULT_DB_ALIAS, IntegrityError, transaction
from django.db.models.functions import Lower

from ..exceptions import ProtocolError
from ..models import Community
from ..protocol import CommunityCreated

# A host as a Host header names it, without its port: DNS labels of letters, digits
# and inner hyphens, joined by dots.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
MAX_HOST_LENGTH = 253


def as_host(value: object) -> str:
    """A community host, lower-cased (the API matches hosts in any case)."""
    if not isinstance(value, str):
        raise ProtocolError("host", f"must be a string, not {type(value).__name__}")
    host = value.lower()
    if not (0 < len(host) <= MAX_HOST_LENGTH and _HOST.fullmatch(host)):
        raise ProtocolError(
            "host",
            f"{value[:80]!r} is not a host name (dot-separated labels of letters, digits "
            f"and inner hyphens, at most {MAX_HOST_LENGTH} characters, no port)",
        )
    return host


def create_community(host: str, *, using: str = DEFAULT_DB_ALIAS) -> CommunityCreated:
    """Create an active community for ``host``, or report the one that has it already
    (``created`` False, whatever its state): running it twice creates one."""
    host = as_host(host)
    try:
        # A savepoint of its own: a caller's transaction survives the duplicate.
        with transaction.atomic(using=using):
            community = Community.objects.using(using).create(host=host)
    except IntegrityError:
        # The case-insensitive unique index (wd_community_host_ci_key) says another
        # row has the host; anything else is re-raised.
        existing = (
            Community.objects.using(using)
            .annotate(lower_host=Lower("host"))
            .filter(lower_host=host)
            .values_list("id", "host", "deletion_state")
            .first()
        )
        if existing is None:
            raise
        return CommunityCreated(*existing, created=False)
    community.refresh_from_db(using=using, fields=["deletion_state"])
    return CommunityCreated(community.id, community.host, community.deletion_state, True)
