"""Crash consistency with real ``worker run`` and ``worker relay`` processes and the payments
example: SIGKILL at each crash point, and a soak under random kills, cut broker connections and
terminated database backends. The soak's faults are driven by its progress, not by the clock:
its load is sent in parts and a fault struck between two parts, so each kind of fault strikes
while the load is still arriving. After a restart and a quiet moment the promise holds: each
payment's effect exactly once, each settled event delivered downstream at least once, nothing
left in the queue, no stuck inbox row, the outbox drained, nothing dead-lettered.

Marked ``chaos``. By default the soak is a short one; ``CHAOS_MESSAGES=20000 ./scripts/test -m
chaos -s`` runs the full soak and prints its figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
from aio_pika import Message
from aio_pika.abc import AbstractQueue, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments.demo import DemoPlan, plan_payments
from tests.helpers import (
    WORKER_SCRIPT,
    assert_each_payment_applied_once,
    broker_depth,
    close_broker_connections,
    rows,
    run,
    scalar,
    wait_until,
    worker_environ,
)
from tests.integration.support import start_worker, wait_for_consumer
from worker import faults
from worker.settings import Settings

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl"),
    pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc"),
]

PAYMENTS = {"WORKER_HANDLERS": "examples.payments"}


def make_load(count: int, duplicate_share: float = 0.2, seed: int = 5) -> DemoPlan:
    """Payments over 8 accounts, a share of them sent twice, and the balances they must give."""
    return plan_payments(count, duplicate_share, 8, seed)


async def publish_all(
    amqp: AbstractRobustConnection, settings: Settings, sends: list[dict[str, object]]
) -> int:
    """Publish every send with confirms, retrying one whose confirm was lost (a cut connection):
    a resend is just one more duplicate. Returns how many publishes were retried."""
    retried = 0
    channel = await amqp.channel(publisher_confirms=True)
    for p in sends:
        message = Message(json.dumps(p).encode(), headers={"idempotency-key": p["payment_id"]})
        while True:
            try:
                if channel.is_closed:
                    channel = await amqp.channel(publisher_confirms=True)
                exchange = await channel.get_exchange(settings.exchange)
                await exchange.publish(message, routing_key="payment.requested")
                break
            except Exception:
                retried += 1
                await asyncio.sleep(0.2)
    if not channel.is_closed:
        await channel.close()
    return retried


@contextlib.asynccontextmanager
async def capture_queue(
    amqp: AbstractRobustConnection, settings: Settings
) -> AsyncIterator[AbstractQueue]:
    """A downstream queue bound to ``payment.settled`` (durable: cut connections keep it)."""
    channel = await amqp.channel()
    queue = await channel.declare_queue(f"{settings.queue}.capture", durable=True)
    await queue.bind(settings.exchange, "payment.settled")
    try:
        yield queue
    finally:
        cleanup = await amqp.channel()
        await cleanup.queue_delete(f"{settings.queue}.capture")


async def captured_payments(queue: AbstractQueue) -> dict[str, int]:
    """How often each payment's ``payment.settled`` reached the downstream queue (drains it)."""
    seen: dict[str, int] = {}
    while (message := await queue.get(fail=False, no_ack=True)) is not None:
        payment_id = json.loads(message.body)["payment_id"]
        seen[payment_id] = seen.get(payment_id, 0) + 1
    return seen


