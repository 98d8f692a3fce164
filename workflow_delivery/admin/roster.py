"""The agent roster's admin: an operator revokes and reinstates keys, each action
behind its own permission."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from .. import services
from ..exceptions import AgentNotEnrolled, CommunityWriteFenced
from ..models import CommunityAgent
from .shared import (
    ReadOnlyAdmin,
    community_link,
    hex_field,
    log_operator_change,
    operator_permission,
    time_field,
)


@admin.register(CommunityAgent)
class CommunityAgentAdmin(ReadOnlyAdmin):
    """A community's agent roster. Keys are enrolled by ``services.enroll_agents`` (or
    ``manage.py enroll_agent``); here an operator revokes and reinstates them, each
    action behind its own permission. Revoking releases the key's leases."""

    list_display = [
        hex_field("pubkey", short=True),
        "label",
        community_link,
        "enabled",
        time_field("added_at", short=True),
        time_field("revoked_at", short=True),
    ]
    list_filter = ["enabled", "community"]
    list_select_related = ["community"]
    search_fields = ["label"]
    hex_search_fields = ("pubkey",)
    search_help_text = (
        "An agent key (64 hex, or its first 12 hex as the list shows it), or a label."
    )
    fields = [
        hex_field("pubkey"),
        "label",
        community_link,
        "enabled",
        time_field("added_at"),
        time_field("revoked_at"),
    ]
    actions = ["revoke_agents", "reinstate_agents"]

    @admin.action(permissions=["revoke_agent"], description="Revoke (and release its leases)")
    def revoke_agents(self, request: HttpRequest, queryset: QuerySet) -> None:
        operator = request.user.get_username()
        done, released = [], 0
        considered = list(queryset.filter(enabled=True))
        for agent in considered:
            try:
                revocation = services.revoke_agent(
                    agent.community_id, bytes(agent.pubkey), operator=operator
                )
            except (AgentNotEnrolled, CommunityWriteFenced):
                continue  # removed by a purge, or its community is being deleted
            done.append(agent)
            released += len(revocation.released)
        if done:
            log_operator_change(
                request,
                CommunityAgent,
                done,
                f"Revoked by an operator; {released} leases released",
            )
        skipped = {"already revoked": queryset.count() - len(considered)}
        skipped["community not active"] = len(considered) - len(done)
        self._report(request, "Revoke", len(done), queryset.count(), skipped)

    @admin.action(permissions=["reinstate_agent"], description="Reinstate")
    def reinstate_agents(self, request: HttpRequest, queryset: QuerySet) -> None:
        done = []
        considered = list(queryset.filter(enabled=False))
        for agent in considered:
            try:
                services.reinstate_agent(agent.community_id, bytes(agent.pubkey))
            except (AgentNotEnrolled, CommunityWriteFenced):
                continue
            done.append(agent)
        if done:
            log_operator_change(request, CommunityAgent, done, "Reinstated by an operator")
        skipped = {"enabled": queryset.count() - len(considered)}
        skipped["community not active"] = len(considered) - len(done)
        self._report(request, "Reinstate", len(done), queryset.count(), skipped)

    has_revoke_agent_permission = operator_permission("revoke_agent")
    has_reinstate_agent_permission = operator_permission("reinstate_agent")
