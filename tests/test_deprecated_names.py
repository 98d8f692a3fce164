"""Old public names stay importable, each with a DeprecationWarning naming its successor."""

from __future__ import annotations

import importlib

import pytest

from workflow_delivery import exceptions, services


def test_lease_lost_error_is_the_lease_not_live_exception_with_a_warning():
    with pytest.warns(DeprecationWarning, match="LeaseLostError is deprecated; use LeaseNotLive"):
        from workflow_delivery.exceptions import LeaseLostError
    assert LeaseLostError is exceptions.LeaseNotLive


def test_catching_the_old_name_catches_what_holding_raises():
    with pytest.warns(DeprecationWarning):
        old = exceptions.LeaseLostError
    with pytest.raises(old):
        raise exceptions.LeaseNotLive(object())


def test_the_current_names_import_without_a_warning(recwarn):
    from workflow_delivery.exceptions import LeaseNotLive, WorkflowDeliveryConfigurationError

    assert LeaseNotLive.__name__ == "LeaseNotLive"
    assert WorkflowDeliveryConfigurationError.__name__ == "WorkflowDeliveryConfigurationError"
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchError"):
        exceptions.NoSuchError  # noqa: B018


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
