"""The alerting rules shipped in the docs are rules Prometheus can load, and every
metric they name is one the app exposes (read from a real scrape)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.support import factories
from workflow_delivery.metrics import exposition

RULES = Path(__file__).resolve().parents[2] / "docs" / "howto" / "alert-rules.yml"
METRIC = re.compile(r"\bworkflow_delivery_[a-z_]+\b")


def rules() -> list[dict]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_the_file_has_the_shape_of_prometheus_alerting_rules():
    document = yaml.safe_load(RULES.read_text())
    assert set(document) == {"groups"}
    for group in document["groups"]:
        assert set(group) == {"name", "rules"} and group["rules"]
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert "for" not in rule or re.fullmatch(r"\d+[smh]", rule["for"])
        assert set(rule["annotations"]) <= {"summary", "description"}


@pytest.mark.django_db
def test_every_metric_a_rule_names_is_exposed():
    factories.committed(factories.Step(targets=1))  # a community with figures
    scraped = exposition().decode()
    exposed = set(re.findall(r"^# TYPE (\S+) ", scraped, re.M))
    # A counter's samples carry _total (and _created) after its family's name.
    exposed |= {f"{name}_total" for name in exposed}
    named = {name for rule in rules() for name in METRIC.findall(rule["expr"])}
    assert named, "the rules name no metric"
    assert named <= exposed, sorted(named - exposed)
