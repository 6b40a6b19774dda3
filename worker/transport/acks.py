"""Settling deliveries: acks and nacks, with one multiple-ack where it is provably safe.

AMQP's ``basic.ack(tag, multiple=True)`` settles every unsettled delivery of the channel up to
``tag``. A channel numbers its deliveries 1, 2, 3 ...; this module sends a multiple-ack only
for a run that starts at the channel's lowest tag not yet settled and in which every tag is
either being acked now (its transaction committed) or was settled before. A tag it never saw
(a delivery the client dropped, e.g. one that arrived for a cancelled consumer) breaks the run,
so a multiple-ack can never settle a delivery nobody processed.

A committed delivery above the run may wait (it is *held*) while every unsettled delivery below
it is one this consumer received (``received``) and so will settle: a culprit being parked, the
other consumer task's batch. Once those are settled, one multiple-ack settles the held ones with
them. At most ``hold`` deliveries of a channel are held (past that, the highest are acked on
their own: a later run goes on through them), never past a delivery the client dropped, and
``flush`` acks all of them (the consumer stops: what is below them will not be settled); any
other committed delivery is acked on its own. An ack is still sent only after the commit;
holding it only delays it, never past the settling of what is below it.

Settlements go out on the aiormq channel a delivery came on (``basic.ack``/``basic.nack``), and
each delivery is settled once: a second settlement of a tag is dropped here (on the wire the
broker would close the channel for it). Settlements are issued one at a time, in order, each
after the last was written, so none overtakes another. (Not together: the client's write queue
is bounded, and on a connection that dies with settlements still queued, one waiting for room
there would wait for ever, holding up every settlement after it.) Each ends once its channel has
closed, if not before (``closing.until_closed``): a write caught waiting for room in a dead
connection's full queue would otherwise hold the lock every later settlement waits on.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from worker.telemetry import Count, Telemetry
from worker.transport.closing import until_closed
from worker.transport.deliveries import Received

log = logging.getLogger(__name__)


@dataclass
class _Channel:
    """What is settled on one AMQP channel: every tag below ``floor``, and ``above`` (settled
    tags at or over ``floor``); ``held``: committed deliveries whose ack waits; ``received``: the
    highest tag the consumer received, and ``dropped`` the tags below it it never received."""

    floor: int = 1
    above: set[int] = field(default_factory=set)
    held: dict[int, Received] = field(default_factory=dict)
    received: int = 0
    dropped: set[int] = field(default_factory=set)

    def is_settled(self, tag: int) -> bool:
        return tag < self.floor or tag in self.above or tag in self.held

    def settled(self, tag: int) -> None:
        self.above.add(tag)
        while self.floor in self.above:
            self.above.discard(self.floor)
            self.floor += 1

    def arrived(self, tag: int) -> None:
        if tag > self.received + 1:
            self.dropped.update(range(self.received + 1, tag))
        self.dropped.discard(tag)  # (one that came late, after a higher one)
        self.received = max(self.received, tag)

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

    def may_wait(self) -> bool:
        """True while the held deliveries may wait for a multiple-ack: every unsettled tag below
        them was received, so it will be settled here."""
        top = max(self.held)
        return top <= self.received and not any(self.floor <= t < top for t in self.dropped)


class Settlements:
    """The settled deliveries of a consumer's channels, and the one way to settle them.

    ``hold``: the most committed deliveries of a channel whose acks may wait for a multiple-ack
    (0: none wait); holding needs every delivery reported with ``received``. Each multiple-ack
    sent is counted in ``telemetry`` (``Count.MULTIPLE_ACKS``).
    """

    def __init__(self, hold: int = 0, telemetry: Telemetry | None = None) -> None:
        # per AMQP channel (a reconnect opens a new one)
        self._channels: weakref.WeakKeyDictionary[Any, _Channel] = weakref.WeakKeyDictionary()
        self._issuing = asyncio.Lock()
        self._hold = hold
        self._telemetry = Telemetry() if telemetry is None else telemetry

    def received(self, message: Received) -> None:
        """Note that the consumer received ``message`` (and will settle it)."""
        if not message.void:
            state = self._channels.get(message.channel)
            if state is None:  # (not setdefault: that would build a _Channel per delivery)
                state = self._channels[message.channel] = _Channel()
            state.arrived(message.delivery_tag)

    async def ack(self, messages: Iterable[Received]) -> int:
        """Ack ``messages`` (all committed): the run from the channel's lowest unsettled tag
        with one multiple-ack, the others held or one by one. Returns how many multiple-acks it
        sent."""
        sent = 0
        async with self._issuing:
            by_channel: dict[Any, dict[int, Received]] = {}
            void: list[Received] = []
            for message in messages:
                if message.void:
                    void.append(message)
                    continue
                by_channel.setdefault(message.channel, {})[message.delivery_tag] = message
            if void:
                _void(void)
            for channel, ready in by_channel.items():
                state = self._channels.setdefault(channel, _Channel())
                state.held.update(_unsettled(state, ready))
                sent += await self._ack_held(state)
            self._forget_closed()
        return sent

    async def ack_one(self, message: Received) -> None:
        await self.ack([message])

    async def requeue(self, message: Received) -> None:
        """Return ``message`` to its queue (``basic.nack`` with requeue)."""
        await self._nack(message, requeue=True)

    async def reject(self, message: Received) -> None:
        """Hand ``message`` to the broker's dead-lettering (``basic.nack`` without requeue): the
        work queue's dead-letter exchange parks it as it is, with the broker's ``x-death``."""
        await self._nack(message, requeue=False)

    async def flush(self) -> None:
        """Ack every held delivery now, each on its own."""
        async with self._issuing:
            self._forget_closed()
            for state in list(self._channels.values()):
                await self._ack_alone(state, len(state.held))

    async def _nack(self, message: Received, *, requeue: bool) -> None:
        async with self._issuing:
            if message.void:
                _void([message])
                return
            state = self._channels.setdefault(message.channel, _Channel())
            if state.is_settled(message.delivery_tag):
                _settled_twice(message)
                return
            state.settled(message.delivery_tag)
            await _issue(
                message,
                message.channel.basic_nack(message.delivery_tag, multiple=False, requeue=requeue),
            )
            if state.held:  # it may have been what they waited for
                await self._ack_held(state)

    async def _ack_held(self, state: _Channel) -> int:
        """Ack the held deliveries of ``state``'s channel that one multiple-ack may settle; keep
        the others held while they may wait, else ack them on their own. Returns how many
        multiple-acks it sent."""
        sent = 0
        run = state.run(state.held)
        if run:
            last = state.held[run[-1]]
            for tag in run:
                state.settled(tag)
                del state.held[tag]
            await _issue(last, last.channel.basic_ack(last.delivery_tag, multiple=len(run) > 1))
            sent = int(len(run) > 1)
            self._telemetry.count(Count.MULTIPLE_ACKS, sent)
        if state.held and not state.may_wait():
            await self._ack_alone(state, len(state.held))
        elif len(state.held) > self._hold:  # the highest: the run will go on through them
            await self._ack_alone(state, len(state.held) - self._hold)
        return sent

    def _forget_closed(self) -> None:
        """Drop what is held on channels that closed: their tags are void (the broker
        redelivers), and a held delivery would keep its channel's entry alive."""
        for channel, state in list(self._channels.items()):
            if state.held and getattr(channel, "is_closed", False):
                state.held.clear()

    async def _ack_alone(self, state: _Channel, count: int) -> None:
        """Ack the ``count`` highest held deliveries of ``state``'s channel, each on its own."""
        alone = sorted(state.held.items())[-count:] if count > 0 else []
        for tag, _ in alone:
            state.settled(tag)
            del state.held[tag]
        for tag, message in alone:
            await _issue(message, message.channel.basic_ack(tag, multiple=False))


