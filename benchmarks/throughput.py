"""Throughput of the worker against baselines measured in the same run, on the same machine.

Every scenario gets fresh broker names; the queue is preloaded first (publisher confirms,
``PUBLISH_WINDOW`` publishes in flight at a time) and only the drain is timed:

a. ``aio-pika consume+ack``: a bare consumer that acks each delivery, no database; prefetch as the
   worker's. The broker-client ceiling.
a-limit. ``aiormq consume+ack``: (a) on aiormq's ``basic_consume``, no per-message aio-pika
   objects, acking ``multiple=True`` every ``LIMIT_ACK_EVERY`` deliveries: the broker's limit.
b. ``naive asyncpg``: the payments example's business write done by hand, one asyncpg transaction
   per message (insert the ledger row, ``ON CONFLICT DO NOTHING``; when it was new, upsert the
   balance), ack after commit; prefetch and concurrency as the worker's.
c. ``worker, relay off``: ``worker.ops.runner.run`` with ``examples.payments``, until every
   preloaded message is processed or recognised as a duplicate.
d. ``worker + relay``: the same with the in-process relay, until every payment is processed, every
   settlement notice written (the example consumes its own ``payment.settled``) and a capture
   queue bound to ``payment.settled`` holds one event per payment.
e. ``relay draining the outbox``: ``worker.ops.runner.run_relay`` alone on N preloaded outbox rows
   (the payments example's ``payment.settled`` events, written with ``outbox.append_outbox``,
   ordered by account), against ``bare publish+confirm``: the same N messages published with
   aio-pika, confirms on, ``mandatory`` to a bound queue, ``PUBLISH_WINDOW`` in flight and then
   awaited. After the drain, (e) reads its queue back and notes any account whose events arrived
   in another order than their rows were committed in.
f. ``FastStream + faststream-outbox``: (d)'s pipeline written the way those libraries document it
   (``benchmarks/peer/service.py``: a subscriber per message, one SQLAlchemy transaction with a
   hand-written inbox claim, ``OutboxBroker.publish(session=)``, its relay, a downstream
   subscriber), run as a subprocess in ``.venv-peer`` (built on first use from
   ``benchmarks/peer/requirements.txt``; skipped, with the reason, when it cannot be built),
   timed from its ``ready`` line until (d)'s end condition holds; d/f is printed. Its ``cpu %``
   is the peer process's.

j. ``worker, junk only``: ``--messages`` junk messages (``JUNK_KINDS`` in turn: no JSON, JSON the
   payments handler refuses, a routing key no handler takes, a body over ``max_body_bytes``),
   until every one is parked: junk parked per second; j/c compares it with good messages per
   second.
jc. ``worker, --junk junk, then (c)``: ``--junk`` (2000) junk messages ahead of (c)'s payments,
   until every payment is handled and every junk message parked; its rate counts the payments,
   so jc/c is (c)'s drain time over this one's (target 1/1.2: good work behind a junk flood
   takes at most 1.2 times as long). ``--only junk`` runs (c) too. Each notes junk not parked
   exactly once in the DLQ, and a throttled consumer.

The payments are ``examples.payments.demo.plan_payments``: a share of them (``--duplicates``) are
repeats of earlier ones, spread over ``--accounts`` accounts. The tables are emptied and a
CHECKPOINT taken before each scenario that writes, so each starts from the same state. A timed
run starts once the worker (or relay) reported it had started and ends at the first poll
(every ``POLL_INTERVAL``) that sees it finished; everything runs in this one process and event
loop, next to PostgreSQL and RabbitMQ. ``cpu %`` is this process's CPU time (user + system)
over the drain's wall time: near 100 % means one core spent in Python, the client is the limit.
Each drain may take ``--timeout`` seconds (default 120 + 20 ms per message); a scenario that
takes longer is reported as not finished, and the others still run.

``--inbox-rows N`` adds (c+): (c) again after filling the inbox with N completed keys of earlier
messages (10,000,000 takes about 2 minutes to write), against (c) for the ratio c+/c.

Run time on a 2-core machine with both services on it: about 1 minute with ``--messages
10000``, about 5 with the default 50,000.

``latency``: the worker as in (c), offered ``--latency-rate`` requests per second (1000) for
``--latency-seconds`` on absolute deadlines by a producer in a spawned process (in this event
loop it would compete with the worker for it), each with its wall-clock publish time in the
``x-bench-published-at`` header. Two delays per request, nearest-rank percentiles:

- publish -> commit: until the consumer's after-commit debug record for its key (logged after the
  commit and before the ack; captured by a filter on the ``worker.transport.consumer`` logger,
  which keeps
  those records from going anywhere else);
- publish -> transaction start: until the inbox row's ``created_at``, which is PostgreSQL's
  ``now()``, i.e. when the transaction began, not when it committed.

A fresh database ``worker_bench_<hex>`` is created next to the one in ``WORKER_DATABASE_URL``,
migrated and dropped at the end; exchanges and queues on ``WORKER_AMQP_URL`` are named
``bench-<hex>-<scenario>...`` and deleted at the end of each scenario. From the repository root::

    .venv/bin/python -m benchmarks.throughput [--messages 50000] [--only a,b,c,d,e,f,junk,latency]
        [--inbox-rows 10000000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import logging
import multiprocessing
import os
import random
import resource
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
)
from dataclasses import dataclass, field, replace
from typing import Any

import aio_pika
import aiormq
import asyncpg
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks import peer
from benchmarks.common import (
    REQUESTED,
    SEED,
    count_rows,
    publish_all,
    reset_tables,
)
from benchmarks.processes import drain_with_processes
from benchmarks.relay_latency import (
    delete_broker_objects,
    offer,
    percentile,
    progress,
    stopping,
    until_started,
)
from examples.payments import router as payments_router
from examples.payments.demo import DemoPlan, plan_payments, request_message
from examples.payments.handlers import PaymentRequested, settle_payments_with_sqlalchemy
from examples.payments.tables import accounts, ledger_entries
from worker import Context, Router
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, ROUTING_KEY_HEADER
from worker.database import create_engine
from worker.ops import runner
from worker.settings import Settings, positive_float, positive_int
from worker.sql import outbox
from worker.sql.rows import OutboxMessage
from worker.telemetry import Count
from worker.testing import scratch_database
from worker.transport.topology import declare_topology

log = logging.getLogger("benchmarks.throughput")

SETTLED = "payment.settled"
PUBLISHED_AT_HEADER = "x-bench-published-at"
OUTBOX_BATCH = 1000
"""Outbox rows inserted per transaction when preloading the outbox for (e)."""
POLL_INTERVAL = 0.01
"""Seconds between checks of whether a timed scenario has finished."""
LATENCY_WARM_UP = 0.5
"""Seconds of offered load before the latency measurement: pool connections, caches."""
SCENARIOS = (
    "a",
    "a-limit",
    "b",
    "c",
    "c-sa",
    "c-q",
    "poison",
    "junk",
    "plain",
    "processes",
    "d",
    "e",
    "f",
    "uvloop",
    "latency",
)
GROUPS = {
    "bare": "e",
    "c+": "c",
    "p1": "poison",
    "p10": "poison",
    "j": "junk",
    "jc": "junk",
    "a-uv": "uvloop",
    "c-uv": "uvloop",
    "n1": "processes",
    "n2": "processes",
    "plain-pre": "plain",
    "plain-pg": "plain",
}
"""The ``--only`` name of the scenarios that do not go by their own."""
AFTER_COMMIT_RECORD = "%s key=%s handler=%s message_id=%s"
"""The format of ``worker.transport.consumer``'s debug record after each commit; its second
argument is
the key. If the consumer stops logging it, the publish -> commit latency is reported as n/a."""
EXPECTED_STATS = frozenset(
    {"processed", "duplicate", "relay_published", "batches", "multiple_acks"}
)
"""Stats counters of an undisturbed run; any other (dead letters, retries ...) is reported."""


class ScenarioTimeout(Exception):
    """A scenario did not finish within ``--timeout`` seconds."""


class ScenarioSkipped(Exception):
    """A scenario could not run here (the message says why); the others still run."""


@dataclass(frozen=True)
class Options:
    """What to run, from the command line."""

    messages: int
    duplicates: float
    accounts: int
    only: tuple[str, ...]
    latency_seconds: float
    latency_rate: float
    timeout: float
    inbox_rows: int
    junk: int = 2000
    quick: bool = False


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of a timed drain, and the CPU seconds this process spent in them;
    ``messages`` the drain's rate is counted in when not the plan's."""

    seconds: float
    cpu_seconds: float
    messages: int | None = None


