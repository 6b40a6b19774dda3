"""The consumer's channel, the topology declared on it, and its subscription to the work queue:
the one object the consumer, its pause gate and its copy publisher share.

Invariant: whoever holds it sees the current channel and topology (a paused consumer declares the
topology again before it resumes), and the work queue is consumed at most once at a time.

The channel is aio-pika's robust one (it declares the topology again after a reconnect), but the
work queue is consumed on its aiormq channel (``basic_consume``): each delivery reaches the
consumer as a lean ``deliveries.Received``, not an aio-pika message. aio-pika does not restore
such a consumer, so the subscription consumes again itself, on the new aiormq channel, each time
the robust channel reopens (and after the broker cancelled it) while it is meant to consume; the
deliveries of the old channel stay tied to it, void.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiormq.abc
import aiormq.exceptions
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection
from pamqp.commands import Basic

from worker.core.router import Router
from worker.settings import Settings
from worker.transport.deliveries import Received, received_from
from worker.transport.topology import Topology, declare_topology

log = logging.getLogger(__name__)

OnMessage = Callable[[Received], None]
"""Takes a delivery of the work queue."""

CONSUME_AGAIN_DELAY = 1.0
"""Seconds between tries to consume again after the broker cancelled the consumer."""


class Subscription:
    """The channel the consumer takes deliveries on and publishes its copies on (confirms on,
    returns raised), its ``topology`` (bound with ``router``'s routing keys), and whether it
    consumes the work queue (``consume``, ``cancel``)."""

    def __init__(self, settings: Settings, router: Router, on_message: OnMessage) -> None:
        self.settings = settings
        self.router = router
        self.on_message = on_message
        self.channel: AbstractRobustChannel | None = None
        self.topology: Topology | None = None
        self._wanted = False  # consume (again, after a reopen) until ``cancel``
        self._underlay: aiormq.abc.AbstractChannel | None = None  # what the consumer is on
        self._consumer_tag: str | None = None
        self._switching = asyncio.Lock()  # one consume or cancel at a time
        self._again: asyncio.Task[None] | None = None

    @property
    def consuming(self) -> bool:
        """True while a consumer is attached to the work queue on an open channel."""
        underlay = self._underlay
        return self._consumer_tag is not None and underlay is not None and not underlay.is_closed

    @property
    def channel_lost(self) -> bool:
        """True when there is no open channel (the delivery tags taken on it are void)."""
        return self.channel is None or self.channel.is_closed

    async def open(self, connection: AbstractRobustConnection) -> Topology:
        """Open the channel and declare the topology on it."""
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        assert isinstance(channel, AbstractRobustChannel)
        self.channel = channel
        await channel.set_qos(prefetch_count=self.settings.prefetch)
        channel.reopen_callbacks.add(self._reopened)
        return await self.declare()

    async def declare(self) -> Topology:
        """Declare the topology (again) on the channel."""
        assert self.channel is not None
        self.topology = await declare_topology(
            self.channel, self.settings, self.router.routing_keys()
        )
        return self.topology

    async def consume(self) -> None:
        """Consume the work queue, deliveries to ``on_message``, now and after each reopen of
        the channel until ``cancel``. Raises ``ChannelInvalidStateError`` while the channel is
        closed (its reopen consumes): it never waits for the broker to come back, so a resume
        under way never holds up a stop."""
        assert self.channel is not None
        async with self._switching:
            self._wanted = True
            if self.channel.is_closed:  # (its underlay would wait for the reconnect)
                raise aiormq.exceptions.ChannelInvalidStateError(
                    f"{self.channel!r} is closed; it consumes once it reopens"
                )
            await self._consume_on(await self.channel.get_underlay_channel())

    async def cancel(self) -> None:
        """Stop consuming the work queue and return once the broker confirmed it (deliveries in
        flight stay to be settled)."""
        async with self._switching:
            self._wanted = False  # (a ``_consume_again`` in flight sees it: never cancelled)
            underlay, tag = self._underlay, self._consumer_tag
            self._consumer_tag = None
            if underlay is not None and tag is not None:
                try:
                    await underlay.basic_cancel(tag)
                except Exception:  # a dead channel consumes nothing anyway
                    log.debug("cancelling the consumer failed", exc_info=True)

    async def _consume_on(self, underlay: aiormq.abc.AbstractChannel) -> None:
        """Attach the consumer on ``underlay``, unless it is attached there already."""
        assert self.topology is not None
        if self._consumer_tag is not None and self._underlay is underlay and self.consuming:
            return
        consume_ok = await underlay.basic_consume(self.topology.queue.name, self._deliver)
        self._underlay, self._consumer_tag = underlay, consume_ok.consumer_tag
        underlay.on_consumer_cancel_callbacks.add(self._cancelled_by_broker)

    async def _deliver(self, message: aiormq.abc.DeliveredMessage) -> None:
        self.on_message(received_from(message))

    async def _reopened(self, channel: Any) -> None:
        """The robust channel reopened (on a new connection, or after the broker closed it):
        consume again on its new aiormq channel if the consumer is meant to consume."""
        async with self._switching:
            if self._wanted and self.channel is not None:
                try:
                    await self._consume_on(await self.channel.get_underlay_channel())
                except Exception:
                    log.warning("could not consume again on the reopened channel", exc_info=True)
                    return
                log.info("consuming %r again on the reopened channel", self.settings.queue)

    def _cancelled_by_broker(self, frame: Basic.Cancel) -> None:
        """The broker cancelled the consumer (its queue was deleted, a quorum queue's leader
        moved): declare the topology and consume again, as aio-pika does for its consumers."""
        if frame.consumer_tag != self._consumer_tag or not self._wanted:
            return
        log.warning("the broker cancelled the consumer of %r; consuming again", self.settings.queue)
        self._consumer_tag = None
        if self._again is None or self._again.done():
            self._again = asyncio.create_task(self._consume_again())

    async def _consume_again(self) -> None:
        while self._wanted and self.channel is not None and not self.channel.is_closed:
            try:
                await self.declare()
                async with self._switching:
                    if self._wanted:
                        await self._consume_on(await self.channel.get_underlay_channel())
                return
            except Exception as exc:
                log.warning("could not consume %r again: %r", self.settings.queue, exc)
                await asyncio.sleep(CONSUME_AGAIN_DELAY)

    async def close(self) -> None:
        """Close the channel: deliveries never taken go back to the queue."""
        if self.channel is not None and not self.channel.is_closed:
            await self.channel.close()
