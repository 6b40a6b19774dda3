"""The HTTP ingress against a hand-written FastAPI endpoint doing the same writes, in one run.

Two servers, one after the other, each under uvicorn with the same settings
(``worker.ingress.serve.serve_app``: h11, no access log) in this process, on the same fresh
database:

- ``ingress``: ``worker serve``'s application for the payments example
  (``worker.ingress.serve.serve``), ``ingress_pool_size`` connections;
- ``baseline``: a FastAPI endpoint written by hand for ``payment.requested``: FastAPI parses and
  validates the body into ``PaymentRequested`` and reads the ``Idempotency-Key`` header, then one
  raw asyncpg transaction (a pool of as many connections) inserts the request row
  ``ON CONFLICT DO NOTHING`` and, when it was new, the outbox row with its NOTIFY; 202.

For each, a load generator in a spawned process (in this event loop it would compete with the
server for it) measures:

1. ``accepted/s``: ``--requests`` distinct payments posted by ``--clients`` (50) concurrent httpx
   clients, each with a connection of its own, as fast as they are answered; every answer must
   be a 202. The ratio ingress/baseline is printed against its target (>= 0.8x).
2. latency at ``--rate`` (500) requests per second offered for ``--seconds`` on absolute deadlines
   (an open loop: a request is sent at its time whether or not earlier ones were answered), from
   its deadline to its answer; p50 and p99 (nearest rank) against the target p99 < 50 ms.

Then two attacks on ``worker serve`` in a process of its own, at its default bounds, as a
client without a token could make them: ``--connections`` (1,100) idle TCP connections, and
``--slow-clients`` (400) POSTs that declare a body of ``max_body_bytes`` (1 MiB), send 99 % of
it and stall. For each: the process's RSS (``/proc/<pid>/status``) before, under and a few
seconds after the attack, its open files before and under it (``/proc/<pid>/fd``), and ten
``/healthz`` probes made under it (answered, p50, slowest).

The tables are emptied and a CHECKPOINT taken before each measurement. Tests never assert the
timings. A fresh database ``worker_bench_<hex>`` is created next to the one in
``WORKER_DATABASE_URL``, migrated and dropped at the end. From the repository root::

    .venv/bin/python -m benchmarks.ingress [--requests 5000] [--rate 500] [--seconds 10]
        [--connections 1100] [--slow-clients 400] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Annotated, Any

import aio_pika
import asyncpg
import httpx
from fastapi import FastAPI, Header
from starlette.responses import JSONResponse

from benchmarks.footprint import rss_kib
from benchmarks.relay_latency import percentile, progress
from examples.payments import router as payments_router
from examples.payments.handlers import PaymentRequested
from worker.core.codec import fingerprint
from worker.ingress.serve import serve, serve_app
from worker.settings import Settings, positive_float, positive_int
from worker.sql.outbox import NOTIFY_RELAYS
from worker.testing import scratch_database
from worker.transport.topology import delete_topology

PATH = "/messages/payment.requested"
CLIENTS = 50
WARM_UP = 50
"""Requests sent and answered before each measurement: connections, caches, prepared statements."""
RATIO_TARGET = 0.8
P99_TARGET_MS = 50.0
LATENCY_CONNECTIONS = 200
"""Connections the latency generator may open: enough that an offered request never waits for
one while the server keeps up."""

BASELINE_INSERT_REQUEST = """
INSERT INTO ingress_requests
    (handler, client, key, handler_key, routing_key, fingerprint, message_id)
VALUES ('payment.requested', 'anonymous', $1, 'http:anonymous:' || $1, 'payment.requested', $2, $3)
ON CONFLICT (handler, client, key) DO NOTHING
RETURNING message_id
"""

BASELINE_INSERT_EVENT = f"""
INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, headers)
SELECT $1, $2, 'payment.requested', $3, 'application/json',
       jsonb_build_object('idempotency-key', $4::text)
