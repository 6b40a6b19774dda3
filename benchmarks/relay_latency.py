"""How long a committed outbox event waits before RabbitMQ hands it to a consumer, under light load.

Three scenarios run one after another, each against the same fresh database and broker names:

1. ``relay (LISTEN/NOTIFY)``: a separate relay (``worker.ops.runner.run_relay``) woken by NOTIFY.
2. ``relay (polling only)``: the same relay without NOTIFY, finding rows by polling alone
   (idle waits doubling from ``worker.transport.relay.MIN_IDLE`` up to ``relay_poll_interval``).
3. ``worker run, in-process relay``: the whole worker (``worker.ops.runner.run``) with a one-handler
   router that publishes one event per request.

In 1 and 2 this script commits the outbox rows itself, one row per transaction, with the worker's
own SQL (``outbox.append_outbox``), and the latency is commit -> arrival of the event at a
consumer of this script's. In 3 the latency is end to end: request publish -> consume ->
transaction -> relay -> arrival of the event. Load is offered at ``--rate`` per second on absolute
deadlines; a few warm-up rows (or requests) go first and are not counted. Percentiles are
nearest-rank. Everything (offering, relay, worker, capture) runs in this one process and event
loop, next to PostgreSQL and RabbitMQ on whatever host they are on, so the figures include that
contention.

A fresh database ``worker_bench_<hex>`` is created next to the one in ``WORKER_DATABASE_URL``
(default ``postgresql://postgres@localhost:5432/postgres``), migrated, and dropped at the end;
the exchange and queues on ``WORKER_AMQP_URL`` (default ``amqp://guest:guest@localhost:5672/``)
are named ``bench-<hex>...`` and deleted at the end. Run it from the repository root::

    .venv/bin/python -m benchmarks.relay_latency [--count 200] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import Context, Router
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER
from worker.database import create_engine
from worker.ops import runner
from worker.settings import Settings, positive_float, positive_int
from worker.sql import outbox
from worker.sql.rows import OutboxMessage
from worker.testing import scratch_database
from worker.transport.topology import delete_topology, queue_names

log = logging.getLogger("benchmarks.relay_latency")

IN_KEY = "bench.in"
OUT_KEY = "bench.out"
WARM_UP = 5
"""Rows (or requests) sent and awaited before measuring: connections, caches, first probes."""
DRAIN_SECONDS = 30.0
"""How long to wait, after the last offer, for events still missing."""
START_SECONDS = 60.0
"""How long a relay or worker may take to start."""
STOP_SECONDS = 30.0
"""How long a relay or worker may take to stop."""

Send = Callable[[], Awaitable[tuple[str, float]]]
"""Offers one row or request; returns the key its event will carry and the time it counts from."""


@dataclass
class Result:
    """One scenario's outcome; ``latencies`` in seconds, one per event that arrived."""

    label: str
    expected: int
    latencies: list[float]
    offered_seconds: float
    duplicates: int
    stats: Counter[str]
    note: str = ""


class Capture:
    """Arrival times of events, by a key taken from each message (the first arrival counts)."""

    def __init__(self, key_of: Callable[[AbstractIncomingMessage], str]) -> None:
        self.key_of = key_of
        self.arrived: dict[str, float] = {}
        self.duplicates = 0
        self._changed = asyncio.Event()

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        now = time.perf_counter()
        key = self.key_of(message)
        if key in self.arrived:
            self.duplicates += 1
        else:
            self.arrived[key] = now
        self._changed.set()

    async def wait_for(self, keys: Collection[str], within: float) -> bool:
        """True once every key in ``keys`` has arrived; False after ``within`` seconds."""
        deadline = time.perf_counter() + within
        while any(key not in self.arrived for key in keys):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True


@contextlib.asynccontextmanager
async def capturing(
    channel: AbstractChannel,
    exchange: AbstractExchange,
    key_of: Callable[[AbstractIncomingMessage], str],
) -> AsyncIterator[Capture]:
    """A consumer of ``OUT_KEY`` events on an exclusive queue of its own, deleted on exit."""
    capture = Capture(key_of)
    queue = await channel.declare_queue(exclusive=True, auto_delete=True)
    await queue.bind(exchange, OUT_KEY)
    tag = await queue.consume(capture.on_message, no_ack=True)
    try:
        yield capture
    finally:
        if not channel.is_closed:
            await queue.cancel(tag)
            await queue.delete(if_unused=False, if_empty=False)


async def offer(count: int, rate: float, send: Send) -> tuple[dict[str, float], float]:
    """Send ``count`` times, the i-th at start + i/rate; the start times by key, and the duration.

    Absolute deadlines keep the rate exact: a slow send delays the next one, not all the rest.
    """
    sent: dict[str, float] = {}
    start = time.perf_counter()
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        key, at = await send()
        sent[key] = at
    return sent, time.perf_counter() - start


