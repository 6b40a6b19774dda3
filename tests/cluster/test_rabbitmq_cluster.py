"""Losing the broker node that leads the work queue, for real: a three-node RabbitMQ cluster,
quorum queues, a ``worker run`` process (its relay inside) with the payments example, given the
three nodes' addresses with the leader first.

Payments stream in while the leader is stopped and later started again. Meanwhile some batches
are held open in the database (the test locks the accounts) so that they commit only after their
connection died: their acks must not be sent on the new connection (their delivery tags died with
the old channel), and the broker's redeliveries of them must be absorbed by the inbox as
duplicates. At the end nothing is lost, nothing applied twice, nothing dead-lettered, and every
payment's ``payment.settled`` event reached a downstream queue.

Marked ``cluster`` (``pytest -m cluster``); part of the default run too. Prints its figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractQueue, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments.demo import DemoPlan, plan_payments, request_message
from tests.cluster.conftest import Cluster, amqp_port
from tests.helpers import (
    WORKER_SCRIPT,
    assert_each_payment_applied_once,
    run,
    scalar,
    wait_until,
    worker_environ,
)
from tests.integration.support import start_worker
from worker.settings import Settings
from worker.telemetry import Count
from worker.transport.connection import connect

pytestmark = pytest.mark.cluster

PAYMENTS = 3000
ACCOUNTS = 8
HANDLERS = "examples.payments.handlers"
QUORUM = {"WORKER_QUEUE_TYPE": "quorum"}
WINDOW = 50
"""Publishes awaited together (each confirmed by the broker) before the next ones are sent."""


@pytest.fixture
def settings(cluster: Cluster, database_url: str) -> Settings:
    suffix = uuid.uuid4().hex[:8]
    return Settings(
        database_url=database_url,
        amqp_url=cluster.urls(),
        exchange=f"cluster-{suffix}-events",
        queue=f"cluster-{suffix}",
        retry_delays=(0.5, 1.0),
        http_port=0,
    )


def environ(settings: Settings) -> dict[str, str]:
    return worker_environ(settings, WORKER_HANDLERS=HANDLERS, **QUORUM)


class Publisher:
    """Publishes payment requests with confirms over a robust connection to the cluster; a
    window whose confirms did not all come (its node died) is sent again once the connection is
    back, on another node: a resend is one more duplicate for the inbox."""

    def __init__(self, connection: AbstractRobustConnection, settings: Settings) -> None:
        self.connection = connection
        self.settings = settings
        self.resent = 0

    async def publish(self, sends: Sequence[dict[str, object]], pace: float = 0.0) -> None:
        """Publish ``sends``, a window at a time, ``pace`` seconds between two windows."""
        for start in range(0, len(sends), WINDOW):
            window = sends[start : start + WINDOW]
            while not await self._confirmed(window):
                self.resent += len(window)
                await asyncio.sleep(0.2)
            await asyncio.sleep(pace)

    async def _confirmed(self, window: Sequence[dict[str, object]]) -> bool:
        try:
            async with asyncio.timeout(30):
                await self.connection.ready()
                async with self.connection.channel(publisher_confirms=True) as channel:
                    exchange = await channel.get_exchange(self.settings.exchange)
                    await asyncio.gather(
                        *(
                            exchange.publish(request_message(p), routing_key="payment.requested")
                            for p in window
                        )
                    )
        except (aio_pika.exceptions.AMQPError, ConnectionError, TimeoutError, RuntimeError):
            return False
        except asyncio.CancelledError:  # a confirm the dying connection cancelled
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return False
        return True


async def downstream(connection: AbstractRobustConnection, settings: Settings) -> AbstractQueue:
    """A quorum queue bound to ``payment.settled``: a downstream consumer's, replicated so that
    it outlives the node loss (it goes with the cluster)."""
    channel = await connection.channel()
    queue = await channel.declare_queue(
        f"{settings.queue}.downstream", durable=True, arguments={"x-queue-type": "quorum"}
    )
    await queue.bind(settings.exchange, "payment.settled")
    return queue


async def settled_events(queue: AbstractQueue) -> dict[str, str]:
    """The downstream queue drained: each ``payment.settled`` message id with its payment."""
    seen: dict[str, str] = {}
    while (message := await queue.get(fail=False, no_ack=True, timeout=30)) is not None:
        seen[str(message.message_id)] = json.loads(message.body)["payment_id"]
    return seen


class WorkerLog:
    """The worker's JSON log lines."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> Iterator[dict[str, Any]]:
        for line in self.path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    yield entry

    def times(self, beginning: str) -> list[datetime]:
        """When each line beginning with ``beginning`` was logged."""
        return [
            datetime.fromisoformat(e["time"])
            for e in self.entries()
            if str(e.get("message", "")).startswith(beginning)
        ]

    def count(self, beginning: str) -> int:
        return len(self.times(beginning))

    def stats(self) -> dict[str, int]:
        """The counts the worker logged when it stopped."""
        (stopped,) = [e for e in self.entries() if str(e["message"]).startswith("stopped; ")]
        return dict(stopped["stats"])


