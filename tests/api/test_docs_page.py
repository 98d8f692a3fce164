"""The agent API's reference page (``v1/docs``): rendered on the server from the same
OpenAPI document ``v1/openapi.json`` serves, escaped, with no script."""

from __future__ import annotations

import html
import json
import re

import pytest
from django.test import Client

from workflow_delivery.api import docs_view

DOCS = "/agents/v1/docs"
OPENAPI = "/agents/v1/openapi.json"


@pytest.fixture
def pages(client: Client) -> tuple[str, dict]:
    page = client.get(DOCS)
    assert page.status_code == 200
    assert page["Content-Type"].startswith("text/html")
    return page.content.decode(), json.loads(client.get(OPENAPI).content)


def test_the_page_lists_every_operation_of_the_openapi_document(pages):
    text, openapi = pages
    assert openapi["paths"], "the document has no paths"
    for path, item in openapi["paths"].items():
        for method in item:
            assert (
                f'<span class="method">{method.upper()}</span> <span class="path">{path}</span>'
                in text
            )
            assert html.escape(item[method]["summary"]) in text


def test_the_page_shows_every_document_and_field(pages):
    text, openapi = pages
    for name, schema in openapi["components"]["schemas"].items():
        assert f'<section id="{name}">' in text
        for field in schema.get("properties", {}):
            assert f"<td><code>{field}</code></td>" in text


def test_each_answer_status_of_an_operation_is_shown(pages):
    text, openapi = pages
    claim = openapi["paths"]["/agents/v1/claim"]["post"]
    section = text.split('id="workflow_delivery_api_views_claim"', 1)[1].split("</section>", 1)[0]
    for status in claim["responses"]:
        assert f"<td>{status}</td>" in section


def test_text_from_the_document_is_escaped(pages):
    text, openapi = pages
    # The API's description names the header as ``Nostr <base64 NIP-98 event>``.
    assert "<base64" in openapi["info"]["description"]
    assert "&lt;base64 NIP-98 event&gt;" in text
    assert "<base64" not in text


def test_markup_in_a_schema_cannot_reach_the_page(rf):
    hostile = {
        "info": {"title": "<script>alert(1)</script>", "version": "1", "description": ""},
        "paths": {"/x": {"get": {"summary": "<img src=x onerror=alert(1)>", "responses": {}}}},
        "components": {"schemas": {"Doc": {"properties": {"a": {"description": "<b>"}}}}},
    }
    response = docs_view.render(
        rf.get(DOCS), "workflow_delivery/api_docs.html", docs_view.page_context(hostile)
    )
    text = response.content.decode()
    assert "<script>alert" not in text and "&lt;script&gt;" in text
    assert "<img" not in text and "<b>" not in text


def test_the_page_needs_no_script_and_loads_nothing_from_elsewhere(pages):
    text, _ = pages
    assert "<script" not in text
    assert not re.search(r'(src|href)="(https?:)?//', text)


def test_only_safe_methods_are_served(client: Client):
    assert client.post(DOCS).status_code == 405


def test_type_names_follow_references_and_unions():
    assert docs_view.type_name(
        {"anyOf": [{"$ref": "#/components/schemas/A"}, {"type": "null"}]}
    ) == (docs_view.TypeName("A or null", ("A",)))
    assert docs_view.type_name({"type": "array", "items": {"$ref": "#/components/schemas/B"}}) == (
        docs_view.TypeName("list of B", ("B",))
    )
    assert (
        docs_view.type_name({"enum": ["finished", "failed"]}).text == "one of 'finished', 'failed'"
    )
