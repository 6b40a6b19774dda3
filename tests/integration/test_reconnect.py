"""A broker connection lost while a unit of work is open, in the real ``worker run`` process: the
transaction is not cancelled with the connection's tasks but commits; its ack fails on the dead
channel, the broker redelivers after the reconnect, and the inbox turns the redelivery into a
duplicate — one effect."""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import close_broker_connections, scalar, wait_until
from tests.integration.support import send_blocking_credit, worker_behind_lock
from worker.settings import Settings

LOCK = 515151

pytestmark = pytest.mark.skipif(
    shutil.which("rabbitmqctl") is None or not Path("/proc/net/tcp").exists(),
    reason="needs rabbitmqctl and Linux's /proc to close the worker's broker connections",
)


async def test_connection_closed_after_commit_before_ack_gives_one_effect(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    async with worker_behind_lock(settings, amqp, log, LOCK) as (holder, worker):
        body = {"account": "dave", "amount_cents": 9, "lock": LOCK}
        await send_blocking_credit(amqp, engine, settings, body, "lost-ack")

        # When the worker's broker connections are cut while the transaction is open, and the
        # transaction then commits
        assert await close_broker_connections([worker.pid], settings.amqp_url, "cut by test")

        async def worker_saw_the_cut() -> bool:
            return "cut by test" in log.read_text(errors="replace")

        await wait_until(worker_saw_the_cut)
        await holder.execute("SELECT pg_advisory_unlock($1)", LOCK)

        # Then the worker reconnects and the redelivery is recognised as a duplicate
        async def redelivered_as_duplicate() -> bool:
            return "duplicate=1" in log.read_text(errors="replace")

        await wait_until(redelivered_as_duplicate, timeout=40)
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)
        output = log.read_text(errors="replace")
        assert worker.returncode == 0, output
        assert "'processed': 1" in output
        assert "'duplicate': 1" in output
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='dave'") == 9
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE status='completed'") == 1
