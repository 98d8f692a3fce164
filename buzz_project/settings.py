"""Settings of the host project. Every value comes from the environment through one Env."""

from __future__ import annotations

import json
import math
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import environ
from django.core.exceptions import ImproperlyConfigured

from workflow_delivery.conf import DEFAULTS as WORKFLOW_DELIVERY_DEFAULTS

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)


def _read(name: str, cast, default):
    try:
        return env(name, cast=cast, default=default)
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"{name} is malformed: {exc}") from exc


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True}
_BOOLEANS.update({"0": False, "false": False, "no": False, "off": False})


def _flag(name: str, default: bool) -> bool:
    raw = env.str(name, default="")
    if raw == "":
        return default
    if raw.strip().lower() not in _BOOLEANS:
        raise ImproperlyConfigured(f"{name} must be true or false, got {raw!r}.")
    return _BOOLEANS[raw.strip().lower()]


# Off unless the environment turns it on (scripts/run does, for local use).
DEBUG = _flag("DEBUG", False)

SECRET_KEY = _read("SECRET_KEY", str, "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is false.")
    # Local use only: a key of this process alone, never a published one.
    SECRET_KEY = secrets.token_urlsafe(50)

# The demo communities' hosts too: serve_demo's HTTP agents send them as Host.
ALLOWED_HOSTS = _read("ALLOWED_HOSTS", list, ["127.0.0.1", "localhost", "[::1]", ".demo.buzz"])

# HTTPS: on by default whenever DEBUG is off, so `manage.py check --deploy` is quiet;
# each can be turned off (or, with DEBUG, on) from the environment.
SECURE_SSL_REDIRECT = _flag("SECURE_SSL_REDIRECT", not DEBUG)
SESSION_COOKIE_SECURE = _flag("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = _flag("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = _read("SECURE_HSTS_SECONDS", int, 0 if DEBUG else 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _flag("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = _flag("SECURE_HSTS_PRELOAD", not DEBUG)
# Behind a TLS-terminating proxy: the header it sets, e.g. HTTP_X_FORWARDED_PROTO.
if _proxy_header := _read("SECURE_PROXY_SSL_HEADER", str, ""):
    SECURE_PROXY_SSL_HEADER = (_proxy_header, "https")


def _database() -> dict:
    url = env.str("DATABASE_URL", default="")
    if not url:
        from buzz_project.embedded import embedded_database

        return embedded_database(BASE_DIR / ".pgdata")
    scheme = url.split(":", 1)[0].lower()
    if scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ImproperlyConfigured(
            f"DATABASE_URL must be a PostgreSQL URL (postgres://user@host:port/name), "
            f"got scheme {scheme!r}: this app needs PostgreSQL."
        )
    try:
        config = env.db_url_config(url)
    except Exception as exc:
        raise ImproperlyConfigured(f"DATABASE_URL is malformed: {exc}") from exc
    if "," in url.split("://", 1)[-1].split("/", 1)[0]:
        config.update(_hosts(url))
    if not config.get("NAME"):
        raise ImproperlyConfigured("DATABASE_URL names no database (…/dbname at the end).")
    attrs = config.get("OPTIONS", {}).get("target_session_attrs")
    if attrs is not None and attrs not in _SESSION_ATTRS:
        # libpq would refuse every host with it, and the error would read as a server down.
        raise ImproperlyConfigured(
            f"DATABASE_URL's target_session_attrs must be one of {', '.join(_SESSION_ATTRS)}, "
            f"got {attrs!r}."
        )
    return config


_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\[\]:]+)(?::(?P<port>[^:]*))?")


_SESSION_ATTRS = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")


def _hosts(url: str) -> dict[str, str]:
    """HOST and PORT of a libpq multi-host URL (``postgres://u@a:5441,b:5442/db``), each
    a comma-separated list, one port per host (5432 where a host names none), as libpq
    reads them (a host percent-decoded); django-environ would give every host the first port."""
    hosts, ports = [], []
    netloc = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    for entry in netloc.rsplit("@", 1)[-1].split(","):
        found = _HOST_PORT.fullmatch(entry.strip())
        if found is None:
            raise ImproperlyConfigured(
                f"DATABASE_URL is malformed: host {entry!r} of its host list is not "
                "host or host:port (postgres://user@host1:port1,host2:port2/name)."
            )
        port = found["port"] or "5432"
        if not (port.isdigit() and 0 < int(port) < 65536):
            raise ImproperlyConfigured(
                f"DATABASE_URL is malformed: host {found['host']!r} has port {port!r}, "
                "not a number from 1 to 65535."
            )
        # Percent-decoded, as libpq reads a URL: a Unix-socket directory may stand in
        # the list (%2Frun%2Fpostgresql).
        hosts.append(unquote(found["host"].strip("[]")))
        ports.append(port)
    return {"HOST": ",".join(hosts), "PORT": ",".join(ports)}


def _as_app_role(config: dict) -> dict:
    """With APP_DATABASE_ROLE set, the same server and database as that role (the
    unprivileged one of docs/howto/operations.md, "Run under an unprivileged role"); scripts/run
    migrates without it and serves with it."""
    role = env.str("APP_DATABASE_ROLE", default="")
    if role:
        config["USER"] = role
        config["PASSWORD"] = env.str("APP_DATABASE_PASSWORD", default="")
    return config


DATABASES = {"default": _as_app_role(_database())}
# Fail fast, with one clear line from manage.py, when the server does not answer.
DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
    "connect_timeout", _read("DATABASE_CONNECT_TIMEOUT", int, 10)
)
DATABASES["default"]["TEST"] = {"NAME": _read("TEST_DATABASE_NAME", str, None)}
# DATABASE_POOL_SIZE > 0: Django's psycopg pool of at most that many sessions per
# process, for an ASGI server, where each request's thread would otherwise connect anew.
_POOL_SIZE = _read("DATABASE_POOL_SIZE", int, 0)
if _POOL_SIZE < 0:
    raise ImproperlyConfigured(f"DATABASE_POOL_SIZE must be 0 or more, got {_POOL_SIZE}.")
