"""A readable page of the agent API's OpenAPI document, rendered on the server.

The page is built from the same schema object ``v1/openapi.json`` serves, so it
lists exactly the operations, fields and answers the API has. Plain HTML from a
Django template: no script and nothing loaded from elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.views.decorators.http import require_safe

from .views import api

_REF_PREFIX = "#/components/schemas/"
_METHODS = ("get", "put", "post", "patch", "delete")
_CONSTRAINTS = (
    ("minimum", "≥ {}"),
    ("maximum", "≤ {}"),
    ("minLength", "at least {} characters"),
    ("maxLength", "at most {} characters"),
    ("minItems", "at least {} items"),
    ("maxItems", "at most {} items"),
    ("pattern", "matches {}"),
    ("format", "format {}"),
    ("default", "default {}"),
)


@dataclass(frozen=True)
class TypeName:
    """A field's type as text, with the documents it names (linked on the page)."""

    text: str
    refs: tuple[str, ...] = ()

    @property
    def is_ref(self) -> bool:
        """The type is one document, named and linked as it is."""
        return self.refs == (self.text,)


@dataclass(frozen=True)
class Field:
    name: str
    type: TypeName
    required: bool
    description: str
    constraints: list[str]


@dataclass(frozen=True)
class Answer:
    status: str
    description: str
    document: TypeName | None


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    anchor: str
    summary: str
    description: str
    parameters: list[Field]
    body: TypeName | None
    body_required: bool
    answers: list[Answer]


@dataclass(frozen=True)
class Document:
    name: str
    description: str
    fields: list[Field] = field(default_factory=list)
    strict: bool = False


def _ref_name(ref: str) -> str:
    return ref.removeprefix(_REF_PREFIX)


def type_name(schema: dict[str, Any]) -> TypeName:
    """``schema`` as a short phrase: a document's name, ``list of X``, ``A or null``."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return TypeName(name, (name,))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            parts = [type_name(part) for part in schema[key]]
            refs = tuple(ref for part in parts for ref in part.refs)
            return TypeName(" or ".join(part.text for part in parts), refs)
    if "enum" in schema:
        return TypeName("one of " + ", ".join(repr(value) for value in schema["enum"]))
    if "const" in schema:
        return TypeName(repr(schema["const"]))
    kind = schema.get("type")
    if kind == "array":
        items = type_name(schema.get("items", {}))
        return TypeName(f"list of {items.text}", items.refs)
    if isinstance(kind, list):
        return TypeName(" or ".join(kind))
    return TypeName(kind or "any")


def _constraints(schema: dict[str, Any]) -> list[str]:
    found = []
    for option in (schema, *schema.get("anyOf", ()), *schema.get("oneOf", ())):
        for key, text in _CONSTRAINTS:
            if key in option:
                found.append(text.format(option[key]))
    return found


def _description(schema: dict[str, Any]) -> str:
    if "description" in schema:
        return schema["description"]
    for option in schema.get("anyOf", ()):
        if "description" in option:
            return option["description"]
    return ""


def _fields(schema: dict[str, Any]) -> list[Field]:
    required = set(schema.get("required", ()))
    return [
        Field(
            name=name,
            type=type_name(prop),
            required=name in required,
            description=_description(prop),
            constraints=_constraints(prop),
        )
        for name, prop in schema.get("properties", {}).items()
    ]


def _json_schema(container: dict[str, Any]) -> dict[str, Any] | None:
    content = container.get("content", {})
    media = content.get("application/json")
    return None if media is None else media.get("schema")


def _operation(path: str, method: str, spec: dict[str, Any]) -> Operation:
    parameters = [
        Field(
            name=f"{param['name']} ({param['in']})",
            type=type_name(param.get("schema", {})),
            required=bool(param.get("required")),
            description=param.get("description") or _description(param.get("schema", {})),
            constraints=_constraints(param.get("schema", {})),
        )
        for param in spec.get("parameters", ())
    ]
    body = spec.get("requestBody")
    body_schema = None if body is None else _json_schema(body)
    answers = []
    for status, answer in spec.get("responses", {}).items():
        schema = _json_schema(answer)
        answers.append(
            Answer(
                status, answer.get("description", ""), None if schema is None else type_name(schema)
            )
        )
    return Operation(
        method=method.upper(),
        path=path,
        anchor=spec.get("operationId") or f"{method}-{path}",
        summary=spec.get("summary", ""),
        description=spec.get("description", ""),
        parameters=parameters,
        body=None if body_schema is None else type_name(body_schema),
        body_required=bool(body and body.get("required")),
        answers=answers,
    )


def page_context(openapi: dict[str, Any]) -> dict[str, Any]:
    """What the template shows, from an OpenAPI 3 document."""
    operations = [
        _operation(path, method, item[method])
        for path, item in openapi.get("paths", {}).items()
        for method in _METHODS
        if method in item
    ]
    documents = [
        Document(
            name=name,
            description=schema.get("description", ""),
            fields=_fields(schema),
            strict=schema.get("additionalProperties") is False,
        )
        for name, schema in openapi.get("components", {}).get("schemas", {}).items()
    ]
    schemes = openapi.get("components", {}).get("securitySchemes", {})
    return {
        "info": openapi.get("info", {}),
        "operations": operations,
        "documents": documents,
        "headers": sorted({scheme.get("name", "") for scheme in schemes.values()} - {""}),
    }


def render_page(openapi: dict[str, Any]) -> str:
    """The page of an OpenAPI 3 document."""
    return render_to_string("workflow_delivery/api_docs.html", page_context(openapi))


# The page as rendered, per OpenAPI document (one per path the API is served under).
_PAGES: dict[int, tuple[dict[str, Any], bytes]] = {}


@require_safe
def api_docs(request: HttpRequest) -> HttpResponse:
    """The API's reference page (``v1/docs``), beside ``v1/openapi.json``; rendered
    once per process from the document the API built once."""
    openapi = api.get_openapi_schema()
    page = _PAGES.get(id(openapi))
    if page is None or page[0] is not openapi:
        page = _PAGES[id(openapi)] = (openapi, render_page(openapi).encode())
    return HttpResponse(page[1])
