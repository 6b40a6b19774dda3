"""A PostgreSQL failover under load, for real: a primary and its synchronous replica
(``scripts/pg-failover``), a ``worker run`` (with its relay) and a ``worker relay`` on the
multi-host URL ``postgresql://...@127.0.0.1:A,127.0.0.1:B/db?target_session_attrs=read-write``.

First what the worker meets while no primary answers, each error classified as raised by the
real servers: all transient, never the message's fault. Then the failover itself: mid-stream
the primary is stopped (immediate mode); while no primary answers the worker must be paused,
not parking (nothing in the dead-letter queue, no key failed, no delayed retry); the replica is
promoted and both processes carry on through the same URL. Afterwards every payment was applied
exactly once, nothing was dead-lettered, and every ``payment.settled`` event reached the
downstream queue under one message id per payment (copies of a message on the wire are allowed,
at least once, and the example's own consumer of the event recorded each message id once).
The figures (time paused, messages in flight, effects) are printed: run with ``-s``.

Marked ``failover``: ``pytest -m failover -s``. It runs in the default test command too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractQueue, AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from examples.payments.demo import DemoPlan, plan_payments, request_message
from tests.failover.conftest import Pair
from tests.helpers import broker_depth, free_port, rows, scalar, wait_until
from tests.integration.support import (
    ready_messages,
    request,
    start_worker,
    wait_for_consumer,
)
from worker.database import create_engine, probe
from worker.errors import Fault, NoPrimary, classify
from worker.settings import Settings
from worker.sql.driver import in_transaction

pytestmark = [
    pytest.mark.failover,
    pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl"),
]

PAYMENTS = {"WORKER_HANDLERS": "examples.payments"}

SENDS = 3000
"""Payment requests sent in the failover test (a fifth of them repeats)."""

BURST = 1500
"""Sends published at once first, so that the worker has a backlog when the primary stops."""

RATE = 300.0
"""Sends per second after the burst: the stream still flows while no primary answers."""

STOP_AFTER = 0.2
"""Share of the unique payments committed when the primary is stopped (within the burst)."""

OUTAGE = 4.0
"""Seconds without a primary once the worker is seen paused, before the replica is promoted."""


def database_of(settings: Settings) -> str:
    return urlsplit(settings.database_url).path.lstrip("/")


@contextlib.asynccontextmanager
async def engine_on(url: str, settings: Settings) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(settings.replace(database_url=url), pool_size=2)
    try:
        yield engine
    finally:
        await engine.dispose()


async def failure_of(engine: AsyncEngine, sql: str) -> BaseException:
    """What running ``sql`` in a transaction raised (the test fails if nothing did)."""
    try:
        async with engine.begin() as conn:
            await conn.execute(text(sql))
    except Exception as exc:
        return exc
    raise AssertionError(f"{sql!r} succeeded")


async def driver_of(conn: AsyncConnection) -> asyncpg.Connection:
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None
    return driver


async def probe_failure(engine: AsyncEngine) -> BaseException:
    """What the worker's probe raised (the test fails if it found a primary)."""
    try:
        await probe(engine)
    except Exception as exc:
        return exc
    raise AssertionError("the probe found a primary")


WRITE = "INSERT INTO accounts (account, balance_cents) VALUES ('probe', 0) ON CONFLICT DO NOTHING"


# What the worker meets while no primary answers, as the real servers raise it


async def test_only_a_standby_to_connect_to_is_transient(
    pair: Pair, failover_settings: Settings
) -> None:
    # Given a URL whose one answering host is a standby, and a read-write session asked for
    url = pair.direct_url(pair.first_standby, database_of(failover_settings))
    async with engine_on(url + "?target_session_attrs=read-write", failover_settings) as engine:
        # When the worker connects, or probes: Then no primary, a transient failure
        failed = await failure_of(engine, "SELECT 1")
        assert classify(failed) is Fault.TRANSIENT, repr(failed)
        assert classify(await probe_failure(engine)) is Fault.TRANSIENT


async def test_a_write_on_a_standby_is_transient_and_the_probe_finds_no_primary(
    pair: Pair, failover_settings: Settings
) -> None:
    # Given a connection to the standby itself (no target_session_attrs)
    url = pair.direct_url(pair.first_standby, database_of(failover_settings))
    async with engine_on(url, failover_settings) as engine:
        # When a unit of work writes: Then read_only_sql_transaction, transient
        failed = await failure_of(engine, WRITE)
        assert getattr(failed.__cause__, "sqlstate", None) == "25006", repr(failed)
        assert classify(failed) is Fault.TRANSIENT
        # And the probe behind the consumer's pause says no primary, though the server answers
        with pytest.raises(NoPrimary):
            await probe(engine)