async def measure(
    label: str, capture: Capture, send: Send, count: int, rate: float, stats: Counter[str]
) -> Result:
    """Warm up, then offer ``count`` at ``rate`` and wait for their events."""
    warm_up, _ = await offer(WARM_UP, rate, send)
    if not await capture.wait_for(warm_up, DRAIN_SECONDS):
        raise RuntimeError(f"{label}: the warm-up events did not arrive within {DRAIN_SECONDS} s")
    sent, offered_seconds = await offer(count, rate, send)
    await capture.wait_for(sent, DRAIN_SECONDS)
    latencies = [capture.arrived[key] - at for key, at in sent.items() if key in capture.arrived]
    return Result(label, count, latencies, offered_seconds, capture.duplicates, stats)


async def until_started(task: asyncio.Task[Counter[str]], started: asyncio.Event) -> None:
    """Return once ``started`` is set; raise if ``task`` ends first or it takes too long."""
    waiter = asyncio.create_task(started.wait())
    done, _ = await asyncio.wait(
        {task, waiter}, timeout=START_SECONDS, return_when=asyncio.FIRST_COMPLETED
    )
    waiter.cancel()
    if task in done:
        task.result()
        raise RuntimeError(f"{task.get_name()} ended before it started")
    if waiter not in done:
        raise TimeoutError(f"{task.get_name()} did not start within {START_SECONDS} s")


async def stopping(task: asyncio.Task[Counter[str]], stop: asyncio.Event) -> None:
    """Set ``stop`` and wait for ``task`` to finish (re-raising its error)."""
    stop.set()
    await asyncio.wait_for(task, STOP_SECONDS)


async def relay_scenario(
    label: str,
    settings: Settings,
    engine: AsyncEngine,
    channel: AbstractChannel,
    exchange: AbstractExchange,
    count: int,
    rate: float,
) -> Result:
    """Commit outbox rows here, one per transaction; a separate relay publishes them."""

    async def commit_one() -> tuple[str, float]:
        message = OutboxMessage(
            message_id=uuid.uuid4(),
            exchange=settings.exchange,
            routing_key=OUT_KEY,
            body=b"{}",
            content_type="application/json",
            headers={},
            correlation_id=None,
            causation_id=None,
            ordering_key=None,
        )
        async with engine.begin() as conn:
            await outbox.append_outbox(conn, [message], notify=settings.outbox_notify)
        return str(message.message_id), time.perf_counter()

    stop, started, stats = asyncio.Event(), asyncio.Event(), Counter[str]()
    async with capturing(channel, exchange, lambda m: m.message_id or "") as capture:
        task = asyncio.create_task(runner.run_relay(settings, stop, started, stats), name="relay")
        try:
            await until_started(task, started)
            return await measure(label, capture, commit_one, count, rate, stats)
        finally:
            await stopping(task, stop)


def bench_router() -> Router:
    """One handler: every ``IN_KEY`` request publishes one ``OUT_KEY`` event echoing its ``i``."""
    router = Router()

    @router.handler(IN_KEY)
    async def handle(body: dict[str, Any], ctx: Context) -> None:
        ctx.publish(OUT_KEY, {"i": body["i"]})

    return router


async def worker_scenario(
    label: str,
    settings: Settings,
    channel: AbstractChannel,
    exchange: AbstractExchange,
    count: int,
    rate: float,
) -> Result:
    """Publish requests to a running worker; its in-process relay publishes the events."""
    numbers = itertools.count()

    async def request_one() -> tuple[str, float]:
        i = next(numbers)
        message = aio_pika.Message(
            json.dumps({"i": i}).encode(),
            content_type="application/json",
            message_id=uuid.uuid4().hex,
            headers={IDEMPOTENCY_KEY_HEADER: uuid.uuid4().hex},
        )
        at = time.perf_counter()
        await exchange.publish(message, IN_KEY)
        return str(i), at

    def echoed(message: AbstractIncomingMessage) -> str:
        return str(json.loads(message.body)["i"])

    stop, started, stats = asyncio.Event(), asyncio.Event(), Counter[str]()
    async with capturing(channel, exchange, echoed) as capture:
        task = asyncio.create_task(
            runner.run(settings, bench_router(), stop, started, stats), name="worker"
        )
        try:
            await until_started(task, started)
            result = await measure(label, capture, request_one, count, rate, stats)
        finally:
            await stopping(task, stop)
    result.note = "(request publish -> event arrival)"
    return result