@dataclass
class Run:
    """One timed scenario; ``timing`` is None when it did not finish."""

    key: str
    label: str
    messages: int
    timing: Timing | None

    @property
    def rate(self) -> float | None:
        """Messages per second, when the scenario finished."""
        return self.messages / self.timing.seconds if self.timing else None


@dataclass(frozen=True)
class Target:
    """A goal of the form ``numerator >= at_least x denominator``, in msg/s."""

    numerator: str
    denominator: str
    at_least: float


TARGETS = (
    Target("c", "a", 1.0),
    Target("c", "a-limit", 1.0),
    Target("c", "b", 4.0),
    Target("p1", "c", 0.85),
    Target("p10", "c", 0.5),
    Target("j", "c", 0.0),
    Target("jc", "c", 1 / 1.2),
    Target("plain", "b", 2.0),
    Target("plain-pre", "b", 0.0),
    Target("plain-pg", "b", 0.0),
    Target("d", "a", 0.3),
    Target("d", "f", 0.0),
    Target("e", "bare", 1.0),
    Target("c+", "c", 0.9),
    Target("c", "c-sa", 0.0),
    Target("c-q", "c", 0.0),
    Target("n2", "n1", 0.0),
    Target("a-uv", "a", 0.0),
    Target("c-uv", "c", 0.0),
)
"""Ratios to print; a target of 0 is a comparison to show, with no goal."""


@dataclass
class Latency:
    """Delays in seconds by what they end at; how long offering took, and until all were handled."""

    count: int
    rate: float
    offered_seconds: float
    handled_seconds: float
    to_commit: list[float]
    to_transaction_start: list[float]


@dataclass
class Bench:
    """What every scenario shares: settings, connections, the payments and the results."""

    settings: Settings
    options: Options
    run_id: str
    connection: AbstractRobustConnection
    channel: AbstractChannel
    engine: AsyncEngine
    plan: DemoPlan
    runs: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    latency: Latency | None = None
    peak_rss_kib: dict[str, int] = field(default_factory=dict)

    @property
    def unique(self) -> int:
        return len(self.plan.payments)

    @property
    def repeats(self) -> int:
        return len(self.plan.sends) - len(self.plan.payments)

    def names(self, scenario: str, **changes: Any) -> Settings:
        """Settings with an exchange and queues of the scenario's own, no HTTP endpoint."""
        prefix = f"bench-{self.run_id}-{scenario}"
        return self.settings.replace(
            exchange=f"{prefix}-events", queue=prefix, http_port=0, **changes
        )

    def note(self, scenario: str, text: str) -> None:
        self.notes.append(f"({scenario}) {text}")


# Messages and publishing


def settled_body(payment: dict[str, object]) -> bytes:
    """The body of the ``payment.settled`` event of ``payment`` (balance: its own amount)."""
    return json.dumps({**payment, "balance_cents": payment["amount_cents"]}).encode()


async def preload(bench: Bench, exchange: AbstractExchange, routing_key: str) -> None:
    """Publish every planned request, confirmed; prints how long it took."""
    started = time.perf_counter()
    await publish_all(exchange, routing_key, (request_message(p) for p in bench.plan.sends))
    progress(
        f"  preloaded {len(bench.plan.sends)} messages in {time.perf_counter() - started:.1f} s"
    )


async def queue_depth(queue: AbstractQueue) -> int:
    """Messages ready in ``queue`` (a passive declare: one round trip)."""
    return (await queue.declare()).message_count or 0


# Waiting and timing


class Stopwatch:
    """Wall clock and this process's CPU time (user + system, all threads) since creation."""

    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), self._cpu_now()

    @staticmethod
    def _cpu_now() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._wall

    def read(self) -> Timing:
        return Timing(self.elapsed, self._cpu_now() - self._cpu)


async def timed(
    finished: Callable[[], Awaitable[bool]],
    within: float,
    task: asyncio.Task[Any] | None = None,
) -> Timing:
    """Time until ``finished()`` is true, polled every ``POLL_INTERVAL``.

    Raises ``ScenarioTimeout`` after ``within`` seconds, and the error of ``task`` (the worker
    or relay under test) if it ends first.
    """
    watch = Stopwatch()
    while not await finished():
        if task is not None and task.done():
            task.result()
            raise RuntimeError(f"the {task.get_name()} stopped before the scenario finished")
        if watch.elapsed > within:
            raise ScenarioTimeout(f"not finished within {within:g} s")
        await asyncio.sleep(POLL_INTERVAL)
    return watch.read()


Service = Callable[[asyncio.Event, asyncio.Event, Counter[str]], Coroutine[Any, Any, Counter[str]]]
"""``runner.run`` or ``runner.run_relay`` with their settings bound: (stop, started, stats)."""


def worker_service(settings: Settings) -> Service:
    """``worker.ops.runner.run`` with the payments example on ``settings``."""
    return functools.partial(runner.run, settings, payments_router)


@contextlib.asynccontextmanager
async def serving(
    name: str, service: Service
) -> AsyncIterator[tuple[asyncio.Task[Counter[str]], Counter[str]]]:
    """Run ``service`` in a task; yield it and its stats once started, stop it on exit."""
    stop, started, stats = asyncio.Event(), asyncio.Event(), Counter[str]()
    task = asyncio.create_task(service(stop, started, stats), name=name)
    try:
        await until_started(task, started)
        yield task, stats
    finally:
        await stopping(task, stop)


def handled(stats: Counter[str]) -> int:
    """Deliveries that reached their end: processed or recognised as duplicates."""
    return stats[Count.PROCESSED] + stats[Count.DUPLICATE]


def ended(stats: Counter[str]) -> int:
    """Deliveries that reached their end, dead letters (and repeats of them) included."""
    return handled(stats) + stats[Count.DEAD_LETTERED] + stats[Count.DUPLICATE_OF_FAILED]


