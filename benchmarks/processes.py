"""Throughput of ``worker run --processes N`` for each N asked (1 and 2 by default), on this
machine: how much a second worker process buys.

For each N: the worker's and the payments example's tables are emptied and a CHECKPOINT taken;
``--messages`` payment requests are preloaded (publisher confirms) into a queue of that N's own;
then ``worker run --processes N --no-relay`` runs as a subprocess with ``examples.payments``, as
an operator starts it (with N = 1 that is the plain process, no supervisor). The payments are
all distinct (``examples.payments.demo.plan_payments`` without repeats), so "drained" is exact:
every payment has its ledger row. The drain is timed from the first poll that sees N consumers on
the queue to the first that sees every ledger row; the payments applied before (while the
processes were still starting, one ahead of the other) are left out, so the rate is that of N
processes consuming together; where the first one applied them all before the others consumed (a
short run), the drain is timed from the first poll that saw one consumer instead. Then SIGTERM
(the run must exit 0) and the balances are checked against the plan.

Polling costs little: the broker's queue depth every ``POLL_INTERVAL`` while messages are ready,
the ledger's row count only for the last in-flight ones. PostgreSQL and RabbitMQ share the
machine with the workers and this process. A fresh database ``worker_bench_<hex>`` is created next
to the one in ``WORKER_DATABASE_URL``, migrated and dropped at the end; the exchange and queues
on ``WORKER_AMQP_URL`` are named ``bench-<hex>-processes-<N>...`` and deleted after each N. From
the repository root::

    .venv/bin/python -m benchmarks.processes [--messages 20000] [--processes 1,2] [--rounds 1]

``--rounds 3`` drains each N three times, interleaved, and reports each N's median: on a machine
that others use too, single drains vary by a factor of two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from aio_pika.abc import AbstractQueue
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.common import REQUESTED, SEED, count_rows, publish_all, reset_tables
from benchmarks.relay_latency import delete_broker_objects, progress
from examples.payments import router as payments_router
from examples.payments.demo import DemoPlan, plan_payments, request_message
from worker.database import create_engine
from worker.ops.runner import connect_broker
from worker.settings import Settings, positive_float, positive_int
from worker.testing import scratch_database
from worker.transport.topology import declare_topology

log = logging.getLogger("benchmarks.processes")

ROOT = Path(__file__).resolve().parents[1]
POLL_INTERVAL = 0.01
"""Seconds between two looks at the queue (or, at the end, the ledger)."""
STOP_TIMEOUT = 60.0
"""Seconds the worker has to exit after SIGTERM (its grace period is 30 s)."""
LOG_TAIL = 20
"""Lines of the worker's output shown when it fails."""


class WorkerFailed(Exception):
    """The worker under test stopped, timed out or applied the payments wrongly."""


@dataclass(frozen=True)
class Drain:
    """A timed drain: ``messages`` applied in ``seconds`` by ``processes`` worker processes."""

    processes: int
    messages: int
    seconds: float
    early: int
    """Payments applied before all the processes consumed, left out of the timing."""
    busy: float | None
    """The machine's CPU busy during the drain, 0 to 1 (all cores, every process), if known."""

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


async def drain_with_processes(settings: Settings, processes: int, plan: DemoPlan) -> Drain:
    """Preload ``plan``'s payment requests, drain them with ``worker run --processes
    processes --no-relay``, stop it, check the balances.

    ``settings`` names a database migrated for the payments example (whose tables are emptied
    first) and an exchange and queue of this drain's own (deleted afterwards). The payments
    must be distinct: the drain ends when each has its ledger row. Raises ``WorkerFailed``;
    bound it with ``asyncio.timeout`` (the worker is killed if it is cancelled).
    """
    if len(plan.sends) != len(plan.payments):
        raise ValueError("a drain's payments must be distinct (plan_payments without repeats)")
    engine = create_engine(settings, application_name="bench-processes", pool_size=1)
    try:
        await reset_tables(engine)
        async with _preloaded(settings, plan) as queue:
            arguments = ("--processes", str(processes), "--no-relay", "--http-port", "0")
            with worker_run(settings, *arguments) as (worker, output):
                try:
                    drain = await _timed_drain(engine, queue, worker, processes, plan)
                    await stop_worker(worker)
                except WorkerFailed as exc:
                    raise WorkerFailed(f"{exc}; the worker's last lines:\n{tail(output)}") from None
        await _check_balances(engine, plan)
        return drain
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def _preloaded(settings: Settings, plan: DemoPlan) -> AsyncIterator[AbstractQueue]:
    """The topology declared, every request published and confirmed; yields the work queue
    (a passive handle: ``declare()`` asks its depth and consumers); deletes it all on exit."""
    connection = await connect_broker(settings, name="bench-processes")
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        topology = await declare_topology(channel, settings, payments_router.routing_keys())
        started = time.perf_counter()
        await publish_all(topology.exchange, REQUESTED, map(request_message, plan.sends))
        progress(f"  preloaded {len(plan.sends)} messages in {time.perf_counter() - started:.1f} s")
        yield await channel.declare_queue(settings.queue, passive=True)
    finally:
        await connection.close()
        await delete_broker_objects(settings)


