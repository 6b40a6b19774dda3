"""The asyncpg connection under an SQLAlchemy connection, inside the same transaction.

The hot path's own statements (claim, lookup, completion, outbox append) run on it as asyncpg
prepared statements, with no SQLAlchemy execution layer in between, while handlers keep their
SQLAlchemy connection and session: it is one connection, so it is one transaction. A statement
sent here outside a transaction would commit on its own, so ``in_transaction`` refuses that.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import asyncpg
from sqlalchemy.ext.asyncio import AsyncConnection

Connection: TypeAlias = AsyncConnection | asyncpg.Connection
"""What the statements of ``worker.sql`` take: an SQLAlchemy ``AsyncConnection`` in a transaction
(``engine.begin()``, ``conn.begin()``) or the asyncpg connection of an open transaction."""


class NotInTransaction(RuntimeError):
    """The worker's statements must run in the caller's transaction; this connection has none."""


async def in_transaction(conn: Connection) -> Any:
    """The asyncpg connection of ``conn``'s open transaction.

    SQLAlchemy's asyncpg adapter sends ``BEGIN`` lazily, with the first statement of a
    transaction; when none was sent yet, it is sent now, so that what follows on the driver
    belongs to the transaction. Raises ``NotInTransaction`` for a connection with no transaction.
    """
    if isinstance(conn, AsyncConnection):
        if not conn.in_transaction():
            raise NotInTransaction(NotInTransaction.__doc__)
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        assert driver is not None  # (None only for a connection already closed)
        if not driver.is_in_transaction():
            await _begin(conn, raw.dbapi_connection)
        return driver
    if not conn.is_in_transaction():
        raise NotInTransaction(NotInTransaction.__doc__)
    return conn


async def _begin(conn: AsyncConnection, adapter: Any) -> None:
    """Have SQLAlchemy's asyncpg adapter begin its transaction now: through the coroutine its own
    cursor awaits before a transaction's first statement (no statement of ours, no greenlet), or,
    where this SQLAlchemy version has no such coroutine, through a statement of its own."""
    start = getattr(adapter, "_start_transaction", None)
    if start is not None and getattr(adapter, "_transaction", False) is None:
        await start()
    else:
        await conn.exec_driver_sql("SELECT 1")
