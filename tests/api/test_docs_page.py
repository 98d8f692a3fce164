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


def test_markup_in_a_schema_cannot_reach_the_page():
    hostile = {
        "info": {"title": "<script>alert(1)</script>", "version": "1", "description": ""},
        "paths": {"/x": {"get": {"summary": "<img src=x onerror=alert(1)>", "responses": {}}}},
        "components": {"schemas": {"Doc": {"properties": {"a": {"description": "<b>"}}}}},
    }
    text = docs_view.render_page(hostile)
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


def test_the_document_and_the_page_are_built_once_per_process(client: Client, monkeypatch):
    """Both answer without a signature: each call serves what the first one built."""
    import ninja.main
    from ninja.responses import NinjaJSONEncoder

    from workflow_delivery.api.views import api

    builds = []
    build = ninja.main.get_schema

    def counted(**options):
        builds.append(options["path_prefix"])
        return build(**options)

    monkeypatch.setattr(ninja.main, "get_schema", counted)
    rendered = []
    render = docs_view.render_page
    monkeypatch.setattr(docs_view, "render_page", lambda doc: rendered.append(1) or render(doc))
    monkeypatch.setitem(api.__dict__, "_openapi_documents", {})
    monkeypatch.setattr(docs_view, "_PAGES", {})
    documents = {client.get(OPENAPI).content for _ in range(3)}
    pages = {client.get(DOCS).content for _ in range(3)}
    assert builds == ["/agents/"] and len(rendered) == 1
    assert len(documents) == len(pages) == 1
    fresh = json.dumps(build(api=api, path_prefix="/agents/"), cls=NinjaJSONEncoder)
    assert json.loads(documents.pop()) == json.loads(fresh)