@contextlib.contextmanager
def worker_run(
    settings: Settings, *arguments: str
) -> Iterator[tuple[subprocess.Popen[bytes], IO[bytes]]]:
    """``worker run arguments`` with the payments example, on the database, broker, exchange and
    queue of ``settings`` (no other ``WORKER_*`` variable of this process's reaches it), its
    output in a temporary file; killed on exit if it is still running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        PYTHONPATH=str(ROOT),
        WORKER_DATABASE_URL=settings.database_url,
        WORKER_AMQP_URL=settings.amqp_url,
        WORKER_EXCHANGE=settings.exchange,
        WORKER_QUEUE=settings.queue,
        WORKER_HANDLERS="examples.payments",
    )
    with tempfile.TemporaryFile() as output:
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker", "run", *arguments],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            yield worker, output
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


async def _timed_drain(
    engine: AsyncEngine,
    queue: AbstractQueue,
    worker: subprocess.Popen[bytes],
    processes: int,
    plan: DemoPlan,
) -> Drain:
    async def consuming() -> bool:
        return (await queue.declare()).consumer_count == processes

    async def one_consuming() -> bool:
        return bool((await queue.declare()).consumer_count)

    async def nothing_ready() -> bool:
        return (await queue.declare()).message_count == 0

    async def all_applied() -> bool:
        return await count_rows(engine, "ledger_entries") == len(plan.payments)

    await until(one_consuming, worker)
    first = await count_rows(engine, "ledger_entries"), time.perf_counter(), cpu_times()
    await until(consuming, worker)
    early = await count_rows(engine, "ledger_entries")
    started, cpu = time.perf_counter(), cpu_times()
    if early == len(plan.payments):  # the first drained them all before the others consumed:
        early, started, cpu = first  # time it from when the first consumed (rate stays defined)
    await until(nothing_ready, worker)
    await until(all_applied, worker)
    seconds = time.perf_counter() - started
    return Drain(processes, len(plan.payments) - early, seconds, early, busy_since(cpu))


def cpu_times() -> tuple[int, int] | None:
    """The machine's (busy, total) CPU time so far, in ticks, from Linux's ``/proc/stat``."""
    try:
        ticks = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def busy_since(before: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time that was busy since ``before``."""
    after = cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


async def until(condition: Callable[[], Awaitable[bool]], worker: subprocess.Popen[bytes]) -> None:
    """Poll ``condition`` every ``POLL_INTERVAL``; ``WorkerFailed`` if the worker exits first."""
    while not await condition():
        if worker.poll() is not None:
            raise WorkerFailed(
                f"the worker exited {worker.returncode} while waiting for {condition.__name__}"
            )
        await asyncio.sleep(POLL_INTERVAL)


async def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM; ``WorkerFailed`` unless the worker exits 0 in time."""
    worker.send_signal(signal.SIGTERM)
    try:
        status = await asyncio.to_thread(worker.wait, STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise WorkerFailed(f"the worker did not stop within {STOP_TIMEOUT:g} s") from None
    if status != 0:
        raise WorkerFailed(f"the worker exited {status} on SIGTERM")


def tail(output: IO[bytes]) -> str:
    """The last ``LOG_TAIL`` lines of the worker's output."""
    output.seek(0)
    return "\n".join(output.read().decode(errors="replace").splitlines()[-LOG_TAIL:])


