"""The persistence floor: the app's SQL and how it reaches PostgreSQL.

* ``statement``: the ``Statement`` type (named parameters, compiled once).
* ``statements``: every statement of the app, literal.
* ``run``: running them (the lane in autocommit, cursors, savepoints).
* ``lane``: the libpq fast path under ``run``.
* ``rows``: decoding rows, beside the column lists they read.
* ``errors``: what a database error means (the one translation).
"""
