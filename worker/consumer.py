"""The consumer: deliveries in, units of work, acks out — an ack only ever after a commit.

Each delivery is checked (``open_envelope``), processed in one transaction (``unit_of_work``) and
then acked. A ``Rejected`` delivery is parked in the dead-letter queue first and acked after the
broker confirmed the parked copy. A transient failure is retried in-process with backoff; if it
persists the delivery is returned to the queue unacked, never dead-lettered for an outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from worker import dead_letters
from worker.envelope import Delivery, Envelope, open_envelope
from worker.errors import Rejected, is_transient
from worker.router import Router
from worker.settings import Settings
from worker.topology import Topology, declare_topology
from worker.unit_of_work import Outcome, process

log = logging.getLogger(__name__)

TRANSIENT_ATTEMPTS = 3


def delivery_from_amqp(message: AbstractIncomingMessage) -> Delivery:
    """The transport-neutral facts of an aio-pika delivery."""
    return Delivery(
        body=message.body,
        routing_key=message.routing_key or "",
        headers=dict(message.headers or {}),
        message_id=message.message_id,
        correlation_id=message.correlation_id,
        content_type=message.content_type,
        exchange=message.exchange or "",
        redelivered=bool(message.redelivered),
    )


class Consumer:
    """Consumes the work queue on one channel, ``concurrency`` units of work at a time.

    ``stats`` counts outcomes: ``processed``, ``duplicate``, ``dead_lettered``,
    ``dead_lettered:<reason>`` and ``requeued``.
    """

    def __init__(
        self,
        settings: Settings,
        router: Router,
        engine: AsyncEngine,
        connection: AbstractRobustConnection,
        stats: Counter[str] | None = None,
        on_events: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_events = on_events
        self.router = router
        self.engine = engine
        self.connection = connection
        self.stats: Counter[str] = Counter() if stats is None else stats
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._channel: AbstractChannel | None = None
        self._topology: Topology | None = None
        self._consumer_tag: str | None = None
        self._transient_retry = AsyncRetrying(
            stop=stop_after_attempt(TRANSIENT_ATTEMPTS),
            wait=wait_exponential(multiplier=0.1, max=2.0) + wait_random(0, 0.1),
            retry=retry_if_exception(is_transient),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        )

    async def start(self) -> Topology:
        """Declare the topology and start consuming."""
        self._channel = await self.connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        await self._channel.set_qos(prefetch_count=self.settings.prefetch)
        self._topology = await declare_topology(
            self._channel, self.settings, self.router.routing_keys()
        )
        self._consumer_tag = await self._topology.queue.consume(self._on_message)
        log.info(
            "consuming queue %r (routing keys: %s; prefetch %d, concurrency %d)",
            self.settings.queue,
            ", ".join(self.router.routing_keys()) or "none",
            self.settings.prefetch,
            self.settings.concurrency,
        )
        return self._topology

    async def stop(self) -> None:
        """Stop taking deliveries, let the ones in flight commit and ack, then close the channel.

        Prefetched deliveries that never started go back to the queue when the channel closes.
        """
        if self._topology is not None and self._consumer_tag is not None:
            try:
                await self._topology.queue.cancel(self._consumer_tag)
            except Exception:  # a dead channel consumes nothing anyway
                log.debug("cancelling the consumer failed", exc_info=True)
            self._consumer_tag = None
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._channel is not None and not self._channel.is_closed:
            await self._channel.close()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            async with self._slots:
                await self.handle(message)
        finally:
            self._in_flight.discard(task)

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """Process one delivery to its end: acked after commit, parked, or returned to the queue."""
        delivery = delivery_from_amqp(message)
        envelope: Envelope | None = None
        try:
            envelope = open_envelope(
                delivery, self.router, max_body_bytes=self.settings.max_body_bytes
            )
            outcome: Outcome = await self._transient_retry.copy()(
                process,
                self.engine,
                envelope,
                default_exchange=self.settings.exchange,
                notify=self.settings.outbox_notify,
                on_events=self.on_events,
            )
        except Rejected as exc:
            await self._park(message, exc, envelope)
            return
        except Exception as exc:
            if is_transient(exc):
                log.warning(
                    "transient failure persisted for message %s; returning it to the queue: %r",
                    delivery.message_id,
                    exc,
                )
                self.stats["requeued"] += 1
                await self._settle(message.nack(requeue=True))
                return
            log.exception("unexpected failure for message %s", delivery.message_id)
            await self._park(message, exc, envelope, reason="internal-error")
            return
        self.stats[outcome.value] += 1
        log.debug(
            "%s key=%s handler=%s message_id=%s",
            outcome.value,
            envelope.key,
            envelope.handler.name,
            delivery.message_id,
        )
        await self._settle(message.ack())

    async def _park(
        self,
        message: AbstractIncomingMessage,
        exc: Exception,
        envelope: Envelope | None,
        *,
        reason: str | None = None,
    ) -> None:
        reason = reason or (exc.reason if isinstance(exc, Rejected) else "internal-error")
        handler = envelope.handler.name if envelope is not None else None
        if handler is None:
            found = self.router.find(message.routing_key or "")
            handler = found.name if found is not None else None
        assert self._topology is not None
        try:
            await dead_letters.park(
                self._topology.dead_letter_exchange,
                message,
                reason=reason,
                error=str(exc),
                exception_type=type(exc.__cause__ or exc).__name__,
                handler=handler,
            )
        except Exception:
            log.exception(
                "could not park message %s; returning it to the queue", message.message_id
            )
            self.stats["requeued"] += 1
            await self._settle(message.nack(requeue=True))
            return
        self.stats["dead_lettered"] += 1
        self.stats[f"dead_lettered:{reason}"] += 1
        log.warning(
            "dead-lettered message %s (routing key %r): %s: %s",
            message.message_id,
            message.routing_key,
            reason,
            exc,
        )
        await self._settle(message.ack())

    @staticmethod
    async def _settle(settlement: Awaitable[None]) -> None:
        """Ack or nack; on a dead channel the tag is void and the broker redelivers by itself."""
        try:
            await settlement
        except Exception as exc:
            log.warning("could not settle a delivery (the broker will redeliver it): %r", exc)
