"""Creating a community: the first step of its lifecycle (``services.fence`` takes the rest)."""

from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS, IntegrityError, transaction
from django.db.models.functions import Lower

from ..models import Community
from ..protocol import CommunityCreated
from ..validation import as_host


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
