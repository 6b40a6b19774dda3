"""Every statement on ``console_audit``: one row per console action (who, what, when, how many,
how it ended; a refusal repeated within a window bumps its row's ``repeats``), its pages,
newest first, and the janitor's deletion of entries past their retention.

Invariant: a page is a keyset range of the primary key (``id < before``) with a LIMIT, so
reading any page costs the same however long the audit grows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.sql.tables import console_audit, interval


@dataclass(frozen=True)
class AuditEntry:
    """One action taken in the console."""

    id: int
    at: datetime
    actor: str
    role: str
    action: str
    target: str
    count: int
    outcome: str
    detail: Mapping[str, Any]
    repeats: int = 1
    last_at: datetime | None = None


async def record(
    conn: AsyncConnection,
    *,
    actor: str,
    role: str,
    action: str,
    target: str,
    count: int,
    outcome: str,
    detail: Mapping[str, Any] | None = None,
) -> int:
    """Append one entry; its id."""
    statement = (
        insert(console_audit)
        .values(
            actor=actor,
            role=role,
            action=action,
            target=target,
            count=count,
            outcome=outcome,
            detail=dict(detail or {}),
        )
        .returning(console_audit.c.id)
    )
    return int((await conn.execute(statement)).scalar_one())


async def repeat(conn: AsyncConnection, entry: int, *, window: float) -> bool:
    """Count one more time on ``entry`` if it was first written less than ``window`` seconds
    ago; whether it was (else the caller writes a new entry)."""
    c = console_audit.c
    statement = (
        update(console_audit)
        .where(c.id == entry, c.at > func.now() - interval(window))
        .values(repeats=c.repeats + 1, last_at=func.now())
    )
    return bool((await conn.execute(statement)).rowcount)


async def delete_expired_entries(conn: AsyncConnection, *, retention: float, limit: int) -> int:
    """Delete up to ``limit`` entries written more than ``retention`` seconds ago (by the last
    time a repeated one happened), oldest first; how many."""
    c = console_audit.c
    expired = (
        select(c.id)
        .where(c.at < func.now() - interval(retention))
        .where(func.coalesce(c.last_at, c.at) < func.now() - interval(retention))
        .order_by(c.at)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return (await conn.execute(delete(console_audit).where(c.id.in_(expired)))).rowcount


def page_query(*, before: int | None, limit: int) -> Any:
    """The statement of ``page`` (EXPLAIN reads it too)."""
    c = console_audit.c
    statement = select(console_audit).order_by(c.id.desc()).limit(limit)
    return statement if before is None else statement.where(c.id < before)


async def page(conn: AsyncConnection, *, before: int | None, limit: int) -> Sequence[AuditEntry]:
    """The ``limit`` entries before id ``before`` (the newest when None), newest first."""
    rows = await conn.execute(page_query(before=before, limit=limit))
    return [AuditEntry(**row._mapping) for row in rows]