class Processes:
    """Worker and relay subprocesses of one test, restartable, all killed at the end."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.starts = 0

    def start(self, name: str, command: str = "run", **env: str) -> subprocess.Popen[bytes]:
        self.starts += 1
        log = self.log_dir / f"{name}.log"
        process = start_worker(self.settings, log, command, **PAYMENTS, **env)
        self.running[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    async def wait_killed(self, name: str, timeout: float = 60) -> None:
        process = self.running[name]
        await asyncio.to_thread(process.wait, timeout)
        assert process.returncode == -signal.SIGKILL, self.log(name)[-3000:]

    async def stop_all(self) -> None:
        """SIGTERM every process once it handles SIGTERM (one restarted a moment ago may still
        be starting, and would die of it), and expect a clean exit."""

        async def all_handle_sigterm() -> bool:
            running = self.running.values()
            return all(p.poll() is not None or catches_sigterm(p.pid) for p in running)

        await wait_until(all_handle_sigterm, timeout=60, interval=0.1)
        for process in self.running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name, process in self.running.items():
            await asyncio.to_thread(process.wait, 60)
            assert process.returncode == 0, self.log(name)[-3000:]

    def kill_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM installed (Linux's ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


@pytest.fixture
def processes(settings: Settings, tmp_path: Path) -> Iterator[Processes]:
    running = Processes(settings, tmp_path)
    yield running
    running.kill_all()


async def wait_quiet(
    engine: AsyncEngine, settings: Settings, load: DemoPlan, timeout: float
) -> None:
    """Until every unique payment and its notice are committed, and outbox and queue are empty."""

    async def quiet() -> bool:
        done = await scalar(
            engine,
            "SELECT count(*) FROM inbox WHERE handler = 'payment.requested' "
            "AND status = 'completed'",
        )
        notices = await scalar(engine, "SELECT count(*) FROM settlement_notices")
        outbox = await scalar(engine, "SELECT count(*) FROM outbox")
        return (
            done == len(load.payments)
            and notices == len(load.payments)
            and outbox == 0
            and await broker_depth(settings.queue) == 0
        )

    await wait_until(quiet, timeout=timeout, interval=0.5)


async def assert_promise_kept(
    engine: AsyncEngine, settings: Settings, load: DemoPlan, capture: AbstractQueue
) -> dict[str, int]:
    """The invariants; returns figures about the run."""
    await assert_each_payment_applied_once(engine, load)
    assert await broker_depth(settings.queue) == 0, "a message was left in the work queue"
    assert await broker_depth(settings.dead_letter_queue) == 0, "a message was dead-lettered"
    # the same invariants as an operator checks them on a deployment
    expected = Path(tempfile.mkdtemp()) / "expected.json"
    expected.write_text(json.dumps(load.expected_balances))
    verified = await asyncio.to_thread(
        run,
        WORKER_SCRIPT,
        "verify",
        "--quiet-queue",
        "--no-dead-letters",
        "--expect-balances",
        str(expected),
        **worker_environ(settings, **PAYMENTS),
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    seen = await captured_payments(capture)
    ledger = {pid for (pid,) in await rows(engine, "SELECT payment_id FROM ledger_entries")}
    missing = ledger - set(seen)
    assert not missing, f"{len(missing)} settled events never reached the downstream queue"
    return {
        "payments": len(load.payments),
        "sends": len(load.sends),
        "settled_events_downstream": sum(seen.values()),
        "settled_events_repeated": sum(n - 1 for n in seen.values()),
    }


CRASHES = [
    pytest.param("worker", faults.CONSUMER_BEFORE_CLAIM + "@40", id="before-claim"),
    pytest.param("worker", faults.UNIT_OF_WORK_BEFORE_COMMIT + "@40", id="inside-the-handler"),
    pytest.param("worker", faults.CONSUMER_AFTER_COMMIT + "@40", id="after-commit-before-ack"),
    pytest.param("relay", faults.RELAY_MID_BATCH + "@30", id="relay-mid-batch"),
    pytest.param("relay", faults.RELAY_AFTER_PUBLISH + "@3", id="relay-after-publish"),
    pytest.param("worker", faults.CONSUMER_DRAINING, id="during-shutdown"),
]


ELSEWHERE = {
    faults.UNIT_OF_WORK_ISOLATING,
    faults.FAILURES_PARKED,
    faults.FAILURES_RECORDED,
    faults.WORKFLOW_WAIT_REGISTERED,
    faults.WORKFLOW_TIMEOUT_BEFORE_COMMIT,
    faults.WORKFLOW_RESUMED_BEFORE_COMMIT,
    faults.SCHEDULE_BEFORE_COMMIT,
}
"""Crash points this load never reaches, killed in their own tests (``test_isolation.py``,
``test_workflow_waits.py``, ``test_scheduled_crashes.py``): a rollback to a savepoint needs a
failing message in a batch, parking needs a message that fails for good, a wait needs a workflow
that waits, a move needs a scheduled event, and this load has none of them."""


def test_every_fixed_crash_point_has_its_kill_test() -> None:
    points = {param.values[1].partition("@")[0] for param in CRASHES}
    assert points | ELSEWHERE == set(faults.POINTS)


@pytest.mark.parametrize(("victim", "crash_at"), CRASHES)
async def test_a_kill_at_each_crash_point_then_a_restart_keeps_the_promise(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    processes: Processes,
    victim: str,
    crash_at: str,
) -> None:
    load = make_load(300)
    crash = {"WORKER_CRASH_AT": crash_at}
    # Given a worker (its relay off) and a relay, one of them armed to crash
    processes.start("worker", WORKER_RELAY="false", **(crash if victim == "worker" else {}))
    processes.start("relay", "relay", **(crash if victim == "relay" else {}))
    await wait_for_consumer(amqp, settings.queue)
    async with capture_queue(amqp, settings) as capture:
        # When a burst arrives and the armed process dies at the crash point
        await publish_all(amqp, settings, load.sends)
        if crash_at == faults.CONSUMER_DRAINING:

            async def under_way() -> bool:
                return int(await scalar(engine, "SELECT count(*) FROM inbox")) >= 20

            await wait_until(under_way)
            processes.running["worker"].send_signal(signal.SIGTERM)
        await processes.wait_killed(victim)

        # And it is started again
        if victim == "worker":
            processes.start("worker", WORKER_RELAY="false")
        else:
            processes.start("relay", "relay")
        await wait_quiet(engine, settings, load, timeout=90)
        await processes.stop_all()

        # Then the promise holds
        await assert_promise_kept(engine, settings, load, capture)


CHAOS_MESSAGES = int(os.environ.get("CHAOS_MESSAGES", "1500"))

FAULTS = (
    "sigkill worker",
    "sigkill relay",
    "broker connections closed",
    "database backends terminated",
)
"""The kinds of fault a soak injects, each at least once while its load is still being sent."""

FAULT_ROUNDS = max(1, CHAOS_MESSAGES // 1500)
"""How often a soak injects each kind of fault: once in the short soak, more in a longer one."""


@dataclass
class Chaos:
    """The faults of a soak, injected into its processes in a seeded random order, one at each
    of the load's checkpoints, and how many of each were injected."""

    processes: Processes
    settings: Settings
    rng: random.Random = field(default_factory=lambda: random.Random(23))
    counts: Counter[str] = field(default_factory=Counter)

    def schedule(self, rounds: int) -> list[str]:
        """Every kind of fault ``rounds`` times, shuffled."""
        faults = list(FAULTS) * rounds
        self.rng.shuffle(faults)
        return faults

    async def inject(self, fault: str) -> None:
        """SIGKILL and restart a worker or a relay (chosen at random), cut every broker
        connection of the processes, or terminate their database backends; the last two wait
        until they hit at least one connection (every process may be starting)."""
        if fault == "sigkill worker":
            await self.kill_and_restart("worker", "run")
        elif fault == "sigkill relay":
            await self.kill_and_restart("relay", "relay")
        elif fault == "broker connections closed":
            await wait_until(self.cut_broker_connections, timeout=60, interval=0.2)
        else:
            await wait_until(self.terminate_backends, timeout=60, interval=0.2)
        self.counts[fault] += 1

    async def kill_and_restart(self, role: str, command: str) -> None:
        name = self.rng.choice(sorted(n for n in self.processes.running if n.startswith(role)))
        process = self.processes.running[name]
        process.kill()
        await asyncio.to_thread(process.wait, 30)
        self.processes.start(name, command)

    async def cut_broker_connections(self) -> bool:
        pids = [p.pid for p in self.processes.running.values() if p.poll() is None]
        return await close_broker_connections(pids, self.settings.amqp_url, "chaos") >= 1

    async def terminate_backends(self) -> bool:
        admin = await asyncpg.connect(self.settings.database_url)
        try:
            terminated = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name IN ('worker', 'worker-relay') "
                "AND datname = current_database()"
            )
        finally:
            await admin.close()
        return int(terminated) >= 1


