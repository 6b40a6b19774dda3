"""Peak memory and CPU of the worker's real processes under load: the figures behind the
Kubernetes manifests' requests and limits (docs/capacity.md).

Each scenario starts one process as an operator would (``python -m worker <command>`` with the
payments example) on a fresh database ``worker_bench_<hex>`` and broker names of this run's own,
loads it, and reads it from Linux's ``/proc`` every ``SAMPLE_INTERVAL`` seconds while it runs:

- ``run``: ``worker run --no-relay`` draining ``--messages`` preloaded payment requests;
- ``relay``: ``worker relay`` draining ``--messages`` preloaded outbox rows to a bound queue;
- ``serve``: ``worker serve`` taking ``--requests`` payment requests from ``--clients``
  concurrent HTTP clients of this process (which shares the machine and so limits the rate);
- ``big``: ``worker run --no-relay`` while ``--big`` payments of about 1 MB arrive with the
  accounts table locked for ``--stall`` seconds: every transaction waits, the broker fills the
  prefetch, and the peak approaches ``prefetch * max_body_bytes`` beyond the process's own.

For each: the rate, the process's peak resident set (``VmHWM``); its CPU time (user + system)
while it worked, from its first item done to its last (its start left out), per item and as a
share of a core, and its busiest share over ``WINDOW`` seconds; and the CPU time of the
PostgreSQL backends serving it (found by their ``application_name`` in ``pg_stat_activity``) in
the same span, per item. Linux only. From the repository root::

    .venv/bin/python -m benchmarks.footprint [--messages 20000] [--requests 3000] [--big 800]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika
import httpx
from aio_pika.abc import AbstractExchange
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.common import REQUESTED, SEED, count_rows, publish_all, reset_tables
from benchmarks.processes import ROOT, WorkerFailed, stop_worker, until
from benchmarks.relay_latency import delete_broker_objects, progress
from benchmarks.throughput import settled_body
from examples.payments import router as payments_router
from examples.payments.demo import plan_payments, request_message
from worker.database import create_engine
from worker.ops.runner import connect_broker
from worker.settings import Settings, positive_float, positive_int
from worker.sql.outbox import append_outbox
from worker.sql.rows import OutboxMessage
from worker.testing import scratch_database
from worker.transport.topology import declare_topology

log = logging.getLogger("benchmarks.footprint")

APPLICATION_NAME = "bench-footprint"
"""This module's own database connections, left out of the backends' CPU."""
SAMPLE_INTERVAL = 0.2
WINDOW = 2.0
"""Seconds over which the busiest share of a core is measured."""
BIG_BODY = 1_000_000
"""Bytes of padding in each payment of the ``big`` scenario (under the 1 MiB ``max_body_bytes``)."""
SETTLED = "payment.settled"
TICKS = os.sysconf("SC_CLK_TCK")
SCENARIOS = ("run", "relay", "serve", "big")


@dataclass
class Footprint:
    """What ``/proc`` said of one process (and its PostgreSQL backends) while it ran."""

    peak_rss_kib: int = 0
    busiest: float = 0.0
    cpu_seconds: float = 0.0
    """The process's CPU time between ``begin`` and ``end``."""
    backend_seconds: float = 0.0
    """Its PostgreSQL backends' CPU time between ``begin`` and ``end``."""
    _cpu: float = 0.0
    _recent: list[tuple[float, float]] = field(default_factory=list)
    _backends: dict[int, float] = field(default_factory=dict)
    _begun: tuple[float, float] | None = None

    def sample(self, pid: int, backends: set[int]) -> None:
        """Read the process's ``/proc`` entries and its backends' CPU now."""
        now = time.monotonic()
        cpu = cpu_seconds(pid)
        if cpu is None:
            return
        self._cpu = cpu
        self.peak_rss_kib = max(self.peak_rss_kib, peak_rss_kib(pid))
        self._recent = [(t, c) for t, c in self._recent if now - t <= WINDOW] + [(now, cpu)]
        started, before = self._recent[0]
        if now - started >= WINDOW * 0.75:
            self.busiest = max(self.busiest, (cpu - before) / (now - started))
        for backend in backends:
            seconds = cpu_seconds(backend)
            if seconds is not None:  # (a backend that ended keeps its last reading)
                self._backends[backend] = seconds

    async def begin(self, pid: int, engine: AsyncEngine) -> None:
        """The timed work starts: take the process's and its backends' CPU time now."""
        self.sample(pid, await backends_of(engine))
        self._begun = self._cpu, sum(self._backends.values())

    async def end(self, pid: int, engine: AsyncEngine) -> None:
        """The timed work ended: the CPU time since ``begin``."""
        self.sample(pid, await backends_of(engine))
        assert self._begun is not None, "end before begin"
        process, backends = self._begun
        self.cpu_seconds = self._cpu - process
        self.backend_seconds = sum(self._backends.values()) - backends


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (``/proc/<pid>/stat``), None once it ended."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_kib(pid: int) -> int:
    """``VmHWM`` of ``pid`` (``/proc/<pid>/status``), 0 once it ended."""
    return status_kib(pid, "VmHWM")


