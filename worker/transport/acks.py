"""Settling deliveries: acks and nacks, with one multiple-ack where it is provably safe.

AMQP's ``basic.ack(tag, multiple=True)`` settles every unsettled delivery of the channel up to
``tag``. A channel numbers its deliveries 1, 2, 3 ...; this module sends a multiple-ack only
for a run that starts at the channel's lowest tag not yet settled and in which every tag is
either being acked now (its transaction committed) or was settled before. A tag it never saw
(a delivery the client dropped, e.g. one that arrived for a cancelled consumer) breaks the run,
so a multiple-ack can never settle a delivery nobody processed. Any other delivery is settled on
its own. Settlements are issued one call at a time, in order: a call's multiple-ack is written
before its single acks, and all of them before the next call's first, so none overtakes another.
The single acks of one call are sent together rather than each after the last was written: each
settles only its own tag, which no other settlement of the call covers, so their order is free
(a batch committed above a delivery still in flight has every tag acked alone).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

log = logging.getLogger(__name__)


@dataclass
class _Channel:
    """What is settled on one AMQP channel: every tag below ``floor``, and ``above`` (settled
    tags at or over ``floor``)."""

    floor: int = 1
    above: set[int] = field(default_factory=set)

    def settled(self, tag: int) -> None:
        self.above.add(tag)
        while self.floor in self.above:
            self.above.discard(self.floor)
            self.floor += 1

    def run(self, ready: Iterable[int]) -> list[int]:
        """The tags of ``ready`` that one multiple-ack may settle: those in the unbroken
        sequence from ``floor`` of tags settled before or in ``ready``."""
        ready = set(ready)
        run: list[int] = []
        tag = self.floor
        while tag in ready or tag in self.above:
            if tag in ready:
                run.append(tag)
            tag += 1
        return run


class Settlements:
    """The settled deliveries of a consumer's channels, and the one way to settle them."""

    def __init__(self) -> None:
        # per AMQP channel (a reconnect opens a new one)
        self._channels: weakref.WeakKeyDictionary[Any, _Channel] = weakref.WeakKeyDictionary()
        self._issuing = asyncio.Lock()

    async def ack(self, messages: Iterable[AbstractIncomingMessage]) -> int:
        """Ack ``messages`` (all committed): the run from the channel's lowest unsettled tag
        with one multiple-ack, the others one by one. Returns how many multiple-acks it sent."""
        sent = 0
        async with self._issuing:
            by_channel: dict[Any, dict[int, AbstractIncomingMessage]] = {}
            for message in messages:
                channel = _channel_of(message)
                if channel is None or message.delivery_tag is None:
                    _void(message)
                    continue
                by_channel.setdefault(channel, {})[message.delivery_tag] = message
            for channel, ready in by_channel.items():
                state = self._channels.setdefault(channel, _Channel())
                run = state.run(ready)
                if len(run) > 1:
                    for tag in run:
                        state.settled(tag)
                    await _issue(ready[run[-1]].ack(multiple=True))
                    sent += 1
                    for tag in run:
                        del ready[tag]
                for tag in ready:
                    state.settled(tag)
                await asyncio.gather(
                    *(_issue(message.ack()) for _, message in sorted(ready.items()))
                )
        return sent

    async def ack_one(self, message: AbstractIncomingMessage) -> None:
        await self.ack([message])

    async def requeue(self, message: AbstractIncomingMessage) -> None:
        """Return ``message`` to its queue (``basic.nack`` with requeue)."""
        await self._nack(message, requeue=True)

    async def reject(self, message: AbstractIncomingMessage) -> None:
        """Hand ``message`` to the broker's dead-lettering (``basic.nack`` without requeue): the
        work queue's dead-letter exchange parks it as it is, with the broker's ``x-death``."""
        await self._nack(message, requeue=False)

    async def _nack(self, message: AbstractIncomingMessage, *, requeue: bool) -> None:
        async with self._issuing:
            channel = _channel_of(message)
            if channel is not None and message.delivery_tag is not None:
                self._channels.setdefault(channel, _Channel()).settled(message.delivery_tag)
            await _issue(message.nack(requeue=requeue))


def _channel_of(message: AbstractIncomingMessage) -> Any:
    """The AMQP channel ``message`` came on, or None once that channel has closed."""
    try:
        return message.channel
    except Exception:  # aio-pika raises ChannelInvalidStateError for a closed channel
        return None


def _void(message: AbstractIncomingMessage) -> None:
    log.warning(
        "could not settle message %s: its channel has closed (the broker will redeliver it)",
        message.message_id,
    )


async def _issue(settlement: Any) -> None:
    """Await an ack or nack; on a dead channel the tag is void and the broker redelivers."""
    try:
        await settlement
    except Exception as exc:
        log.warning("could not settle a delivery (the broker will redeliver it): %r", exc)
