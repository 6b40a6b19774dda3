"""``worker migrate`` and ``worker declare`` against the real services: the broker topology
exists before any worker runs, so a producer deployed first loses nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import WORKER_SCRIPT, payment, run, scalar, wait_until, worker_environ
from tests.integration.support import running_worker
from worker.settings import Settings
from worker.transport.topology import queue_names


async def worker(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    env = worker_environ(settings, WORKER_HANDLERS="examples.payments")
    return await asyncio.to_thread(run, WORKER_SCRIPT, *argv, **env)


async def queues_present(amqp: AbstractRobustConnection, settings: Settings) -> list[str]:
    present = []
    for name in queue_names(settings):
        channel = await amqp.channel()
        try:
            await channel.declare_queue(name, passive=True)
            present.append(name)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            pass
        finally:
            if not channel.is_closed:
                await channel.close()
    return present


async def test_a_payment_published_after_migrate_and_before_the_worker_is_applied(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a deployment that migrated, and no worker has run yet
    migrated = await worker(settings, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert await queues_present(amqp, settings) == queue_names(settings)

    # When a producer publishes a payment (mandatory: it would come back if no queue took it)
    async with amqp.channel(publisher_confirms=True, on_return_raises=True) as channel:
        exchange = await channel.get_exchange(settings.exchange)
        await exchange.publish(
            aio_pika.Message(json.dumps(payment("p-early", "early", 7)).encode(), message_id="m1"),
            "payment.requested",
            mandatory=True,
        )

    # Then the first worker to start applies it
    async with running_worker(settings, payments):
        await wait_until(lambda: _applied(engine))


async def _applied(engine: AsyncEngine) -> bool:
    return await scalar(engine, "SELECT count(*) FROM ledger_entries") == 1


async def test_migrate_no_declare_leaves_the_broker_alone_and_declare_does_it_alone(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    migrated = await worker(settings, "migrate", "--no-declare")
    assert migrated.returncode == 0, migrated.stderr
    assert await queues_present(amqp, settings) == []

    declared = await worker(settings, "declare")
    assert declared.returncode == 0, declared.stderr
    assert "'payment.requested'" in declared.stderr  # (the log line names the bindings)
    assert await queues_present(amqp, settings) == queue_names(settings)
