"""The broker objects the worker needs, declared idempotently at start.

A durable topic exchange; the durable work queue bound to it with each handler's routing key and
dead-lettering to ``<queue>.dlx``; that fanout exchange and the ``<queue>.dlq`` queue behind it.
Anything the broker itself dead-letters (a rejected message, say) lands in the same queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aio_pika import ExchangeType
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from worker.settings import Settings


@dataclass(frozen=True)
class Topology:
    """The declared objects, kept referenced so a robust connection restores them."""

    exchange: AbstractExchange
    queue: AbstractQueue
    dead_letter_exchange: AbstractExchange
    dead_letter_queue: AbstractQueue


def work_queue_arguments(settings: Settings) -> dict[str, Any]:
    """Arguments of the work queue; they must stay the same across versions to redeclare it."""
    return {"x-dead-letter-exchange": settings.dead_letter_exchange}


async def declare_topology(
    channel: AbstractChannel, settings: Settings, routing_keys: Iterable[str]
) -> Topology:
    """Declare (or confirm) the exchange, queues and bindings; safe to run from many workers."""
    exchange = await channel.declare_exchange(settings.exchange, ExchangeType.TOPIC, durable=True)
    dlx = await channel.declare_exchange(
        settings.dead_letter_exchange, ExchangeType.FANOUT, durable=True
    )
    dlq = await channel.declare_queue(settings.dead_letter_queue, durable=True)
    await dlq.bind(dlx)
    queue = await channel.declare_queue(
        settings.queue, durable=True, arguments=work_queue_arguments(settings)
    )
    for routing_key in routing_keys:
        await queue.bind(exchange, routing_key)
    return Topology(exchange, queue, dlx, dlq)
