"""Silent network partitions under a paced stream of payments, for real: two ``worker run``
processes (each with its in-process relay) on a PostgreSQL and a RabbitMQ of their own, and the
path to one of them cut by dropping its packets (no reset, no refusal), then restored.

While the path is silent, the worker must say so: ``/healthz`` reports the pause (PostgreSQL)
or the lost broker (RabbitMQ) within seconds, and ``/livez`` stays 200. After the heal the
stream must flow again within seconds (fresh connections, not half-open ones waited out): the
time from the heal to the first payment applied is asserted loosely (under 30 s) and printed,
with the time the outage took to show (run with ``-s``). Then the contract: every payment
applied exactly once, every event published and consumed (the example's own notices), no key
failed, nothing parked. A last test cuts one pooled connection for good: the worker drops it
and carries on.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments.demo import DemoPlan, plan_payments, request_message
from tests.helpers import assert_each_payment_applied_once, free_port, scalar, wait_until
from tests.integration.support import ready_messages, request, start_worker, wait_for_consumer
from tests.partition.conftest import Network
from worker.database import create_engine
from worker.settings import Settings

pytestmark = pytest.mark.timeout(420)  # (a 150 s partition, and the stream around it)

PAYMENTS = {"WORKER_HANDLERS": "examples.payments"}

RATE = 25.0
"""Payment requests sent per second, all along."""

BEFORE = 8.0
"""Seconds the stream flows before the cut."""

AFTER = 12.0
"""Seconds the stream goes on after the heal."""

RECOVERY_BOUND = 30.0
"""Seconds after the heal by which the stream must flow again (a loose bound: about 10 s is
what the worker aims at; two shared cores are slower)."""

NOTICE_BOUND = 30.0
"""Seconds after the cut by which ``/healthz`` must report it (about 10 s aimed at)."""


class Stream:
    """Publishes ``plan``'s payment requests at ``RATE`` per second through the connection that
    is never cut, in the background."""

    def __init__(self, control: AbstractRobustConnection, settings: Settings, plan: DemoPlan):
        self.control, self.settings, self.plan = control, settings, plan
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._publish())

    async def _publish(self) -> None:
        channel = await self.control.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(self.settings.exchange)
        started = time.monotonic()
        for sent, payment in enumerate(self.plan.sends, start=1):
            await exchange.publish(request_message(payment), routing_key="payment.requested")
            ahead = started + sent / RATE - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
        await channel.close()

    async def finished(self) -> None:
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout=120)


class Workers:
    """Two ``worker run`` processes; the first serves ``/healthz`` on ``port``."""

    def __init__(self, settings: Settings, log_dir: Path, **env: str) -> None:
        self.port = free_port()
        self.logs = [log_dir / "a.log", log_dir / "b.log"]
        self.running: list[subprocess.Popen[bytes]] = [
            start_worker(
                settings, self.logs[0], **PAYMENTS, WORKER_HTTP_PORT=str(self.port), **env
            ),
            start_worker(settings, self.logs[1], **PAYMENTS, **env),
        ]

    def log(self, index: int) -> str:
        return self.logs[index].read_text(errors="replace")[-4000:]

    def assert_alive(self) -> None:
        for index, process in enumerate(self.running):
            assert process.poll() is None, f"worker {index} exited:\n{self.log(index)}"

    async def health(self) -> tuple[int, dict[str, Any]]:
        answer = await request(self.port, "/healthz")
        return answer.status, json.loads(answer.body)

    async def alive(self) -> bool:
        return (await request(self.port, "/livez")).status == 200

    async def stop(self) -> None:
        """SIGTERM each, and expect each to drain and exit 0."""
        for process in self.running:
            process.send_signal(signal.SIGTERM)
        for index, process in enumerate(self.running):
            await asyncio.to_thread(process.wait, 60)
            assert process.returncode == 0, self.log(index)

    def kill(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.kill()
                process.wait()


@dataclass
class Rig:
    """What a test here works with: the network to cut, the settings of the workers it starts
    (logging to ``log_dir``), the connection never cut, and an engine of the test's own."""

    network: Network
    settings: Settings
    control: AbstractRobustConnection
    engine: AsyncEngine
    log_dir: Path

    async def stream(self, plan: DemoPlan) -> tuple[Workers, Stream]:
        """Two workers, consuming, and ``plan``'s payments streaming in for ``BEFORE``."""
        workers = Workers(self.settings, self.log_dir)
        try:
            await wait_for_consumer(self.control, self.settings.queue)
            stream = Stream(self.control, self.settings, plan)
            stream.start()
            await asyncio.sleep(BEFORE)
            assert await applied(self.engine) > 0, workers.log(0)
        except BaseException:
            workers.kill()
            raise
        return workers, stream


@pytest.fixture
async def rig(
    network: Network,
    partition_settings: Settings,
    control: AbstractRobustConnection,
    tmp_path: Path,
) -> AsyncIterator[Rig]:
    engine = create_engine(partition_settings, application_name="partition-test", pool_size=2)
    yield Rig(network, partition_settings, control, engine, tmp_path)
    await engine.dispose()


async def applied(engine: AsyncEngine) -> int:
    return int(await scalar(engine, "SELECT count(*) FROM ledger_entries"))


