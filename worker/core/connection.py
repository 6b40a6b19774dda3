"""The handler's ``ctx.connection`` and ``ctx.session``: SQLAlchemy's own, with a fast path for
the Core statements that ``worker.sql.compiled`` can run exactly as SQLAlchemy would.

The invariant: a handler sees the same SQL sent, rows, row counts and exceptions either way
(the one difference: a fast-path result is a ``Result`` with ``rowcount``, not a ``CursorResult``
with ``inserted_primary_key``; an insert whose key the database generates never takes the fast
path, so that accessor keeps working where it means something). ``HandlerConnection`` is an
``AsyncConnection`` on the unit of work's connection (same transaction, same savepoints);
``execute`` (and ``scalar``, ``scalars``, which call it) sends a statement the fast path covers
on the transaction's asyncpg connection and returns a ``Result`` with the same rows, keys and
``rowcount``; everything else, and everything but ``execute``, is SQLAlchemy's unchanged.
``HandlerSession.execute`` does the same for a Core statement when the session has joined the
transaction already (its first statement joins it: SQLAlchemy's path), has nothing to flush (so
autoflush would send nothing), no execution options of its own and no ``do_orm_execute`` hook.
Statement hooks on the engine (``before_execute``, ``before_cursor_execute`` …), ``handle_error``
hooks other than the worker's (``worker.errors.unusable_connection_is_a_disconnect``, installed
by ``worker.database``), execution options on the connection and the engine's ``echo`` turn the
fast path off.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import asyncpg
from sqlalchemy.engine import CursorResult, Result
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.util import EMPTY_DICT

from worker.errors import causes, unusable_connection_is_a_disconnect
from worker.sql import compiled


class HandlerConnection(AsyncConnection):
    """``conn`` (in a transaction whose asyncpg connection is ``driver``) for handlers."""

    __slots__ = ("_fast", "_mutex", "driver")

    def __init__(self, conn: AsyncConnection, driver: asyncpg.Connection) -> None:
        super().__init__(conn.engine, conn.sync_connection)
        self.driver = driver
        sync = conn.sync_connection
        pooled = getattr(sync, "_dbapi_connection", None)
        # SQLAlchemy's adapter sends one statement at a time on the driver: so does the fast path
        self._mutex: Any = getattr(
            getattr(pooled, "dbapi_connection", None), "_execute_mutex", None
        )
        dispatch = sync.dispatch if sync is not None else None
        self._fast = (
            dispatch is not None
            and self._mutex is not None
            and not (
                dispatch.before_execute
                or dispatch.after_execute
                or dispatch.before_cursor_execute
                or dispatch.after_cursor_execute
            )
            # the worker's own error hook is what _lost does; any other must see the error
            and all(
                hook is unusable_connection_is_a_disconnect
                for hook in conn.engine.dialect.dispatch.handle_error
            )
        )

    async def execute(
        self,
        statement: Any,
        parameters: Any = None,
        *,
        execution_options: Any = None,
    ) -> CursorResult[Any]:
        """SQLAlchemy's ``AsyncConnection.execute``, on the fast path where it applies."""
        if not execution_options:
            result = await self.fast_execute(statement, parameters)
            if result is not None:
                # a Result with CursorResult's rowcount, not a CursorResult (see docs/handlers.md)
                return cast(CursorResult[Any], result)
        result = await super().execute(statement, parameters, execution_options=execution_options)
        return cast(CursorResult[Any], result)

    async def fast_execute(self, statement: Any, parameters: Any) -> Result[Any] | None:
        """The result of ``statement`` run on the fast path, or None when it does not apply
        (then nothing was sent)."""
        sync = self.sync_connection
        if not self._fast or sync is None or sync._execution_options or sync._echo:
            return None  # (statement events, execution options, echo: SQLAlchemy's path)
        if not sync.in_transaction() or not self.driver.is_in_transaction():
            return None
        dialect = sync.dialect
        found = compiled.plan(statement, parameters, dialect)
        if found is None:
            return None
        plan, cache_key = found
        try:
            args = compiled.arguments(plan, cache_key, parameters)
        except Exception:
            return None  # a missing or unbindable value: SQLAlchemy's path raises it its way
        try:
            async with self._mutex:
                # None: SQLAlchemy's path
                return await compiled.run(plan, args, self.driver, statement)
        except Exception as exc:
            error = compiled.as_sqlalchemy_error(
                exc, plan, args, dialect, hide=sync.engine.hide_parameters
            )
            if error is exc:
                raise
            if await self._lost(exc):
                error.connection_invalidated = True  # type: ignore[attr-defined]
            raise error from error.__cause__

    async def _lost(self, exc: BaseException) -> bool:
        """True, the connection invalidated (and the pool's older connections with it), when
        ``exc`` leaves it unusable: what SQLAlchemy's path decides (closed, or
        ``worker.database``'s hook: an ``InternalClientError``)."""
        if not self.driver.is_closed() and not any(
            isinstance(cause, asyncpg.exceptions.InternalClientError) for cause in causes(exc)
        ):
            return False
        sync = self.sync_connection
        with contextlib.suppress(Exception):  # already failing with the error that counts
            if sync is not None and not sync.invalidated and sync._dbapi_connection is not None:
                # as SQLAlchemy's path does on a disconnect: every connection the pool made
                # before this one is replaced at its next checkout, not only this one
                sync.engine.pool._invalidate(sync._dbapi_connection, exc)
            await self.invalidate()
        return True


class HandlerSession(AsyncSession):
    """An ``AsyncSession`` whose ``execute`` takes the fast path of its ``HandlerConnection``
    for a Core statement when it has nothing to flush."""

    async def execute(
        self,
        statement: Any,
        params: Any = None,
        *,
        execution_options: Any = EMPTY_DICT,
        bind_arguments: Any = None,
        **kw: Any,
    ) -> Result[Any]:
        """SQLAlchemy's ``AsyncSession.execute``, on the fast path where it applies."""
        bind = self.bind
        if (
            isinstance(bind, HandlerConnection)
            and not execution_options
            and not self.sync_session.execution_options  # the session's own (schema map …)
            and bind_arguments is None
            and not kw
            and not self.sync_session.dispatch.do_orm_execute
            and self.sync_session._is_clean()
            and self._joined(bind)
        ):
            result = await bind.fast_execute(statement, params)
            if result is not None:
                return result
        result = await super().execute(
            statement,
            params,
            execution_options=execution_options,
            bind_arguments=bind_arguments,
            **kw,
        )
        return cast(Result[Any], result)

    def _joined(self, bind: HandlerConnection) -> bool:
        """True when the session's transaction already holds ``bind``, so SQLAlchemy's execute
        would begin and join nothing. Its first statement takes SQLAlchemy's path: it joins
        the unit of work's transaction, so that ``session.rollback()`` rolls that back too
        (``join_transaction_mode="rollback_only"``), as it would without the fast path."""
        transaction = self.sync_session._transaction
        return (
            transaction is not None
            and transaction.is_active
            and bind.sync_connection in transaction._connections
        )
