"""A durable multi-tenant delivery inbox for workflow agents (Django + PostgreSQL)."""

__version__ = "0.2.0"