async def seconds_until(predicate: Any, since: float, bound: float) -> float:
    """Seconds from ``since`` until ``predicate()`` held (polled every 0.2 s), within ``bound``
    of ``since``; the test fails after that."""
    await wait_until(predicate, timeout=max(1.0, since + bound - time.monotonic()), interval=0.2)
    return time.monotonic() - since


async def everything_through(engine: AsyncEngine, plan: DemoPlan, workers: Workers) -> None:
    """Wait until every payment is applied, its event published and its notice recorded."""

    async def through() -> bool:
        workers.assert_alive()
        notices = await scalar(engine, "SELECT count(*) FROM settlement_notices")
        outbox = await scalar(engine, "SELECT count(*) FROM outbox")
        return int(notices) == len(plan.payments) and int(outbox) == 0

    await wait_until(through, timeout=180, interval=0.5)


async def assert_the_contract(rig: Rig, plan: DemoPlan) -> None:
    """Each payment applied once, every event out, nothing left or parked."""
    await assert_each_payment_applied_once(rig.engine, plan)
    async with rig.control.channel() as channel:
        assert await ready_messages(channel, rig.settings.dead_letter_queue) == 0, "parked"


@pytest.mark.parametrize(
    ("server", "seconds"),
    [("postgresql", 20), ("postgresql", 150), ("rabbitmq", 20), ("rabbitmq", 150)],
    ids=["postgresql-20s", "postgresql-150s", "rabbitmq-20s", "rabbitmq-150s"],
)
async def test_a_silent_partition_shows_heals_within_seconds_and_loses_nothing(
    server: str, seconds: int, rig: Rig
) -> None:
    network, engine = rig.network, rig.engine
    plan = plan_payments(round(RATE * (BEFORE + seconds + AFTER)), 0.2, 8, seed=seconds)
    port = network.pg_port if server == "postgresql" else network.amqp_port
    # Given two workers taking a paced stream of payments
    workers, stream = await rig.stream(plan)
    try:
        await engine.dispose()  # (the test's own connections are not the worker's to lose)

        # When the path to the server goes silent
        with network.cut(port):
            cut_at = time.monotonic()

            # Then /healthz says so within seconds, and /livez stays 200 all along
            async def reported() -> bool:
                workers.assert_alive()
                assert await workers.alive(), "/livez failed during a partition"
                status, body = await workers.health()
                if server == "postgresql":
                    return status == 503 and body.get("paused") == "database-unreachable"
                return status == 503 and body.get("broker") is False

            noticed = await seconds_until(reported, cut_at, NOTICE_BOUND)
            _, shown = await workers.health()
            if server == "postgresql":
                assert "PostgreSQL unreachable" in str(shown.get("paused_because")), shown
            while time.monotonic() < cut_at + seconds:
                assert await workers.alive(), "/livez failed during a partition"
                workers.assert_alive()
                await asyncio.sleep(min(2.0, max(0.0, cut_at + seconds - time.monotonic())))
            before_heal = await applied(engine) if server == "rabbitmq" else None

        # And once the path is back, payments are applied again within seconds
        healed_at = time.monotonic()
        baseline = before_heal if before_heal is not None else await applied(engine)

        async def flowing() -> bool:
            return await applied(engine) > baseline

        recovered = await seconds_until(flowing, healed_at, RECOVERY_BOUND)

        async def healthy() -> bool:
            status, _ = await workers.health()
            return status == 200

        healthy_after = await seconds_until(healthy, healed_at, RECOVERY_BOUND)
        print(
            f"\n{server} cut {seconds} s: /healthz reported it after {noticed:.1f} s; after the "
            f"heal, payments applied again after {recovered:.1f} s, /healthz ok after "
            f"{healthy_after:.1f} s"
        )

        # And in the end every payment was applied once, every event went out, nothing parked
        await stream.finished()
        await everything_through(engine, plan, workers)
        await workers.stop()
        await assert_the_contract(rig, plan)
    finally:
        workers.kill()


async def test_one_pooled_connection_cut_for_good_is_dropped_and_the_worker_carries_on(
    rig: Rig,
) -> None:
    network, engine = rig.network, rig.engine
    plan = plan_payments(round(RATE * 40), 0.2, 8, seed=40)
    client_ports = (
        "SELECT client_port FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'worker'"
    )
    # Given two workers taking a paced stream of payments, their pools open
    workers, stream = await rig.stream(plan)
    try:

        async def pooled() -> list[int]:
            found = await scalar(engine, f"SELECT array_agg(client_port) FROM ({client_ports}) p")
            return sorted(found or [])

        victim = (await pooled())[0]

        # When one pooled connection's path goes silent, for good (its port pair only)
        with network.cut(network.pg_port, client=victim):
            cut_at = time.monotonic()

            # Then the worker drops it (PostgreSQL's end too: its backend goes away)
            async def dropped() -> bool:
                workers.assert_alive()
                return victim not in await pooled()

            gone = await seconds_until(dropped, cut_at, 60.0)

            # And the stream goes on through the other connections: everything gets through
            await stream.finished()
            await everything_through(engine, plan, workers)
            print(f"\none pooled connection cut for good: dropped after {gone:.1f} s")
        await workers.stop()
        await assert_the_contract(rig, plan)
    finally:
        workers.kill()
