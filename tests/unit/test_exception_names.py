"""The names ``workflow_delivery.exceptions`` answers: its own classes and the
configuration error it finds in ``conf``, each without a warning; a retired or unknown
name is an AttributeError (and an ImportError to ``from … import``)."""

from __future__ import annotations

import pytest

from workflow_delivery import conf, exceptions


def test_the_current_names_import_without_a_warning(recwarn):
    from workflow_delivery.exceptions import LeaseNotLive, WorkflowDeliveryConfigurationError

    assert LeaseNotLive.__name__ == "LeaseNotLive"
    assert WorkflowDeliveryConfigurationError is conf.WorkflowDeliveryConfigurationError
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_the_retired_lease_lost_error_is_gone():
    with pytest.raises(AttributeError, match="LeaseLostError"):
        exceptions.LeaseLostError  # noqa: B018
    with pytest.raises(ImportError, match="LeaseLostError"):
        from workflow_delivery.exceptions import LeaseLostError  # noqa: F401


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchError"):
        exceptions.NoSuchError  # noqa: B018
