"""Connection settings as the harnesses and tests pass them on, without psycopg: a
Django ``DATABASES`` entry as libpq keywords, and those keywords as a ``DATABASE_URL``
for a process one starts (importable where only psycopg2 is installed)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote


def conninfo(entry: dict[str, Any], name: str) -> dict[str, Any]:
    info = {"dbname": name, "user": entry.get("USER") or None}
    if entry.get("HOST"):
        info["host"] = entry["HOST"]
    if entry.get("PORT"):
        info["port"] = str(entry["PORT"])
    if entry.get("PASSWORD"):
        info["password"] = entry["PASSWORD"]
    return info


def database_url(name: str, info: dict[str, Any]) -> str:
    """A ``DATABASE_URL`` for database ``name``; a Unix-socket directory (the embedded server)
    travels as ``?host=``, which django-environ hands to psycopg unchanged."""
    credentials = quote(info.get("user") or "", safe="")
    if info.get("password"):
        credentials += ":" + quote(info["password"], safe="")
    host = info.get("host") or "127.0.0.1"
    if host.startswith("/"):
        return f"postgres://{credentials}@/{name}?host={quote(host)}"
    port = f":{info['port']}" if info.get("port") else ""
    return f"postgres://{credentials}@{quote(host, safe='')}{port}/{name}"
