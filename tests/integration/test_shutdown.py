"""Graceful shutdown of a real ``worker run`` process: SIGTERM in the middle of a burst drains
and exits 0, and a transaction still open when the grace period ends rolls back unacked; after a
restart every message has taken effect exactly once."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments.demo import plan_payments
from tests.helpers import broker_depth, rows, scalar, wait_until
from tests.integration.support import (
    send_blocking_credit,
    wait_for_consumer,
    worker_behind_lock,
    worker_process,
)
from worker.settings import Settings

PAYMENTS = {"WORKER_HANDLERS": "examples.payments", "WORKER_RELAY": "false"}


async def test_sigterm_during_a_burst_exits_0_and_a_restart_applies_each_payment_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    # (enough that a batching worker is still busy when the signal comes)
    plan = plan_payments(2500, 0.2, 5, 11)
    unique, sends, expected = plan.payments, plan.sends, plan.expected_balances
    log = tmp_path / "worker.log"

    # Given a worker in the middle of a burst
    with worker_process(settings, log, **PAYMENTS) as worker:
        await wait_for_consumer(amqp, settings.queue)
        channel = await amqp.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)
        for p in sends:
            await exchange.publish(
                Message(json.dumps(p).encode(), headers={"idempotency-key": p["payment_id"]}),
                routing_key="payment.requested",
            )

        async def under_way() -> bool:
            return int(await scalar(engine, "SELECT count(*) FROM inbox")) >= 20

        await wait_until(under_way)

        # When it gets SIGTERM
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 60)

        # Then it drains and exits 0
        output = log.read_text(errors="replace")
        assert worker.returncode == 0, output
        assert "stopped;" in output

    # When a worker starts again, every payment takes effect exactly once
    with worker_process(settings, log, **PAYMENTS) as restarted:
        await wait_for_consumer(amqp, settings.queue)  # (its signal handlers are installed)

        async def all_applied() -> bool:
            return await scalar(engine, "SELECT count(*) FROM inbox") == len(unique)

        await wait_until(all_applied, timeout=60)

        async def queue_empty() -> bool:
            return await broker_depth(settings.queue) == 0

        await wait_until(queue_empty)
        restarted.send_signal(signal.SIGTERM)
        await asyncio.to_thread(restarted.wait, 30)
        assert restarted.returncode == 0
    assert dict(await rows(engine, "SELECT account, balance_cents FROM accounts")) == expected
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == len(unique)
    assert await broker_depth(settings.dead_letter_queue) == 0


LOCK = 626262


async def test_a_transaction_open_past_the_grace_period_rolls_back_and_is_redelivered(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    body = {"account": "gus", "amount_cents": 13, "lock": LOCK}
    # Given a worker with a short grace period, whose handler waits on a lock the test holds
    grace = {"WORKER_SHUTDOWN_GRACE": "500ms"}
    async with worker_behind_lock(settings, amqp, log, LOCK, **grace) as (holder, worker):
        await send_blocking_credit(amqp, engine, settings, body, "graceful-1")

        # When it gets SIGTERM and the transaction is still open after the grace period
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 60)

        # Then it exits 0, the transaction rolled back and the message is back in the queue
        output = log.read_text(errors="replace")
        assert worker.returncode == 0, output
        assert "rolling them back" in output
        assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
        assert await broker_depth(settings.queue) == 1
        await holder.execute("SELECT pg_advisory_unlock($1)", LOCK)

    # And a restarted worker applies it once
    with worker_process(settings, log) as restarted:

        async def applied() -> bool:
            return await scalar(engine, "SELECT count(*) FROM inbox") == 1

        await wait_until(applied, timeout=30)
        restarted.send_signal(signal.SIGTERM)
        await asyncio.to_thread(restarted.wait, 30)
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='gus'") == 13


class _Stops:
    """A component that runs until told to stop, and records that it was."""

    def __init__(self) -> None:
        self.stopped = False

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stopped = True


class _Dies:
    async def run(self, stop: asyncio.Event) -> None:
        raise LookupError("the relay lost its table")


async def test_a_component_that_dies_stops_the_others_and_fails_the_process() -> None:
    from worker.ops.runner import _supervise

    settings = Settings(shutdown_grace=5)
    survivor = _Stops()
    drained: list[bool] = []

    async def drain() -> None:
        drained.append(True)

    with pytest.raises(RuntimeError, match="the relay task stopped unexpectedly") as failed:
        await _supervise(
            settings, asyncio.Event(), {"janitor": survivor, "relay": _Dies()}, None, drain
        )
    assert isinstance(failed.value.__cause__, LookupError)
    assert survivor.stopped
    assert drained == [True]