FROM (SELECT {NOTIFY_RELAYS}) AS notified
"""


@dataclass(frozen=True)
class Options:
    requests: int
    clients: int
    rate: float
    seconds: float
    connections: int = 1100
    slow_clients: int = 400


@dataclass(frozen=True)
class Throughput:
    """``requests`` answered in ``seconds``, by status."""

    requests: int
    seconds: float
    statuses: dict[int, int]

    @property
    def rate(self) -> float:
        return self.statuses.get(202, 0) / self.seconds


@dataclass(frozen=True)
class Latency:
    """Delays from each request's deadline to its answer, in seconds, and the offering's span."""

    delays: list[float]
    offered_seconds: float
    statuses: dict[int, int]


@dataclass
class Measured:
    label: str
    throughput: Throughput
    latency: Latency


def body_of(prefix: str, i: int) -> dict[str, Any]:
    return {"payment_id": f"{prefix}-{i}", "account": f"acct-{i % 100}", "amount_cents": 100 + i}


# -- the load generator, in a spawned process --------------------------------------------------


def generate(url: str, mode: str, options: Options, prefix: str, results: Connection) -> None:
    """Entry point of the load process: ``mode`` is ``throughput`` or ``latency``."""
    if mode == "throughput":
        results.send(asyncio.run(_throughput(url, options, prefix)))
    else:
        results.send(asyncio.run(_latency(url, options, prefix)))
    results.close()


async def _post(client: httpx.AsyncClient, prefix: str, i: int) -> int:
    body = json.dumps(body_of(prefix, i)).encode()
    headers = {"content-type": "application/json", "idempotency-key": f"{prefix}-{i}"}
    return (await client.post(PATH, content=body, headers=headers)).status_code


async def _throughput(url: str, options: Options, prefix: str) -> Throughput:
    statuses: Counter[int] = Counter()
    remaining = iter(range(options.requests))

    async def client(own: httpx.AsyncClient) -> None:
        for i in remaining:
            statuses[await _post(own, prefix, i)] += 1

    limits = httpx.Limits(max_connections=1)
    clients = [httpx.AsyncClient(base_url=url, limits=limits) for _ in range(options.clients)]
    async with contextlib.AsyncExitStack() as stack:
        for each in clients:
            await stack.enter_async_context(each)
        await asyncio.gather(*(_post(c, f"{prefix}-warm", i) for i, c in enumerate(clients)))
        started = time.perf_counter()
        await asyncio.gather(*(client(each) for each in clients))
        seconds = time.perf_counter() - started
    return Throughput(options.requests, seconds, dict(statuses))


async def _latency(url: str, options: Options, prefix: str) -> Latency:
    count = max(1, round(options.rate * options.seconds))
    limits = httpx.Limits(max_connections=LATENCY_CONNECTIONS)
    statuses: Counter[int] = Counter()
    delays: list[float] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        await asyncio.gather(*(_post(client, f"{prefix}-warm", i) for i in range(WARM_UP)))

        async def timed(i: int, deadline: float) -> None:
            statuses[await _post(client, prefix, i)] += 1
            delays.append(time.perf_counter() - deadline)

        tasks = []
        start = time.perf_counter() + 0.05
        for i in range(count):
            deadline = start + i / options.rate
            await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
            tasks.append(asyncio.create_task(timed(i, deadline)))
        offered = time.perf_counter() - start
        await asyncio.gather(*tasks)
    return Latency(delays, offered, dict(statuses))


async def load(url: str, mode: str, options: Options, prefix: str) -> Any:
    """Run the load generator in a spawned process and return what it measured."""
    context = multiprocessing.get_context("spawn")
    receiving, sending = context.Pipe(duplex=False)
    process = context.Process(target=generate, args=(url, mode, options, prefix, sending))
    process.start()
    sending.close()
    try:
        return await asyncio.to_thread(receiving.recv)
    finally:
        await asyncio.to_thread(process.join, 30)


# -- the servers --------------------------------------------------------------------------------


def baseline_app(settings: Settings) -> FastAPI:
    """The hand-written endpoint: FastAPI validates, asyncpg writes the request and its event."""
    pool: list[asyncpg.Pool] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        size = settings.ingress_pool_size
        pool.append(await asyncpg.create_pool(settings.database_url, min_size=size, max_size=size))
        try:
            yield
        finally:
            await pool[0].close()

    app = FastAPI(lifespan=lifespan)

    @app.post(PATH, status_code=202)
    async def post(
        body: PaymentRequested, idempotency_key: Annotated[str, Header()]
    ) -> JSONResponse:
        raw = body.model_dump_json().encode()
        message_id = uuid.uuid4()
        async with pool[0].acquire() as conn, conn.transaction():
            inserted = await conn.fetchval(
                BASELINE_INSERT_REQUEST, idempotency_key, fingerprint(body.model_dump()), message_id
            )
            if inserted is not None:
                await conn.execute(
                    BASELINE_INSERT_EVENT, message_id, settings.exchange, raw, idempotency_key
                )
        location = f"{PATH}/{idempotency_key}"
        return JSONResponse(
            {"status_url": location, "message_id": str(message_id)},
            status_code=202,
            headers={"Location": location},
        )

    return app


Server = Callable[[asyncio.Event, Callable[[int], object]], Coroutine[Any, Any, None]]


async def measure(label: str, settings: Settings, options: Options, server: Server) -> Measured:
    """Start ``server`` on a free port, measure throughput then latency against it, stop it."""
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server(stop, port.set_result))
    try:
        started: set[asyncio.Future[Any]] = {port, task}
        await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        url = f"http://127.0.0.1:{port.result()}"
        await empty_tables(settings)
        progress(f"({label}) {options.requests} requests, {options.clients} clients ...")
        throughput = await load(url, "throughput", options, f"{label}-t")
        await empty_tables(settings)
        progress(f"({label}) {options.rate:g} req/s for {options.seconds:g} s ...")
        latency = await load(url, "latency", options, f"{label}-l")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    return Measured(label, throughput, latency)


async def empty_tables(settings: Settings) -> None:
    conn = await asyncpg.connect(settings.database_url)
    try:
        await conn.execute("TRUNCATE ingress_requests, outbox")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def run(settings: Settings, options: Options) -> list[Measured]:
    served = settings.replace(ingress_host="127.0.0.1", ingress_port=0)

    async def ingress(stop: asyncio.Event, started: Callable[[int], object]) -> None:
        await serve(served, payments_router, stop, started=started)

    async def baseline(stop: asyncio.Event, started: Callable[[int], object]) -> None:
        await serve_app(baseline_app(served), "127.0.0.1", 0, stop, started)

    return [
        await measure("ingress", served, options, ingress),
        await measure("baseline", served, options, baseline),
    ]


# -- attacks: what a client without a token can do to the ingress's connections ----------------

Streams = list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
"""Client connections: what each reads, and what it writes with."""


async def idle_connections(port: int, count: int) -> Streams:
    """``count`` TCP connections to ``127.0.0.1:port`` that send nothing (those the server
    refuses to accept are left out)."""
    streams = []
    for _ in range(count):
        try:
            streams.append(await asyncio.open_connection("127.0.0.1", port))
        except OSError:
            continue
    return streams


def closed_by_server(streams: Streams) -> int:
    """How many of ``streams`` the server has closed (their end of file has arrived)."""
    return sum(reader.at_eof() or reader.exception() is not None for reader, _ in streams)


async def slow_bodies(port: int, count: int, declared: int, sent: int) -> Streams:
    """``count`` POSTs of a payment that declare ``declared`` bytes of body, send ``sent`` of
    them and stall."""
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: slow\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()
    body = b" " * sent
    streams = []
    for _ in range(count):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        writer.write(head)
        writer.write(body)
        streams.append((reader, writer))
    return streams


async def close_all(writers: list[asyncio.StreamWriter]) -> None:
    """Close every connection at once (a reset, as a killed client's)."""
    for writer in writers:
        writer.transport.abort()
    await asyncio.sleep(0)


async def status_of(reader: asyncio.StreamReader, within: float) -> int | None:
    """The status of the response ``reader`` gets within ``within`` seconds; None when the
    connection closes (or stays silent) first."""
    try:
        async with asyncio.timeout(within):
            line = await reader.readline()
    except (TimeoutError, OSError):
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def probe(
    port: int, path: str = "/healthz", within: float = 10.0
) -> tuple[int | None, float]:
    """A GET of ``path`` on a connection of its own: its status (None without an answer within
    ``within`` seconds) and the seconds it took."""
    started = time.perf_counter()
    request = f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request.encode())
            status = await status_of(reader, within)
            writer.transport.abort()
    except (TimeoutError, OSError):
        status = None
    return status, time.perf_counter() - started