async def _check_balances(engine: AsyncEngine, plan: DemoPlan) -> None:
    async with engine.connect() as conn:
        result = await conn.execute(text("SELECT account, balance_cents FROM accounts"))
        balances = {str(account): int(cents) for account, cents in result}
    if balances != plan.expected_balances:
        raise WorkerFailed("the balances differ from the sums of the planned payments")


# Running and reporting


@dataclass(frozen=True)
class Options:
    messages: int
    processes: tuple[int, ...]
    rounds: int
    accounts: int
    timeout: float


async def drain_each(settings: Settings, options: Options) -> list[Drain]:
    """``options.rounds`` rounds of one drain per number of processes, in order (1, 2, 1, 2
    ...: a machine that slows down or speeds up meanwhile weighs on each N alike), each drain on
    broker names of its own."""
    plan = plan_payments(options.messages, 0.0, options.accounts, SEED)
    run_id = uuid.uuid4().hex[:10]
    drains = []
    for round_number in range(1, options.rounds + 1):
        for processes in options.processes:
            prefix = f"bench-{run_id}-processes-{processes}-{round_number}"
            names = settings.replace(exchange=f"{prefix}-events", queue=prefix)
            progress(f"round {round_number}: draining with --processes {processes} ...")
            drain = await _bounded(drain_with_processes(names, processes, plan), options.timeout)
            progress(f"  {drain.rate:.0f} msg/s")
            drains.append(drain)
    return drains


async def _bounded(drain: Awaitable[Drain], seconds: float) -> Drain:
    try:
        async with asyncio.timeout(seconds):
            return await drain
    except TimeoutError:
        raise WorkerFailed(
            f"not drained within {seconds:g} s (lower --messages or raise --timeout)"
        ) from None


def report(drains: list[Drain], options: Options) -> str:
    """Each drain, then each N's median rate and its ratio to the first N's."""
    lines = [
        f"worker run --processes N, {options.messages} distinct payment requests over "
        f"{options.accounts} accounts, relay off, cpu count {os.cpu_count()}",
        f"{'processes':>9}{'timed':>9}{'early':>7}{'seconds':>9}{'msg/s':>8}{'cpu busy':>10}",
        *(
            f"{d.processes:>9}{d.messages:>9}{d.early:>7}{d.seconds:>9.2f}{d.rate:>8.0f}"
            f"{'-' if d.busy is None else f'{100 * d.busy:.0f} %':>10}"
            for d in drains
        ),
        "(early: applied before all N processes consumed, left out of the timing; cpu busy: "
        "the whole machine's, every core and process, during the drain)",
        "",
    ]
    medians = {
        n: statistics.median(d.rate for d in drains if d.processes == n) for n in options.processes
    }
    lines.append("median msg/s: " + ", ".join(f"N={n} {rate:.0f}" for n, rate in medians.items()))
    first, *others = medians
    lines += [f"ratio N={n}/N={first}: {medians[n] / medians[first]:.2f}x" for n in others]
    return "\n".join(lines)


def process_counts(raw: str) -> tuple[int, ...]:
    """``1,2,4``: numbers of worker processes, each at least 1."""
    try:
        counts = tuple(positive_int(part) for part in raw.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts:
        raise argparse.ArgumentTypeError("a comma-separated list of numbers of processes, e.g. 1,2")
    return counts


def parse_options(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.processes",
        description="Throughput of `worker run --processes N` for each N, and the ratios.",
    )
    parser.add_argument("--messages", type=positive_int, default=20_000, help="per N (20000)")
    parser.add_argument(
        "--processes", type=process_counts, default=(1, 2), help="numbers of processes (1,2)"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=1, help="drains of each N, interleaved (1)"
    )
    parser.add_argument("--accounts", type=positive_int, default=1000, help="accounts (1000)")
    parser.add_argument(
        "--timeout",
        type=positive_float,
        help="seconds a drain may take (default: 120 + 20 ms per message)",
    )
    args = parser.parse_args(argv)
    timeout = args.timeout or 120.0 + 0.02 * args.messages
    return Options(args.messages, args.processes, args.rounds, args.accounts, timeout)


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with scratch_database(Settings.load(), payments_router, prefix="worker_bench") as settings:
        drains = asyncio.run(drain_each(settings, options))
    print(report(drains, options))


if __name__ == "__main__":
    main()