def unusual(stats: Counter[str], expected: Iterable[str] = ()) -> dict[str, int]:
    """The counters an undisturbed run does not have (beyond ``expected`` ones)."""
    usual = EXPECTED_STATS | set(expected)
    return {
        k: n for k, n in stats.items() if n and k not in usual and k.partition(":")[0] not in usual
    }


# The database


async def check_payments(bench: Bench, scenario: str, *, notices: bool = False) -> None:
    """Note any difference from the plan: ledger rows, balances, and (``notices``) notices."""
    tables = ("ledger_entries", "settlement_notices") if notices else ("ledger_entries",)
    for table in tables:
        rows = await count_rows(bench.engine, table)
        if rows != bench.unique:
            bench.note(scenario, f"{table} has {rows} rows, expected {bench.unique}")
    async with bench.engine.connect() as conn:
        result = await conn.execute(text("SELECT account, balance_cents FROM accounts"))
        balances = {str(account): int(cents) for account, cents in result}
    if balances != bench.plan.expected_balances:
        bench.note(scenario, "balances differ from the planned payments' sums")


# The scenarios


@contextlib.asynccontextmanager
async def preloaded_for_a_consumer(
    bench: Bench, key: str
) -> AsyncIterator[tuple[AbstractChannel, str]]:
    """Scenario ``key``'s queue preloaded with the plan's messages, and a channel of a connection
    of its own with the worker's prefetch to consume it on; both gone afterwards."""
    queue_name = bench.names(key).queue
    queue = await bench.channel.declare_queue(queue_name, durable=True)
    connection = await runner.connect_broker(bench.settings, name=f"bench-{key}")
    try:
        await preload(bench, bench.channel.default_exchange, queue_name)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=bench.settings.prefetch)
        yield channel, queue_name
    finally:
        await connection.close()
        await queue.delete(if_unused=False, if_empty=False)


async def bare_consume(bench: Bench) -> Timing:
    """(a) A consumer that only acks: the broker and client ceiling."""
    async with preloaded_for_a_consumer(bench, "a") as (channel, queue_name):
        consumed = await channel.get_queue(queue_name, ensure=False)
        acked = 0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal acked
            await message.ack()
            acked += 1

        async def finished() -> bool:
            return acked >= len(bench.plan.sends)

        await consumed.consume(on_message)
        return await timed(finished, bench.options.timeout)


LIMIT_ACK_EVERY = 100
"""Deliveries (a-limit) settles with one multiple-ack."""


async def aiormq_consume(bench: Bench) -> Timing:
    """(a-limit) (a) on aiormq's ``basic_consume``, one multiple-ack per ``LIMIT_ACK_EVERY``
    deliveries (and one for the rest at the end)."""
    async with preloaded_for_a_consumer(bench, "a-limit") as (channel, queue_name):
        underlay = await channel.get_underlay_channel()
        total, received = len(bench.plan.sends), 0

        async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
            nonlocal received
            received += 1
            if received % LIMIT_ACK_EVERY == 0 or received == total:
                await underlay.basic_ack(message.delivery_tag or 0, multiple=True)

        async def finished() -> bool:
            return received >= total

        await underlay.basic_consume(queue_name, on_message)
        return await timed(finished, bench.options.timeout)


LEDGER_INSERT = """
INSERT INTO ledger_entries (payment_id, account, amount_cents) VALUES ($1, $2, $3)
ON CONFLICT (payment_id) DO NOTHING RETURNING payment_id
"""
BALANCE_UPSERT = """
INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)
ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents
RETURNING balance_cents
"""


async def naive_consume(bench: Bench) -> Timing:
    """(b) One asyncpg transaction per message doing the payments example's write; ack after
    commit. A repeated payment finds its ledger row taken and changes nothing."""
    settings = bench.settings
    queue_name = bench.names("b").queue
    queue = await bench.channel.declare_queue(queue_name, durable=True)
    await reset_tables(bench.engine)
    connection = await runner.connect_broker(settings, name="bench-b")
    pool = await asyncpg.create_pool(
        settings.database_url,
        min_size=settings.concurrency,
        max_size=settings.concurrency,
        server_settings={"application_name": "bench-naive"},
    )
    try:
        await preload(bench, bench.channel.default_exchange, queue_name)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=settings.prefetch)
        consumed = await channel.get_queue(queue_name, ensure=False)
        slots = asyncio.Semaphore(settings.concurrency)
        acked = 0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal acked
            payment = json.loads(message.body)
            account, amount = payment["account"], payment["amount_cents"]
            async with slots, pool.acquire() as conn, conn.transaction():
                if await conn.fetchval(LEDGER_INSERT, payment["payment_id"], account, amount):
                    await conn.fetchval(BALANCE_UPSERT, account, amount)
            await message.ack()
            acked += 1

        async def finished() -> bool:
            return acked >= len(bench.plan.sends)

        await consumed.consume(on_message)
        timing = await timed(finished, bench.options.timeout)
    finally:
        await connection.close()
        await pool.close()
        await queue.delete(if_unused=False, if_empty=False)
    await check_payments(bench, "b")
    return timing


async def worker_relay_off(bench: Bench) -> Timing:
    """(c) ``worker.ops.runner.run`` with the payments example and no relay."""
    return await _worker_relay_off(bench, "c")


async def worker_relay_off_full_inbox(bench: Bench) -> Timing:
    """(c+) As (c), with ``--inbox-rows`` completed keys of other messages in the inbox."""
    return await _worker_relay_off(bench, "c+", inbox_rows=bench.options.inbox_rows)


async def fill_inbox(engine: AsyncEngine, rows: int) -> None:
    """``rows`` completed inbox keys of earlier messages, as a long-running deployment has.

    Their keys (``demo-1-<n>e``) interleave with the plan's (``demo-1-<n>``) in the primary-key
    index, as keys from one source do, so a claim lands on leaves spread over the whole index,
    not on a corner of it that stays cached."""
    progress(f"  filling the inbox with {rows:,} rows ...")
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, routing_key, result)"
                " SELECT 'payment.requested', 'demo-1-' || g || 'e', sha256(g::text::bytea),"
                " 'completed', 'payment.requested', '{}'::jsonb"
                " FROM generate_series(1, :rows) AS g"
            ),
            {"rows": rows},
        )
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE inbox"))
        await conn.execute(text("CHECKPOINT"))