def open_files(pid: int) -> int:
    """File descriptors ``pid`` holds open (``/proc/<pid>/fd``)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_ingress(settings: Settings, log: Path, **environ: str) -> subprocess.Popen[bytes]:
    """``python -m worker serve --port 0`` for the payments example on ``settings``' database,
    with ``environ`` added to its environment, its output in ``log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_DATABASE_URL=settings.database_url,
        WORKER_HANDLERS="examples.payments",
        PYTHONPATH=str(Path(__file__).resolve().parent.parent),
        **environ,
    )
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "serve", "--port", "0"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def listening_port(log: Path, process: subprocess.Popen[bytes]) -> int:
    """The port ``worker serve`` logged it listens on, once it did (within a minute)."""
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(log.read_text)
        found = re.search(r"serving the ingress .* on http://[^:]+:(\d+)", text)
        if found:
            return int(found[1])
        if process.poll() is not None:
            break
        await asyncio.sleep(0.1)
    raise RuntimeError(f"worker serve did not listen:\n{text}")


@dataclass(frozen=True)
class AttackFigures:
    """What the ingress process looked like before, under and after one attack."""

    name: str
    rss_before_mib: float
    rss_during_mib: float
    rss_after_mib: float
    files_before: int
    files_during: int
    probes: list[tuple[int | None, float]]
    statuses: dict[str, int]