if _POOL_SIZE:
    DATABASES["default"]["OPTIONS"]["pool"] = {"min_size": 1, "max_size": _POOL_SIZE}
    # Django's pool takes no persistent connections: it keeps the sessions itself.
    DATABASES["default"].setdefault("CONN_MAX_AGE", 0)
else:
    # Persistent connections (seconds; 0 closes each at the end of its request), as
    # the agent API wants them: a request opens no new session. Under ASGI only with
    # asgi.py's handler, whose few threads keep them; Django's own would leave one
    # behind per request. A session that broke meanwhile is found by the health
    # check before a request uses it, not by the request's first statement.
    _CONN_MAX_AGE = _read("DATABASE_CONN_MAX_AGE", int, 60)
    if _CONN_MAX_AGE < 0:
        raise ImproperlyConfigured(f"DATABASE_CONN_MAX_AGE must be 0 or more, got {_CONN_MAX_AGE}.")
    DATABASES["default"].setdefault("CONN_MAX_AGE", _CONN_MAX_AGE)
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)

# The ASGI server's threads per process for synchronous code (asgi.py): each holds
# at most one database connection.
ASGI_THREADS = _read("ASGI_THREADS", int, 4)
if ASGI_THREADS < 1:
    raise ImproperlyConfigured(f"ASGI_THREADS must be 1 or more, got {ASGI_THREADS}.")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "workflow_delivery",
    "buzz_project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "buzz_project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "buzz_project.wsgi.application"
ASGI_APPLICATION = "buzz_project.asgi.application"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_WHOLE = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NONE = {"none", "null"}


def _number(name: str, raw: str, *, whole: bool) -> int | float:
    """A finite number written as one: ``1e3`` is 1000.0, never 13.0 or an error."""
    text = raw.strip()
    if _WHOLE.fullmatch(text):
        return int(text)
    if not whole and _DECIMAL.fullmatch(text):
        value = float(text)
        if math.isfinite(value):
            return value
        raise ImproperlyConfigured(f"{name} must be a finite number, got {raw!r}.")
    kind = "a whole number" if whole else "a number"
    raise ImproperlyConfigured(f"{name} must be {kind}, got {raw!r}.")


def _app_setting(name: str, default: Any) -> Any:
    """``name`` from the environment, parsed after the type of the app's default."""
    raw = env.str(name, default="")
    if raw.strip() == "":
        return default
    if isinstance(default, bool):
        return _flag(name, default)
    if raw.strip().lower() in _NONE and not isinstance(default, str):
        # A cap or option the app lets be None (the system checks judge the rest).
        return None
    if default is None:
        # An optional text (API_ORIGIN): the value as written.
        return raw.strip()
    if isinstance(default, int):
        return _number(name, raw, whole=True)
    if isinstance(default, dict):
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ImproperlyConfigured(f"{name} must be a JSON object, got {raw!r}.")
        return value
    if isinstance(default, float):
        return float(_number(name, raw, whole=False))
    if isinstance(default, tuple):
        # A list of names (ACP_ALLOW_PERMISSIONS), comma-separated.
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    return raw


# Every setting the app reads, whatever it is: a setting added to the app's DEFAULTS
# is read from the environment here without another line.
for _name, _default in WORKFLOW_DELIVERY_DEFAULTS.items():
    globals()[f"WORKFLOW_DELIVERY_{_name}"] = _app_setting(f"WORKFLOW_DELIVERY_{_name}", _default)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "workflow_delivery": {
            "handlers": ["console"],
            "level": _read("WORKFLOW_DELIVERY_LOG_LEVEL", str, "INFO"),
            "propagate": False,
        },
        "buzz_project": {
            "handlers": ["console"],
            "level": _read("WORKFLOW_DELIVERY_LOG_LEVEL", str, "INFO"),
            "propagate": False,
        },
    },
}
