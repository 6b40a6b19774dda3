"""Several broker addresses against the real broker: a list whose first node is dead (a closed
port) connects to the live one, in the worker's runner too, and a connection that is lost
reconnects to the next node of the list instead of retrying the one it lost.

(A real cluster losing a node is ``tests/cluster``.)"""

from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import urlsplit

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import free_port, payment, scalar, wait_until
from tests.integration.support import BASE, publish, running_worker
from tests.integration.tcp_proxy import tcp_proxy
from worker.settings import Settings, redact
from worker.transport.connection import connect


def dead_node() -> str:
    """The main broker's URL on a port where nothing listens."""
    return BASE.amqp_url.replace(f":{urlsplit(BASE.amqp_url).port or 5672}/", f":{free_port()}/")


async def round_trip(connection: AbstractRobustConnection) -> bytes:
    """A message through a queue of its own on ``connection`` and back."""
    channel = await connection.channel()
    queue = await channel.declare_queue(f"test-nodes-{uuid.uuid4().hex[:8]}", exclusive=True)
    await channel.default_exchange.publish(aio_pika.Message(b"here"), routing_key=queue.name)

    async def arrived() -> bool:
        return await queue.get(fail=False, no_ack=True) is not None

    await wait_until(arrived, timeout=10)
    await channel.close()
    return b"here"


async def test_a_list_whose_first_node_is_dead_connects_to_the_live_one() -> None:
    main = urlsplit(BASE.amqp_url).port or 5672
    connection = await connect(f"{dead_node()},{BASE.amqp_url}", within=5)
    try:
        assert connection.url.port == main
        assert await round_trip(connection) == b"here"
    finally:
        await connection.close()
    assert connection.url.port == main  # (closed by its owner: no reason to move on)


async def test_a_lost_connection_reconnects_to_the_next_node_not_the_lost_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="worker.transport.connection")
    main = urlsplit(BASE.amqp_url)
    async with tcp_proxy(main.hostname or "127.0.0.1", main.port or 5672) as proxy:
        # Given a connection through a proxy, the first of three nodes: proxy, dead, main
        # (reconnecting a tenth of a second after a failed attempt)
        through_proxy = BASE.amqp_url.replace(f":{main.port or 5672}/", f":{proxy.port}/")
        nodes = [f"{through_proxy}?reconnect_interval=0.1", dead_node(), BASE.amqp_url]
        connection = await connect(nodes, name="test-nodes")
        reconnected = asyncio.Event()
        connection.reconnect_callbacks.add(lambda *_: reconnected.set())
        try:
            assert connection.url.port == proxy.port
            # When the proxy's node goes away for good
            await proxy.down()

            # Then the connection skips the dead node and reconnects to the main broker
            await asyncio.wait_for(reconnected.wait(), timeout=30)
            assert connection.url.port == (main.port or 5672)
            assert await round_trip(connection) == b"here"
        finally:
            await connection.close()
    said = [r.getMessage() for r in caplog.records if r.name == "worker.transport.connection"]
    assert said[0].startswith(f"broker connection 'test-nodes' to {used(nodes[0])} lost (")
    assert said[0].endswith(f"; reconnecting to {used(nodes[1])}")
    assert said[-1] == f"broker connection 'test-nodes' reconnected to {used(BASE.amqp_url)}"


def used(url: str) -> str:
    """``url`` as a connection uses it, and logs it: asking for the worker's heartbeat."""
    return redact(f"{url}{'&' if '?' in url else '?'}heartbeat={Settings().broker_heartbeat}")


async def test_the_worker_runs_with_a_dead_node_first_in_its_list(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a worker (consumer and relay) whose broker list starts with a dead node
    listed = settings.replace(amqp_url=f"{dead_node()},{settings.amqp_url}")
    async with running_worker(listed, payments) as worker:
        # When a payment arrives
        channel = await amqp.channel()
        await publish(channel, settings, payment("p-nodes", "nadia", 250), key="p-nodes")

        # Then it is settled, and its event published by the relay and handled too
        async def settled() -> bool:
            return bool(await scalar(engine, "SELECT count(*) FROM settlement_notices"))

        await wait_until(settled)
        await worker.shutdown()
    balance = "SELECT balance_cents FROM accounts WHERE account = 'nadia'"
    assert await scalar(engine, balance) == 250