async def _probes(port: int, count: int) -> list[tuple[int | None, float]]:
    results = []
    for _ in range(count):
        results.append(await probe(port))
        await asyncio.sleep(0.2)
    return results


async def attacked(
    name: str,
    pid: int,
    port: int,
    attack: Coroutine[Any, Any, Streams],
    outcome: Callable[[Streams], Coroutine[Any, Any, dict[str, int]]],
    settle: float,
) -> AttackFigures:
    """The figures of ``attack`` on the ingress process ``pid``: /healthz probed under it, what
    became of its connections (``outcome``), then all of them closed and ``settle`` seconds
    left for the process to give back what it held."""
    rss_before, files_before = rss_kib(pid) / 1024, open_files(pid)
    streams = await attack
    probes = await _probes(port, 10)
    rss_during, files_during = rss_kib(pid) / 1024, open_files(pid)
    statuses = await outcome(streams)
    await close_all([writer for _, writer in streams])
    await asyncio.sleep(settle)
    rss_after = rss_kib(pid) / 1024
    return AttackFigures(
        name, rss_before, rss_during, rss_after, files_before, files_during, probes, statuses
    )


async def idle_flood(pid: int, port: int, connections: int) -> AttackFigures:
    """``connections`` idle connections, /healthz probed meanwhile, then all closed."""

    async def closed(streams: Streams) -> dict[str, int]:
        return {"opened": len(streams), "closed by the server": closed_by_server(streams)}

    attack = idle_connections(port, connections)
    return await attacked("idle flood", pid, port, attack, closed, settle=2)


