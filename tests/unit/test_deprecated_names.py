"""Old public names stay importable, each with a DeprecationWarning naming its successor."""

from __future__ import annotations

import pytest

from workflow_delivery import exceptions


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
