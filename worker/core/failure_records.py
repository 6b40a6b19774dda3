"""The database's side of parking: the parking records of DLQ copies, and the keys recorded as
failed, each set committed in one transaction of its own.

Invariant: a copy's parking record commits before the copy is published, and a key is recorded
as failed only after its copy was confirmed (the order is the caller's, ``transport.failures``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.sql import inbox
from worker.sql.inbox import FailedKey
from worker.sql.parkings import ParkingRow, record_parkings


async def commit_parkings(engine: AsyncEngine, records: Sequence[ParkingRow]) -> None:
    """Commit ``records``, the provenance of the copies about to be parked."""
    async with engine.begin() as conn:
        await record_parkings(conn, records)


async def commit_failed_keys(engine: AsyncEngine, failed: Sequence[FailedKey]) -> None:
    """Commit each (claim, error, attempts)'s key as failed (``inbox.record_failures``)."""
    async with engine.begin() as conn:
        await inbox.record_failures(conn, failed)
