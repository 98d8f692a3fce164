"""The reference pages name everything the code has: every setting, exception, system
check, command option, record field and API path. A name added to the code without a
line in docs/reference fails here."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest
from django.core.management import load_command_class

from workflow_delivery import checks, conf, exceptions
from workflow_delivery.consumer import PermanentFailure
from workflow_delivery.protocol import DeliveryRecord

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"
COMMANDS = sorted(
    path.stem
    for path in (Path(conf.__file__).parent / "management" / "commands").glob("*.py")
    if not path.stem.startswith("_")
)


def page(name: str) -> str:
    return (REFERENCE / name).read_text()


def test_every_setting_is_in_the_settings_reference():
    text = page("settings.md")
    missing = [name for name in conf.DEFAULTS if f"`WORKFLOW_DELIVERY_{name}`" not in text]
    assert not missing


def test_every_exception_is_in_the_errors_reference():
    text = page("errors.md")
    raised = [
        value
        for value in vars(exceptions).values()
        if inspect.isclass(value)
        and issubclass(value, Exception)
        and value.__module__ == exceptions.__name__
    ]
    assert raised
    missing = [cls.__name__ for cls in raised if f"| `{cls.__name__}` |" not in text]
    assert not missing
    assert f"`consumer.{PermanentFailure.__name__}`" in text


def test_every_system_check_is_in_the_errors_reference():
    text = page("errors.md")
    ids = sorted(
        name.removesuffix("_MSG") for name in vars(checks) if re.fullmatch(r"E\d{3}_MSG", name)
    )
    assert ids
    missing = [check for check in ids if f"`workflow_delivery.{check}`" not in text]
    assert not missing


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_and_option_is_in_the_commands_reference(name):
    text = page("commands.md")
    assert f"## `{name}`" in text
    section = text.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
    parser = load_command_class("workflow_delivery", name).create_parser("manage.py", name)
    defaults = {"--help", "--version", "--verbosity", "--settings", "--pythonpath"}
    defaults |= {"--traceback", "--no-color", "--force-color", "--skip-checks"}
    options = {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option not in defaults
    }
    missing = sorted(option for option in options if f"`{option}" not in section)
    assert not missing


def test_every_record_field_is_in_the_delivery_record_reference():
    text = page("delivery-record.md")
    missing = [f.name for f in fields(DeliveryRecord) if f"| `{f.name}`" not in text]
    # Two fields share one row.
    missing = [name for name in missing if f"`{name}`" not in text]
    assert not missing


def test_every_api_path_is_in_the_http_api_reference():
    from workflow_delivery.api.views import api

    text = page("http-api.md")
    paths = api.get_openapi_schema(path_prefix="")["paths"]
    assert paths
    for path, item in paths.items():
        written = re.sub(r"\{(\w+)\}", "<id>", path.lstrip("/"))
        for method in item:
            assert f"`{method.upper()} {written}" in text, (method, path)
