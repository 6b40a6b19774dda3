"""Settling deliveries: acks and nacks, with one multiple-ack where it is provably safe.

AMQP's ``basic.ack(tag, multiple=True)`` settles every unsettled delivery of the channel up to
``tag``. It is sent only for a contiguous run: when every delivery of that channel with a tag up
to ``tag`` that is still unsettled is one being acked now (its transaction committed). Any other
delivery is settled on its own. Settlements are issued one at a time, in order, so a multiple-ack
never overtakes an ack or nack of a tag below it.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterable
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

log = logging.getLogger(__name__)


class Settlements:
    """The unsettled deliveries of a consumer's channels, and the one way to settle them."""

    def __init__(self) -> None:
        # per AMQP channel (a reconnect opens a new one): the tags delivered and not yet settled
        self._unsettled: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
        self._issuing = asyncio.Lock()

    def received(self, message: AbstractIncomingMessage) -> None:
        """Note a delivery as unsettled; call it before the delivery can be settled."""
        channel = _channel_of(message)
        if channel is not None and message.delivery_tag is not None:
            self._unsettled.setdefault(channel, set()).add(message.delivery_tag)

    async def ack(self, messages: Iterable[AbstractIncomingMessage]) -> int:
        """Ack ``messages`` (all committed): the contiguous run from the channel's lowest
        unsettled tag with one multiple-ack, the others one by one. Returns how many
        multiple-acks it sent."""
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
                unsettled = self._unsettled.setdefault(channel, set())
                run: list[int] = []
                for tag in sorted(unsettled):
                    if tag not in ready:
                        break
                    run.append(tag)
                if len(run) > 1:
                    unsettled.difference_update(run)
                    await _issue(ready[run[-1]].ack(multiple=True))
                    sent += 1
                    for tag in run:
                        del ready[tag]
                for tag, message in sorted(ready.items()):
                    unsettled.discard(tag)
                    await _issue(message.ack())
        return sent

    async def ack_one(self, message: AbstractIncomingMessage) -> None:
        await self.ack([message])

    async def requeue(self, message: AbstractIncomingMessage) -> None:
        """Return ``message`` to its queue (``basic.nack`` with requeue)."""
        async with self._issuing:
            self._forget(message)
            await _issue(message.nack(requeue=True))

    def _forget(self, message: AbstractIncomingMessage) -> None:
        channel = _channel_of(message)
        if channel is not None and message.delivery_tag is not None:
            self._unsettled.get(channel, set()).discard(message.delivery_tag)


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
