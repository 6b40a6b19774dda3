"""Scheduled events through real ``worker relay`` and ``worker run`` processes killed with SIGKILL
around their due time, round after round, then restarted: every scheduled event is published at
least once (by message id), none arrives before the due time the database gave it, and a
cancelled one never arrives."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aio_pika import ExchangeType, Message
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import rows, scalar, wait_until
from tests.integration.scheduling_handlers import reminder_id
from tests.integration.support import running_relay, wait_for_consumer, worker_process
from worker import outbox
from worker.faults import CONSUMER_AFTER_COMMIT, SCHEDULE_BEFORE_COMMIT, UNIT_OF_WORK_BEFORE_COMMIT
from worker.outbox import Event
from worker.settings import Settings

HANDLERS = {"WORKER_HANDLERS": "tests.integration.scheduling_handlers"}


@dataclass
class Arrivals:
    """Every ``sched.#`` event the broker routed to the test, with the instant it was received."""

    seen: list[tuple[str, datetime]] = field(default_factory=list)

    def on_message(self, message: AbstractIncomingMessage) -> None:
        self.seen.append((str(message.message_id), datetime.now(UTC)))

    def ids(self) -> set[str]:
        return {message_id for message_id, _ in self.seen}

    async def wait_for(self, message_ids: set[str], timeout: float = 60) -> None:
        async def all_arrived() -> bool:
            return message_ids <= self.ids()

        await wait_until(all_arrived, timeout=timeout)

    def early(self, due: dict[str, datetime]) -> list[tuple[str, datetime, datetime]]:
        """Each arrival before its event's due time: (message id, arrived, due)."""
        return [(m, at, due[m]) for m, at in self.seen if at < due[m]]


