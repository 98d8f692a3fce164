"""The services package: one module per audience, behind the names callers import from
``workflow_delivery.services``."""

from __future__ import annotations

import importlib
import inspect

from workflow_delivery import services
from workflow_delivery.services import sending

AUDIENCES = [
    "producer",
    "holder",
    "admitted",
    "maintenance",
    "operator",
    "replay",
    "replies",
    "communities",
    "fence",
    "roster",
]


def audience_modules():
    return [importlib.import_module(f"{services.__name__}.{name}") for name in AUDIENCES]


def test_a_star_import_gives_exactly_the_public_names():
    namespace: dict[str, object] = {}
    exec(f"from {services.__name__} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(services.__all__)


def test_each_public_name_is_its_audience_modules_own_object():
    # A re-export, never a wrapper: a caller of services.claim_delivery runs the
    # holder's function itself.
    homes = {}
    for module in audience_modules():
        assert module.__doc__, f"{module.__name__} says what it is for"
        for name, value in vars(module).items():
            public = not name.startswith("_") and (
                inspect.isfunction(value) or inspect.isclass(value)
            )
            if public and value.__module__ == module.__name__:
                assert name not in homes, f"{name} is defined in {homes.get(name)} and {module}"
                homes[name] = module
    assert set(homes) == set(services.__all__) - {
        "MAX_BATCH_SIZE",
        "PURGE_ATTEMPTS",
        "send_message",
    }
    for name, module in homes.items():
        assert getattr(services, name) is getattr(module, name)
    assert services.MAX_BATCH_SIZE is services.holder.MAX_BATCH_SIZE
    assert services.PURGE_ATTEMPTS is services.fence.PURGE_ATTEMPTS
    assert services.send_message is sending.send_message