def channel_closed(message: Received) -> bool:
    """Whether the channel ``message`` came on has closed: it can no longer be settled, and the
    broker delivers it again."""
    return message.void


def _unsettled(state: _Channel, ready: dict[int, Received]) -> dict[int, Received]:
    """``ready`` without the deliveries settled (or held) before, each named in a warning."""
    twice = [tag for tag in ready if state.is_settled(tag)]
    for tag in twice:
        _settled_twice(ready.pop(tag))
    return ready


def _settled_twice(message: Received) -> None:
    log.warning(
        "message %s (delivery %d) was settled before; not settling it again",
        message.message_id,
        message.delivery_tag,
    )


VOID_IDS_SHOWN = 5
"""Message ids a warning about acks on a closed channel names (one line per batch, not per ack)."""


def _void(messages: list[Received]) -> None:
    ids = ", ".join(str(message.message_id) for message in messages[:VOID_IDS_SHOWN])
    more = f" and {len(messages) - VOID_IDS_SHOWN} more" if len(messages) > VOID_IDS_SHOWN else ""
    log.warning(
        "could not ack %d message(s) (%s%s): their channel has closed, the broker will "
        "redeliver them (the inbox recognises each as a duplicate)",
        len(messages),
        ids,
        more,
    )


async def _issue(message: Received, settlement: Any) -> None:
    """Await an ack or nack of ``message`` until its channel closes (``closing.until_closed``);
    on a dead channel the tag is void and the broker redelivers."""
    try:
        await until_closed(message.channel, settlement)
    except Exception as exc:
        log.warning("could not settle a delivery (the broker will redeliver it): %r", exc)
