"""Small builders shared by the tests."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.envelope import Delivery, Envelope, open_envelope
from worker.router import Router
from worker.settings import Settings, format_duration


def payment(payment_id: str, account: str = "alice", amount_cents: int = 100) -> dict[str, Any]:
    return {"payment_id": payment_id, "account": account, "amount_cents": amount_cents}


def envelope(router: Router, routing_key: str, body: Any, key: str, **delivery: Any) -> Envelope:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return open_envelope(
        Delivery(body=raw, routing_key=routing_key, headers={"idempotency-key": key}, **delivery),
        router,
        max_body_bytes=1 << 20,
    )


async def scalar(engine: AsyncEngine, sql: str, **params: Any) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar()


async def rows(engine: AsyncEngine, sql: str, **params: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(sql), params)).all())


async def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.05) -> None:
    """Poll the async ``predicate`` until it returns true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


def worker_environ(settings: Settings, **extra: str) -> dict[str, str]:
    """The ``WORKER_*`` variables that point a ``worker`` subprocess at this test's database,
    broker names and retry queues (no HTTP endpoint), plus ``extra``."""
    return {
        "WORKER_DATABASE_URL": settings.database_url,
        "WORKER_AMQP_URL": settings.amqp_url,
        "WORKER_EXCHANGE": settings.exchange,
        "WORKER_QUEUE": settings.queue,
        "WORKER_RETRY_DELAYS": ",".join(map(format_duration, settings.retry_delays)) or "none",
        "WORKER_HTTP_PORT": "0",
        **extra,
    }


async def broker_depth(queue: str) -> int:
    """Ready plus unacknowledged messages of ``queue``, as the broker counts them.

    (A passive declare's message count lags behind requeued messages, so ask rabbitmqctl.)
    """
    listing = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "list_queues", "name", "messages_ready", "messages_unacknowledged"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in listing.stdout.splitlines():
        name, *counts = line.split("\t")
        if name == queue:
            return sum(int(count) for count in counts)
    raise AssertionError(f"queue {queue} not found")
