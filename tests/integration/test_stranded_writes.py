"""A publish or a settlement caught on a connection that dies with its write queue full, in
process against the real RabbitMQ: it ends with the channel's error once the connection has
closed, never waits for ever (aiormq leaves a write waiting for room in a dead connection's queue
waiting: nothing reads that queue any more). A copy publish that waited for ever held its consumer
task and the deliveries of its batch; an ack that did held the lock every later settlement of the
consumer waits on, across reconnects: the consumer never acked again and stalled.

The queue is filled, and the writer stopped, by hand: what a connection whose socket stopped
draining (a network path gone) looks like when its heartbeat finally closes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import aio_pika
import aiormq
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import ChannelFrame
from pamqp.commands import Basic
from pamqp.heartbeat import Heartbeat

from worker.settings import Settings
from worker.transport.acks import Settlements
from worker.transport.deliveries import Received
from worker.transport.publisher import channel_of, persistent, publish_on

HANG = 15.0
"""Seconds after which an operation on the closed connection counts as waiting for ever (a bound
for the test only: what is asserted is that it ends, not how soon)."""


@pytest.fixture
async def connection(settings: Settings) -> AsyncIterator[AbstractConnection]:
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        yield connection
    finally:
        await connection.close()


async def _channel(connection: AbstractConnection) -> tuple[AbstractChannel, aiormq.Channel]:
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    return channel, await channel_of(channel)


def _strand(underlay: aiormq.Channel) -> None:
    """Stop the writer of ``underlay``'s connection and fill its write queue (it then closes)."""
    amqp = underlay.connection
    assert isinstance(amqp, aiormq.Connection)
    amqp._writer_task.cancel()
    frame = ChannelFrame.marshall(channel_number=0, frames=[Heartbeat()])
    while not amqp.write_queue.full():
        amqp.write_queue.put_nowait(frame)


async def _ends_after_close(underlay: aiormq.Channel, operation: Awaitable[object]) -> None:
    """Run ``operation`` (started while the connection lives, its queue full), let the connection
    close, and return once the operation has ended."""
    task = asyncio.ensure_future(operation)
    await asyncio.wait_for(asyncio.shield(underlay.connection.closing), HANG)
    done, _ = await asyncio.wait([task], timeout=HANG)
    task.cancel()
    assert done, "the operation still waits on the closed connection"


async def test_a_copy_publish_caught_on_a_dying_connection_ends(
    connection: AbstractConnection,
) -> None:
    # Given a channel whose connection stops writing with its write queue full
    channel, underlay = await _channel(connection)
    _strand(underlay)

    # When a copy is published on it: Then it fails once the connection has closed
    publish = publish_on(
        channel,
        b"{}",
        persistent(message_id="stranded-copy", headers={}, content_type="application/json"),
        exchange="",
        routing_key="worker.test.stranded",
    )
    await _ends_after_close(underlay, _raises(publish))


async def test_an_ack_caught_on_a_dying_connection_ends_and_frees_the_later_ones(
    connection: AbstractConnection,
) -> None:
    # Given a delivery of a channel whose connection stops writing with its write queue full
    _, underlay = await _channel(connection)
    message = Received(b"", Basic.Properties(), 1, False, "", "q", underlay)
    settlements = Settlements()
    settlements.received(message)
    _strand(underlay)

    # When it is acked: Then the ack ends once the connection has closed (void: the broker
    # delivers it again), and the next settlement is not held up behind it
    await _ends_after_close(underlay, settlements.ack([message]))
    await asyncio.wait_for(settlements.flush(), HANG)


async def _raises(operation: Awaitable[object]) -> None:
    with pytest.raises(Exception):  # noqa: B017,PT011 (the channel's error, whichever it is)
        await operation
