"""The consumer's aiormq-level subscription across a lost connection and a closed channel, in
process against the real PostgreSQL and RabbitMQ: a batch whose connection (or channel) is lost
while its transaction is open commits, and its acks are never sent, neither on the dead channel
nor on the new one, where the same tags name other deliveries; the broker redelivers the batch
there, the inbox recognises each as a duplicate, and consumption goes on on the new channel. A
consumer the broker cancels (its queue deleted) consumes again on the queue declared anew."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import scalar, wait_until
from tests.integration.support import publish
from tests.integration.tcp_proxy import TcpProxy, tcp_proxy
from worker import Context, Router
from worker.errors import PauseReason
from worker.settings import Settings
from worker.telemetry import Count
from worker.transport.connection import connect
from worker.transport.consumer import Consumer

BATCH = 5


def _holding_router(release: asyncio.Event, entered: asyncio.Event) -> Router:
    """A handler of ``held`` that waits for ``release`` inside its transaction (once
    ``entered``) until it is set."""
    router = Router()

    @router.handler("held")
    async def held(body: str, ctx: Context) -> None:
        entered.set()
        await release.wait()

    return router


@asynccontextmanager
async def _consumer_through_a_proxy(
    settings: Settings, engine: AsyncEngine, router: Router | None = None
) -> AsyncIterator[tuple[Consumer, TcpProxy]]:
    """A started consumer of ``router`` (default: one whose handler never waits) whose broker
    connection (named uniquely) goes through a TCP proxy of its own, and that proxy."""
    if router is None:
        release = asyncio.Event()
        release.set()
        router = _holding_router(release, asyncio.Event())
    broker = urlsplit(settings.amqp_url)
    async with tcp_proxy(broker.hostname or "127.0.0.1", broker.port or 5672) as proxy:
        url = settings.amqp_url.replace(
            broker.netloc, f"{broker.netloc.rpartition('@')[0]}@127.0.0.1:{proxy.port}"
        )
        connection = await connect(url, name=f"test-consume-reconnect-{uuid.uuid4().hex[:8]}")
        consumer = Consumer(settings, router, engine, connection)
        try:
            await consumer.start()
            yield consumer, proxy
        finally:
            await consumer.stop(grace=5)
            await connection.close()


async def _run_a_batch_across(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    cut: str,
) -> Consumer:
    """Hold a batch of ``BATCH`` in its transaction, ``cut`` the consumer's connection or channel,
    let the batch commit, then send ``BATCH`` more; returns the consumer once all are handled
    (stopped)."""
    release, entered = asyncio.Event(), asyncio.Event()
    router = _holding_router(release, entered)
    one_batch = settings.replace(batch_size=BATCH, concurrency=1, prefetch=50, batch_linger=0.2)
    async with _consumer_through_a_proxy(one_batch, engine, router) as (consumer, proxy):
        channel = await amqp.channel(publisher_confirms=True)
        for n in range(BATCH):
            await publish(channel, settings, f"first-{n}", key=f"first-{n}", routing_key="held")
        # Given a batch in its open transaction
        await asyncio.wait_for(entered.wait(), 30)
        old = consumer.subscription._underlay
        assert old is not None

        # When the consumer's connection is cut, or its channel closed by the broker
        if cut == "connection":
            await proxy.down()
            await wait_until(lambda: _closed(old), timeout=30)
            await proxy.up()
        else:  # an ack of a tag the broker never delivered closes the channel (406)
            await old.basic_ack(10_000)
            await wait_until(lambda: _closed(old), timeout=30)

        # And the batch then commits (its acks have nowhere to go)
        release.set()
        await wait_until(lambda: _at_least(consumer, Count.PROCESSED, BATCH), timeout=30)

        # Then the consumer consumes again, on a new channel
        await wait_until(lambda: _consuming_anew(consumer, old), timeout=60)
        for n in range(BATCH):
            await publish(channel, settings, f"later-{n}", key=f"later-{n}", routing_key="held")
        await wait_until(lambda: _at_least(consumer, Count.PROCESSED, 2 * BATCH), timeout=60)
        # (the batch redelivered on the new channel: each a duplicate)
        await wait_until(lambda: _at_least(consumer, Count.DUPLICATE, BATCH), timeout=60)
        await channel.close()
    return consumer


async def _closed(channel: object) -> bool:
    return bool(getattr(channel, "is_closed", False))


async def _at_least(consumer: Consumer, count: Count, value: int) -> bool:
    return consumer.telemetry.stats[count] >= value


async def _consuming_anew(consumer: Consumer, old: object) -> bool:
    return consumer.consuming and consumer.subscription._underlay is not old


async def _nothing_left(amqp: AbstractRobustConnection, settings: Settings) -> None:
    """Every message was acked (the consumer's channel is closed: an unacked one is ready
    again), each effect once."""
    channel = await amqp.channel()
    declared = await channel.declare_queue(settings.queue, passive=True)
    await channel.close()
    assert declared.declaration_result.message_count == 0


@pytest.mark.parametrize("cut", ["connection", "channel"])
async def test_a_batch_across_a_lost_connection_or_channel_loses_nothing_and_consumes_anew(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, cut: str
) -> None:
    consumer = await _run_a_batch_across(settings, engine, amqp, cut)

    # Then nothing was lost: 2 x BATCH effects, each once, the first batch's redelivered as
    # duplicates (no old tag acked on the new channel), consumed on the new channel, and nothing
    # of any of them is left in the queue
    stats = consumer.telemetry.stats
    assert stats[Count.PROCESSED] == 2 * BATCH
    assert stats[Count.DUPLICATE] == BATCH
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE status = 'completed'") == (
        2 * BATCH
    )
    await _nothing_left(amqp, settings)


async def test_a_consumer_the_broker_cancels_consumes_again_on_the_queue_declared_anew(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with _consumer_through_a_proxy(settings, engine) as (consumer, _):
        # Given a consuming worker
        assert consumer.consuming
        # When its work queue is deleted under it (the broker cancels its consumer)
        channel = await amqp.channel(publisher_confirms=True)
        await channel.queue_delete(settings.queue)

        # Then it declares the queue again and consumes it: a message sent then is processed
        async def processed() -> bool:
            await publish(channel, settings, "again", key="again", routing_key="held")
            return consumer.telemetry.stats[Count.PROCESSED] >= 1

        await wait_until(processed, timeout=30, interval=0.5)
        assert consumer.consuming
        await channel.close()


async def _consumers(amqp: AbstractRobustConnection, settings: Settings) -> int:
    channel = await amqp.channel()
    declared = await channel.declare_queue(settings.queue, passive=True)
    await channel.close()
    count = declared.declaration_result.consumer_count
    assert count is not None
    return count


async def test_a_subscription_cancelled_across_a_reconnect_stays_cancelled_and_resumes_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with _consumer_through_a_proxy(settings, engine) as (consumer, proxy):
        # Given a consumer paused (its subscription cancelled, as the pause gate does)
        subscription = consumer.subscription
        assert subscription.channel is not None
        old = await subscription.channel.get_underlay_channel()
        await subscription.cancel()

        # When its connection is cut and comes back (the channel reopens)
        await proxy.down()
        await wait_until(lambda: _closed(old), timeout=30)
        await proxy.up()

        async def reopened() -> bool:
            channel = subscription.channel
            if channel is None or channel.is_closed:
                return False
            underlay = await channel.get_underlay_channel()
            return underlay is not old and not underlay.is_closed

        await wait_until(reopened, timeout=60)

        # Then the reopened channel does not consume, and health says so
        assert not consumer.consuming
        assert await _consumers(amqp, settings) == 0

        # And resuming (twice, as a retried resume may) attaches exactly one consumer
        await subscription.consume()
        await subscription.consume()
        assert consumer.consuming
        assert await _consumers(amqp, settings) == 1

        # And a reconnect while it consumes consumes again once, on the new channel
        current = subscription._underlay
        await proxy.down()
        await wait_until(lambda: _closed(current), timeout=30)
        await proxy.up()
        await wait_until(lambda: _consuming_anew(consumer, current), timeout=60)
        assert await _consumers(amqp, settings) == 1


async def test_a_consumer_resuming_while_the_broker_is_unreachable_still_stops(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with _consumer_through_a_proxy(settings, engine) as (consumer, proxy):
        # Given a consumer whose broker cannot be reached
        old = consumer.subscription._underlay
        await proxy.down()
        await wait_until(lambda: _closed(old), timeout=30)

        # When it pauses (PostgreSQL answers at once, so it resumes while the broker is away)
        await consumer.gate.pause(PauseReason.DATABASE_UNREACHABLE, "a test's pause")
        await asyncio.sleep(0.5)  # (its resume is under way)

        # Then stopping it ends (its resume gives up instead of waiting for the broker)
        await asyncio.wait_for(consumer.stop(grace=5), 30)
        await proxy.up()
