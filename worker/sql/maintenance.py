"""Statements of housekeeping: the janitor's lock and sweep, the database probe, and
what the deployment's migrations and commit settings are.
"""

from __future__ import annotations

from sqlalchemy import (
    column,
    delete,
    func,
    select,
    table,
    text,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.sql import locks
from worker.sql.tables import inbox, interval


async def applied_revisions(conn: AsyncConnection, version_table: str) -> frozenset[str]:
    """The revisions an Alembic version table records; empty when the table does not exist."""
    if await conn.scalar(select(func.to_regclass(version_table))) is None:
        return frozenset()
    versions = table(version_table, column("version_num"))
    return frozenset((await conn.execute(select(versions.c.version_num))).scalars())


async def takes_writes(conn: AsyncConnection) -> bool:
    """One round trip to the server (raises when PostgreSQL does not answer): whether this
    session's transactions may write, False on a standby or a server made read-only."""
    read_only = await conn.scalar(select(func.current_setting("transaction_read_only")))
    return read_only == "off"


async def synchronous_commit(conn: AsyncConnection) -> str:
    """The server's ``synchronous_commit`` for this connection ('off' breaks ack-after-commit)."""
    return str((await conn.execute(text("SHOW synchronous_commit"))).scalar_one())


JANITOR_LOCK_CLASS = locks.JANITOR
"""First key of the session-level advisory lock (second key 0) held by the one sweeping janitor."""


async def try_lock_janitor(conn: AsyncConnection) -> bool:
    """Take the janitor lock for this session unless another session holds it; never waits."""
    stmt = select(func.pg_try_advisory_lock(JANITOR_LOCK_CLASS, 0))
    return bool((await conn.execute(stmt)).scalar_one())


async def unlock_janitor(conn: AsyncConnection) -> None:
    """Release the janitor lock this session holds."""
    await conn.execute(select(func.pg_advisory_unlock(JANITOR_LOCK_CLASS, 0)))


async def delete_expired_keys(conn: AsyncConnection, *, retention: float, limit: int) -> int:
    """Delete up to ``limit`` completed or failed keys untouched for ``retention`` seconds, oldest
    first; returns how many. Rows another transaction holds are skipped, never waited on, and
    ``in_progress`` keys are left alone whatever their age.
    """
    expired = (
        select(inbox.c.handler, inbox.c.key)
        .where(
            inbox.c.status.in_(("completed", "failed")),
            inbox.c.updated_at < func.now() - interval(retention),
        )
        .order_by(inbox.c.updated_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    stmt = delete(inbox).where(inbox.c.handler == expired.c.handler, inbox.c.key == expired.c.key)
    return (await conn.execute(stmt)).rowcount
