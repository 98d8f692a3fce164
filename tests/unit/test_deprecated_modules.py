"""The old ``fence`` and ``roster`` modules stay importable: each name they hand out
is the ``services`` one, with a DeprecationWarning naming it."""

from __future__ import annotations

import importlib

import pytest

from workflow_delivery import services


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("fence", "transition_community"),
        ("fence", "purge_community"),
        ("fence", "PURGE_ATTEMPTS"),
        ("roster", "enroll_agents"),
        ("roster", "revoke_agent"),
    ],
)
def test_the_old_fence_and_roster_modules_hand_out_the_services_names_with_a_warning(module, name):
    old = importlib.import_module(f"workflow_delivery.{module}")
    with pytest.warns(
        DeprecationWarning,
        match=f"workflow_delivery.{module}.{name} is deprecated; "
        f"use workflow_delivery.services.{name}",
    ):
        found = getattr(old, name)
    assert found is getattr(services, name)


def test_the_old_roster_module_has_only_the_public_names():
    from workflow_delivery import roster

    with pytest.raises(AttributeError, match="operator_name"):
        roster.operator_name  # noqa: B018
