"""The real ``worker run`` process: killed inside a transaction it has acked nothing, and a
restart applies the message exactly once; SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
from aio_pika import Message
from aio_pika.abc import AbstractExchange, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import scalar, wait_until, worker_environ
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
LOCK = 424242


def start_worker(
    settings: Settings, log: Path, command: str = "run", **env_vars: str
) -> subprocess.Popen[bytes]:
    """``python -m worker <command>`` with the blocking handlers (unless ``WORKER_HANDLERS`` is
    given) and the given extra environment; its output goes to ``log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(
        worker_environ(settings, **{"WORKER_HANDLERS": "tests.blocking_handlers", **env_vars})
    )
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", command],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@contextlib.contextmanager
def worker_process(
    settings: Settings, log: Path, command: str = "run", **env_vars: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``start_worker``, killed on exit if it is still running."""
    process = start_worker(settings, log, command, **env_vars)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.asynccontextmanager
async def worker_behind_lock(
    settings: Settings, amqp: AbstractRobustConnection, log: Path, lock: int, **env_vars: str
) -> AsyncIterator[tuple[asyncpg.Connection, subprocess.Popen[bytes]]]:
    """A consuming ``worker run`` process while this test holds ``lock``, the advisory lock the
    ``blocking.credit`` handler waits on; yields the holding connection and the process."""
    holder = await asyncpg.connect(settings.database_url)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", lock)
        with worker_process(settings, log, **env_vars) as worker:
            await wait_for_consumer(amqp, settings.queue)
            yield holder, worker
    finally:
        await holder.close()  # also releases the lock


async def wait_for_consumer(amqp: AbstractRobustConnection, queue: str) -> None:
    async def consuming() -> bool:
        channel = await amqp.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelClosed:
            return False
        finally:
            if not channel.is_closed:
                await channel.close()
        return bool(declared.declaration_result.consumer_count)

    await wait_until(consuming, timeout=30)


async def ready_count(amqp: AbstractRobustConnection, queue: str) -> int:
    channel = await amqp.channel()
    declared = await channel.declare_queue(queue, passive=True)
    await channel.close()
    return int(declared.declaration_result.message_count or 0)


async def send_blocking_credit(
    amqp: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    body: dict[str, Any],
    key: str,
) -> AbstractExchange:
    """Publish a ``blocking.credit`` message and wait until its handler waits on the lock inside
    its open transaction; return the exchange for further publishing."""
    channel = await amqp.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(settings.exchange)
    await exchange.publish(
        Message(json.dumps(body).encode(), headers={"idempotency-key": key}),
        routing_key="blocking.credit",
    )

    async def handler_waits() -> bool:
        return bool(
            await scalar(
                engine,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND objsubid = 1 AND objid = :lock",
                lock=body["lock"],
            )
        )

    await wait_until(handler_waits)
    return exchange


async def test_sigkill_inside_the_transaction_acks_nothing_and_a_restart_applies_it_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    # Given the test holds the lock the handler will wait on, inside its transaction
    async with worker_behind_lock(settings, amqp, log, LOCK) as (_, worker):
        body = {"account": "carol", "amount_cents": 42, "lock": LOCK}
        exchange = await send_blocking_credit(amqp, engine, settings, body, "crash-1")

        # When the worker is killed while its transaction is open
        worker.kill()
        worker.wait(10)

        # Then nothing was committed and the delivery is back in the queue, unacked
        async def requeued() -> bool:
            return await ready_count(amqp, settings.queue) == 1

        await wait_until(requeued)
        assert await scalar(engine, "SELECT count(*) FROM inbox") == 0

    # When a new worker starts
    with worker_process(settings, log, WORKER_LOG_LEVEL="DEBUG") as restarted:

        async def applied() -> bool:
            return bool(
                await scalar(
                    engine,
                    "SELECT count(*) FROM inbox WHERE key = 'crash-1' AND status = 'completed'",
                )
            )

        await wait_until(applied, timeout=30)
        # a second delivery of the same key changes nothing
        await exchange.publish(
            Message(json.dumps(body).encode(), headers={"idempotency-key": "crash-1"}),
            routing_key="blocking.credit",
        )

        # (a delivery the consumer holds but has not taken yet goes back to the queue on
        # SIGTERM, so wait until the duplicate has been handled, not merely delivered)
        async def duplicate_handled() -> bool:
            return "duplicate key=crash-1 " in log.read_text(errors="replace")

        await wait_until(duplicate_handled)

        # Then the effect exists exactly once, and SIGTERM drains and exits cleanly
        restarted.send_signal(signal.SIGTERM)
        await asyncio.to_thread(restarted.wait, 30)
        output = log.read_text(errors="replace")
        assert restarted.returncode == 0, output
        assert "stopped" in output
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='carol'") == 42
    assert await ready_count(amqp, settings.queue) == 0
