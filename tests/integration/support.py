"""What the integration tests share: the worker run in-process or as a process, publishing
and reading back through the real broker, and the database's answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import pytest
from aio_pika import Message
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractRobustConnection,
)
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from examples.orders import router as orders_router
from examples.orders.tables import metadata as orders_metadata
from examples.payments import router as payments_router
from examples.payments.tables import metadata as payments_metadata
from examples.shop import router as shop_router
from examples.shop.tables import metadata as shop_metadata
from tests.helpers import rows, scalar, wait_until, worker_environ
from worker import Router, schema
from worker import outbox as public_outbox
from worker.ops import runner
from worker.settings import Settings, redact
from worker.sql import outbox, tables
from worker.transport.topology import declare_topology


async def publish(
    channel: AbstractChannel,
    settings: Settings,
    body: Any,
    *,
    key: str | None = None,
    message_id: str | None = None,
    routing_key: str = "payment.requested",
    content_type: str | None = "application/json",
    headers: dict[str, Any] | None = None,
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    all_headers = dict(headers or {})
    if key is not None:
        all_headers["idempotency-key"] = key
    exchange = await channel.get_exchange(settings.exchange)
    await exchange.publish(
        Message(raw, message_id=message_id, content_type=content_type, headers=all_headers),
        routing_key=routing_key,
    )


async def dead_letters(
    channel: AbstractChannel, settings: Settings
) -> list[AbstractIncomingMessage]:
    queue = await channel.get_queue(settings.dead_letter_queue)
    parked = []
    while (message := await queue.get(fail=False, no_ack=True)) is not None:
        parked.append(message)
    return parked


async def ready_messages(channel: AbstractChannel, queue: str) -> int:
    """Ready messages of ``queue``, asked of the broker now. (A robust channel answers a passive
    ``declare_queue`` of a queue it declared before from its cache, with the old count.)"""
    declared = await (await channel.get_underlay_channel()).queue_declare(queue, passive=True)
    count = declared.message_count
    assert count is not None
    return count


async def queue_empty(channel: AbstractChannel, queue: str) -> bool:
    return await ready_messages(channel, queue) == 0


async def inbox(engine: AsyncEngine, key: str) -> Any:
    found = await rows(
        engine, "SELECT status, error, attempts FROM inbox WHERE key = :key", key=key
    )
    return found[0] if found else None


async def settled(worker: RunningWorker, **counts: int) -> None:
    async def reached() -> bool:
        return all(worker.stats[name] >= count for name, count in counts.items())

    await wait_until(reached)


ROOT = Path(__file__).resolve().parents[2]


def start_worker(
    settings: Settings,
    log: Path,
    command: str = "run",
    *,
    args: Sequence[str] = (),
    **env_vars: str,
) -> subprocess.Popen[bytes]:
    """``python -m worker <command> <args>`` with the blocking handlers (unless
    ``WORKER_HANDLERS`` is given) and the given extra environment; its output goes to ``log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(
        worker_environ(
            settings, **{"WORKER_HANDLERS": "tests.integration.blocking_handlers", **env_vars}
        )
    )
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", command, *args],
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


ROUTING_KEY = "admin.test"


async def declare(amqp: AbstractRobustConnection, settings: Settings) -> None:
    async with amqp.channel() as channel:
        await declare_topology(channel, settings, [ROUTING_KEY])


async def add_outbox_row(
    engine: AsyncEngine,
    settings: Settings,
    *,
    ordering_key: str | None = None,
    age: float = 0.0,
    waiting: bool = False,
) -> tuple[int, uuid.UUID]:
    message_id = uuid.uuid4()
    async with engine.begin() as conn:
        row_id = (
            await conn.execute(
                text(
                    "INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, "
                    "ordering_key, created_at, available_at) VALUES (:m, :e, :r, :b, "
                    "'application/json', :k, now() - make_interval(secs => :age), "
                    "now() + CASE WHEN :waiting THEN interval '1 h' ELSE interval '0' END) "
                    "RETURNING id"
                ),
                {
                    "m": message_id,
                    "e": settings.exchange,
                    "r": ROUTING_KEY,
                    "b": json.dumps({"n": str(message_id)}).encode(),
                    "k": ordering_key,
                    "age": age,
                    "waiting": waiting,
                },
            )
        ).scalar_one()
    return int(row_id), message_id


async def schedule(
    engine: AsyncEngine,
    settings: Settings,
    *delays: timedelta,
    ordering_key: str | None = None,
) -> list[uuid.UUID]:
    """An event of ``ROUTING_KEY`` scheduled ``delay`` ahead for each of ``delays``, through
    ``worker.outbox.publish_many`` in one transaction; their message ids, in order."""
    async with engine.begin() as conn:
        return await public_outbox.publish_many(
            conn,
            [
                public_outbox.Event(
                    ROUTING_KEY,
                    {"n": n},
                    exchange=settings.exchange,
                    ordering_key=ordering_key,
                    delay=delay,
                )
                for n, delay in enumerate(delays)
            ],
        )


