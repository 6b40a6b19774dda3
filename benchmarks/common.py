"""What the payments benchmarks share: the routing key and seed of their payments, publishing a
preload with confirms, and emptying or counting the tables between scenarios.

A leaf of ``benchmarks``: the benchmark scripts import it, it imports none of them, so their
import graph has no cycle.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections.abc import Iterable

import aio_pika
from aio_pika.abc import AbstractExchange
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

REQUESTED = "payment.requested"
"""The routing key of the payments example's requests."""
SEED = 1
"""The seed of every benchmark's payment plan, so runs compare."""
PUBLISH_WINDOW = 1000
"""Publishes in flight at once when preloading, and in the bare publish+confirm baseline."""
PAYMENT_TABLES = ("accounts", "ledger_entries", "settlement_notices")
WORKER_TABLES = (
    "inbox",
    "workflow_steps",
    "workflow_waits",
    "workflow_signals",
    "outbox",
    "outbox_scheduled",
    "outbox_parked",
)
"""The worker's tables a scenario empties (``workflow_waits`` references ``inbox``: TRUNCATE
needs both in one statement)."""


async def publish_all(
    exchange: AbstractExchange, routing_key: str, messages: Iterable[aio_pika.Message]
) -> None:
    """Publish ``messages`` on a confirming channel, ``PUBLISH_WINDOW`` confirms pipelined at a
    time; raises if one is returned (``mandatory``) or nacked."""
    pending = iter(messages)
    while window := list(itertools.islice(pending, PUBLISH_WINDOW)):
        await asyncio.gather(*(exchange.publish(m, routing_key, mandatory=True) for m in window))


async def reset_tables(
    engine: AsyncEngine, tables: Iterable[str] = WORKER_TABLES + PAYMENT_TABLES
) -> None:
    """Empty ``tables`` (by default the worker's and the example's), then CHECKPOINT, so each
    scenario starts from the same state without the previous one's dirty pages to write."""
    async with engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {', '.join(tables)}"))
    async with engine.connect() as conn:
        await conn.execute(text("CHECKPOINT"))


async def count_rows(engine: AsyncEngine, table: str) -> int:
    """The rows of ``table``, counted."""
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


async def stop_process(process: asyncio.subprocess.Process, seconds: float) -> None:
    """SIGTERM, then SIGKILL if it is still running after ``seconds``; nothing if it ended."""
    if process.returncode is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), seconds)
    except TimeoutError:
        process.kill()
        await process.wait()