@pytest.fixture
async def arrivals(settings: Settings, amqp: AbstractRobustConnection) -> AsyncIterator[Arrivals]:
    """A queue on the test's exchange bound to ``sched.#``, consumed for the whole test."""
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(settings.exchange, ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(f"{settings.queue}.capture", durable=True)
    await queue.bind(exchange, "sched.#")
    found = Arrivals()

    async def received(message: AbstractIncomingMessage) -> None:
        found.on_message(message)

    tag = await queue.consume(received, no_ack=True)
    yield found
    await queue.cancel(tag)
    await channel.queue_delete(queue.name)
    await channel.close()


async def killed(process: subprocess.Popen[bytes], log: Path) -> None:
    """Wait for a process started to crash at a crash point to have died of SIGKILL."""
    code = await asyncio.to_thread(process.wait, 60)
    if code != -signal.SIGKILL:
        pytest.fail(await asyncio.to_thread(log.read_text, errors="replace"))


async def relay_connected(engine: AsyncEngine) -> None:
    """Wait until a relay process has connected to the test's database (so that what is scheduled
    next falls due while it runs, not while it starts)."""

    async def connected() -> bool:
        count = await scalar(
            engine,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'worker-relay'",
        )
        return bool(count)

    await wait_until(connected, timeout=60)


async def schedule_round(
    engine: AsyncEngine, settings: Settings, n: str
) -> tuple[dict[str, datetime], set[str]]:
    """Schedule eight events 0.3 to 2.4 s out (half of them of one ordering key) in two
    transactions, reading each one's due time from the database in its own transaction, then
    cancel the two due last; returns (due time by message id, cancelled ids)."""
    due: dict[str, datetime] = {}
    for half in (0, 1):
        events = [
            Event(
                f"sched.{n}.{i}",
                {"round": n, "i": i},
                exchange=settings.exchange,
                ordering_key="K" if i % 2 else None,
                delay=timedelta(milliseconds=300 * (i + 1)),
            )
            for i in range(4 * half, 4 * half + 4)
        ]
        async with engine.begin() as conn:
            ids = await outbox.publish_many(conn, events)
            found = await conn.execute(
                text(
                    "SELECT message_id, due_at FROM outbox_scheduled WHERE message_id = ANY(:ids)"
                    " ORDER BY due_at"
                ),
                {"ids": ids},
            )
            due.update({str(message_id): due_at for message_id, due_at in found})
    cancelled = set(list(due)[-2:])  # the last due: cancelled well before their time
    async with engine.begin() as conn:
        for message_id in cancelled:
            assert await outbox.cancel(conn, uuid.UUID(message_id)) is True
    return due, cancelled


async def test_relays_killed_around_due_time_publish_each_scheduled_event_never_early(
    settings: Settings, engine: AsyncEngine, arrivals: Arrivals, tmp_path: Path
) -> None:
    log = tmp_path / "relay.log"
    due: dict[str, datetime] = {}
    cancelled: set[str] = set()
    for n in range(3):
        # Given a relay that dies as its first move of due events is about to commit, and eight
        # events scheduled while it runs, a fraction of a second to two seconds out, two of them
        # cancelled
        with worker_process(settings, log, "relay", WORKER_CRASH_AT=SCHEDULE_BEFORE_COMMIT) as p:
            await relay_connected(engine)
            scheduled, taken_back = await schedule_round(engine, settings, f"{n}.a")
            due.update(scheduled)
            cancelled |= taken_back
            await killed(p, log)

        # And a relay SIGKILLed once one of eight more events, scheduled while it runs, arrived
        with worker_process(settings, log, "relay") as relay:
            await relay_connected(engine)
            scheduled, taken_back = await schedule_round(engine, settings, f"{n}.b")
            due.update(scheduled)
            cancelled |= taken_back
            mine = set(scheduled) - taken_back

            async def one_arrived(mine: set[str] = mine) -> bool:
                return bool(mine & arrivals.ids())

            await wait_until(one_arrived, timeout=60)
            relay.kill()
            await asyncio.to_thread(relay.wait, 30)

    # When a relay runs to the end
    expected = set(due) - cancelled
    async with running_relay(settings):
        await arrivals.wait_for(expected)
        await wait_until(lambda: _nothing_left(engine))

    # Then each event arrived at least once, none before it was due, and no cancelled one
    assert arrivals.ids() == expected
    assert arrivals.early(due) == []


async def test_a_worker_killed_around_due_time_publishes_each_reminder_never_early(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    arrivals: Arrivals,
    tmp_path: Path,
) -> None:
    log = tmp_path / "worker.log"

    # Given twelve requests in the queue, each for a reminder 0.5 to 3.25 s after its handler's
    # transaction started, a third of them of one ordering key
    with worker_process(settings, log, **HANDLERS) as first:  # declares the queue
        await wait_for_consumer(amqp, settings.queue)
        first.kill()
        await asyncio.to_thread(first.wait, 30)
    keys = [f"reminder-{n}" for n in range(12)]
    channel = await amqp.channel(publisher_confirms=True)
    exchange = await channel.get_exchange(settings.exchange)
    for n, key in enumerate(keys):
        body = {"n": n, "delay_ms": 500 + 250 * n, "ordering_key": "K" if n % 3 == 0 else None}
        await exchange.publish(
            Message(json.dumps(body).encode(), headers={"idempotency-key": key}),
            routing_key="reminder.requested",
        )
    await channel.close()

    # When the worker dies: with its first batch written but not committed, then committed but
    # not acked, then as its relay's first move of due reminders is about to commit
    for crash_at in (UNIT_OF_WORK_BEFORE_COMMIT, CONSUMER_AFTER_COMMIT, SCHEDULE_BEFORE_COMMIT):
        with worker_process(settings, log, WORKER_CRASH_AT=crash_at, **HANDLERS) as worker:
            await killed(worker, log)

    # And the next worker is SIGKILLed once the first reminder arrived
    with worker_process(settings, log, **HANDLERS) as worker:

        async def one_arrived() -> bool:
            return bool(arrivals.seen)

        await wait_until(one_arrived, timeout=60)
        worker.kill()
        await asyncio.to_thread(worker.wait, 30)

    # When a worker runs to the end
    expected = {str(reminder_id(key)) for key in keys}
    with worker_process(settings, log, **HANDLERS) as worker:
        await arrivals.wait_for(expected)
        await wait_until(lambda: _nothing_left(engine))
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)

    # Then each reminder was scheduled once, arrived at least once, and none before the due time
    # its handler's transaction gave it
    results = await rows(engine, "SELECT status, result FROM inbox WHERE key = ANY(:k)", k=keys)
    assert [status for status, _ in results] == ["completed"] * len(keys)
    due = {r["message_id"]: datetime.fromisoformat(r["due_at"]) for _, r in results}
    assert set(due) == expected
    assert arrivals.ids() == expected
    assert arrivals.early(due) == []


async def _nothing_left(engine: AsyncEngine) -> bool:
    left = await scalar(
        engine, "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_scheduled)"
    )
    return bool(left == 0)