async def slow_body_flood(pid: int, port: int, clients: int, declared: int) -> AttackFigures:
    """``clients`` POSTs declaring ``declared`` bytes that send 99 % and stall, /healthz probed
    meanwhile; then they are closed and the ingress left idle a few seconds."""

    async def answers(streams: Streams) -> dict[str, int]:
        statuses = await asyncio.gather(*(status_of(reader, 0.5) for reader, _ in streams))
        return dict(Counter(str(status) if status else "no answer yet" for status in statuses))

    attack = slow_bodies(port, clients, declared, declared * 99 // 100)
    return await attacked("slow bodies", pid, port, attack, answers, settle=3)


WIDE_NAMES = 80_000
"""Names of a wide body: about 870 KB, within ``max_body_bytes``, far past ``max_json_items``."""


def wide_body(i: int) -> bytes:
    """A valid payment with ``WIDE_NAMES`` names more."""
    names = {f"k{n:05d}": 1 for n in range(WIDE_NAMES)}
    return json.dumps(body_of("wide", i) | names, separators=(",", ":")).encode()


async def wide_body_flood(pid: int, port: int, clients: int) -> AttackFigures:
    """``clients`` clients each POSTing wide bodies back to back while /healthz is probed: the
    cost of a body is its decoding, which must never hold the event loop."""
    body = wide_body(0)
    statuses: Counter[str] = Counter()
    stop = asyncio.Event()

    async def client(n: int) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            i = 0
            while not stop.is_set():
                headers = {"content-type": "application/json", "idempotency-key": f"w{n}-{i}"}
                answer = await http.post(PATH, content=body, headers=headers)
                statuses[str(answer.status_code)] += 1
                i += 1

    async def attack() -> Streams:
        return []

    async def outcome(_: Streams) -> dict[str, int]:
        stop.set()
        await asyncio.gather(*senders)
        return dict(statuses)

    senders = [asyncio.create_task(client(n)) for n in range(clients)]
    await asyncio.sleep(0.5)  # the bodies are on their way
    return await attacked("wide bodies", pid, port, attack(), outcome, settle=1)


async def attacks(settings: Settings, connections: int, slow_clients: int) -> list[AttackFigures]:
    """Both attacks against ``worker serve`` in a process of its own, at its default bounds."""
    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "serve.log"
        process = start_ingress(settings, log, WORKER_INGRESS_ACCESS_LOG="false")
        try:
            port = await listening_port(log, process)
            await probe(port)
            progress(f"(attacks) {connections} idle connections ...")
            idle = await idle_flood(process.pid, port, connections)
            progress(f"(attacks) {slow_clients} slow 1 MiB bodies ...")
            slow = await slow_body_flood(process.pid, port, slow_clients, settings.max_body_bytes)
            progress(f"(attacks) {WIDE_CLIENTS} clients posting {WIDE_NAMES:,}-name bodies ...")
            idle_probes = await attacked("idle", process.pid, port, _nothing(), _none, settle=0)
            wide = await wide_body_flood(process.pid, port, WIDE_CLIENTS)
        finally:
            process.terminate()
            await asyncio.to_thread(process.wait, 30)
    progress(f"(attacks) {WIDE_MESSAGES} wide bodies over AMQP to worker run ...")
    return [idle, slow, idle_probes, wide, *await wide_messages(settings, WIDE_MESSAGES)]


WIDE_MESSAGES = 10
"""Wide bodies published to the consumer (ten kept its /healthz waiting 8 s)."""


def start_consumer(settings: Settings, port: int) -> subprocess.Popen[bytes]:
    """``python -m worker run`` for the payments example on ``settings``, its health endpoint on
    127.0.0.1:``port``, its output discarded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parent.parent),
        WORKER_DATABASE_URL=settings.database_url,
        WORKER_AMQP_URL=settings.amqp_url,
        WORKER_EXCHANGE=settings.exchange,
        WORKER_QUEUE=settings.queue,
        WORKER_HANDLERS="examples.payments",
        WORKER_HTTP_HOST="127.0.0.1",
        WORKER_HTTP_PORT=str(port),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "worker", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def wide_messages(settings: Settings, count: int) -> list[AttackFigures]:
    """The consumer's variant: a ``worker run`` of the payments example, its /healthz probed
    idle and while ``count`` wide bodies arrive over AMQP (each parked, never decoded on the
    event loop)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_id = uuid.uuid4().hex[:8]
    settings = settings.replace(exchange=f"bench-{run_id}-events", queue=f"bench-{run_id}")
    process = start_consumer(settings, port)
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        for _ in range(300):
            if (await probe(port, within=1))[0] == 200:
                break
            await asyncio.sleep(0.1)
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(settings.queue, passive=True)
        while queue.declaration_result.consumer_count == 0:
            await asyncio.sleep(0.1)
            queue = await channel.declare_queue(settings.queue, passive=True)
        idle = await attacked("worker, idle", process.pid, port, _nothing(), _none, settle=0)
        exchange = await channel.get_exchange(settings.exchange)
        body = wide_body(0)

        async def publish() -> Streams:
            for i in range(count):
                message = aio_pika.Message(
                    body, headers={"idempotency-key": f"wide-{i}"}, content_type="application/json"
                )
                await exchange.publish(message, routing_key="payment.requested")
            return []

        wide = await attacked("worker, wide", process.pid, port, publish(), _none, settle=0)
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)
        await delete_topology(await connection.channel(), settings)
        await connection.close()
    return [idle, wide]


WIDE_CLIENTS = 2
"""Clients posting wide bodies at once (two took /healthz to 10-22 s before bodies were checked
off the event loop)."""


async def _nothing() -> Streams:
    return []


async def _none(_: Streams) -> dict[str, int]:
    return {}