async def test_connections_to_a_primary_made_read_only_are_dropped_not_reused(
    pair: Pair, failover_settings: Settings
) -> None:
    # Given the worker's engine on the multi-host URL, its pool holding connections to the primary
    async with engine_on(failover_settings.database_url, failover_settings) as engine:
        async with engine.connect() as one, engine.connect() as two:
            for conn in (one, two):
                await conn.execute(text("SELECT 1"))
        admin = await asyncpg.connect(pair.direct_url(pair.first_primary, "postgres"))
        try:
            # When the primary stops taking writes (as some switchovers fence the old primary)
            await admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            await admin.execute("SELECT pg_reload_conf()")

            async def reloaded() -> bool:  # (the server's processes reload in a moment)
                return await admin.fetchval("SHOW default_transaction_read_only") == "on"

            await wait_until(reloaded, timeout=10)
            # Then each write fails transiently, and a pooled connection that failed so is not
            # used again: within a few writes the pool reconnects, through
            # target_session_attrs, and finds no primary
            failures = [await failure_of(engine, WRITE) for _ in range(4)]
            assert all(classify(f) is Fault.TRANSIENT for f in failures), failures
            read_only = [getattr(f.__cause__, "sqlstate", None) == "25006" for f in failures]
            assert read_only[0], failures
            assert not read_only[-1], failures
            assert classify(await probe_failure(engine)) is Fault.TRANSIENT
        finally:
            await admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
            await admin.execute("SELECT pg_reload_conf()")
            await admin.close()

        # And once it takes writes again, so does the worker's engine
        async def writable() -> bool:
            try:
                await probe(engine)
            except Exception:
                return False
            return True

        await wait_until(writable, timeout=10, interval=0.2)


async def test_pooled_connections_the_server_cut_are_replaced_not_handed_out(
    pair: Pair, failover_settings: Settings
) -> None:
    # Given the worker's engine, its pool holding two connections to the primary
    async with engine_on(failover_settings.database_url, failover_settings) as engine:
        async with engine.connect() as one, engine.connect() as two:
            raw = [await driver_of(conn) for conn in (one, two)]
            pids = [await conn.fetchval("SELECT pg_backend_pid()") for conn in raw]
        # When the server cuts them (as a stopping primary does), and asyncpg has noticed
        admin = await asyncpg.connect(pair.direct_url(pair.first_primary, "postgres"))
        try:
            await admin.execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) pid", pids)
        finally:
            await admin.close()

        async def noticed() -> bool:
            return all(conn.is_closed() for conn in raw)

        await wait_until(noticed, timeout=10)
        # Then a transaction whose statements go to the driver directly (as the hot path's and
        # the relay's do) gets a live connection, never a dead one from the pool
        for _ in range(3):
            async with engine.begin() as conn:
                assert await (await in_transaction(conn)).fetchval("SELECT 1") == 1


# The failover


class Stream:
    """Publishes the payment requests of ``plan`` with confirms, in the background: the first
    ``BURST`` at once, the others at ``RATE`` per second; ``sent`` counts the confirmed ones."""

    def __init__(self, amqp: AbstractRobustConnection, settings: Settings, plan: DemoPlan):
        self.amqp, self.settings, self.plan = amqp, settings, plan
        self.sent = 0
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._publish())

    async def _publish(self) -> None:
        channel = await self.amqp.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(self.settings.exchange)
        started = time.monotonic()
        for index, payment in enumerate(self.plan.sends):
            await exchange.publish(request_message(payment), routing_key="payment.requested")
            self.sent = index + 1
            ahead = started + (self.sent - BURST) / RATE - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
            elif self.sent == BURST:
                started = time.monotonic()
        await channel.close()

    def ids_sent(self) -> set[str]:
        return {str(p["payment_id"]) for p in self.plan.sends[: self.sent]}