def rss_kib(pid: int) -> int:
    """``VmRSS`` of ``pid`` now (``/proc/<pid>/status``), 0 once it ended."""
    return status_kib(pid, "VmRSS")


def status_kib(pid: int, name: str) -> int:
    """The KiB of field ``name`` of ``/proc/<pid>/status``, 0 once the process ended."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1])
    return 0


async def backends_of(engine: AsyncEngine) -> set[int]:
    """The pids of this database's backends other than this module's own connections."""
    async with engine.connect() as conn:
        result = await conn.execute(
            text(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name <> :own"
            ),
            {"own": APPLICATION_NAME},
        )
        return {int(pid) for pid in result.scalars()}


@contextlib.asynccontextmanager
async def sampled(
    process: subprocess.Popen[bytes], engine: AsyncEngine
) -> AsyncIterator[Footprint]:
    """Sample ``process`` every ``SAMPLE_INTERVAL`` until the block ends (and once more then)."""
    footprint = Footprint()

    async def sample() -> None:
        footprint.sample(process.pid, await backends_of(engine))

    async def keep_sampling() -> None:
        while True:
            await sample()
            await asyncio.sleep(SAMPLE_INTERVAL)

    task = asyncio.create_task(keep_sampling())
    try:
        yield footprint
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sample()


@dataclass(frozen=True)
class Measured:
    scenario: str
    what: str
    items: int
    seconds: float
    footprint: Footprint

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0


# The processes


@contextlib.contextmanager
def started(settings: Settings, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m worker <args>`` with the payments example on ``settings``' database and broker
    names, its output discarded; killed on exit if it is still running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        PYTHONPATH=str(ROOT),
        WORKER_DATABASE_URL=settings.database_url,
        WORKER_AMQP_URL=settings.amqp_url,
        WORKER_EXCHANGE=settings.exchange,
        WORKER_QUEUE=settings.queue,
        WORKER_HANDLERS="examples.payments",
        WORKER_HTTP_PORT="0",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "worker", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def timed_drain(
    count: Callable[[], Awaitable[int]],
    total: int,
    process: subprocess.Popen[bytes],
    footprint: Footprint,
    engine: AsyncEngine,
) -> tuple[int, float]:
    """(items, seconds) from the first item ``count`` sees done to the last of ``total``, the
    span of ``footprint``'s CPU times."""

    async def begun() -> bool:
        return await count() > 0

    await until(begun, process)
    first, since = await count(), time.perf_counter()
    await footprint.begin(process.pid, engine)

    async def finished() -> bool:
        return await count() >= total

    await until(finished, process)
    seconds = time.perf_counter() - since
    await footprint.end(process.pid, engine)
    return total - first, seconds


# The scenarios


@dataclass(frozen=True)
class Run:
    settings: Settings
    engine: AsyncEngine
    options: Options


@contextlib.asynccontextmanager
async def work_queue(run: Run) -> AsyncIterator[AbstractExchange]:
    """The payments topology on this run's names, deleted afterwards; yields its exchange."""
    connection = await connect_broker(run.settings, name=APPLICATION_NAME)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        topology = await declare_topology(channel, run.settings, payments_router.routing_keys())
        yield topology.exchange
    finally:
        await connection.close()
        await delete_broker_objects(run.settings)


