"""Writes on an aiormq channel bounded by the channel's life.

Invariant: a publish, ack or nack awaited through ``until_closed`` ends once its channel has
closed (with ``ChannelInvalidStateError`` if it had not ended by then), never waits for ever.
aiormq rejects a pending confirm or drain when its channel closes, but not a write still waiting
for room in the connection's write queue (bounded): when a connection whose socket stopped
draining dies with that queue full, nothing reads it again, and such a write would wait for ever
(holding the channel's publish lock, and whatever its caller holds: a consumer task and its
batch, the settlements of a consumer).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiormq.abc
import aiormq.exceptions

T = TypeVar("T")

_observers: weakref.WeakKeyDictionary[Any, asyncio.Future[Any]] = weakref.WeakKeyDictionary()
"""One observer of each channel's close, made once (aiormq's ``closing`` makes a new one per
call, and one made per write costs more than the write), forgotten once its channel has closed."""


def _closing(channel: aiormq.abc.AbstractChannel) -> asyncio.Future[Any]:
    observer = _observers.get(channel)
    if observer is None:
        observer = _observers[channel] = channel.closing
        key = weakref.ref(channel)

        def forget(_: Any) -> None:  # (its error's traceback may refer to the channel)
            if (closed := key()) is not None:
                _observers.pop(closed, None)

        observer.add_done_callback(forget)
    return observer


async def until_closed(channel: aiormq.abc.AbstractChannel, operation: Awaitable[T]) -> T:
    """Await ``operation`` (a write on ``channel``) until it ends or the channel closes."""
    closing = _closing(channel)
    loop = asyncio.get_running_loop()
    active = True

    def closed(_: Any) -> None:
        if active:
            bound.reschedule(loop.time())  # expire now: cancels the wait

    try:
        async with asyncio.timeout(None) as bound:
            closing.add_done_callback(closed)
            return await operation
    except TimeoutError as exc:
        if not closing.done():
            raise
        raise aiormq.exceptions.ChannelInvalidStateError(
            f"{channel!r} closed while a write on it waited"
        ) from exc
    finally:
        active = False
        closing.remove_done_callback(closed)