class Processes:
    """The test's ``worker`` subprocesses, each killed at the end if still running."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings, self.log_dir = settings, log_dir
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: str, **env: str) -> None:
        log = self.log_dir / f"{name}.log"
        self.running[name] = start_worker(self.settings, log, command, **PAYMENTS, **env)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def assert_alive(self) -> None:
        for name, process in self.running.items():
            assert process.poll() is None, f"{name} exited:\n{self.log(name)[-3000:]}"

    async def stop(self) -> None:
        """SIGTERM each, and expect each to drain and exit 0."""
        for process in self.running.values():
            process.send_signal(signal.SIGTERM)
        for name, process in self.running.items():
            await asyncio.to_thread(process.wait, 60)
            assert process.returncode == 0, self.log(name)[-3000:]

    def kill(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def processes(failover_settings: Settings, tmp_path: Path) -> Iterator[Processes]:
    running = Processes(failover_settings, tmp_path)
    yield running
    running.kill()


@contextlib.asynccontextmanager
async def downstream(
    amqp: AbstractRobustConnection, settings: Settings
) -> AsyncIterator[AbstractQueue]:
    """A durable queue of a downstream consumer, bound to ``payment.settled``."""
    channel = await amqp.channel()
    queue = await channel.declare_queue(f"{settings.queue}.downstream", durable=True)
    await queue.bind(settings.exchange, "payment.settled")
    try:
        yield queue
    finally:
        await channel.queue_delete(f"{settings.queue}.downstream")


async def drained(queue: AbstractQueue) -> list[aio_pika.abc.AbstractIncomingMessage]:
    seen = []
    while (message := await queue.get(fail=False, no_ack=True)) is not None:
        seen.append(message)
    return seen


async def health(port: int) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads((await request(port, "/healthz")).body)
    return answer


async def metric_sums(port: int) -> Counter[str]:
    """``worker_messages_total`` by outcome and ``worker_consumer_pauses_total``, scraped."""
    sums: Counter[str] = Counter()
    for line in (await request(port, "/metrics")).body.decode().splitlines():
        if line.startswith("worker_messages_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            sums[outcome] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("worker_consumer_pauses_total "):
            sums["pauses"] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith('worker_relay_messages_total{result="published"}'):
            sums["relayed"] += int(float(line.rsplit(" ", 1)[1]))
    return sums


async def test_a_failover_mid_stream_loses_nothing_applies_nothing_twice_and_parks_nothing(
    pair: Pair,
    failover_settings: Settings,
    amqp: AbstractRobustConnection,
    processes: Processes,
) -> None:
    settings = failover_settings
    plan = plan_payments(SENDS, 0.2, 8, seed=18)
    database = database_of(settings)
    port = free_port()
    engine = create_engine(settings, pool_size=2)
    standby = await asyncpg.connect(pair.direct_url(pair.first_standby, database))
    stopped = promoted = False
    try:
        # Given a worker (with its relay) and a relay of its own on the multi-host URL
        processes.start("worker", "run", WORKER_HTTP_PORT=str(port))
        processes.start("relay", "relay")
        await wait_for_consumer(amqp, settings.queue)
        async with downstream(amqp, settings) as queue:
            # And payment requests streaming in
            stream = Stream(amqp, settings, plan)
            stream.start()

            async def under_way() -> bool:
                done = await scalar(
                    engine, "SELECT count(*) FROM inbox WHERE handler = 'payment.requested'"
                )
                return int(done) >= STOP_AFTER * len(plan.payments)

            await wait_until(under_way, timeout=60, interval=0.02)

            # When the primary stops at once, mid-stream
            stopped_at = time.time()
            await asyncio.to_thread(pair.run, "stop-primary")
            stopped = True
            sent_at_stop = stream.ids_sent()
            await engine.dispose()  # (its connections died with the primary)

            # (what was in flight, read on the replica once it applied all it received: it has
            # every commit a client saw. The primary streams WAL up to its flush point, which
            # may end inside a record; stopped at once, it never sends the rest, and the
            # replica's replay stays short of what it received. So replay has caught up when it
            # reaches the received end, or when it has stood still for 2 s: what remains is a
            # torn record, no commit)
            replayed: list[tuple[float, str]] = []

            async def applied() -> bool:
                row = await standby.fetchrow(
                    "SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn() AS done, "
                    "pg_last_wal_replay_lsn()::text AS replay"
                )
                assert row is not None
                if row["done"]:
                    return True
                if not replayed or replayed[-1][1] != row["replay"]:
                    replayed.append((time.monotonic(), row["replay"]))
                return time.monotonic() - replayed[-1][0] >= 2.0

            await wait_until(applied, timeout=60, interval=0.1)
            committed_at_stop = {
                key
                for (key,) in await standby.fetch(
                    "SELECT key FROM inbox WHERE handler = 'payment.requested'"
                )
            }
            outbox_at_stop = await standby.fetchval("SELECT count(*) FROM outbox")

            # Then, while no primary answers, the worker pauses, and parks nothing
            async def paused() -> bool:
                return (await health(port)).get("paused") == "database-unreachable"

            await wait_until(paused, timeout=30, interval=0.1)
            outage_ends = time.monotonic() + OUTAGE
            while time.monotonic() < outage_ends:
                processes.assert_alive()
                assert (await health(port)).get("paused") == "database-unreachable"
                async with amqp.channel() as channel:
                    assert await ready_messages(channel, settings.dead_letter_queue) == 0
                not_completed = await standby.fetchval(
                    "SELECT count(*) FROM inbox WHERE status <> 'completed'"
                )
                assert not_completed == 0, "a key was marked failed (or left in progress)"
                await asyncio.sleep(0.5)
            during = await metric_sums(port)
            assert during["dead_lettered"] == during["retry_scheduled"] == 0, during

            # When the replica is promoted
            promoted_at = time.time()
            await asyncio.to_thread(pair.run, "promote")
            promoted = True

            # Then both carry on through the same URL, and everything arrives
            assert stream.task is not None
            await asyncio.wait_for(stream.task, timeout=60)

            async def quiet() -> bool:
                processes.assert_alive()
                done = await scalar(
                    engine,
                    "SELECT count(*) FROM inbox "
                    "WHERE handler = 'payment.requested' AND status = 'completed'",
                )
                notices = await scalar(engine, "SELECT count(*) FROM settlement_notices")
                outbox = await scalar(engine, "SELECT count(*) FROM outbox")
                return (
                    done == len(plan.payments)
                    and notices == len(plan.payments)
                    and outbox == 0
                    and await broker_depth(settings.queue) == 0
                )

            await wait_until(quiet, timeout=90, interval=0.5)
            after = await metric_sums(port)
            first_commit = await scalar(
                engine,
                "SELECT extract(epoch FROM min(updated_at)) FROM inbox "
                "WHERE updated_at > to_timestamp(:promoted)",
                promoted=promoted_at,
            )
            await processes.stop()

            # Then every payment was applied exactly once
            balances = dict(await rows(engine, "SELECT account, balance_cents FROM accounts"))
            assert balances == plan.expected_balances, "an effect was lost or applied twice"
            ledger = await scalar(engine, "SELECT count(*) FROM ledger_entries")
            assert ledger == len(plan.payments)
            stuck = await scalar(engine, "SELECT count(*) FROM inbox WHERE status <> 'completed'")
            assert stuck == 0, "a key was marked failed (or left in progress)"
            # And nothing was parked, nor sent to a delayed retry
            assert await broker_depth(settings.dead_letter_queue) == 0, "a message was parked"
            assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 0
            assert after["dead_lettered"] == after["retry_scheduled"] == 0, after
            # And each payment's event reached the downstream queue, under one message id:
            # a copy sent twice is the same message (at least once), never a second event
            events = await drained(queue)
            ids_by_payment: dict[str, set[str | None]] = {}
            for event in events:
                payment_id = json.loads(event.body)["payment_id"]
                ids_by_payment.setdefault(payment_id, set()).add(event.message_id)
            assert set(ids_by_payment) == {str(p["payment_id"]) for p in plan.payments}
            assert all(len(ids) == 1 for ids in ids_by_payment.values()), "an event made twice"
            # And the example's own consumer of the event recorded each message id once
            notices = await rows(
                engine, "SELECT event_id, count(*) FROM settlement_notices GROUP BY event_id"
            )
            assert len(notices) == len(plan.payments)
            assert all(n == 1 for _, n in notices)

        figures = {
            "sends": len(plan.sends),
            "payments": len(plan.payments),
            "outage_seconds": round(promoted_at - stopped_at, 2),
            "paused_seconds": round(float(first_commit) - stopped_at, 2),
            "first_commit_after_promotion_seconds": round(float(first_commit) - promoted_at, 2),
            "payments_sent_not_committed_at_stop": len(sent_at_stop - committed_at_stop),
            "outbox_rows_unpublished_at_stop": outbox_at_stop,
            "consumer_pauses": after["pauses"],
            "deliveries_the_worker_held_and_requeued": after["requeued"],
            "ledger_entries": ledger,
            "settled_events_downstream": len(events),
            "settled_events_repeated_on_the_wire": len(events) - len(ids_by_payment),
            "published_by_the_workers_relay_after_promotion": after["relayed"] - during["relayed"],
            "dead_lettered": after["dead_lettered"],
            "delayed_retries": after["retry_scheduled"],
        }
        print("\nfailover figures:", json.dumps(figures, sort_keys=True))
    finally:
        await standby.close()
        await engine.dispose()
        if stopped and not promoted:  # a primary to drop the database on
            await asyncio.to_thread(pair.run, "promote")
