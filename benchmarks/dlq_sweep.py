"""How long a read of the dead-letter queue takes: the console's groups view and a preview of a
replay of everything (``worker.ops.dlq``'s dry run), over a DLQ of ``--copies`` parked copies.

The copies are parked the way the worker parks them (``worker.transport.dead_letters.Failure``:
the worker's record of each committed first, then the copy published to the dead-letter
exchange with its parking id), a few handlers and reasons mixed, each body ``--body-bytes``
long. Each view then runs ``--runs`` times, timed from its start to its last record, with the
CPU time this process spent meanwhile (the rest is waiting for the broker and the database);
the queue is unchanged after each (the tests assert that: this only counts). ``--chunk`` sets
``worker.ops.dlq.CHUNK``, the most messages a sweep takes at a time; ``--queue-type quorum``
parks them in a quorum DLQ. Last, ``worker dlq list
--all`` runs once over the queue in a subprocess, and its peak resident set is reported: the
memory a sweep needs (``--copies 200 --body-bytes 1048576`` for large bodies).

A fresh database ``worker_bench_<hex>`` is created next to the one in ``WORKER_DATABASE_URL``,
migrated and dropped at the end; the exchange and queues have names of their own, deleted at the
end. From the repository root::

    .venv/bin/python -m benchmarks.dlq_sweep [--copies 10000] [--runs 2] [--body-bytes 200] \\
        [--queue-type classic] [--chunk 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.common import publish_all
from worker.core.envelope import Delivery
from worker.database import create_engine
from worker.ops import dlq
from worker.settings import Settings, positive_int, queue_type
from worker.sql import parkings
from worker.testing import scratch_database
from worker.transport.dead_letters import Failure
from worker.transport.topology import declare_topology, delete_topology

HANDLERS = ("bench.charge", "bench.refund", "bench.notify")
REASONS = ("handler-error", "invalid", "handler-error", "no-handler")
RECORDS_PER_INSERT = 1000


async def park(
    amqp: AbstractRobustConnection, engine: AsyncEngine, settings: Settings, copies: int, size: int
) -> None:
    """Park ``copies`` copies of ``size``-byte bodies, records first, as the worker does."""
    failures = [
        Failure(
            Delivery(
                body=(b'{"n": %d, "pad": "' % n).ljust(size - 2, b"x") + b'"}',
                routing_key=HANDLERS[n % len(HANDLERS)],
                headers={"idempotency-key": f"bench-{n}"},
            ),
            "KeyError: 'account'",
            "KeyError",
            HANDLERS[n % len(HANDLERS)],
        )
        for n in range(copies)
    ]
    records = [
        failure.parking(REASONS[n % len(REASONS)], failed_key=True)
        for n, failure in enumerate(failures)
    ]
    for start in range(0, copies, RECORDS_PER_INSERT):
        async with engine.begin() as conn:
            await parkings.record_parkings(conn, records[start : start + RECORDS_PER_INSERT])
    async with amqp.channel(publisher_confirms=True) as channel:
        await declare_topology(channel, settings, list(HANDLERS))
        exchange = await channel.get_exchange(settings.dead_letter_exchange)
        for handler in HANDLERS:
            messages = (
                aio_pika.Message(
                    failure.delivery.body,
                    headers=failure.dead_letter_headers(record.reason, record.parking_id),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                )
                for failure, record in zip(failures, records, strict=True)
                if failure.delivery.routing_key == handler
            )
            await publish_all(exchange, handler, messages)


async def groups_view(
    amqp: AbstractRobustConnection, engine: AsyncEngine, settings: Settings
) -> int:
    """The console's groups page's read: the messages it counted."""
    return (await dlq.grouped(amqp, engine, settings)).count


async def replay_preview(
    amqp: AbstractRobustConnection, engine: AsyncEngine, settings: Settings
) -> int:
    """The console's preview of a replay of everything (a dry run): the messages it went over."""
    tally = await dlq.Tally().carry_out(
        dlq.replaying(amqp, engine, settings, dry_run=True, scan=dlq.Scan(dlq.SCAN_LIMIT))
    )
    return tally.done_count + tally.refused_count


VIEWS = {"groups": groups_view, "preview": replay_preview}


PEAK_RSS = """
import atexit, sys
from worker.ops.cli import main
def peak():
    with open("/proc/self/status") as status:
        print(*(line for line in status if line.startswith("VmHWM")), file=sys.stderr)
atexit.register(peak)
sys.exit(main())
"""
"""``worker``'s own entry point, which prints the process's peak resident set (Linux's
``VmHWM``: since its exec, unlike ``ru_maxrss``, which keeps the forking parent's) as it exits."""


def list_all_peak_rss(settings: Settings) -> int:
    """The peak resident set (KiB) of ``worker dlq list --all`` over this DLQ, its output
    discarded."""
    environ = {
        **{name: value for name, value in os.environ.items() if not name.startswith("WORKER_")},
        "WORKER_DATABASE_URL": settings.database_url,
        "WORKER_AMQP_URL": settings.amqp_url,
        "WORKER_EXCHANGE": settings.exchange,
        "WORKER_QUEUE": settings.queue,
        "WORKER_QUEUE_TYPE": settings.queue_type,
    }
    listed = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, "dlq", "list", "--all"],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=True,
        timeout=600,
    )
    [line] = [line for line in listed.stderr.splitlines() if line.startswith("VmHWM")]
    return int(line.split()[1])


async def measure(settings: Settings, options: argparse.Namespace) -> None:
    amqp = await aio_pika.connect_robust(settings.amqp_url)
    engine = create_engine(settings, application_name="worker-bench", pool_size=4)
    try:
        started = time.perf_counter()
        await park(amqp, engine, settings, options.copies, options.body_bytes)
        print(f"parked {options.copies} copies in {time.perf_counter() - started:.1f} s")
        for name, view in VIEWS.items():
            for run in range(1, options.runs + 1):
                started, cpu = time.perf_counter(), time.process_time()
                seen = await view(amqp, engine, settings)
                took, cpu = time.perf_counter() - started, time.process_time() - cpu
                print(
                    f"{name:8} run {run}: {seen} messages in {took:.2f} s "
                    f"({took / max(seen, 1) * 1e3:.3f} ms each; this process's CPU {cpu:.2f} s)"
                )
        print(f"the DLQ holds {await dlq.depth(amqp, settings)} messages")
        peak = await asyncio.to_thread(list_all_peak_rss, settings)
        print(f"worker dlq list --all: peak RSS {peak / 1024:.0f} MB")
    finally:
        async with amqp.channel() as channel:
            await delete_topology(channel, settings)
        await amqp.close()
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--copies", type=positive_int, default=10_000)
    parser.add_argument("--runs", type=positive_int, default=2)
    parser.add_argument("--body-bytes", type=positive_int, default=200)
    parser.add_argument("--queue-type", type=queue_type, default="classic")
    parser.add_argument(
        "--chunk", type=positive_int, default=dlq.CHUNK, help="messages a sweep takes at a time"
    )
    options = parser.parse_args()
    dlq.CHUNK = options.chunk
    suffix = uuid.uuid4().hex[:10]
    with scratch_database(Settings.load(), prefix="worker_bench") as scratch:
        settings = scratch.replace(
            exchange=f"bench-{suffix}-events",
            queue=f"bench-{suffix}",
            queue_type=options.queue_type,
        )
        asyncio.run(measure(settings, options))


if __name__ == "__main__":
    main()