def checkpoints(sends: list[dict[str, object]], faults: int) -> list[list[dict[str, object]]]:
    """``sends`` cut into ``faults + 1`` nearly equal parts, in order."""
    parts = faults + 1
    return [sends[len(sends) * i // parts : len(sends) * (i + 1) // parts] for i in range(parts)]


async def test_a_soak_under_random_faults_keeps_the_promise(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    processes: Processes,
) -> None:
    load = make_load(CHAOS_MESSAGES, duplicate_share=0.2, seed=7)
    chaos = Chaos(processes, settings)
    faults = chaos.schedule(FAULT_ROUNDS)
    started = time.monotonic()
    # Given two workers (with their in-process relays) and two relays
    for name in ("worker1", "worker2"):
        processes.start(name)
    for name in ("relay1", "relay2"):
        processes.start(name, "relay")
    await wait_for_consumer(amqp, settings.queue)
    async with capture_queue(amqp, settings) as capture:
        # When the load is sent in parts, and between two parts a fault is injected: a kill,
        # a cut of the broker connections or of the database backends (so every kind of fault
        # strikes before the last part is even sent)
        resent = 0
        for part, fault in itertools.zip_longest(checkpoints(load.sends, len(faults)), faults):
            resent += await publish_all(amqp, settings, part)
            if fault is not None:
                await chaos.inject(fault)

        # Then, once it is quiet, every invariant holds
        await wait_quiet(engine, settings, load, timeout=300)
        await processes.stop_all()
        figures = await assert_promise_kept(engine, settings, load, capture)
    assert chaos.counts == Counter(dict.fromkeys(FAULTS, FAULT_ROUNDS))
    figures.update(chaos.counts)
    figures["publishes_resent_after_a_cut"] = resent
    figures["process_starts"] = processes.starts
    figures["seconds"] = round(time.monotonic() - started)
    print("\nsoak figures:", json.dumps(figures, sort_keys=True))