async def make_overdue(engine: AsyncEngine, message_id: uuid.UUID, seconds: float) -> None:
    """Move scheduled event ``message_id``'s due time ``seconds`` into the past (no relay moves
    it: none runs)."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE outbox_scheduled SET due_at = now() - make_interval(secs => :s) "
                "WHERE message_id = :m"
            ),
            {"s": seconds, "m": message_id},
        )


async def park(engine: AsyncEngine, settings: Settings, **row: Any) -> tuple[int, uuid.UUID]:
    """An outbox row parked the way the relay parks one: its last attempt failed."""
    row_id, message_id = await add_outbox_row(engine, settings, **row)
    async with engine.begin() as conn:
        parked = await outbox.fail_outbox(
            conn, {row_id: "unroutable: NO_ROUTE"}, max_attempts=1, retry_delay=1.0
        )
    assert parked == [row_id]
    return row_id, message_id


HANG_GUARD = 10.0


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


async def request(port: int, path: str, method: str = "GET", raw: bytes | None = None) -> Response:
    """One HTTP/1.1 request with a few headers (or ``raw`` bytes), read to the server's close."""
    async with asyncio.timeout(HANG_GUARD):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                raw or f"{method} {path} HTTP/1.1\r\nHost: test\r\nAccept: */*\r\n\r\n".encode()
            )
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            await writer.wait_closed()
    if not data:
        raise ConnectionResetError("closed without an answer")
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return Response(int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body)


def inspect_database(settings: Settings, fn: Any) -> Any:
    async def go() -> Any:
        engine = create_async_engine(settings.sqlalchemy_url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(fn)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def schema_diff(metadata: MetaData) -> Any:
    def compare(conn: Connection) -> list[Any]:
        context = MigrationContext.configure(
            conn,
            opts={"compare_type": True, "include_object": schema.own_objects_only},
        )
        return list(compare_metadata(context, metadata))

    return compare


def table_names(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


BASE = Settings.load()


TEST_RETRY_DELAYS = (0.1, 0.2)
"""Tests that set other ``retry_delays`` delete their retry queues themselves."""


TABLES = (
    *tables.metadata.tables,
    *payments_metadata.tables,
    *orders_metadata.tables,
    *shop_metadata.tables,
)


EXAMPLES = Router()
"""The example handler modules, whose tables every test database has."""


EXAMPLES.include(payments_router)


EXAMPLES.include(orders_router)


EXAMPLES.include(shop_router)


def require_services() -> None:
    async def check() -> None:
        try:
            conn = await asyncpg.connect(BASE.database_url, timeout=5)
            await conn.close()
        except Exception as exc:
            pytest.exit(
                "PostgreSQL is not reachable at "
                f"WORKER_DATABASE_URL={redact(BASE.database_url)!r}: {exc!r}",
                returncode=3,
            )
        try:
            connection = await aio_pika.connect(BASE.amqp_url, timeout=5)
            await connection.close()
        except Exception as exc:
            pytest.exit(
                f"RabbitMQ is not reachable at WORKER_AMQP_URL={redact(BASE.amqp_url)!r}: {exc!r}",
                returncode=3,
            )

    asyncio.run(check())


@dataclass
class RunningWorker:
    task: asyncio.Future[Counter[str]]
    stop: asyncio.Event
    stats: Counter[str]

    async def shutdown(self) -> Counter[str]:
        self.stop.set()
        return await asyncio.wait_for(self.task, 30)


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, router: Router) -> AsyncIterator[RunningWorker]:
    """The worker's real runner, in-process, stopped (drained) on exit."""
    async with _running(
        lambda stop, started, stats: runner.run(settings, router, stop, started, stats)
    ) as worker:
        yield worker


@contextlib.asynccontextmanager
async def running_relay(settings: Settings) -> AsyncIterator[RunningWorker]:
    """A relay on its own (``worker relay``), in-process, stopped on exit."""
    async with _running(
        lambda stop, started, stats: runner.run_relay(settings, stop, started, stats)
    ) as relay:
        yield relay


@contextlib.asynccontextmanager
async def _running(
    serve: Callable[[asyncio.Event, asyncio.Event, Counter[str]], Awaitable[Counter[str]]],
) -> AsyncIterator[RunningWorker]:
    stop, started, stats = asyncio.Event(), asyncio.Event(), Counter[str]()
    task = asyncio.ensure_future(serve(stop, started, stats))
    waiter = asyncio.create_task(started.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        task.result()  # raises what stopped it
    worker = RunningWorker(task, stop, stats)
    try:
        yield worker
    finally:
        if not task.done():
            await worker.shutdown()


def run_benchmark(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<module> args`` from the repository root, against the services the
    tests use (``WORKER_DATABASE_URL`` and ``WORKER_AMQP_URL`` only: no other worker setting)."""
    base = Settings.load()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(WORKER_DATABASE_URL=base.database_url, WORKER_AMQP_URL=base.amqp_url)
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=170,
        check=False,
    )