async def _worker_relay_off(
    bench: Bench,
    key: str,
    *,
    inbox_rows: int = 0,
    router: Router = payments_router,
    messages: list[aio_pika.Message] | None = None,
    **changes: Any,
) -> Timing:
    """The worker with ``router`` (default: the payments example) and no relay, draining
    ``messages`` (default: the planned requests) until each ended: handled or dead-lettered."""
    settings = bench.names(key.replace("+", "-full"), relay=False, **changes)
    sent = messages if messages is not None else [request_message(p) for p in bench.plan.sends]
    await reset_tables(bench.engine)
    if inbox_rows:
        await fill_inbox(bench.engine, inbox_rows)
    bench.peak_rss_kib[f"before ({key})"] = peak_rss_kib()
    try:
        topology = await declare_topology(bench.channel, settings, router.routing_keys())
        started = time.perf_counter()
        await publish_all(topology.exchange, REQUESTED, sent)
        progress(f"  preloaded {len(sent)} messages in {time.perf_counter() - started:.1f} s")

        async with serving("worker", functools.partial(runner.run, settings, router)) as (
            task,
            stats,
        ):
            early = ended(stats)

            async def finished() -> bool:
                return ended(stats) >= len(sent)

            timing = await timed(finished, bench.options.timeout, task)
    finally:
        await delete_broker_objects(settings)
    bench.peak_rss_kib[f"after ({key})"] = peak_rss_kib()
    if early:
        bench.note(key, f"{early} messages were handled before the worker reported it started")
    poisoned = ("dead_lettered", "isolated", "duplicate_of_failed") if messages else ()
    if odd := unusual(stats, expected=poisoned):
        bench.note(key, f"{odd} (all stats: {dict(stats)})")
    await check_payments(bench, key)
    return timing


def worker_sqlalchemy_handler(bench: Bench) -> Awaitable[Timing]:
    """(c-sa) As (c), with the payments handler's two writes through SQLAlchemy Core on
    ``batch.connection`` (``settle_payments_with_sqlalchemy``) instead of ``batch.asyncpg``."""
    router = Router()
    router.batch_handler(REQUESTED)(settle_payments_with_sqlalchemy)
    return _worker_relay_off(bench, "c-sa", router=router)


def worker_on_quorum_queues(bench: Bench) -> Awaitable[Timing]:
    """(c-q) As (c), with ``queue_type`` quorum: the work queue replicated (one node here) and
    written to disk for every message."""
    return _worker_relay_off(bench, "c-q", queue_type="quorum")


