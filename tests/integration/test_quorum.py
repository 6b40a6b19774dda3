"""Quorum queues against the real RabbitMQ: the worker's queues declared as quorum queues
(``queue_type``), delayed retries and parking through them, the broker's delivery limit as the
last guard against a message whose worker keeps dying, pauses that never count toward it, and
``worker convert-queues`` moving an existing deployment's messages between queue types."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from aiormq.exceptions import ChannelPreconditionFailed
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import WORKER_SCRIPT, payment, rows, run, scalar, wait_until, worker_environ
from tests.integration.support import (
    dead_letters,
    publish,
    queue_empty,
    ready_messages,
    running_worker,
    settled,
)
from tests.integration.test_failures import Script, effects, job_effects, scripted_router
from worker import Context, Router
from worker.settings import Settings
from worker.telemetry import Count
from worker.transport.topology import declare_topology, work_queue_arguments

__all__ = ["job_effects"]  # (the scripted handler's table, an autouse fixture)


@pytest.fixture
def quorum(settings: Settings) -> Settings:
    return settings.replace(queue_type="quorum")


async def cli(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    env = worker_environ(
        settings,
        WORKER_HANDLERS="examples.payments",
        WORKER_QUEUE_TYPE=settings.queue_type,
        WORKER_DELIVERY_LIMIT=str(settings.delivery_limit),
    )
    return await asyncio.to_thread(run, WORKER_SCRIPT, *argv, **env)


async def declared_as(amqp: AbstractRobustConnection, settings: Settings) -> bool:
    """Whether the broker accepts the work queue's declaration as ``settings`` make it."""
    channel = await amqp.channel()
    try:
        await channel.declare_queue(
            settings.queue, durable=True, arguments=work_queue_arguments(settings)
        )
    except ChannelPreconditionFailed:
        return False
    await channel.close()
    return True


async def test_retries_and_dead_letters_go_through_quorum_queues(
    quorum: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given quorum queues, one try per delivery: a job failing twice, then one failing for good
    settings = quorum.replace(transient_attempts=1)
    script = Script("retryable", "retryable")
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"n": 1}, key="k-retried", routing_key="flaky.job")
        await settled(worker, processed=1)
        script.plan = ["permanent"]
        await publish(channel, settings, {"n": 2}, key="k-parked", routing_key="flaky.job")
        await settled(worker, dead_lettered=1)

    # Then the first went round both delayed-retry queues and was applied once, the second was
    # parked, and every queue is a quorum queue (a classic declaration is refused)
    assert worker.stats[Count.RETRY_SCHEDULED] == 2
    assert await effects(engine) == 1
    [parked] = await dead_letters(channel, settings)
    assert parked.headers["x-worker-reason"] == "handler-error"
    assert await declared_as(amqp, settings)
    assert not await declared_as(amqp, settings.replace(queue_type="classic"))


async def test_the_delivery_limit_parks_a_message_whose_worker_keeps_dying(
    quorum: Settings, amqp: AbstractRobustConnection
) -> None:
    # Given quorum queues with a delivery limit of 2
    settings = quorum.replace(delivery_limit=2)
    async with amqp.channel() as channel:
        await declare_topology(channel, settings, ["payment.requested"])
        await publish(channel, settings, payment("p-crash"), key="k-crash")

    # When three workers in a row take the message and die holding it (their channel closes)
    for _ in range(3):
        async with amqp.channel() as dying:
            queue = await dying.get_queue(settings.queue)
            assert await queue.get(no_ack=False, timeout=10) is not None  # (never settled)

    # Then the broker parks it in the dead-letter queue, and `worker dlq list` shows why
    async def parked() -> bool:
        async with amqp.channel() as channel:
            return await ready_messages(channel, settings.dead_letter_queue) == 1

    await wait_until(parked)
    listed = await cli(settings, "dlq", "list")
    assert listed.returncode == 0, listed.stderr
    assert "key=k-crash" in listed.stdout
    # (the worker did not park it: no record of its own vouches for the broker's reason)
    assert "reason=unverified" in listed.stdout
    assert "broker_reason='delivery-limit'" in listed.stdout


