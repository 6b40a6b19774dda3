"""The real ``worker run`` process: killed inside a transaction it has acked nothing, and a
restart applies the message exactly once; SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import scalar, wait_until
from tests.integration.support import (
    ready_count,
    send_blocking_credit,
    worker_behind_lock,
    worker_process,
)
from worker.settings import Settings

LOCK = 424242


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
