"""The consumer's channel, the topology declared on it, and its subscription to the work queue:
the one object the consumer, its pause gate and its copy publisher share.

Invariant: whoever holds it sees the current channel and topology (a paused consumer declares the
topology again before it resumes), and the work queue is consumed at most once at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from worker.core.router import Router
from worker.settings import Settings
from worker.transport.topology import Topology, declare_topology

log = logging.getLogger(__name__)

OnMessage = Callable[[AbstractIncomingMessage], Awaitable[None]]
"""Takes a delivery of the work queue."""


class Subscription:
    """The channel the consumer takes deliveries on and publishes its copies on (confirms on,
    returns raised), its ``topology`` (bound with ``router``'s routing keys), and whether it
    consumes the work queue (``consume``, ``cancel``)."""

    def __init__(self, settings: Settings, router: Router, on_message: OnMessage) -> None:
        self.settings = settings
        self.router = router
        self.on_message = on_message
        self.channel: AbstractChannel | None = None
        self.topology: Topology | None = None
        self._consumer_tag: str | None = None

    @property
    def consuming(self) -> bool:
        """True while a consumer is attached to the work queue on an open channel."""
        channel = self.channel
        return self._consumer_tag is not None and channel is not None and not channel.is_closed

    @property
    def channel_lost(self) -> bool:
        """True when there is no open channel (the delivery tags taken on it are void)."""
        return self.channel is None or self.channel.is_closed

    async def open(self, connection: AbstractRobustConnection) -> Topology:
        """Open the channel and declare the topology on it."""
        self.channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await self.channel.set_qos(prefetch_count=self.settings.prefetch)
        return await self.declare()

    async def declare(self) -> Topology:
        """Declare the topology (again) on the channel."""
        assert self.channel is not None
        self.topology = await declare_topology(
            self.channel, self.settings, self.router.routing_keys()
        )
        return self.topology

    async def consume(self) -> None:
        """Consume the work queue, deliveries to ``on_message``."""
        assert self.topology is not None
        self._consumer_tag = await self.topology.queue.consume(self.on_message)

    async def cancel(self) -> None:
        """Stop consuming the work queue (deliveries in flight stay to be settled)."""
        if self.topology is not None and self._consumer_tag is not None:
            tag, self._consumer_tag = self._consumer_tag, None
            try:
                await self.topology.queue.cancel(tag)
            except Exception:  # a dead channel consumes nothing anyway
                log.debug("cancelling the consumer failed", exc_info=True)

    async def close(self) -> None:
        """Close the channel: deliveries never taken go back to the queue."""
        if self.channel is not None and not self.channel.is_closed:
            await self.channel.close()