async def drain_requests(run: Run) -> Measured:
    """``run``: ``worker run --no-relay`` draining preloaded payment requests."""
    plan = plan_payments(run.options.messages, 0.0, 1000, SEED)
    await reset_tables(run.engine)
    async with work_queue(run) as exchange:
        await publish_all(exchange, REQUESTED, map(request_message, plan.sends))
        with started(run.settings, "run", "--no-relay") as process:
            async with sampled(process, run.engine) as footprint:
                ledger = functools.partial(count_rows, run.engine, "ledger_entries")
                items, seconds = await timed_drain(
                    ledger, len(plan.sends), process, footprint, run.engine
                )
                await stop_worker(process)
    return Measured("run", "worker run --no-relay, msg/s", items, seconds, footprint)


async def drain_outbox(run: Run) -> Measured:
    """``relay``: ``worker relay`` draining preloaded outbox rows to a queue bound for them."""
    plan = plan_payments(run.options.messages, 0.0, 1000, SEED)
    await reset_tables(run.engine)
    rows = (
        OutboxMessage(
            message_id=uuid.uuid4(),
            exchange=run.settings.exchange,
            routing_key=SETTLED,
            body=settled_body(payment),
            content_type="application/json",
            headers={},
            correlation_id=str(payment["payment_id"]),
            causation_id=str(payment["payment_id"]),
            ordering_key=str(payment["account"]),
        )
        for payment in plan.sends
    )
    while batch := list(itertools.islice(rows, 1000)):
        async with run.engine.begin() as conn:
            await append_outbox(conn, batch)
    sink = f"{run.settings.queue}.sink"
    connection = await connect_broker(run.settings, name=APPLICATION_NAME)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            run.settings.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(sink, durable=True)
        await queue.bind(exchange, SETTLED)
        total = len(plan.sends)

        async def published() -> int:
            return total - await count_rows(run.engine, "outbox")

        with started(run.settings, "relay") as process:
            async with sampled(process, run.engine) as footprint:
                items, seconds = await timed_drain(published, total, process, footprint, run.engine)
                await stop_worker(process)
    finally:
        await connection.close()
        await delete_broker_objects(run.settings, [sink])
    return Measured("relay", "worker relay, events/s", items, seconds, footprint)


async def take_requests(run: Run) -> Measured:
    """``serve``: ``worker serve`` taking payment requests from concurrent clients."""
    await reset_tables(run.engine)
    port = free_port()
    count = run.options.requests
    todo = iter(range(count))

    async def client() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            for i in todo:
                answer = await http.post(
                    f"/messages/{REQUESTED}",
                    headers={"Idempotency-Key": f"f{i}"},
                    json={"payment_id": f"f{i}", "account": f"a{i % 1000}", "amount_cents": 100},
                )
                if answer.status_code != 202:
                    raise WorkerFailed(f"the ingress answered {answer.status_code}: {answer.text}")

    async def listening() -> bool:
        with contextlib.suppress(httpx.TransportError):
            async with httpx.AsyncClient(timeout=5) as http:
                return (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
        return False

    args = ("serve", "--port", str(port), "--ingress-routing-keys", REQUESTED)
    with started(run.settings, *args) as process:
        async with sampled(process, run.engine) as footprint:
            await until(listening, process)
            await footprint.begin(process.pid, run.engine)
            since = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(run.options.clients)))
            seconds = time.perf_counter() - since
            await footprint.end(process.pid, run.engine)
            await stop_worker(process)
    return Measured(
        "serve",
        f"worker serve, {run.options.clients} clients, requests/s",
        count,
        seconds,
        footprint,
    )


async def stalled_big_bodies(run: Run) -> Measured:
    """``big``: the prefetch filled with ~1 MB bodies while every transaction waits on a lock."""
    count = run.options.big
    await reset_tables(run.engine)
    padding = "x" * BIG_BODY
    messages = (
        request_message(
            {"payment_id": f"b{i}", "account": f"a{i % 50}", "amount_cents": 1, "memo": padding}
        )
        for i in range(count)
    )
    async with work_queue(run) as exchange:
        await publish_all(exchange, REQUESTED, messages)
        async with run.engine.connect() as blocker:
            transaction = await blocker.begin()
            await blocker.execute(text("LOCK TABLE accounts IN ACCESS EXCLUSIVE MODE"))
            with started(run.settings, "run", "--no-relay") as process:
                async with sampled(process, run.engine) as footprint:
                    await asyncio.sleep(run.options.stall)
                    await transaction.commit()
                    ledger = functools.partial(count_rows, run.engine, "ledger_entries")
                    items, seconds = await timed_drain(
                        ledger, count, process, footprint, run.engine
                    )
                    await stop_worker(process)
    what = f"worker run, {BIG_BODY // 1000} kB bodies after a {run.options.stall:g} s stall, msg/s"
    return Measured("big", what, items, seconds, footprint)


