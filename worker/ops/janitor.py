"""The inbox janitor: deletes completed and failed inbox keys older than ``inbox_retention``, and
in the same sweep the HTTP ingress's requests accepted longer ago than that, and the records of
copies parked in the dead-letter queue twice as long ago (their copies are then unverified), and
the signals for workflows received longer ago than the retention (a wait took them, or nobody
waited for them in that time), and the console's audit entries older than
``console_audit_retention``.

One instance sweeps at a time: a sweep holds a session-level advisory lock and an instance that
finds it taken skips its turn. A sweep deletes in batches of ``janitor_batch_size``, each its own
short transaction, oldest first, skipping (``SKIP LOCKED``) rows a consumer holds, so consumers
never wait behind a sweep for long. ``in_progress`` keys are never deleted here.

Retention must outlast redelivery, the delayed retries and any replay from the dead-letter queue:
once a key is deleted, a late copy of its message is new again and applies its effect a second
time. A request of the ingress expires with the same retention: a client's retry after it
appends a new event, which the inbox still recognises for as long as its key is kept (keys are
touched after their request was accepted, so they outlive it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.backoff import first
from worker.errors import is_transient
from worker.ops.metrics import Metrics
from worker.settings import Settings, format_duration
from worker.sql import audit, ingress, maintenance, parkings, waits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sweep:
    """What one sweep did: ``deleted`` inbox keys and ``requests`` ingress requests in total, in
    ``batches`` transactions that deleted at least one row each (the closing transaction of each
    table, which found fewer than a batch, maybe none, counts only if it deleted something)."""

    deleted: int
    batches: int
    requests: int = 0
    parkings: int = 0
    audit_entries: int = 0


Delete = Callable[..., Awaitable[int]]
"""A statement that deletes up to ``limit`` expired rows older than ``retention`` seconds."""


async def sweep(engine: AsyncEngine, settings: Settings) -> Sweep | None:
    """Delete every expired inbox key, then every expired ingress request, a batch per
    transaction; None if another instance is sweeping.

    The janitor lock is held, on one connection, from before the first batch to after the last
    and is released before the connection goes back to the pool (or the connection is closed).
    """
    async with engine.connect() as conn:
        locked = False
        try:
            async with conn.begin():
                locked = await maintenance.try_lock_janitor(conn)
            if not locked:
                return None
            keys, key_batches = await _delete_all(conn, settings, maintenance.delete_expired_keys)
            requests, request_batches = await _delete_all(
                conn, settings, ingress.delete_expired_requests
            )
            parked, parked_batches = await _delete_all(
                conn, settings, parkings.delete_expired_parkings
            )
            _, signal_batches = await _delete_all(conn, settings, waits.delete_expired_signals)
            entries, audit_batches = await _delete_all(
                conn,
                settings,
                audit.delete_expired_entries,
                retention=settings.console_audit_retention,
            )
            batches = (
                key_batches + request_batches + parked_batches + signal_batches + audit_batches
            )
            return Sweep(keys, batches, requests, parked, entries)
        finally:
            if locked:
                await _unlock(conn)


async def _delete_all(
    conn: AsyncConnection, settings: Settings, delete: Delete, *, retention: float | None = None
) -> tuple[int, int]:
    """Run ``delete`` (with ``retention``, default ``inbox_retention``) a batch per transaction
    until a batch finds fewer than ``janitor_batch_size`` rows; (rows deleted, transactions that
    deleted some)."""
    retention = settings.inbox_retention if retention is None else retention
    deleted = batches = 0
    while True:
        async with conn.begin():
            count = await delete(conn, retention=retention, limit=settings.janitor_batch_size)
        deleted += count
        if count:
            batches += 1
        if count < settings.janitor_batch_size:
            return deleted, batches


async def _unlock(conn: AsyncConnection) -> None:
    """Release the janitor lock, or close the connection so that the lock cannot outlive it.

    A connection that already died took its lock with it. A failure to release is logged, not
    raised, so that it cannot hide the error that ended the sweep.
    """
    if conn.invalidated:
        return
    try:
        async with conn.begin():
            await maintenance.unlock_janitor(conn)
    except BaseException as exc:
        await conn.invalidate(exc)
        if not isinstance(exc, Exception):
            raise
        log.warning("could not release the janitor lock; closed its connection: %r", exc)


class Janitor:
    """Sweeps expired inbox keys every ``janitor_interval`` until stopped.

    ``metrics`` counts ``Count.INBOX_EXPIRED``, the keys it deleted, and
    ``Count.INGRESS_REQUESTS_EXPIRED``.
    """

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = Metrics() if metrics is None else metrics

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep now and then every interval until ``stop`` is set.

        A transient failure is logged and the next sweep waits for the next interval; any other
        error is raised.
        """
        log.info(
            "expiring inbox keys after %s, every %s",
            format_duration(self.settings.inbox_retention),
            format_duration(self.settings.janitor_interval),
        )
        while not stop.is_set():
            try:
                await self.sweep()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning(
                    "inbox sweep failed, next in %s: %r",
                    format_duration(self.settings.janitor_interval),
                    exc,
                )
            await first(stop.wait(), within=self.settings.janitor_interval)

    async def sweep(self) -> Sweep | None:
        """One sweep, counted and logged."""
        result = await sweep(self.engine, self.settings)
        if result is None:
            log.debug("another instance is sweeping the inbox")
        elif result.deleted or result.requests or result.audit_entries:
            self.metrics.expired(result.deleted, result.requests)
            log.info(
                "deleted %d expired inbox keys, %d ingress requests and %d console audit "
                "entries in %d batches",
                result.deleted,
                result.requests,
                result.audit_entries,
                result.batches,
            )
        return result
