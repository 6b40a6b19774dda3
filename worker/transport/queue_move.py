"""Moving a deployment's queues to queues declared anew: another type, other arguments.

A queue's type and arguments are fixed when it is declared; the broker refuses to declare it
again with others (406 PRECONDITION_FAILED). ``convert`` takes each of the worker's queues the
broker refuses to declare as the settings say (``topology.queue_arguments``) through these steps,
each safe to repeat, so that running it again after a crash finishes the job:

1. a holding queue ``<name>.moving`` is declared and bound as the original is (the work queue's
   to the exchange with every routing key, the dead-letter queue's to the dead-letter exchange),
   so what producers publish meanwhile lands in it too;
2. every message of the original is moved to it: taken, copied with the broker's confirm, and
   only then acked; a crash between the two leaves a message in both, at worst (at least once;
   the inbox recognises the second delivery of a key);
3. the original is deleted (what reached it after the move reached the holding queue too) and
   declared anew with the worker's topology;
4. the holding queue is unbound, its messages are moved into the new queue, and it is deleted.

While the work queue is replaced, the delayed-retry queues are emptied into holding queues as
well (a retry expiring into a work queue that is missing for a moment would be dropped), and
refilled afterwards: a delayed retry waits its whole delay again. The worker's consumers must be
stopped first; ``convert`` refuses to move a queue that has consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from aiormq.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed

from worker.settings import Settings
from worker.transport.dead_letters import move
from worker.transport.topology import declare_exchanges, declare_topology, queue_arguments

log = logging.getLogger(__name__)

HOLDING_SUFFIX = ".moving"
CHUNK = 200
"""Messages taken before their copies' confirms are awaited together."""


class QueueInUse(RuntimeError):
    """A queue to move has consumers: stop the workers first."""


@dataclass
class Moved:
    """What ``convert`` did: the queues declared anew and the messages moved, by queue."""

    converted: list[str] = field(default_factory=list)
    messages: dict[str, int] = field(default_factory=dict)


async def convert(
    connection: AbstractRobustConnection, settings: Settings, routing_keys: Iterable[str]
) -> Moved:
    """Declare the worker's queues as ``settings`` say, moving the messages of those the broker
    refuses to declare so (see the module's docstring); a no-op when it declares them all."""
    routing_keys = list(routing_keys)
    arguments = queue_arguments(settings)
    refused = [
        name for name, args in arguments.items() if not await _declares(connection, name, args)
    ]
    moved = Moved(converted=refused)
    async with connection.channel(publisher_confirms=True, on_return_raises=True) as channel:
        for name in refused:
            consumers = (await channel.declare_queue(name, passive=True)).declaration_result
            if consumers.consumer_count:
                raise QueueInUse(
                    f"queue {name!r} has {consumers.consumer_count} consumer(s): stop the "
                    "workers before converting it"
                )
        retries = [settings.retry_queue(delay) for delay in settings.retry_delays]
        # The retry queues before the work queue, which receives what they expire.
        order = [*retries, settings.dead_letter_queue, settings.queue]
        for name in order:
            if name in refused or (name in retries and settings.queue in refused):
                holding = await _holding(channel, settings, name, routing_keys)
                moved.messages[name] = await _move(channel, name, holding)
                if name in refused:
                    # Whatever reached it after the move reached the holding queue too.
                    await channel.queue_delete(name)
    # A new channel: RabbitMQ 3.10's channel keeps the type of a queue it took messages from,
    # and fails to publish to a queue of the same name declared anew with another type.
    async with connection.channel(publisher_confirms=True, on_return_raises=True) as channel:
        await declare_topology(channel, settings, routing_keys)
        for name in arguments:
            await _refill(channel, settings, name, routing_keys)
    return moved


async def _declares(connection: AbstractRobustConnection, name: str, args: dict[str, Any]) -> bool:
    """Whether the broker declares ``name`` with ``args`` (it creates a missing queue)."""
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, durable=True, arguments=args)
    except ChannelPreconditionFailed as exc:  # (the broker closed the channel)
        log.info("queue %r is declared otherwise: %s", name, exc)
        return False
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
    return True


def _holding_name(name: str) -> str:
    return f"{name}{HOLDING_SUFFIX}"


def _bindings(
    settings: Settings, name: str, routing_keys: Sequence[str]
) -> list[tuple[str, str | None]]:
    """The (exchange, routing key) bindings of the worker's queue ``name``: the work queue's to
    the exchange with every routing key, the dead-letter queue's to the dead-letter exchange;
    none for a retry queue (messages reach it through the default exchange)."""
    if name == settings.queue:
        return [(settings.exchange, routing_key) for routing_key in routing_keys]
    if name == settings.dead_letter_queue:
        return [(settings.dead_letter_exchange, None)]
    return []


async def _holding(
    channel: AbstractChannel, settings: Settings, name: str, routing_keys: Sequence[str]
) -> str:
    """Declare ``name``'s holding queue, bound as ``name`` is; return its name."""
    holding = _holding_name(name)
    queue = await channel.declare_queue(holding, durable=True)  # (classic, whatever the type)
    await declare_exchanges(channel, settings)
    for exchange, routing_key in _bindings(settings, name, routing_keys):
        await queue.bind(exchange, routing_key)
    return holding


async def _unbind(
    channel: AbstractChannel, settings: Settings, name: str, routing_keys: Sequence[str]
) -> None:
    queue = await channel.declare_queue(_holding_name(name), passive=True)
    for exchange, routing_key in _bindings(settings, name, routing_keys):
        await queue.unbind(exchange, routing_key)


async def _move(channel: AbstractChannel, source: str, target: str) -> int:
    """Move every message of ``source`` to ``target``, in order: each acked once its copy is
    confirmed. Returns how many were moved."""
    queue = await channel.declare_queue(source, passive=True)
    moved = 0
    while True:
        taken: list[AbstractIncomingMessage] = []
        while len(taken) < CHUNK and (message := await queue.get(no_ack=False, fail=False)):
            taken.append(message)
        if not taken:
            return moved
        await asyncio.gather(*(move(channel, message, queue=target) for message in taken))
        await taken[-1].ack(multiple=True)
        moved += len(taken)


async def _refill(
    channel: AbstractChannel, settings: Settings, name: str, routing_keys: Sequence[str]
) -> None:
    """Move the messages of ``name``'s holding queue, if it has one, into ``name``; delete it."""
    try:
        await channel.declare_queue(_holding_name(name), passive=True)
    except ChannelNotFoundEntity:
        await channel.reopen()
        return
    await _unbind(channel, settings, name, routing_keys)
    count = await _move(channel, _holding_name(name), name)
    await channel.queue_delete(_holding_name(name))
    log.info("moved %d message(s) back into %r", count, name)
