"""The worker's record of each copy it parked in the dead-letter queue: written before the copy
is published, read by ``worker dlq`` to tell the worker's own copies from any other.

Invariant: every copy the worker publishes to the DLQ has its row, committed before the publish,
so a copy without one was not parked by this worker (a row without a copy is harmless: the
janitor expires it after twice the inbox's retention). The row, never the copy's headers, says which
handler, key, reason and routing key a copy was parked with, and whether its key was recorded as
failed in the inbox; only then may a replay clear that inbox row.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, any_, bindparam, delete, exists, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import ARRAY, Uuid

from worker.sql.driver import Connection, in_transaction
from worker.sql.tables import dead_letters, interval


@dataclass(frozen=True)
class ParkingRow:
    """One parking: the copy's ``parking_id`` (its ``x-worker-parking-id`` header), the handler
    and key it was parked with (None when it had none), why, the routing key the worker routed
    it by, the SHA-256 of its body, and ``failed_key``: whether (handler, key) was recorded as
    failed in the inbox with it. ``parked_at`` is the database's clock (None before insert).
    ``error``, ``exception_type``, ``attempts`` and ``first_failure_at``: the failure it was
    parked for (None in a record written before migration 0011); ``replayed_at``: when its copy
    was replayed (None: it was not)."""

    parking_id: uuid.UUID
    handler: str | None
    key: str | None
    reason: str
    routing_key: str
    body_sha256: bytes
    failed_key: bool
    parked_at: datetime | None = None
    error: str | None = None
    exception_type: str | None = None
    attempts: int | None = None
    first_failure_at: str | None = None
    replayed_at: datetime | None = None


_COLUMNS = [dead_letters.c[name] for name in ParkingRow.__dataclass_fields__]

RECORD_PARKINGS = """
INSERT INTO dead_letters (parking_id, handler, key, reason, routing_key, body_sha256, failed_key,
                          error, exception_type, attempts, first_failure_at)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[],
                     $7::bool[], $8::text[], $9::text[], $10::int[], $11::text[])
"""
"""Every parking of a batch in one statement: one array per column, in the rows' order."""


async def record_parkings(conn: Connection, parkings: Sequence[ParkingRow]) -> None:
    """Insert ``parkings`` in ``conn``'s transaction, in one statement however many (commit it
    before publishing their copies)."""
    if not parkings:
        return
    driver = await in_transaction(conn)
    await driver.execute(
        RECORD_PARKINGS,
        [p.parking_id for p in parkings],
        [p.handler for p in parkings],
        [p.key for p in parkings],
        [p.reason for p in parkings],
        [p.routing_key for p in parkings],
        [p.body_sha256 for p in parkings],
        [p.failed_key for p in parkings],
        [p.error for p in parkings],
        [p.exception_type for p in parkings],
        [p.attempts for p in parkings],
        [p.first_failure_at for p in parkings],
    )


MAX_FOUND = 1000
"""Parking ids ``find_parkings`` looks up at once at most (a DLQ sweep asks for a chunk's)."""


def find_parkings_query(parking_ids: Collection[uuid.UUID]) -> Select[Any]:
    """The parkings recorded as any of ``parking_ids`` (``parking_id = ANY(:ids)``, one array
    parameter: a range of primary-key lookups, at most ``MAX_FOUND``)."""
    if len(parking_ids) > MAX_FOUND:
        raise ValueError(f"at most {MAX_FOUND} parking ids at once, not {len(parking_ids)}")
    ids = bindparam("parking_ids", list(parking_ids), type_=ARRAY(Uuid))
    return select(*_COLUMNS).where(dead_letters.c.parking_id == any_(ids))


async def find_parkings(
    conn: AsyncConnection, parking_ids: Collection[uuid.UUID]
) -> dict[uuid.UUID, ParkingRow]:
    """The parkings recorded as any of ``parking_ids`` (at most ``MAX_FOUND``), by parking id;
    an id the worker recorded no parking as is not in it. One statement, however many ids."""
    if not parking_ids:
        return {}
    found = await conn.execute(find_parkings_query(parking_ids))
    return {row.parking_id: ParkingRow(**row._asdict()) for row in found}


async def mark_replayed(conn: AsyncConnection, parking_id: uuid.UUID) -> None:
    """Record that the copy of ``parking_id`` was replayed (by the database's clock)."""
    await conn.execute(
        update(dead_letters)
        .where(dead_letters.c.parking_id == parking_id)
        .values(replayed_at=func.now())
    )


async def forget_parking(conn: AsyncConnection, parking_id: uuid.UUID) -> None:
    """Delete the record of ``parking_id`` (its copy was purged)."""
    await conn.execute(delete(dead_letters).where(dead_letters.c.parking_id == parking_id))


async def is_parked(conn: AsyncConnection, handler: str, key: str) -> bool:
    """True when the worker parked a copy of (handler, key) in the DLQ whose record is still
    kept (not purged, not expired; a replayed copy's record is kept too, but then its key has an
    inbox row, or a new copy): what a "key unknown" answer may point an operator to."""
    found = exists().where(dead_letters.c.handler == handler, dead_letters.c.key == key)
    return bool(await conn.scalar(select(found)))


async def delete_expired_parkings(conn: AsyncConnection, *, retention: float, limit: int) -> int:
    """Delete up to ``limit`` parkings recorded longer than twice ``retention`` (the inbox's)
    seconds ago, oldest first; returns how many. A record outlives its key's failed inbox row,
    so a forced replay of an old copy still finds it (and clears what is left of that row)."""
    stale = (
        select(dead_letters.c.parking_id)
        .where(dead_letters.c.parked_at < func.now() - interval(2 * retention))
        .order_by(dead_letters.c.parked_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    result = await conn.execute(delete(dead_letters).where(dead_letters.c.parking_id.in_(stale)))
    return result.rowcount