def poisoned_messages(bench: Bench, share: float) -> list[aio_pika.Message]:
    """The planned requests, plus ``share`` of them again under a second idempotency key (the
    same payment id): each such pair's later one fails in the handler and is parked."""
    rng = random.Random(SEED)
    messages = [request_message(p) for p in bench.plan.sends]
    for n in range(round(share * len(messages))):
        payment = rng.choice(bench.plan.payments)
        key = f"{payment['payment_id']}-again-{n}"
        again = aio_pika.Message(
            json.dumps(payment).encode(),
            content_type="application/json",
            message_id=key,
            headers={IDEMPOTENCY_KEY_HEADER: key},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        messages.insert(rng.randrange(len(messages) + 1), again)
    return messages


def worker_poisoned(share: float) -> Scenario:
    """(p1, p10) As (c), with ``share`` of the messages failing in the handler, inside batches."""

    async def scenario(bench: Bench) -> Timing:
        key = f"p{round(share * 100)}"
        with parked_quietly():
            return await _worker_relay_off(bench, key, messages=poisoned_messages(bench, share))

    return scenario


JUNK_KINDS = ("undecodable", "invalid", "no-handler", "too-large")
"""What a junk flood mixes, in turn: bodies that are no JSON, JSON the handler's type refuses, a
routing key no handler takes, bodies over ``JUNK_MAX_BODY``."""
JUNK_MAX_BODY = 4096
"""The junk scenarios' ``max_body_bytes``, so a too-large body is cheap to publish."""


def junk_messages(count: int) -> list[aio_pika.Message]:
    """``count`` junk messages, ``JUNK_KINDS`` in turn, for the default exchange (the work
    queue's name as routing key): each carries the routing key it claims as
    ``ROUTING_KEY_HEADER``, so a routing key no handler takes reaches the work queue too."""
    bodies = {
        "undecodable": b"\xff\xfe not json",
        "invalid": b'{"not": "a payment"}',
        "no-handler": b'{"amount_cents": 1}',
        "too-large": b"x" * (JUNK_MAX_BODY + 1),
    }
    messages = []
    for n in range(count):
        kind = JUNK_KINDS[n % len(JUNK_KINDS)]
        key = f"junk-{kind}-{n}"
        routing_key = "nobody.handles.this" if kind == "no-handler" else REQUESTED
        messages.append(
            aio_pika.Message(
                bodies[kind],
                content_type="application/json",
                message_id=key,
                headers={IDEMPOTENCY_KEY_HEADER: key, ROUTING_KEY_HEADER: routing_key},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
        )
    return messages


async def junk_alone(bench: Bench) -> Timing:
    """(j) ``--messages`` junk messages and nothing else: how fast the worker parks them."""
    return await _junk_then_good(bench, "j", junk=bench.options.messages, good=False)


async def junk_then_good(bench: Bench) -> Timing:
    """(jc) ``--junk`` junk messages ahead of (c)'s payments: until every payment is handled
    and every junk message parked; its rate counts the payments, so jc/c is (c)'s time over
    this one's."""
    return await _junk_then_good(bench, "jc", junk=bench.options.junk, good=True)


async def _junk_then_good(bench: Bench, key: str, *, junk: int, good: bool) -> Timing:
    """The worker as in (c), throttle as configured, draining ``junk`` junk messages and
    then, with ``good``, the planned payments; notes any junk not parked once in the DLQ."""
    settings = bench.names(key, relay=False, max_body_bytes=JUNK_MAX_BODY)
    goods = [request_message(p) for p in bench.plan.sends] if good else []
    await reset_tables(bench.engine)
    try:
        topology = await declare_topology(bench.channel, settings, payments_router.routing_keys())
        started = time.perf_counter()
        await publish_all(bench.channel.default_exchange, settings.queue, junk_messages(junk))
        await publish_all(topology.exchange, REQUESTED, goods)
        progress(
            f"  preloaded {junk} junk and {len(goods)} payments "
            f"in {time.perf_counter() - started:.1f} s"
        )
        with parked_quietly():
            async with serving("worker", worker_service(settings)) as (task, stats):

                async def finished() -> bool:
                    return stats[Count.DEAD_LETTERED] >= junk and handled(stats) >= len(goods)

                timing = await timed(finished, bench.options.timeout, task)
        dlq = await bench.channel.declare_queue(settings.dead_letter_queue, passive=True)
        parked = await queue_depth(dlq)
    finally:
        await delete_broker_objects(settings)
    if parked != junk or stats[Count.DEAD_LETTERED] != junk:
        bench.note(
            key,
            f"{parked} copies in the DLQ, {stats[Count.DEAD_LETTERED]} dead letters "
            f"counted, for {junk} junk messages",
        )
    if odd := unusual(stats, expected=("dead_lettered", "throttled")):
        bench.note(key, f"{odd} (all stats: {dict(stats)})")
    if stats[Count.THROTTLED]:
        bench.note(key, f"the consumer throttled {stats[Count.THROTTLED]} time(s)")
    if good:
        await check_payments(bench, key)
    return replace(timing, messages=len(goods) if good else junk)


@contextlib.contextmanager
def parked_quietly() -> Iterator[None]:
    """Leave out the warning the worker logs for each message it parks (hundreds in (p10), all
    expected: the scenario checks how many were parked from the worker's counters instead)."""
    logger = logging.getLogger("worker.transport.failures")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


plain_router = Router()


@plain_router.handler(REQUESTED)
async def settle_one(payment: PaymentRequested, ctx: Context) -> None:
    """A plain handler as users write them: the ledger row, and when it is new, the balance;
    two statements per message through SQLAlchemy Core, the same writes as (b)'s."""
    recorded = await ctx.connection.execute(
        insert(ledger_entries)
        .values(
            payment_id=payment.payment_id,
            account=payment.account,
            amount_cents=payment.amount_cents,
        )
        .on_conflict_do_nothing()
        .returning(ledger_entries.c.payment_id)
    )
    if recorded.first() is not None:
        new = insert(accounts).values(account=payment.account, balance_cents=payment.amount_cents)
        await ctx.connection.execute(
            new.on_conflict_do_update(
                index_elements=[accounts.c.account],
                set_={"balance_cents": accounts.c.balance_cents + new.excluded.balance_cents},
            )
        )


def worker_plain_handler(bench: Bench) -> Awaitable[Timing]:
    """(plain) The worker with ``settle_one``, a plain handler: one call per message, in batches."""
    return _worker_relay_off(bench, "plain", router=plain_router)


RECORD_ENTRY = (
    insert(ledger_entries)
    .values(
        payment_id=bindparam("payment_id"),
        account=bindparam("account"),
        amount_cents=bindparam("amount_cents"),
    )
    .on_conflict_do_nothing()
    .returning(ledger_entries.c.payment_id)
)
_NEW_BALANCE = insert(accounts).values(
    account=bindparam("account"), balance_cents=bindparam("amount_cents")
)
ADD_TO_BALANCE = _NEW_BALANCE.on_conflict_do_update(
    index_elements=[accounts.c.account],
    set_={"balance_cents": accounts.c.balance_cents + _NEW_BALANCE.excluded.balance_cents},
)
"""``settle_one``'s two statements built once, at import, and executed with parameters."""

plain_prebuilt_router = Router()


@plain_prebuilt_router.handler(REQUESTED)
async def settle_one_prebuilt(payment: PaymentRequested, ctx: Context) -> None:
    """``settle_one`` with its statements built once (``RECORD_ENTRY``, ``ADD_TO_BALANCE``):
    SQLAlchemy then compiles each once and only binds the parameters per message."""
    values = {
        "payment_id": payment.payment_id,
        "account": payment.account,
        "amount_cents": payment.amount_cents,
    }
    if (await ctx.connection.execute(RECORD_ENTRY, values)).first() is not None:
        await ctx.connection.execute(ADD_TO_BALANCE, values)


plain_asyncpg_router = Router()


@plain_asyncpg_router.handler(REQUESTED)
async def settle_one_asyncpg(payment: PaymentRequested, ctx: Context) -> None:
    """``settle_one`` on ``ctx.asyncpg``: (b)'s two statements, in the worker's transaction."""
    account, amount = payment.account, payment.amount_cents
    if await ctx.asyncpg.fetchval(LEDGER_INSERT, payment.payment_id, account, amount):
        await ctx.asyncpg.fetchval(BALANCE_UPSERT, account, amount)


def worker_plain_prebuilt(bench: Bench) -> Awaitable[Timing]:
    """(plain-pre) (plain) with the statements built once."""
    return _worker_relay_off(bench, "plain-pre", router=plain_prebuilt_router)


def worker_plain_asyncpg(bench: Bench) -> Awaitable[Timing]:
    """(plain-pg) (plain) with (b)'s statements on ``ctx.asyncpg``."""
    return _worker_relay_off(bench, "plain-pg", router=plain_asyncpg_router)


async def worker_with_relay(bench: Bench) -> Timing:
    """(d) The worker with its relay, until every payment's event is downstream and every
    settlement notice is written."""
    settings = bench.names("d", relay=True)
    capture_name = f"{settings.queue}.capture"
    await reset_tables(bench.engine)
    try:
        topology = await declare_topology(bench.channel, settings, payments_router.routing_keys())
        capture = await bench.channel.declare_queue(capture_name, durable=True)
        await capture.bind(topology.exchange, SETTLED)
        passive = await bench.channel.declare_queue(capture_name, passive=True)
        await preload(bench, topology.exchange, REQUESTED)

        async with serving("worker", worker_service(settings)) as (task, stats):

            async def finished() -> bool:
                # payments + notices processed (each key once), the repeats acked as duplicates,
                # and every event in the capture queue
                if (
                    stats[Count.PROCESSED] < 2 * bench.unique
                    or stats[Count.DUPLICATE] < bench.repeats
                ):
                    return False
                return await queue_depth(passive) >= bench.unique

            timing = await timed(finished, bench.options.timeout, task)
        captured = await queue_depth(passive)
    finally:
        await delete_broker_objects(settings, [capture_name])
    if captured != bench.unique:
        bench.note("d", f"{captured} events captured downstream for {bench.unique} payments")
    if odd := unusual(stats):
        bench.note("d", f"{odd} (all stats: {dict(stats)})")
    if left := await count_rows(bench.engine, "outbox"):
        bench.note("d", f"{left} outbox rows left after the worker stopped")
    await check_payments(bench, "d", notices=True)
    return timing


async def faststream_peer(bench: Bench) -> Timing:
    """(f) (d)'s pipeline in FastStream + faststream-outbox (``benchmarks/peer``), a subprocess
    in its own virtualenv, until (d)'s end condition holds; checked as (d) is."""
    try:
        python = await asyncio.to_thread(peer.peer_python, build=not bench.options.quick)
    except peer.PeerUnavailable as exc:
        raise ScenarioSkipped(f"the peer's virtualenv could not be made: {exc}") from exc
    settings = bench.names("f")
    notices, capture_name = f"{settings.queue}.notices", f"{settings.queue}.capture"
    await reset_tables(bench.engine)
    try:
        exchange = await bench.channel.declare_exchange(
            settings.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        for name, key in ((settings.queue, REQUESTED), (notices, SETTLED), (capture_name, SETTLED)):
            await (await bench.channel.declare_queue(name, durable=True)).bind(exchange, key)
        requests = await bench.channel.declare_queue(settings.queue, passive=True)
        capture = await bench.channel.declare_queue(capture_name, passive=True)
        await preload(bench, exchange, REQUESTED)
        names = peer.PeerNames(
            settings.sqlalchemy_url,
            settings.amqp_url,
            settings.exchange,
            settings.queue,
            settings.prefetch,
        )
        async with peer.running_peer(python, names) as process:

            async def finished() -> bool:
                # every event captured and every request taken, then every row written
                if await queue_depth(capture) < bench.unique or await queue_depth(requests):
                    return False
                for table in ("ledger_entries", "settlement_notices"):
                    if await count_rows(bench.engine, table) < bench.unique:
                        return False
                return True

            alive = asyncio.create_task(process.wait(), name="peer")
            cpu_before = await asyncio.to_thread(peer.cpu_seconds, process.pid)
            try:
                timing = await timed(finished, bench.options.timeout, alive)
            finally:
                alive.cancel()
            cpu_after = await asyncio.to_thread(peer.cpu_seconds, process.pid)
            if cpu_before is not None and cpu_after is not None:  # the peer's, not ours
                timing = Timing(timing.seconds, cpu_after - cpu_before)
        captured, left = await queue_depth(capture), await queue_depth(requests)
    finally:
        await delete_broker_objects(settings, [notices, capture_name])
    if captured != bench.unique:
        bench.note("f", f"{captured} events captured downstream for {bench.unique} payments")
    if left:
        bench.note("f", f"{left} requests left in the queue after the peer stopped")
    if rows := await count_rows(bench.engine, "peer_outbox"):
        bench.note("f", f"{rows} outbox rows left after the peer stopped")
    await check_payments(bench, "f", notices=True)
    return timing


def outbox_messages(bench: Bench, exchange: str) -> Iterator[OutboxMessage]:
    """One ``payment.settled`` event per planned send, as the payments handler records it."""
    for payment in bench.plan.sends:
        key = str(payment["payment_id"])
        yield OutboxMessage(
            message_id=uuid.uuid4(),
            exchange=exchange,
            routing_key=SETTLED,
            body=settled_body(payment),
            content_type="application/json",
            headers={},
            correlation_id=key,
            causation_id=key,
            ordering_key=str(payment["account"]),
        )


async def relay_alone(bench: Bench) -> Timing:
    """(e) ``worker.ops.runner.run_relay`` draining N preloaded outbox rows to a bound queue."""
    settings = bench.names("e")
    sink_name = f"{settings.queue}.sink"
    await reset_tables(bench.engine)
    try:
        exchange = await bench.channel.declare_exchange(
            settings.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        sink = await bench.channel.declare_queue(sink_name, durable=True)
        await sink.bind(exchange, SETTLED)
        started = time.perf_counter()
        rows = outbox_messages(bench, settings.exchange)
        while batch := list(itertools.islice(rows, OUTBOX_BATCH)):
            async with bench.engine.begin() as conn:
                await outbox.append_outbox(conn, batch)
        progress(
            f"  preloaded {len(bench.plan.sends)} outbox rows "
            f"in {time.perf_counter() - started:.1f} s"
        )

        async with serving("relay", functools.partial(runner.run_relay, settings)) as (task, stats):

            async def finished() -> bool:
                return stats[Count.RELAY_PUBLISHED] >= len(bench.plan.sends)

            timing = await timed(finished, bench.options.timeout, task)
        delivered = await queue_depth(sink)
        arrived = await arrival_order(sink, delivered, bench.options.timeout)
    finally:
        await delete_broker_objects(settings, [sink_name])
    if delivered != len(bench.plan.sends):
        bench.note("e", f"{delivered} events in the bound queue, expected {len(bench.plan.sends)}")
    if disordered := out_of_order(bench.plan.sends, arrived):
        bench.note("e", f"{disordered} accounts' events arrived out of commit order")
    if odd := unusual(stats):
        bench.note("e", f"{odd} (all stats: {dict(stats)})")
    return timing


async def arrival_order(queue: AbstractQueue, count: int, within: float) -> list[bytes]:
    """The bodies of the first ``count`` messages of ``queue``, in the order it delivers them
    (consumed without acks)."""
    bodies: list[bytes] = []
    if count:
        async with asyncio.timeout(within), queue.iterator(no_ack=True) as messages:
            async for message in messages:
                bodies.append(message.body)
                if len(bodies) >= count:
                    break
    return bodies


def out_of_order(sends: Iterable[dict[str, object]], bodies: Iterable[bytes]) -> int:
    """How many accounts' ``payment.settled`` events (``bodies``) did not arrive in the order of
    ``sends``, which is the order their outbox rows were committed in."""
    expected: dict[str, list[object]] = defaultdict(list)
    arrived: dict[str, list[object]] = defaultdict(list)
    for payment in sends:
        expected[str(payment["account"])].append(payment["payment_id"])
    for body in bodies:
        event = json.loads(body)
        arrived[str(event["account"])].append(event["payment_id"])
    return sum(arrived.get(account) != ids for account, ids in expected.items())


async def bare_publish(bench: Bench) -> Timing:
    """(e, baseline) The same events published with aio-pika: confirms, mandatory, pipelined."""
    settings = bench.names("e-bare")
    connection = await runner.connect_broker(settings, name="bench-e-bare")
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.declare_exchange(
            settings.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        sink = await channel.declare_queue(settings.queue, durable=True)
        await sink.bind(exchange, SETTLED)

        def messages() -> Iterator[aio_pika.Message]:
            for payment in bench.plan.sends:
                key = str(payment["payment_id"])
                yield aio_pika.Message(
                    settled_body(payment),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=str(uuid.uuid4()),
                    correlation_id=key,
                    headers={"causation-id": key, "correlation-id": key},
                )

        watch = Stopwatch()
        await publish_all(exchange, SETTLED, messages())
        timing = watch.read()
        delivered = await queue_depth(sink)
    finally:
        await connection.close()
        await delete_broker_objects(settings)
    if delivered != len(bench.plan.sends):
        bench.note("bare", f"{delivered} in the bound queue, expected {len(bench.plan.sends)}")
    return timing


class CommitTimes(logging.Filter):
    """Wall-clock time of each commit by key, from the consumer's after-commit debug records.

    Passes on only the records at or above ``threshold`` (the logger's level before it was
    lowered to DEBUG to produce these records).
    """

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold
        self.at: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg == AFTER_COMMIT_RECORD and isinstance(args, tuple) and len(args) > 1:
            self.at.setdefault(str(args[1]), record.created)
        return record.levelno >= self.threshold


@contextlib.contextmanager
def watching_commits() -> Iterator[CommitTimes]:
    """``CommitTimes`` on the ``worker.transport.consumer`` logger, at DEBUG level while open."""
    logger = logging.getLogger("worker.transport.consumer")
    commits, level = CommitTimes(logger.getEffectiveLevel()), logger.level
    logger.addFilter(commits)
    logger.setLevel(logging.DEBUG)
    try:
        yield commits
    finally:
        logger.setLevel(level)
        logger.removeFilter(commits)


async def latency(bench: Bench) -> None:
    """Publish-to-commit delays of the worker (relay off) under a steady offered load."""
    settings = bench.names("latency", relay=False)
    await reset_tables(bench.engine)
    try:
        await declare_topology(bench.channel, settings, payments_router.routing_keys())
        with watching_commits() as commits:
            offered = await offer_requests(bench, settings)
    finally:
        await delete_broker_objects(settings)
    async with bench.engine.connect() as conn:
        result = await conn.execute(text("SELECT key, created_at FROM inbox"))
        began = {str(key): created.timestamp() for key, created in result}
    sent = offered.sent
    bench.latency = Latency(
        len(sent),
        bench.options.latency_rate,
        offered.offered_seconds,
        offered.handled_seconds,
        [commits.at[key] - at for key, at in sent.items() if key in commits.at],
        [began[key] - at for key, at in sent.items() if key in began],
    )
    if odd := unusual(offered.stats):
        bench.note("latency", f"{odd} (all stats: {dict(offered.stats)})")


@dataclass(frozen=True)
class Offered:
    """The counted requests' wall-clock publish times by key; how long offering them took, and
    until the last was handled; the worker's stats."""

    sent: dict[str, float]
    offered_seconds: float
    handled_seconds: float
    stats: Counter[str]


async def offer_requests(bench: Bench, settings: Settings) -> Offered:
    """Run the worker; offer requests at the latency rate from another process, first for
    ``LATENCY_WARM_UP`` seconds (not counted), then for ``--latency-seconds``, and wait until all
    are handled. (A producer in this event loop would compete with the worker for it.)"""
    rate = bench.options.latency_rate
    offering = functools.partial(
        offer_from_another_process,
        settings.amqp_url,
        settings.exchange,
        rate=rate,
        accounts=bench.options.accounts,
    )
    async with serving("worker", worker_service(settings)) as (task, stats):
        warm_up = max(1, round(rate * LATENCY_WARM_UP))
        await offering(warm_up, first=0)
        await timed(lambda: _at_least(stats, warm_up), bench.options.timeout, task)
        count = max(1, round(rate * bench.options.latency_seconds))
        sent, offered_seconds = await offering(count, first=warm_up)
        await timed(lambda: _at_least(stats, warm_up + count), bench.options.timeout, task)
        handled_seconds = time.time() - min(sent.values())  # from the first counted publish
    return Offered(sent, offered_seconds, handled_seconds, stats)


async def offer_from_another_process(
    amqp_url: str, exchange: str, count: int, *, first: int, rate: float, accounts: int
) -> tuple[dict[str, float], float]:
    """``offer`` ``count`` requests (numbered from ``first``) in a child process; their publish
    times by key, and how long offering took."""
    context = multiprocessing.get_context("spawn")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(
        target=_offer_in_child, args=(sending, amqp_url, exchange, count, first, rate, accounts)
    )
    child.start()
    sending.close()
    try:
        result: tuple[dict[str, float], float] = await asyncio.to_thread(receiving.recv)
    finally:
        await asyncio.to_thread(child.join)
    return result


def _offer_in_child(
    results: Any,
    amqp_url: str,
    exchange_name: str,
    count: int,
    first: int,
    rate: float,
    accounts: int,
) -> None:
    async def publish_all() -> tuple[dict[str, float], float]:
        connection = await aio_pika.connect(amqp_url)
        try:
            # no confirms: awaiting each one in turn would not keep the rate; all are checked
            # handled by the worker's counts
            channel = await connection.channel(publisher_confirms=False)
            exchange = await channel.get_exchange(exchange_name, ensure=False)
            numbers = itertools.count(first)

            async def send() -> tuple[str, float]:
                i = next(numbers)
                payment = {
                    "payment_id": f"latency-{i}",
                    "account": f"account-{i % accounts}",
                    "amount_cents": 100,
                }
                at = time.time()
                message = request_message(payment, {PUBLISHED_AT_HEADER: at})
                await exchange.publish(message, REQUESTED)
                return str(payment["payment_id"]), at

            return await offer(count, rate, send)
        finally:
            await connection.close()

    results.send(asyncio.run(publish_all()))
    results.close()


async def _at_least(stats: Counter[str], count: int) -> bool:
    return handled(stats) >= count


def peak_rss_kib() -> int:
    """The process's peak resident set so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# Running and reporting

Scenario = Callable[[Bench], Awaitable[Timing]]
"""A timed scenario: returns the timing of its drain, notes what it found wrong."""


def worker_processes(count: int) -> Scenario:
    """(n1, n2) ``worker run --processes N`` as a subprocess, distinct payments, relay off
    (``benchmarks.processes.drain_with_processes``); its own timing, as ``Timing``."""

    async def scenario(bench: Bench) -> Timing:
        distinct = plan_payments(len(bench.plan.sends), 0.0, bench.options.accounts, SEED)
        settings = bench.names(f"n{count}")
        try:
            drain = await drain_with_processes(settings, count, distinct)
        finally:
            await delete_broker_objects(settings)
        seconds = len(bench.plan.sends) / drain.rate
        return Timing(seconds, (drain.busy or 0.0) * seconds)  # cpu %: the machine's busy

    return scenario


TIMED: tuple[tuple[str, str, Scenario], ...] = (
    ("a", "aio-pika consume+ack, no database", bare_consume),
    ("a-limit", "aiormq consume+multiple-ack, no db", aiormq_consume),
    ("b", "naive asyncpg, 1 tx per message", naive_consume),
    ("c", "worker, relay off", worker_relay_off),
    ("c-sa", "worker, handler via SQLAlchemy Core", worker_sqlalchemy_handler),
    ("c-q", "worker, relay off, quorum queues", worker_on_quorum_queues),
    ("p1", "worker, 1 % poison", worker_poisoned(0.01)),
    ("p10", "worker, 10 % poison", worker_poisoned(0.10)),
    ("j", "worker, junk only (parked)", junk_alone),
    ("jc", "worker, --junk junk, then (c)", junk_then_good),
    ("plain", "worker, plain handler (2 stmts/msg)", worker_plain_handler),
    ("plain-pre", "plain, statements built once", worker_plain_prebuilt),
    ("plain-pg", "plain, (b)'s SQL on ctx.asyncpg", worker_plain_asyncpg),
    ("n1", "worker run --processes 1 (subprocess)", worker_processes(1)),
    ("n2", "worker run --processes 2 (subprocess)", worker_processes(2)),
    ("c+", "worker, relay off, full inbox", worker_relay_off_full_inbox),
    ("d", "worker + relay, events downstream", worker_with_relay),
    ("e", "relay draining the outbox", relay_alone),
    ("f", "FastStream + faststream-outbox, as (d)", faststream_peer),
    ("bare", "bare publish+confirm (aio-pika)", bare_publish),
)
"""In order; ``bare`` runs with ``e``."""

ON_UVLOOP: tuple[tuple[str, str, Scenario], ...] = (
    ("a-uv", "(a) on uvloop", bare_consume),
    ("c-uv", "(c) on uvloop", lambda bench: _worker_relay_off(bench, "c-uv")),
)
"""Run in a second event loop, uvloop's, after the others."""


async def run_scenarios(
    settings: Settings,
    options: Options,
    scenarios: tuple[tuple[str, str, Scenario], ...] = TIMED,
    *,
    with_latency: bool = True,
) -> Bench:
    """The selected scenarios in order, on one producer connection and one small engine."""
    connection = await runner.connect_broker(settings, name="bench")
    engine = create_engine(settings, application_name="bench", pool_size=2)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        plan = plan_payments(options.messages, options.duplicates, options.accounts, SEED)
        bench = Bench(settings, options, uuid.uuid4().hex[:10], connection, channel, engine, plan)
        for key, label, scenario in scenarios:
            if GROUPS.get(key, key) not in options.only:
                continue
            if key == "c+" and not options.inbox_rows:
                continue
            progress(f"running ({key}) {label} ...")
            timing: Timing | None = None
            try:
                timing = await scenario(bench)
            except ScenarioTimeout as exc:
                bench.note(key, f"{exc}: lower --messages (or raise --timeout)")
            except ScenarioSkipped as exc:
                bench.note(key, f"not run: {exc}")
            counted = timing.messages if timing and timing.messages else len(plan.sends)
            bench.runs.append(Run(key, label, counted, timing))
            progress(f"  {timing.seconds:.1f} s" if timing else "  timed out")
        if with_latency and "latency" in options.only:
            progress(f"running latency at {options.latency_rate:g}/s ...")
            try:
                await latency(bench)
            except ScenarioTimeout as exc:
                bench.note("latency", str(exc))
        return bench
    finally:
        await engine.dispose()
        await connection.close()


def run_in_scratch_database(options: Options) -> Bench:
    """A fresh, migrated database for this run, the scenarios, then the cleanup; (a) and (c)
    once more on uvloop's event loop when ``uvloop`` is chosen and installed."""
    with scratch_database(Settings.load(), payments_router, prefix="worker_bench") as settings:
        bench = asyncio.run(run_scenarios(settings, options))
        if "uvloop" not in options.only:
            return bench
        try:
            import uvloop
        except ImportError:
            bench.note("uvloop", "not installed (pip install uvloop): (a-uv) and (c-uv) not run")
            return bench
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as on_uvloop:
            again = on_uvloop.run(run_scenarios(settings, options, ON_UVLOOP, with_latency=False))
        bench.runs += again.runs
        bench.notes += again.notes
        return bench


def report(bench: Bench, elapsed: float) -> str:
    """The table, the ratios against their targets, latency, memory, then notes."""
    options, settings = bench.options, bench.settings
    lines = [
        f"throughput, {options.messages} messages ({bench.repeats} duplicates, "
        f"{options.accounts} accounts), prefetch {settings.prefetch}, concurrency "
        f"{settings.concurrency}, cpu count {os.cpu_count()}",
        f"{'scenario':<44}{'messages':>9}{'seconds':>9}{'msg/s':>9}{'cpu %':>7}",
    ]
    for run in bench.runs:
        figures = f"{'-':>9}{'-':>9}{'-':>7}"
        if run.timing is not None:
            cpu = 100 * run.timing.cpu_seconds / run.timing.seconds
            figures = f"{run.timing.seconds:>9.2f}{run.rate:>9.0f}{cpu:>7.0f}"
        lines.append(f"{f'({run.key}) {run.label}':<44}{run.messages:>9}{figures}")
    rates = {run.key: run.rate for run in bench.runs}
    lines += ["", f"{'ratio':<10}{'value':>8}   {'target':<10}"]
    for target in TARGETS:
        top, bottom = rates.get(target.numerator), rates.get(target.denominator)
        name = f"{target.numerator}/{target.denominator}"
        wanted = f">= {target.at_least:.2f}x" if target.at_least else "(compare)"
        if top is None or bottom is None:
            lines.append(f"{name:<10}{'-':>8}   {wanted:<10} not measured")
            continue
        ratio = top / bottom
        verdict = "" if not target.at_least else "met" if ratio >= target.at_least else "missed"
        lines.append(f"{name:<10}{ratio:>7.2f}x   {wanted:<10} {verdict}".rstrip())
    lines.append("")
    lines += latency_lines(bench.latency)
    if "after (c)" in bench.peak_rss_kib:
        lines.append(
            f"peak RSS after (c): {bench.peak_rss_kib['after (c)'] / 1024:.1f} MiB "
            f"(before (c): {bench.peak_rss_kib['before (c)'] / 1024:.1f} MiB)"
        )
    lines.append(f"total {elapsed:.0f} s (scratch database, preloads and clean-up included)")
    return "\n".join([*lines, *(["", *bench.notes] if bench.notes else [])])


def latency_lines(result: Latency | None) -> list[str]:
    if result is None:
        return []
    lines = [
        f"latency at {result.rate:g} msg/s offered for {result.offered_seconds:.2f} s "
        f"({result.count} messages; worker, relay off):"
    ]
    for label, delays in (
        ("publish -> commit", result.to_commit),
        ("publish -> transaction start (inbox.created_at)", result.to_transaction_start),
    ):
        ordered = sorted(1000 * s for s in delays)
        if ordered:
            p50, p99 = percentile(ordered, 50), percentile(ordered, 99)
            figures = f"p50 {p50:6.1f} ms  p99 {p99:6.1f} ms  (n={len(ordered)})"
        else:
            figures = "n/a"
        lines.append(f"  {label:<50}{figures}")
    nominal = (result.count - 1) / result.rate
    if result.offered_seconds > 1.05 * nominal + 0.1:
        lines.append(
            f"  the offered rate was not kept: offering took {result.offered_seconds:.1f} s, "
            f"not {nominal:.1f} s (the producer process shares 2 cores with the worker)"
        )
    handled_rate = result.count / result.handled_seconds
    if handled_rate < 0.95 * result.rate:
        lines.append(
            f"  the worker did not keep up: all {result.count} were handled after "
            f"{result.handled_seconds:.1f} s ({handled_rate:.0f} msg/s), so the delays are mostly "
            "queueing"
        )
    return lines


def scenario_list(raw: str) -> tuple[str, ...]:
    """``a,c,latency``: scenarios among ``SCENARIOS``."""
    names = tuple(part.strip().lower() for part in raw.split(",") if part.strip())
    wrong = [name for name in names if name not in SCENARIOS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"choose among {','.join(SCENARIOS)}")
    return names


def fraction(raw: str) -> float:
    value = float(raw)
    if not 0 <= value < 1:
        raise ValueError("must be at least 0 and below 1")
    return value


def parse_options(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput",
        description="Throughput of the worker against baselines, in one run.",
    )
    parser.add_argument(
        "--messages", type=positive_int, help="messages per scenario (default 50000; 2000 --quick)"
    )
    parser.add_argument(
        "--duplicates", type=fraction, default=0.1, help="share of repeated payments (0.1)"
    )
    parser.add_argument("--accounts", type=positive_int, default=1000, help="accounts (1000)")
    parser.add_argument(
        "--only", type=scenario_list, default=SCENARIOS, help=f"of {','.join(SCENARIOS)} (all)"
    )
    parser.add_argument(
        "--latency-seconds", type=positive_float, help="seconds of offered load (5; 1 --quick)"
    )
    parser.add_argument(
        "--latency-rate", type=positive_float, default=1000.0, help="offered msg/s (1000)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        help="seconds a scenario's drain may take (default: 120 + 20 ms per message)",
    )
    parser.add_argument(
        "--inbox-rows",
        type=positive_int,
        help="also run (c) with this many earlier keys in the inbox, e.g. 10000000 (takes minutes)",
    )
    parser.add_argument(
        "--junk", type=positive_int, default=2000, help="junk messages ahead of (jc)'s payments"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2000 messages")
    args = parser.parse_args(argv)
    messages = args.messages or (2000 if args.quick else 50_000)
    return Options(
        messages=messages,
        duplicates=args.duplicates,
        accounts=args.accounts,
        only=(*args.only, "c") if "junk" in args.only and "c" not in args.only else args.only,
        latency_seconds=args.latency_seconds or (1.0 if args.quick else 5.0),
        latency_rate=args.latency_rate,
        timeout=args.timeout or 120.0 + 0.02 * messages,
        inbox_rows=args.inbox_rows or 0,
        junk=args.junk,
        quick=args.quick,
    )


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    started = time.perf_counter()
    bench = run_in_scratch_database(options)
    print(report(bench, time.perf_counter() - started))


if __name__ == "__main__":
    main()
