"""The outbox relay: committed events out to RabbitMQ, at least once, in order per ordering key.

One batch is one transaction: claim due rows (``FOR UPDATE SKIP LOCKED``, oldest first), publish
them persistent and ``mandatory`` with publisher confirms, delete the confirmed ones, count a
failure on the returned or nacked ones, commit. A row is deleted only in the transaction that
claimed it and only after its confirm, so a crash anywhere publishes it again (same message id)
rather than losing it. Rows of one ordering key go one at a time, in id order, which is their
commit order; other rows are published concurrently, their confirms pipelined.

A broker or database outage fails the whole batch: it rolls back and is retried with backoff.
A row the broker returns or nacks fails alone: its next try moves out exponentially, and after
``relay_max_attempts`` it is moved to ``outbox_parked``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import tracing
from worker.backoff import first, until_stopped
from worker.core.envelope import CORRELATION_HEADER
from worker.errors import Retryable
from worker.faults import RELAY_AFTER_PUBLISH, RELAY_MID_BATCH, crash_point
from worker.ops.metrics import Metrics
from worker.settings import Settings
from worker.sql import outbox
from worker.sql.outbox import OutboxRow

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT = 30.0
"""Seconds a batch may wait for its confirms before the whole batch is retried."""

MIN_IDLE = 0.05
"""First wait of a relay that found less than a full batch; it doubles up to the poll interval."""

CAUSATION_HEADER = "causation-id"


MAX_SHORT_STRING = 255
"""Bytes an AMQP short string (such as the correlation_id property) may hold."""


def message_of(row: OutboxRow) -> aio_pika.Message:
    """The AMQP message for an outbox row: persistent, identified by the row's message id.

    The correlation id travels in the ``correlation-id`` header too, and only there when it is
    longer than an AMQP property can hold (a key may have 512 characters).
    """
    correlation_id = row.correlation_id
    headers = {**row.headers, CAUSATION_HEADER: row.causation_id}
    if correlation_id is not None:
        headers[CORRELATION_HEADER] = correlation_id
        if len(correlation_id.encode("utf-8")) > MAX_SHORT_STRING:
            correlation_id = None
    return aio_pika.Message(
        row.body,
        headers=headers,
        content_type=row.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(row.message_id),
        correlation_id=correlation_id,
        timestamp=row.created_at,
    )


class Relay:
    """Publishes the outbox until stopped; ``wake()`` makes it look at once.

    ``stats`` counts ``relay_published``, ``relay_failed`` (returned, nacked or unpublishable,
    to be retried) and ``relay_parked``.
    """

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        connection: AbstractRobustConnection,
        stats: Counter[str] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.connection = connection
        self.stats: Counter[str] = Counter() if stats is None else stats
        self.metrics = Metrics() if metrics is None else metrics
        self._wake = asyncio.Event()
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._probing = asyncio.Lock()

    def wake(self) -> None:
        """Ask for a batch now: new rows were committed."""
        self._wake.set()

    async def start(self) -> None:
        """Open the publishing channel (confirms on, returns raised); ``run`` does it if needed."""
        if self._channel is None:
            self._channel = await self.connection.channel(
                publisher_confirms=True, on_return_raises=True
            )

    async def run(self, stop: asyncio.Event) -> None:
        """Relay batches until ``stop`` is set; the batch under way when it is set completes."""
        await self.start()
        assert self._channel is not None
        listener = (
            asyncio.create_task(self._listen(stop), name="outbox-listener")
            if self.settings.outbox_notify
            else None
        )
        log.info(
            "relaying the outbox (batch %d, %d attempts before parking)",
            self.settings.relay_batch_size,
            self.settings.relay_max_attempts,
        )
        retrying = until_stopped(stop, logger=log)
        idle = MIN_IDLE
        try:
            while not stop.is_set():
                try:
                    claimed: int = await retrying(self.relay_batch)
                except Exception:
                    if stop.is_set():
                        break  # an outage during shutdown: the rows stay for the next start
                    raise
                if claimed >= self.settings.relay_batch_size:
                    continue
                idle = MIN_IDLE if claimed else min(idle * 2, self.settings.relay_poll_interval)
                await self._idle(stop, idle)
        finally:
            if listener is not None:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
            if not self._channel.is_closed:
                await self._channel.close()

    async def relay_batch(self) -> int:
        """Relay one batch in one transaction; returns how many rows it claimed."""
        self._wake.clear()
        async with self.engine.connect() as conn, conn.begin():
            rows = await outbox.claim_outbox(conn, self.settings.relay_batch_size)
            if not rows:
                return 0
            with tracing.span("outbox publish", {"worker.batch_size": len(rows)}) as span:
                published, failed = await self._publish(rows)
                tracing.set_attribute(span, "worker.failed", len(failed))
            crash_point(RELAY_AFTER_PUBLISH)
            await outbox.delete_outbox(conn, published)
            parked = await outbox.fail_outbox(
                conn,
                failed,
                max_attempts=self.settings.relay_max_attempts,
                retry_delay=self.settings.relay_retry_delay,
            )
        self.metrics.relay_batch(
            len(rows), published=len(published), failed=len(failed), parked=len(parked)
        )
        self.stats["relay_published"] += len(published)
        if failed:
            self.stats["relay_failed"] += len(failed)
            self.stats["relay_parked"] += len(parked)
            for row_id, error in failed.items():
                log.warning(
                    "outbox row %d %s: %s",
                    row_id,
                    "parked in outbox_parked" if row_id in parked else "will be retried",
                    error,
                )
        return len(rows)

    async def _publish(self, rows: list[OutboxRow]) -> tuple[list[int], dict[int, str]]:
        """Publish ``rows``: unordered ones concurrently, each ordering key's rows in turn.

        Returns the confirmed ids and the failed ones with their errors. A key's rows after a
        failed one are neither: they stay for a later batch, behind the failed row.
        """
        exchanges = {name: await self._exchange(name) for name in {row.exchange for row in rows}}
        published: list[int] = []
        failed: dict[int, str] = {}

        async def publish_in_turn(chain: Iterable[OutboxRow]) -> None:
            for row in chain:
                error = await self._publish_one(row, exchanges[row.exchange])
                if error is not None:
                    failed[row.id] = error
                    return
                published.append(row.id)

        chains: dict[str, list[OutboxRow]] = defaultdict(list)
        singles: list[list[OutboxRow]] = []
        for row in rows:
            if row.ordering_key is None:
                singles.append([row])
            else:
                chains[row.ordering_key].append(row)
        await first(
            asyncio.gather(*(publish_in_turn(c) for c in [*singles, *chains.values()])),
            within=PUBLISH_TIMEOUT,
            on_timeout=TimeoutError(f"no publisher confirms within {PUBLISH_TIMEOUT} s"),
        )
        return published, failed

    async def _publish_one(self, row: OutboxRow, exchange: AbstractExchange | None) -> str | None:
        """Publish one row to ``exchange`` (None: the broker has no exchange of the row's name);
        the reason it failed, or None once the broker confirmed it."""
        try:
            message = message_of(row)
        except (TypeError, ValueError) as exc:
            return f"unpublishable: {exc}"
        if exchange is None:
            return f"exchange {row.exchange!r} does not exist"
        try:
            await exchange.publish(message, row.routing_key, mandatory=True)
        except (TypeError, ValueError) as exc:  # pamqp refuses a property it cannot encode
            return f"unpublishable: {exc}"
        except aiormq.exceptions.PublishError:
            return (
                f"returned as unroutable: no queue is bound to exchange {row.exchange!r} "
                f"for routing key {row.routing_key!r}"
            )
        except aiormq.exceptions.DeliveryError as exc:
            return f"nacked by the broker: {exc!r}"
        except aiormq.exceptions.ChannelClosed as exc:
            # e.g. the exchange was deleted since it was checked: check again on the next try
            self._exchanges.pop(row.exchange, None)
            raise Retryable(f"the publishing channel was closed: {exc!r}") from exc
        crash_point(RELAY_MID_BATCH)
        return None

    async def _exchange(self, name: str) -> AbstractExchange | None:
        """The exchange ``name``, or None if the broker does not have it.

        Publishing to a missing exchange would close the publishing channel and fail the whole
        batch, so existence is checked on a throwaway channel: once per name while it exists,
        once per batch while it does not, and one name at a time (one probe channel at a time,
        however many batches and rows ask).
        """
        assert self._channel is not None
        if name == "":
            return self._channel.default_exchange
        async with self._probing:
            if name not in self._exchanges:
                probe = await self.connection.channel(publisher_confirms=False)
                try:
                    await probe.get_exchange(name, ensure=True)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    return None
                finally:
                    if not probe.is_closed:
                        await probe.close()
                self._exchanges[name] = await self._channel.get_exchange(name, ensure=False)
            return self._exchanges[name]

    async def _idle(self, stop: asyncio.Event, seconds: float) -> None:
        """Wait until woken, stopped, or ``seconds`` passed."""
        await first(self._wake.wait(), stop.wait(), within=seconds)

    async def _listen(self, stop: asyncio.Event) -> None:
        """LISTEN for commits that added outbox rows, reconnecting after a lost connection.

        A notification only wakes the relay; polling still finds every row without one, so if
        listening fails for good the relay logs it and goes on polling.
        """
        retrying = until_stopped(stop, initial=0.5, logger=log)
        try:
            await retrying(self._listen_once, stop)
        except Exception:
            log.exception("LISTEN %s failed; relying on polling", outbox.OUTBOX_CHANNEL)

    async def _listen_once(self, stop: asyncio.Event) -> None:
        lost = asyncio.Event()

        def on_notify(*_: Any) -> None:
            self._wake.set()

        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            raw.add_termination_listener(lambda _: lost.set())
            await raw.add_listener(outbox.OUTBOX_CHANNEL, on_notify)
            self._wake.set()  # rows committed while nobody listened
            try:
                await first(stop.wait(), lost.wait())
            finally:
                if not raw.is_closed():
                    await raw.remove_listener(outbox.OUTBOX_CHANNEL, on_notify)
        if lost.is_set() and not stop.is_set():
            raise ConnectionError("the LISTEN connection was lost")
