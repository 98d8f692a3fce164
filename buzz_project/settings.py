"""Settings of the host project. Every value comes from the environment through one Env."""

from __future__ import annotations

from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

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


DEBUG = _flag("DEBUG", True)

_DEV_SECRET_KEY = "dev-only-insecure-key-set-SECRET_KEY-in-production"
SECRET_KEY = _read("SECRET_KEY", str, _DEV_SECRET_KEY if DEBUG else None)
if not SECRET_KEY:
    raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is false.")

ALLOWED_HOSTS = _read("ALLOWED_HOSTS", list, ["127.0.0.1", "localhost", "[::1]"])


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
    if not config.get("NAME"):
        raise ImproperlyConfigured("DATABASE_URL names no database (…/dbname at the end).")
    return config


DATABASES = {"default": _database()}
DATABASES["default"].setdefault("CONN_MAX_AGE", 0)
# Fail fast, with one clear line from manage.py, when the server does not answer.
DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
    "connect_timeout", _read("DATABASE_CONNECT_TIMEOUT", int, 10)
)
DATABASES["default"]["TEST"] = {"NAME": _read("TEST_DATABASE_NAME", str, None)}

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

WORKFLOW_DELIVERY_DEFAULT_LEASE_SECONDS = _read("WORKFLOW_DELIVERY_DEFAULT_LEASE_SECONDS", int, 60)
WORKFLOW_DELIVERY_MAX_LEASE_SECONDS = _read("WORKFLOW_DELIVERY_MAX_LEASE_SECONDS", int, 605200)
WORKFLOW_DELIVERY_REAP_BATCH_SIZE = _read("WORKFLOW_DELIVERY_REAP_BATCH_SIZE", int, 500)
WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS = _read(
    "WORKFLOW_DELIVERY_REAP_INTERVAL_SECONDS", float, 5.0
)

WORKFLOW_DELIVERY_REAP_YIELD_RATIO = _read("WORKFLOW_DELIVERY_REAP_YIELD_RATIO", float, 1.0)

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
