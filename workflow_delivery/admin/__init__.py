"""Read-mostly admin, one module per model's admin. Every table is browsable (bytes as
hex); nothing is written through a form but a new community's host. Operators change
state only through actions, each behind its own permission, that call ``services``
and report "N done, M skipped".

Django imports this package on start (admin autodiscovery); importing the modules
registers their admins.
"""

from . import community, delivery, event, roster, workflow

__all__ = ["community", "delivery", "event", "roster", "workflow"]
