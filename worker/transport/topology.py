"""The broker objects the worker needs, declared idempotently at start.

A durable topic exchange; the durable work queue bound to it with each handler's routing key and
dead-lettering to ``<queue>.dlx``; that fanout exchange and the ``<queue>.dlq`` queue behind it.
Anything the broker itself dead-letters (a rejected message, say) lands in the same queue.

One durable delayed-retry queue per configured delay, ``<queue>.retry.<delay>``: it has no
consumer, and its message TTL dead-letters each message through the default exchange back to the
work queue. A queue per delay (not a per-message TTL) keeps every message of a queue expiring in
the order it arrived, so none waits behind a longer one.

With ``queue_type`` ``quorum`` all of these queues are quorum queues: replicated across a
cluster's nodes; the work queue and the retry queues dead-letter *at least once* (the broker keeps
a message until the queue it is dead-lettered to has confirmed it, so a broker crash mid-way loses
none; this needs ``x-overflow: reject-publish``); and the work queue dead-letters a message
delivered ``delivery_limit`` times without a settlement (its worker died holding it each time).
A queue's type and arguments are fixed when it is declared: ``worker convert-queues``
(``queue_move``) moves an existing deployment's messages to queues declared anew.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aio_pika import ExchangeType
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractQueue
from aio_pika.exceptions import ChannelNotFoundEntity
from aiormq.exceptions import ChannelPreconditionFailed

from worker.errors import ConfigurationError
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


def _typed(settings: Settings, arguments: dict[str, Any], *, dead_letters: bool) -> dict[str, Any]:
    """``arguments`` for a queue of ``settings.queue_type``; a quorum queue that dead-letters
    does it at least once."""
    if settings.queue_type == "classic":
        return arguments  # (unchanged since the first version: existing queues redeclare)
    typed = {"x-queue-type": settings.queue_type, **arguments}
    if dead_letters:
        typed.update({"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
    return typed


def work_queue_arguments(settings: Settings) -> dict[str, Any]:
    """Arguments of the work queue; they must stay the same across versions to redeclare it."""
    arguments = _typed(
        settings, {"x-dead-letter-exchange": settings.dead_letter_exchange}, dead_letters=True
    )
    if limit := settings.work_queue_delivery_limit:
        arguments["x-delivery-limit"] = limit
    return arguments


def retry_queue_arguments(settings: Settings, delay: float) -> dict[str, Any]:
    """A queue that holds each message ``delay`` seconds, then returns it to the work queue."""
    return _typed(
        settings,
        {
            "x-message-ttl": max(1, round(delay * 1000)),
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": settings.queue,
        },
        dead_letters=True,
    )


def dead_letter_queue_arguments(settings: Settings) -> dict[str, Any]:
    """Arguments of the dead-letter queue (none for a classic one)."""
    return _typed(settings, {}, dead_letters=False)


def queue_arguments(settings: Settings) -> dict[str, dict[str, Any]]:
    """Each of ``worker_queues``' names with the arguments it is declared with."""
    return {
        settings.queue: work_queue_arguments(settings),
        settings.dead_letter_queue: dead_letter_queue_arguments(settings),
        **{
            settings.retry_queue(delay): retry_queue_arguments(settings, delay)
            for delay in settings.retry_delays
        },
    }


class TopologyMismatch(ConfigurationError):
    """The broker holds an exchange or queue of the worker's declared with other arguments."""


async def declare_topology(
    channel: AbstractChannel, settings: Settings, routing_keys: Iterable[str]
) -> Topology:
    """Declare (or confirm) the exchange, queues and bindings; safe to run from many workers.

    Raises ``TopologyMismatch`` when the broker refuses a declaration because the object exists
    with other arguments (a classic queue where ``queue_type`` says quorum, say): a deployment
    mistake no retry fixes."""
    try:
        return await _declare(channel, settings, list(routing_keys))
    except ChannelPreconditionFailed as exc:
        raise TopologyMismatch(
            f"the broker refused the worker's topology ({exc}): it was declared otherwise. To "
            f"change queue_type ({settings.queue_type}) or delivery_limit of an existing "
            "deployment, stop its workers and run `worker convert-queues`; else set them as "
            "the queues were declared"
        ) from exc


async def declare_exchanges(
    channel: AbstractChannel, settings: Settings
) -> tuple[AbstractExchange, AbstractExchange]:
    """Declare (or confirm) the events exchange and the dead-letter exchange; return both."""
    exchange = await channel.declare_exchange(settings.exchange, ExchangeType.TOPIC, durable=True)
    dlx = await channel.declare_exchange(
        settings.dead_letter_exchange, ExchangeType.FANOUT, durable=True
    )
    return exchange, dlx


async def _declare(
    channel: AbstractChannel, settings: Settings, routing_keys: list[str]
) -> Topology:
    exchange, dlx = await declare_exchanges(channel, settings)
    dlq = await channel.declare_queue(
        settings.dead_letter_queue, durable=True, arguments=dead_letter_queue_arguments(settings)
    )
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


@dataclass(frozen=True)
class QueueCounts:
    """A queue as a passive declare reports it: its ready messages (not those delivered and
    unacked; they can lag behind messages just returned to the queue) and its consumers."""

    messages: int
    consumers: int


async def count_queues(
    connection: AbstractConnection, names: Sequence[str]
) -> list[QueueCounts | None]:
    """The counts of each of ``names``, in order, by passive declares: None for a queue that
    does not exist, which is never declared here. One channel asks about all of them; a missing
    queue closes it, and the next queue is asked on a new one."""
    found: list[QueueCounts | None] = []
    channel: AbstractChannel | None = None
    try:
        for name in names:
            if channel is None:
                channel = await connection.channel()
            try:
                queue = await channel.declare_queue(name, passive=True)
            except ChannelNotFoundEntity:
                found.append(None)
                if not channel.is_closed:
                    await channel.close()
                channel = None
                continue
            result = queue.declaration_result
            found.append(
                QueueCounts(int(result.message_count or 0), int(result.consumer_count or 0))
            )
    finally:
        if channel is not None and not channel.is_closed:
            await channel.close()
    return found