RUNS: dict[str, Callable[[Run], Awaitable[Measured]]] = {
    "run": drain_requests,
    "relay": drain_outbox,
    "serve": take_requests,
    "big": stalled_big_bodies,
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# Running and reporting


@dataclass(frozen=True)
class Options:
    messages: int
    requests: int
    clients: int
    big: int
    stall: float
    only: tuple[str, ...]
    timeout: float


async def run_scenarios(settings: Settings, options: Options) -> list[Measured]:
    engine = create_engine(settings, application_name=APPLICATION_NAME, pool_size=2)
    run_id = uuid.uuid4().hex[:10]
    results = []
    try:
        for scenario in options.only:
            names = settings.replace(
                exchange=f"bench-{run_id}-{scenario}-events", queue=f"bench-{run_id}-{scenario}"
            )
            progress(f"running {scenario} ...")
            try:
                async with asyncio.timeout(options.timeout):
                    results.append(await RUNS[scenario](Run(names, engine, options)))
            except TimeoutError:
                raise WorkerFailed(
                    f"{scenario} did not finish within {options.timeout:g} s"
                ) from None
    finally:
        await engine.dispose()
    return results


def report(results: list[Measured]) -> str:
    lines = [
        f"footprint of the worker's processes (payments example, cpu count {os.cpu_count()})",
        f"{'scenario':<9}{'items':>7}{'seconds':>9}{'rate':>8}{'peak RSS':>12}{'cores':>7}"
        f"{'busiest':>9}{'ms/item':>9}{'db ms/item':>12}",
    ]
    for m in results:
        f = m.footprint
        lines.append(
            f"{m.scenario:<9}{m.items:>7}{m.seconds:>9.2f}{m.rate:>8.0f}"
            f"{f.peak_rss_kib / 1024:>8.1f} MiB{f.cpu_seconds / m.seconds:>7.2f}{f.busiest:>9.2f}"
            f"{1000 * f.cpu_seconds / m.items:>9.3f}{1000 * f.backend_seconds / m.items:>12.3f}"
        )
    lines += [
        "(rate: " + "; ".join(f"{m.scenario}: {m.what}" for m in results) + ")",
        "(cores: the process's CPU time (user + system) while it worked, from its first item to "
        f"its last, over that time; busiest: the most over {WINDOW:g} s; ms/item: its CPU time "
        "per item; db ms/item: its PostgreSQL backends' CPU time per item in the same span)",
    ]
    return "\n".join(lines)


def scenario_list(raw: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in raw.split(",") if part.strip())
    unknown = set(chosen) - set(SCENARIOS)
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(SCENARIOS)}")
    return chosen


def parse_options(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.footprint",
        description="Peak memory and CPU of worker run, relay and serve under load.",
    )
    parser.add_argument("--messages", type=positive_int, default=20_000, help="run, relay (20000)")
    parser.add_argument("--requests", type=positive_int, default=3000, help="serve (3000)")
    parser.add_argument("--clients", type=positive_int, default=50, help="serve (50)")
    parser.add_argument("--big", type=positive_int, default=800, help="~1 MB payments (800)")
    parser.add_argument(
        "--stall", type=positive_float, default=20.0, help="seconds big's table stays locked (20)"
    )
    parser.add_argument(
        "--only", type=scenario_list, default=SCENARIOS, help=f"of {','.join(SCENARIOS)} (all)"
    )
    parser.add_argument(
        "--timeout", type=positive_int, default=600, help="seconds a scenario may take (600)"
    )
    args = parser.parse_args(argv)
    return Options(
        args.messages, args.requests, args.clients, args.big, args.stall, args.only, args.timeout
    )


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    logging.basicConfig(level=logging.WARNING)
    if not Path("/proc/self/stat").exists():
        raise SystemExit("benchmarks.footprint reads Linux's /proc: not available here")
    with scratch_database(Settings.load(), payments_router, prefix="worker_bench") as settings:
        results = asyncio.run(run_scenarios(settings, options))
    print(report(results))


if __name__ == "__main__":
    main()