async def test_pauses_for_a_deployment_fault_never_count_toward_the_delivery_limit(
    quorum: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given quorum queues with a delivery limit of 1, and a handler whose table is missing
    settings = quorum.replace(delivery_limit=1, failure_throttle_after=0)
    router = Router()

    @router.handler("audit.recorded")
    async def record(body: dict[str, Any], ctx: Context) -> None:
        await ctx.connection.execute(
            text("INSERT INTO quorum_audit (key) VALUES (:key)"), {"key": ctx.key}
        )

    async with engine.begin() as conn:
        await conn.execute(text("DROP TABLE IF EXISTS quorum_audit"))
    try:
        async with running_worker(settings, router) as worker:
            channel = await amqp.channel(publisher_confirms=True)
            for n in range(5):
                await publish(
                    channel, settings, {"n": n}, key=f"k-{n}", routing_key="audit.recorded"
                )

            # When the worker pauses and tries again three times (each try takes the messages)
            await settled(worker, paused=3)
            assert await ready_messages(channel, settings.dead_letter_queue) == 0

            # Then, once the table exists, each message is applied once and none was parked
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE quorum_audit (key text PRIMARY KEY)"))
            await settled(worker, processed=5)
            await wait_until(lambda: queue_empty(channel, settings.queue))
            keys = await rows(engine, "SELECT key FROM quorum_audit ORDER BY key")
    finally:
        async with engine.begin() as conn:
            await conn.execute(text("DROP TABLE IF EXISTS quorum_audit"))
    assert [r.key for r in keys] == [f"k-{n}" for n in range(5)]
    assert worker.stats[Count.DEAD_LETTERED] == 0
    assert await ready_messages(channel, settings.dead_letter_queue) == 0


async def test_worker_refuses_queues_declared_as_another_type(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    # Given a deployment whose queues are classic
    declared = await cli(settings, "declare")
    assert declared.returncode == 0, declared.stderr

    # When it is started with queue_type quorum, it stops as misconfigured and says what to do
    refused = await cli(settings.replace(queue_type="quorum"), "declare")
    assert refused.returncode == 2, refused.stderr
    assert "worker convert-queues" in refused.stderr
    assert await declared_as(amqp, settings)  # (nothing changed)


async def test_convert_queues_moves_every_message_to_quorum_queues_and_back(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a classic deployment holding payments, a parked message and a delayed retry
    settings = settings.replace(retry_delays=(60.0,))
    assert (await cli(settings, "declare")).returncode == 0
    async with amqp.channel(publisher_confirms=True) as channel:
        for n in range(300):
            await publish(channel, settings, payment(f"p{n}", "zoe", 1), key=f"k{n}")
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", headers={"x-worker-reason": "handler-error"}),
            routing_key=settings.dead_letter_queue,
        )
        retry = settings.retry_queue(60.0)
        await channel.default_exchange.publish(
            aio_pika.Message(
                json.dumps(payment("p-retry", "zoe", 1)).encode(),
                headers={"idempotency-key": "k-retry"},
            ),
            routing_key=retry,
        )
    quorum = settings.replace(queue_type="quorum")

    # When a worker still consumes, the conversion is refused
    async with amqp.channel() as consuming:
        await consuming.set_qos(prefetch_count=1)
        await (await consuming.get_queue(settings.queue)).consume(_hold)
        busy = await cli(quorum, "convert-queues")
    assert busy.returncode == 1
    assert "stop the workers" in busy.stderr

    # When the workers are stopped and the queues converted to quorum queues
    converted = await cli(quorum, "convert-queues")
    assert converted.returncode == 0, converted.stderr
    assert "moved 300 message(s) of " + settings.queue in converted.stdout

    # Then every message is where it was, in its order, in a quorum queue
    assert await declared_as(amqp, quorum)
    async with amqp.channel() as channel:
        assert await ready_messages(channel, settings.queue) == 300
        assert await ready_messages(channel, settings.dead_letter_queue) == 1
        assert await ready_messages(channel, retry) == 1
        first = await (await channel.get_queue(settings.queue)).get()
        assert first.headers["idempotency-key"] == "k0"
        await first.nack(requeue=True)

    # And running it again is a no-op; converting back keeps every message too
    again = await cli(quorum, "convert-queues")
    assert (again.returncode, "nothing to move" in again.stdout) == (0, True), again.stderr
    back = await cli(settings, "convert-queues")
    assert back.returncode == 0, back.stderr
    assert await declared_as(amqp, settings)

    # And a classic worker then applies each payment once
    async with running_worker(settings, payments) as worker:
        await settled(worker, processed=300)
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='zoe'") == 300
    async with amqp.channel() as channel:
        assert await ready_messages(channel, settings.dead_letter_queue) == 1
        assert await ready_messages(channel, retry) == 1


async def _hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """A consumer that never settles (its channel's close returns the message)."""