async def completed(engine: AsyncEngine) -> int:
    return int(
        await scalar(
            engine,
            "SELECT count(*) FROM inbox WHERE handler = 'payment.requested' "
            "AND status = 'completed'",
        )
    )


@contextlib.asynccontextmanager
async def accounts_locked(database_url: str) -> AsyncIterator[None]:
    """Every account row locked in an open transaction until exit: the worker's batches, which
    credit accounts, wait inside their own transactions, their deliveries unacked."""
    holder = await asyncpg.connect(database_url)
    try:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute("SELECT account FROM accounts FOR UPDATE")
        yield
        await transaction.rollback()
    finally:
        await holder.close()


async def batches_held(engine: AsyncEngine) -> bool:
    """Whether a batch of the worker waits for a lock inside its transaction."""
    waiting = await scalar(
        engine,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'worker' "
        "AND wait_event_type = 'Lock' AND datname = current_database()",
    )
    return int(waiting) >= 1


async def assert_nothing_lost_or_doubled(
    engine: AsyncEngine, cluster: Cluster, settings: Settings, load: DemoPlan, node: int
) -> None:
    await assert_each_payment_applied_once(engine, load)
    assert await cluster.depth(settings.queue, on=node) == 0, "a message was left in the queue"
    assert await cluster.depth(settings.dead_letter_queue, on=node) == 0, "a message was parked"
    verified = await asyncio.to_thread(
        run,
        WORKER_SCRIPT,
        "verify",
        "--quiet-queue",
        "--no-dead-letters",
        **environ(settings),
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


async def test_the_leader_node_stopped_mid_stream_then_restarted_loses_and_doubles_nothing(
    cluster: Cluster, settings: Settings, database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    load = plan_payments(PAYMENTS, 0.0, ACCOUNTS, seed=18)
    parts = [load.sends[i * PAYMENTS // 3 : (i + 1) * PAYMENTS // 3] for i in range(3)]
    started = time.monotonic()

    # Given the topology declared as quorum queues, and the node leading the work queue
    declared = await asyncio.to_thread(run, WORKER_SCRIPT, "declare", **environ(settings))
    assert declared.returncode == 0, declared.stderr
    leader = await cluster.leader(settings.queue)
    others = [node for node in (1, 2, 3) if node != leader]
    first_in_list = settings.replace(amqp_url=cluster.urls(first=leader))

    # And a worker and a publisher whose lists of nodes start with the leader
    log = WorkerLog(tmp_path / "worker.log")
    worker = start_worker(
        first_in_list, log.path, WORKER_HANDLERS=HANDLERS, WORKER_LOG_FORMAT="json", **QUORUM
    )
    connection = await connect(first_in_list.amqp_url, name="test-publisher")
    try:
        events = await downstream(connection, settings)
        publisher = Publisher(connection, settings)
        await wait_until(lambda: started_consuming(log), timeout=60)

        # When payments stream in
        await publisher.publish(parts[0])
        await wait_until(lambda: accounts_exist(engine), timeout=60)
        # and batches are held open in the database while the leader is stopped, the
        # stream going on meanwhile
        async with accounts_locked(database_url):
            await publisher.publish(parts[1][: len(parts[1]) // 2])
            await wait_until(lambda: batches_held(engine), timeout=60)
            await asyncio.gather(
                cluster.run("stop-node", str(leader)),
                publisher.publish(parts[1][len(parts[1]) // 2 :], pace=0.25),
            )
        # (the held batches commit now: their connection is gone, their acks void)
        moved_to = connection.url.port
        assert moved_to != amqp_port(leader), "the publisher stayed on the stopped node"

        # Then the worker reconnects to another node and carries on
        await wait_until(lambda: reconnected(log, connections=2), timeout=90)
        before = await completed(engine)

        async def carries_on() -> bool:
            return await completed(engine) > before

        await wait_until(carries_on, timeout=90)

        # And when the node comes back, the stream goes on
        await asyncio.gather(cluster.run("start-node", str(leader)), publisher.publish(parts[2]))

        async def quiet() -> bool:
            return (
                await completed(engine) == len(load.payments)
                and await scalar(engine, "SELECT count(*) FROM settlement_notices")
                == len(load.payments)
                and await scalar(engine, "SELECT count(*) FROM outbox") == 0
                and await cluster.depth(settings.queue, on=others[0]) == 0
            )

        await wait_until(quiet, timeout=120, interval=0.5)
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 60)
        assert worker.returncode == 0, log.path.read_text()[-3000:]

        # Then nothing was lost, applied twice or parked, and every event was published
        await assert_nothing_lost_or_doubled(engine, cluster, settings, load, others[0])
        seen = await settled_events(events)
        assert sorted(seen.values()) == sorted(str(p["payment_id"]) for p in load.payments)
    finally:
        await connection.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait()

    # And the deliveries of the dead connection were never settled on the new one: their acks
    # were dropped, the cluster redelivered them, and the inbox took them as duplicates
    text = log.path.read_text()
    assert "unknown delivery tag" not in text
    assert "PRECONDITION_FAILED" not in text
    errors = [
        e for e in log.entries() if e["level"] == "ERROR" and e["logger"].startswith("worker")
    ]
    assert not errors, errors
    stats = log.stats()
    dropped = sum(map(int, re.findall(r"could not ack (\d+) message", text)))
    assert dropped >= 1, "no batch committed after its connection died"
    assert stats.get("duplicate", 0) >= 1, "no redelivery was absorbed as a duplicate"
    assert stats[Count.PROCESSED] == len(load.payments) * 2  # each payment, then its notice
    figures = {
        "payments": len(load.payments),
        "leader_stopped": leader,
        "reconnect_seconds": reconnect_seconds(log),
        "acks_dropped": dropped,
        "duplicates_absorbed": stats.get("duplicate", 0),
        "publishes_resent": publisher.resent,
        "publisher_moved_to": moved_to,
        "settled_events_downstream": len(seen),
        "seconds": round(time.monotonic() - started, 1),
    }
    print("\ncluster figures:", json.dumps(figures, sort_keys=True))


async def started_consuming(log: WorkerLog) -> bool:
    return log.count("consuming queue") >= 1


async def accounts_exist(engine: AsyncEngine) -> bool:
    return int(await scalar(engine, "SELECT count(*) FROM accounts")) == ACCOUNTS


async def reconnected(log: WorkerLog, connections: int) -> bool:
    """Whether ``connections`` broker connections of the worker reconnected."""
    return len(reconnect_seconds(log)) >= connections


def reconnect_seconds(log: WorkerLog) -> dict[str, float]:
    """For each broker connection of the worker, from its loss to its reconnect, as logged."""
    lost: dict[str, datetime] = {}
    back: dict[str, float] = {}
    for entry in log.entries():
        message = str(entry.get("message", ""))
        if not message.startswith("broker connection '"):
            continue
        name = message.split("'")[1]
        at = datetime.fromisoformat(entry["time"])
        if " lost (" in message:
            lost.setdefault(name, at)
        elif " reconnected to " in message and name in lost and name not in back:
            back[name] = round((at - lost[name]).total_seconds(), 2)
    return back
