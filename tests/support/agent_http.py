"""Helpers of the agent API tests: keys, signed requests through Django's test client,
and a real uvicorn server over the test database."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings
from django.test import Client

from bench import dsn
from workflow_delivery import keys
from workflow_delivery.api import nip98

MOUNT = "/agents/"


def secret() -> bytes:
    return os.urandom(32)


def pubkey(secret_key: bytes) -> bytes:
    return keys.public_key_bytes(secret_key)


def signed(
    client: Client,
    method: str,
    path: str,
    document: object = None,
    *,
    host: str,
    secret_key: bytes,
    raw: bytes | None = None,
    query: str = "",
    sign_url: str | None = None,
    sign_method: str | None = None,
    sign_body: bytes | None = None,
    sign_host: str | None = None,
    authorization: str | None = None,
    **sign_options,
):
    """One request to the API through the test client, signed for exactly what it sends
    unless a ``sign_*`` override signs something else (``sign_host``: the ``host``
    tag, none by default)."""
    body = raw if raw is not None else b"" if document is None else json.dumps(document).encode()
    full_path = MOUNT + path + (f"?{query}" if query else "")
    url = f"http://{host}{full_path}"
    if authorization is None:
        authorization = nip98.sign_request(
            secret_key,
            url=sign_url if sign_url is not None else url,
            method=sign_method if sign_method is not None else method,
            body=sign_body if sign_body is not None else body,
            host=sign_host,
            **sign_options,
        )
    return client.generic(
        method,
        full_path,
        data=body,
        content_type="application/json",
        HTTP_HOST=host,
        HTTP_AUTHORIZATION=authorization,
    )


def database_url() -> str:
    """The test database (as pytest-django named it) as a ``DATABASE_URL`` for a
    process the test starts: by TCP, or by the embedded server's socket directory."""
    entry = settings.DATABASES["default"]
    name = entry["NAME"]
    return dsn.database_url(name, dsn.conninfo(entry, name))


@contextmanager
def uvicorn_server(workers: int = 1, extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """uvicorn serving the demo project over the test database; yields its base URL."""
    from bench import common  # psycopg 3 at import; the psycopg2 cell leaves these tests out

    with common.api_server(database_url(), workers=workers, env=extra_env) as url:
        yield url