def attack_report(figures: list[AttackFigures]) -> str:
    lines = [
        "",
        "attacks on worker serve (default bounds), RSS in MiB before / under / after, open files "
        "before / under, /healthz probes under attack",
        f"{'attack':<13}{'rss':>20}{'files':>12}{'probes ok':>11}{'p50 ms':>9}{'max ms':>9}  "
        "connections",
    ]
    for each in figures:
        answered = sorted(1000 * seconds for status, seconds in each.probes if status == 200)
        rss = f"{each.rss_before_mib:.0f} / {each.rss_during_mib:.0f} / {each.rss_after_mib:.0f}"
        lines.append(
            f"{each.name:<13}{rss:>20}{f'{each.files_before} / {each.files_during}':>12}"
            f"{f'{len(answered)}/{len(each.probes)}':>11}"
            f"{percentile(answered, 50) if answered else float('nan'):>9.1f}"
            f"{answered[-1] if answered else float('nan'):>9.1f}  {each.statuses}"
        )
    return "\n".join(lines)


# -- the report ---------------------------------------------------------------------------------


def report(results: list[Measured], options: Options, settings: Settings) -> str:
    lines = [
        f"ingress, {options.requests} requests by {options.clients} clients; latency at "
        f"{options.rate:g} req/s for {options.seconds:g} s; pool {settings.ingress_pool_size}, "
        f"cpu count {os.cpu_count()}",
        f"{'server':<10}{'accepted/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}  statuses",
    ]
    for result in results:
        ordered = sorted(1000 * d for d in result.latency.delays)
        statuses = {**result.throughput.statuses}
        for status, n in result.latency.statuses.items():
            statuses[status] = statuses.get(status, 0) + n
        lines.append(
            f"{result.label:<10}{result.throughput.rate:>11.0f}{percentile(ordered, 50):>9.1f}"
            f"{percentile(ordered, 99):>9.1f}{ordered[-1]:>9.1f}  {dict(sorted(statuses.items()))}"
        )
    ingress, baseline = results
    ratio = ingress.throughput.rate / baseline.throughput.rate
    p99 = percentile(sorted(1000 * d for d in ingress.latency.delays), 99)
    lines += [
        "",
        f"ratio ingress/baseline {ratio:.2f}x   target >= {RATIO_TARGET:.1f}x   "
        f"{'met' if ratio >= RATIO_TARGET else 'missed'}",
        f"ingress p99 at {options.rate:g} req/s {p99:.1f} ms   target < {P99_TARGET_MS:g} ms   "
        f"{'met' if p99 < P99_TARGET_MS else 'missed'}",
    ]
    nominal = (max(1, round(options.rate * options.seconds)) - 1) / options.rate
    for result in results:
        if result.latency.offered_seconds > 1.05 * nominal + 0.1:
            lines.append(
                f"({result.label}) the offered rate was not kept: offering took "
                f"{result.latency.offered_seconds:.1f} s, not {nominal:.1f} s"
            )
        if any(status != 202 for status in result.throughput.statuses):
            lines.append(f"({result.label}) some requests were not accepted")
    return "\n".join(lines)


def parse_options(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ingress",
        description="The HTTP ingress against a hand-written endpoint, in one run.",
    )
    parser.add_argument("--requests", type=positive_int, help="requests timed (5000; 300 --quick)")
    parser.add_argument("--clients", type=positive_int, default=CLIENTS, help="(50)")
    parser.add_argument("--rate", type=positive_float, default=500.0, help="offered req/s (500)")
    parser.add_argument("--seconds", type=positive_float, help="seconds offered (10; 1 --quick)")
    parser.add_argument(
        "--connections", type=positive_int, help="idle connections of the flood (1100; 200 --quick)"
    )
    parser.add_argument(
        "--slow-clients", type=positive_int, help="slow 1 MiB bodies (400; 40 --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    return Options(
        requests=args.requests or (300 if args.quick else 5000),
        clients=args.clients,
        rate=args.rate,
        seconds=args.seconds or (1.0 if args.quick else 10.0),
        connections=args.connections or (200 if args.quick else 1100),
        slow_clients=args.slow_clients or (40 if args.quick else 400),
    )


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    with scratch_database(Settings.load(), payments_router, prefix="worker_bench") as settings:
        results = asyncio.run(run(settings, options))
        figures = asyncio.run(attacks(settings, options.connections, options.slow_clients))
    print(report(results, options, settings))
    print(attack_report(figures))


if __name__ == "__main__":
    main()
