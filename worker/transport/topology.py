"""The broker objects the worker needs, declared idempotently at start.

A durable topic exchange; the durable work queue bound to it with each handler's routing key and
dead-lettering to ``<queue>.dlx``; that fanout exchange and the ``<queue>.dlq`` queue behind it.
Anything the broker itself dead-letters (a rejected message, say) lands in the same queue.

One durable delayed-retry queue per configured delay, ``<queue>.retry.<delay>``: it has no
consumer, and its message TTL dead-letters each message through the default exchange back to the
work queue. A queue per delay (not a per-message TTL) keeps every message of a queue expiring in
the order it arrived, so none waits behind a longer one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aio_pika import ExchangeType
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from worker.settings import Settings, format_duration


@dataclass(frozen=True)
class Topology:
    """The declared objects, kept referenced so a robust connection restores them."""

    channel: AbstractChannel
    exchange: AbstractExchange
    queue: AbstractQueue
    dead_letter_exchange: AbstractExchange
    dead_letter_queue: AbstractQueue
    retry_queues: tuple[AbstractQueue, ...]

    @property
    def default_exchange(self) -> AbstractExchange:
        """The exchange that routes by queue name (to the retry queues and the work queue)."""
        return self.channel.default_exchange


def work_queue_arguments(settings: Settings) -> dict[str, Any]:
    """Arguments of the work queue; they must stay the same across versions to redeclare it."""
    return {"x-dead-letter-exchange": settings.dead_letter_exchange}


def retry_queue_arguments(settings: Settings, delay: float) -> dict[str, Any]:
    """A queue that holds each message ``delay`` seconds, then returns it to the work queue."""
    return {
        "x-message-ttl": max(1, round(delay * 1000)),
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": settings.queue,
    }


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
    retry_queues = [
        await channel.declare_queue(
            settings.retry_queue(delay),
            durable=True,
            arguments=retry_queue_arguments(settings, delay),
        )
        for delay in settings.retry_delays
    ]
    return Topology(channel, exchange, queue, dlx, dlq, tuple(retry_queues))


def worker_queues(settings: Settings) -> list[tuple[str, str]]:
    """(role, name) of every queue ``declare_topology`` declares: the work queue, the
    dead-letter queue and each delayed-retry queue."""
    return [
        ("work", settings.queue),
        ("dead letters", settings.dead_letter_queue),
        *(
            (f"retry {format_duration(delay)}", settings.retry_queue(delay))
            for delay in settings.retry_delays
        ),
    ]


def queue_names(settings: Settings) -> list[str]:
    """The names of ``worker_queues``."""
    return [name for _, name in worker_queues(settings)]


async def delete_topology(channel: AbstractChannel, settings: Settings) -> None:
    """Delete what ``declare_topology`` declared (tests and benchmarks declare their own)."""
    for queue in queue_names(settings):
        await channel.queue_delete(queue)
    for exchange in (settings.exchange, settings.dead_letter_exchange):
        await channel.exchange_delete(exchange)