async def run_scenarios(settings: Settings, count: int, rate: float) -> list[Result]:
    """All three scenarios, on a broker exchange declared here and deleted with the queues."""
    connection = await runner.connect_broker(settings, name="bench")
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(
            settings.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        engine = create_engine(settings, application_name="bench-producer", pool_size=2)
        results: list[Result] = []
        try:
            for label, notify in (("relay (LISTEN/NOTIFY)", True), ("relay (polling only)", False)):
                progress(f"running {label} ...")
                relay_settings = settings.replace(outbox_notify=notify)
                results.append(
                    await relay_scenario(
                        label, relay_settings, engine, channel, exchange, count, rate
                    )
                )
        finally:
            await engine.dispose()
        label = "worker run, in-process relay"
        progress(f"running {label} ...")
        worker_settings = settings.replace(relay=True, outbox_notify=True)
        results.append(
            await worker_scenario(label, worker_settings, channel, exchange, count, rate)
        )
        return results
    finally:
        try:
            await delete_broker_objects(settings)
        finally:
            await connection.close()


async def delete_broker_objects(settings: Settings, extra_queues: Sequence[str] = ()) -> None:
    """Delete this run's queues (everything ``declare_topology`` declared, retry queues
    included, and ``extra_queues``) and exchanges on a connection of its own (the main one may
    be broken); a failure is logged with the names left behind rather than hiding the run's
    error."""
    try:
        connection = await aio_pika.connect(settings.amqp_url)
        async with connection:
            channel = await connection.channel()
            await delete_topology(channel, settings)
            for queue in extra_queues:
                await channel.queue_delete(queue)
    except Exception as exc:
        names = [*queue_names(settings), *extra_queues]
        exchanges = (settings.exchange, settings.dead_letter_exchange)
        log.warning("could not delete queues %s and exchanges %s: %r", names, exchanges, exc)


def run_in_scratch_database(count: int, rate: float) -> list[Result]:
    """A fresh database and broker names for this run, the scenarios, then the cleanup."""
    run_id = uuid.uuid4().hex[:10]
    base = Settings.load(exchange=f"bench-{run_id}-events", queue=f"bench-{run_id}")
    with scratch_database(base, prefix="worker_bench") as settings:
        return asyncio.run(run_scenarios(settings, count, rate))


EXPECTED_STATS = frozenset({"relay_published", "processed"})
"""Stats counters of an undisturbed run; any other (failed, parked, requeued ...) is reported."""


def percentile(ordered: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def report(results: list[Result], count: int, rate: float, poll_interval: float) -> str:
    """The table, then notes on anything that makes a row less than a clean measurement."""
    lines = [
        f"relay commit-to-publish latency, {count} rows at {rate:g}/s (cpu count {os.cpu_count()})",
        f"{'scenario':<30}{'n':>5} {'p50':>7}{'p90':>7}{'p99':>7}{'max':>7}  (ms)",
    ]
    notes: list[str] = []
    for r in results:
        ordered = sorted(1000 * s for s in r.latencies)
        points = [percentile(ordered, p) for p in (50, 90, 99)] + ordered[-1:]
        figures = "".join(f"{ms:>7.1f}" for ms in points) if ordered else f"{'-':>7}" * 4
        lines.append(f"{r.label:<30}{len(ordered):>5} {figures}   {r.note}".rstrip())
        if len(ordered) < r.expected:
            notes.append(
                f"{r.label}: {r.expected - len(ordered)} of {r.expected} events did not arrive "
                f"within {DRAIN_SECONDS:g} s"
            )
        if r.duplicates:
            notes.append(f"{r.label}: {r.duplicates} duplicate deliveries")
        nominal = (r.expected - 1) / rate
        if r.offered_seconds > 1.05 * nominal + 0.1:
            notes.append(
                f"{r.label}: offering took {r.offered_seconds:.1f} s instead of {nominal:.1f} s "
                "(the rate was not kept)"
            )
        unusual = {k: n for k, n in r.stats.items() if n and k not in EXPECTED_STATS}
        if unusual:
            notes.append(f"{r.label}: {unusual} (all stats: {dict(r.stats)})")
    notes.append(f"polling only: relay_poll_interval {poll_interval:g} s")
    return "\n".join([*lines, "", *notes])


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.relay_latency",
        description="Outbox relay commit-to-publish latency under light load.",
    )
    parser.add_argument("--count", type=positive_int, default=200, help="rows per scenario")
    parser.add_argument("--rate", type=positive_float, default=20.0, help="rows per second")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    results = run_in_scratch_database(args.count, args.rate)
    print(report(results, args.count, args.rate, Settings.load().relay_poll_interval))


if __name__ == "__main__":
    main()
