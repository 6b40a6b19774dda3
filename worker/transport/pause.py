"""The consumer's pause gate: consumption stops for a fault that is not a message's (PostgreSQL
unreachable, the deployment not matching the code) and resumes once it is gone.

Invariant: while paused nothing is taken to be parked or retried; a pause returns only once the
broker confirmed the consumer is cancelled, so no delivery comes back to a paused consumer
(aiormq silently drops a delivery for a cancelled consumer, which would leave it unacknowledged
until the channel closes). Why the consumer pauses is decided by ``core.policy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, database, schema
from worker.backoff import first
from worker.core.router import Router
from worker.errors import PauseReason
from worker.settings import Settings
from worker.telemetry import Telemetry
from worker.transport.subscription import Subscription

log = logging.getLogger(__name__)

DEPLOYMENT_RETRY_MAX = 60.0
"""Longest wait, in seconds, before a consumer paused by a deployment fault tries again; the wait
doubles from 1 s with each such pause until a message succeeds."""


class PauseGate:
    """Pauses and resumes one consumer's ``subscription``; ``stopping`` set, it neither pauses
    nor resumes. ``broken`` holds the error of a pause that could not resume."""

    def __init__(
        self,
        settings: Settings,
        router: Router,
        engine: AsyncEngine,
        subscription: Subscription,
        telemetry: Telemetry,
        stopping: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.router = router
        self.engine = engine
        self.subscription = subscription
        self.telemetry = telemetry
        self.stopping = stopping
        self.reason: PauseReason | None = None
        self.detail = ""
        self.unreachable_because = "PostgreSQL unreachable"
        """What the last probe that failed said, for a pause's reason."""
        self.broken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._resuming: asyncio.Task[None] | None = None
        self._deployment_pauses = 0
        self._pausing = asyncio.Lock()

    @property
    def paused(self) -> bool:
        """True while consumption waits for PostgreSQL to answer again, or for a deployment
        fault to be fixed."""
        return self._resuming is not None

    def succeeded(self) -> None:
        """A message ended well: the deployment works, its pauses are no longer in a row."""
        self._deployment_pauses = 0

    async def database_answers(self) -> bool:
        """Probe PostgreSQL; when it does not answer, remember why for the pause."""
        try:
            await database.probe(self.engine)
        except Exception as exc:
            log.warning("PostgreSQL does not answer: %r", exc)
            self.unreachable_because = database.unreachable(exc)
            return False
        return True

    async def resumed(self) -> None:
        """Wait for a resume in flight (the worker is stopping: it ends at once)."""
        if self._resuming is not None:
            await asyncio.gather(self._resuming, return_exceptions=True)

    async def pause(self, reason: PauseReason, detail: str) -> None:
        """Stop consuming until the fault is gone; return once the broker confirmed it."""
        async with self._pausing:
            if self._resuming is not None or self.stopping.is_set():
                return
            await self.subscription.cancel()
            self.reason, self.detail = reason, detail
            self.telemetry.paused(reason)
            if reason is PauseReason.DEPLOYMENT:
                self._deployment_pauses += 1
                wait = min(DEPLOYMENT_RETRY_MAX, 2 ** (self._deployment_pauses - 1))
                log.error(
                    "the deployment does not match the code (%s): consumption paused, nothing "
                    "parked; trying again in %gs, or once migrations are at head. Apply the "
                    "migrations (`worker migrate`) or grant the privileges.",
                    detail,
                    wait,
                )
                self._resuming = asyncio.create_task(self._resume_after_deployment_fault(wait))
            else:
                log.error("%s: consumption paused until it answers again", detail)
                self._resuming = asyncio.create_task(self._resume_when_database_answers())

    async def _resume_after_deployment_fault(self, wait: float) -> None:
        """Resume after ``wait`` seconds, or sooner once migrations that were pending are
        applied (a missing privilege shows only by trying: the next message tries), declaring
        the topology again first (a deleted queue comes back)."""

        async def fixed() -> None:
            if not await self._schema_behind():
                await asyncio.sleep(wait)
                return
            behind = True
            async with asyncio.timeout(wait):
                while behind:
                    await asyncio.sleep(min(wait, 1.0))
                    behind = await self._schema_behind()

        await self._resume(fixed, "trying the deployment again", redeclare=True)

    async def _schema_behind(self) -> bool:
        try:
            return bool(await schema.pending(self.engine, self.settings, self.router))
        except Exception:  # an unreadable schema is no reason to wait less or more
            log.debug("could not read the migration state", exc_info=True)
            return False

    async def _resume_when_database_answers(self) -> None:
        async def answers() -> None:
            await backoff.until_stopped(self.stopping, initial=0.5, maximum=5.0, logger=log)(
                database.probe, self.engine
            )

        await self._resume(answers, "PostgreSQL answers again")

    async def _resume(
        self, fixed: Callable[[], Awaitable[None]], why: str, *, redeclare: bool = False
    ) -> None:
        """Wait until ``fixed`` returns (or the worker stops), then consume again; with
        ``redeclare``, declare the topology first. A declaration in flight is never cancelled
        (that would close the channel the deliveries in flight still ack on)."""
        try:
            with contextlib.suppress(TimeoutError):
                await first(fixed(), self.stopping.wait())
            if redeclare and self.subscription.channel is not None and not self.stopping.is_set():
                await backoff.until_stopped(self.stopping, logger=log)(self.subscription.declare)
            if not self.stopping.is_set():
                await backoff.until_stopped(self.stopping, logger=log)(self.subscription.consume)
                log.info("%s: consumption resumed", why)
        except Exception as exc:
            if not self.stopping.is_set():
                log.exception("could not resume consuming")
                if not self.broken.done():
                    self.broken.set_exception(exc)
        finally:
            self._resuming = None
            self.reason, self.detail = None, ""
            self.telemetry.paused(None)
