"""The app's statements sent straight through libpq, below psycopg's cursor.

A statement of the app needs little of what psycopg's cursor does around it: no DB-API
description, no per-call row maker, no preparation bookkeeping keyed by the query text.
A ``Lane`` belongs to one psycopg 3 connection. It prepares each statement once under
a name of its own (or, behind a pooler, sends it unnamed every time), binds the
parameters with psycopg's own dumpers, waits through psycopg's own wait (so Ctrl-C
cancels the query as it would in a cursor), and loads the rows with psycopg's loaders.

It sends nothing but the statement: every Django check stays with the caller
(``run.fetch``), which hands a statement to the lane only when the connection is in
autocommit and idle, so each statement is its own transaction. What it
uses of psycopg beyond the documented ``Connection.pgconn`` is looked up once here;
without it (or without psycopg 3) ``AVAILABLE`` is false and every statement takes
the cursor path.
"""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import Any

from .statement import Statement

try:
    import psycopg
    from psycopg import pq
    from psycopg.adapt import PyFormat, Transformer
    from psycopg.errors import error_from_result
    from psycopg.generators import execute as _results_of
except ImportError:  # psycopg2, or a psycopg 3 without these: the cursor path only
    psycopg = None

AVAILABLE = psycopg is not None and callable(getattr(psycopg.Connection, "wait", None))

if AVAILABLE:
    _BINARY = pq.Format.BINARY
    _FAILED = pq.ExecStatus.FATAL_ERROR
    IDLE = pq.TransactionStatus.IDLE
    _BUSY = pq.TransactionStatus.ACTIVE
    _CONNECTED = pq.ConnStatus.OK

# How long an interrupted statement's cancel and the rest of its answer may take
# before the session is given up (psycopg's own wait allows as long).
_SETTLE_SECONDS = 5.0

# The server's answer to a prepared statement that is not there: psycopg sends
# DEALLOCATE ALL after a ROLLBACK once it has prepared statements of its own, and a
# host may DISCARD ALL.
_NO_SUCH_STATEMENT = "26000"


class Lane:
    """One connection's statements, prepared once each (unless ``prepare`` is false)."""

    __slots__ = ("_formats", "_names", "_next", "_pgconn", "_prepare", "_tx", "raw")

    def __init__(self, raw: Any, *, prepare: bool) -> None:
        self.raw = raw
        self._pgconn = raw.pgconn
        self._prepare = prepare
        # Dumpers and loaders by type, kept across statements as a cursor keeps its own.
        self._tx = Transformer(raw)
        # Prepared name by statement and parameter types: psycopg picks a type per
        # value (an int may be int2, int4 or int8), and each set of types is its own
        # statement on the server, as it is for psycopg's own preparation.
        self._names: dict[tuple[Statement, tuple[int, ...]], bytes] = {}
        # Never reused: after a partial DEALLOCATE a name may still be taken.
        self._next = 0
        self._formats: dict[int, list[PyFormat]] = {}

    @property
    def transaction_status(self) -> Any:
        return self._pgconn.transaction_status

    def run(self, statement: Statement, params: Sequence[object]) -> list[tuple]:
        """Every row ``statement`` answers with ``params`` (its values in placeholder
        order, ``Statement.args``); a database error is raised as psycopg raises it."""
        try:
            return self._run(statement, params)
        except psycopg.Error as exc:
            if getattr(exc, "sqlstate", None) != _NO_SUCH_STATEMENT or not self._names:
                raise
        # Our prepared statements were dropped under us. The statement never ran (the
        # server refused its Bind) and, in autocommit, aborted nothing: prepare again
        # and send it once more.
        self._names.clear()
        return self._run(statement, params)

    def _run(self, statement: Statement, params: Sequence[object]) -> list[tuple]:
        tx, pgconn = self._tx, self._pgconn
        count = len(params)
        formats = self._formats.get(count)
        if formats is None:
            # AUTO, as a cursor's %s: the same types and formats the cursor path binds.
            formats = self._formats[count] = [PyFormat.AUTO] * count
        values = tx.dump_sequence(params, formats)
        query = statement.numbered
        if self._prepare:
            types = tuple(tx.types)
            name = self._names.get((statement, types))
            if name is None:
                name = b"workflow_delivery_%d" % self._next
                self._next += 1
                self._send(partial(pgconn.send_prepare, name, query, param_types=types))
                self._names[statement, types] = name
            send = partial(
                pgconn.send_query_prepared,
                name,
                values,
                param_formats=tx.formats,
                result_format=_BINARY,
            )
        else:
            # Behind a pooler a name could denote another client's statement.
            send = partial(
                pgconn.send_query_params,
                query,
                values,
                param_types=tx.types,
                param_formats=tx.formats,
                result_format=_BINARY,
            )
        result = self._send(send)
        tx.set_pgresult(result)
        return tx.load_rows(0, result.ntuples, tuple)

    def _send(self, send: Callable[[], None]) -> Any:
        """``send()`` the request and wait for its result, both inside psycopg's wait, so
        that Ctrl-C at any point cancels what the server is running (as a cursor does)."""
        try:
            results = self.raw.wait(_sent(send, self._pgconn))
        except BaseException:
            self._settle()
            raise
        for result in results:
            if result.status == _FAILED:
                raise error_from_result(result, encoding=self.raw.info.encoding)
        return results[-1]

    def _settle(self) -> None:
        """After a wait that ended before the whole answer was read, leave the session
        idle, or close it.

        A Ctrl-C that lands in our generator, between the send and the read, ends it:
        psycopg's wait cancels the query but has no generator left to read the answer
        with, and the session stays mid-command, refusing every later statement (the
        next test's flush too) with "another command is already in progress". So the
        query is cancelled (again: whatever ended the wait may not have) and the rest
        of its answer dropped; a session that does not come back in time, or a second
        interruption, is closed, as psycopg closes one it cannot cancel."""
        pgconn = self._pgconn
        if pgconn.status != _CONNECTED or pgconn.transaction_status != _BUSY:
            return
        try:
            if hasattr(self.raw, "cancel_safe"):  # psycopg 3.2+
                self.raw.cancel_safe(timeout=_SETTLE_SECONDS)
            else:
                self.raw.cancel()
            settled = _drop_answer(pgconn, time.monotonic() + _SETTLE_SECONDS)
        except (psycopg.Error, OSError):
            settled = False
        except BaseException:
            pgconn.finish()
            raise
        if not settled:
            pgconn.finish()


def _drop_answer(pgconn: Any, deadline: float) -> bool:
    """Read every remaining result of the command in progress and drop it; true once
    the session is idle again, false if ``deadline`` passes first."""
    with selectors.DefaultSelector() as selector:
        selector.register(pgconn.socket, selectors.EVENT_READ)
        while True:
            pgconn.consume_input()
            if pgconn.is_busy():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    return False
            elif pgconn.get_result() is None:
                return pgconn.transaction_status == IDLE


def _sent(send: Callable[[], None], pgconn: Any) -> Generator[Any, Any, list[Any]]:
    send()
    return (yield from _results_of(pgconn))
