"""Every statement on ``console_audit``: one row per console action (who, what, when, how many,
how it ended), and its pages, newest first.

Invariant: a page is a keyset range of the primary key (``id < before``) with a LIMIT, so
reading any page costs the same however long the audit grows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.sql.tables import console_audit


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


def page_query(*, before: int | None, limit: int) -> Any:
    """The statement of ``page`` (EXPLAIN reads it too)."""
    c = console_audit.c
    statement = select(console_audit).order_by(c.id.desc()).limit(limit)
    return statement if before is None else statement.where(c.id < before)


async def page(conn: AsyncConnection, *, before: int | None, limit: int) -> Sequence[AuditEntry]:
    """The ``limit`` entries before id ``before`` (the newest when None), newest first."""
    rows = await conn.execute(page_query(before=before, limit=limit))
    return [AuditEntry(**row._mapping) for row in rows]
