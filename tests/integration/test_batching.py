"""Micro-batches against the real PostgreSQL and RabbitMQ: many deliveries, one transaction, and
the same exactly-once effects as one transaction per message."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from pathlib import Path
from typing import Any

import pytest
from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import broker_depth, envelope, payment, rows, scalar, wait_until
from tests.integration.support import running_worker, wait_for_consumer, worker_process
from worker import Batch, Context, Router
from worker.core.config import UnitOfWorkConfig
from worker.core.outcomes import Outcome
from worker.core.unit_of_work import process_batch
from worker.errors import HandlerFailed, KeyReused, Reason
from worker.faults import UNIT_OF_WORK_BEFORE_COMMIT
from worker.settings import Settings
from worker.telemetry import Count, dead_lettered_because
from worker.transport.topology import declare_topology

EXCHANGE = "events"
UNIT = UnitOfWorkConfig(exchange=EXCHANGE)
REQUESTED = "payment.requested"


def requested(payment_id: str, account: str = "alice", cents: int = 100, key: str | None = None):
    return envelope(payments, REQUESTED, payment(payment_id, account, cents), key or payment_id)


async def test_a_batch_commits_every_effect_with_running_balances(engine: AsyncEngine) -> None:
    # Given five payments over two accounts, in one batch
    batch = [
        requested("p1", "alice", 100),
        requested("p2", "bob", 7),
        requested("p3", "alice", 20),
        requested("p4", "alice", 3),
        requested("p5", "bob", 1),
    ]

    # When they are processed together
    ends = await process_batch(engine, batch, UNIT)

    # Then each took effect once, and each event carries its account's balance after it
    assert ends == [Outcome.PROCESSED] * 5
    balances = dict(await rows(engine, "SELECT account, balance_cents FROM accounts"))
    assert balances == {"alice": 123, "bob": 8}
    events = await rows(engine, "SELECT ordering_key, body FROM outbox ORDER BY id")
    chains: dict[str, list[int]] = {}
    for event in events:
        body = json.loads(event.body)
        chains.setdefault(event.ordering_key, []).append(body["balance_cents"])
    assert chains == {"alice": [100, 120, 123], "bob": [7, 8]}
    results = await rows(engine, "SELECT key, result FROM inbox WHERE status = 'completed'")
    assert {r.key: r.result["balance_cents"] for r in results} == {
        "p1": 100,
        "p2": 7,
        "p3": 120,
        "p4": 123,
        "p5": 8,
    }


async def test_a_key_twice_in_one_batch_takes_effect_once(engine: AsyncEngine) -> None:
    # Given a batch holding a payment twice, and a key reused with another amount
    batch = [
        requested("p1", "alice", 100),
        requested("p2", "alice", 5),
        requested("p1", "alice", 100),
        requested("p2", "alice", 6, key="p2"),
    ]

    # When it is processed
    ends = await process_batch(engine, batch, UNIT)

    # Then the first delivery of each key ran; the repeat is a duplicate, the reuse rejected
    assert ends[:3] == [Outcome.PROCESSED, Outcome.PROCESSED, Outcome.DUPLICATE]
    assert isinstance(ends[3], KeyReused)
    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 105
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 2


async def test_keys_committed_before_are_duplicates_in_a_batch(engine: AsyncEngine) -> None:
    # Given a completed key and a failed one
    await process_batch(engine, [requested("p1")], UNIT)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, routing_key)"
                " SELECT handler, 'p9', fingerprint, 'failed', routing_key FROM inbox"
            )
        )

    # When a batch brings both again (p9 with p1's body, so the same fingerprint) and a new one
    again = requested("p1")
    failed = envelope(payments, REQUESTED, payment("p1"), "p9")
    ends = await process_batch(engine, [again, failed, requested("p2")], UNIT)

    # Then only the new one runs
    assert ends == [Outcome.DUPLICATE, Outcome.DUPLICATE_OF_FAILED, Outcome.PROCESSED]
    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 200


async def test_plain_and_batch_handlers_share_one_transaction(engine: AsyncEngine) -> None:
    # Given a router with a batch handler and a plain one that records what it saw
    router = Router()
    calls: list[tuple[str, int]] = []

    @router.batch_handler("many")
    async def many(bodies: list[int], batch: Batch) -> list[int]:
        calls.append(("many", len(bodies)))
        for body, ctx in zip(bodies, batch, strict=True):
            ctx.publish("many.done", {"n": body})
        return [body * 2 for body in bodies]

    @router.handler("one")
    async def one(body: int, ctx: Context) -> int:
        calls.append(("one", body))
        return body

    batch = [envelope(router, "many", n, f"m{n}") for n in (3, 1, 2)]
    batch += [envelope(router, "one", n, f"o{n}") for n in (5, 6)]

    # When they are processed together
    ends = await process_batch(engine, batch, UNIT)

    # Then the batch handler ran once for its three, in key order; the plain one per message
    assert ends == [Outcome.PROCESSED] * 5
    assert calls == [("many", 3), ("one", 5), ("one", 6)]
    results = dict(await rows(engine, "SELECT key, result FROM inbox"))
    assert results == {"m1": 2, "m2": 4, "m3": 6, "o5": 5, "o6": 6}
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 3


async def test_a_batch_handler_must_return_one_result_per_body(engine: AsyncEngine) -> None:
    router = Router()

    @router.batch_handler("many")
    async def many(bodies: list[int], batch: Batch) -> list[int]:
        return [0]

    batch = [envelope(router, "many", n, f"m{n}") for n in (1, 2)]
    with pytest.raises(HandlerFailed, match="returned 1 results for 2 messages"):
        await process_batch(engine, batch, UNIT)
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0


async def test_concurrent_batches_over_the_same_keys_neither_deadlock_nor_repeat(
    engine: AsyncEngine,
) -> None:
    # Given 40 payments over 5 accounts, sent as four batches in four different orders at once
    rng = random.Random(3)
    bodies = [(f"p{i}", f"acct-{i % 5}", rng.randint(1, 99)) for i in range(40)]
    batches = []
    for _ in range(4):
        order = bodies[:]
        rng.shuffle(order)
        batches.append([requested(p, account, cents) for p, account, cents in order])

    # When they run concurrently (deadlocks would surface as errors or as a hang)
    ends = await asyncio.wait_for(
        asyncio.gather(*(process_batch(engine, batch, UNIT) for batch in batches)),
        timeout=30,
    )

    # Then every payment ran exactly once, in whichever batch claimed it first
    processed = sum(end is Outcome.PROCESSED for batch_ends in ends for end in batch_ends)
    assert processed == 40
    expected: dict[str, int] = {}
    for _, account, cents in bodies:
        expected[account] = expected.get(account, 0) + cents
    assert dict(await rows(engine, "SELECT account, balance_cents FROM accounts")) == expected


async def publish_all(
    amqp: AbstractRobustConnection, settings: Settings, sends: list[tuple[str, dict[str, Any]]]
) -> None:
    channel = await amqp.channel(publisher_confirms=True)
    await declare_topology(channel, settings, payments.routing_keys())
    exchange = await channel.get_exchange(settings.exchange)
    for key, body in sends:
        await exchange.publish(
            Message(json.dumps(body).encode(), headers={"idempotency-key": key}, message_id=key),
            routing_key=REQUESTED,
        )
    await channel.close()


async def test_a_failing_message_in_a_batch_alone_takes_the_failure_path(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given 60 payments queued before the worker starts, one of which reuses another's payment
    # id under a new key (the ledger refuses it), and a duplicate delivery
    sends = [(f"k{i}", payment(f"p{i}", f"acct-{i % 3}", 10)) for i in range(60)]
    sends.insert(30, ("k-bad", payment("p7", "acct-1", 10)))
    sends.insert(40, ("k5", payment("p5", "acct-2", 10)))
    await publish_all(amqp, settings, sends)

    # When a worker with batches of up to 16 drains them
    async with running_worker(settings.replace(batch_size=16, relay=False), payments) as worker:

        async def drained() -> bool:
            return (
                sum(
                    worker.stats[s] for s in (Count.PROCESSED, Count.DUPLICATE, Count.DEAD_LETTERED)
                )
                >= 62
            )

        await wait_until(drained)

    # Then the 60 took effect once, only the bad one was parked, taken out of its batch while
    # the rest of that batch committed together, and batches were acked together
    assert worker.stats[Count.PROCESSED] == 60
    assert worker.stats[Count.DUPLICATE] == 1
    assert worker.stats[dead_lettered_because(Reason.HANDLER_ERROR)] == 1
    assert worker.stats[Count.ISOLATED] <= 1  # (0 only if the bad one came in a batch of its own)
    assert worker.stats[Count.BATCH_RETRIED_ALONE] == 0
    assert worker.stats[Count.BATCHES] >= 1
    assert worker.stats[Count.MULTIPLE_ACKS] >= 1
    assert await scalar(engine, "SELECT sum(balance_cents) FROM accounts") == 600
    failed = await rows(engine, "SELECT key, error FROM inbox WHERE status = 'failed'")
    assert [(r.key, r.error.split(":")[0]) for r in failed] == [("k-bad", "DuplicatePayment")]
    assert await broker_depth(settings.queue) == 0
    assert await broker_depth(settings.dead_letter_queue) == 1


async def test_a_crash_mid_batch_acks_nothing_and_the_restart_applies_each_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    # Given 50 payments queued, a worker that dies just before its first batch commits
    sends = [(f"k{i}", payment(f"p{i}", f"acct-{i % 4}", i + 1)) for i in range(50)]
    await publish_all(amqp, settings, sends)
    log = tmp_path / "worker.log"
    env = {
        "WORKER_HANDLERS": "examples.payments",
        "WORKER_BATCH_SIZE": "20",
        "WORKER_RELAY": "false",
    }
    with worker_process(settings, log, WORKER_CRASH_AT=UNIT_OF_WORK_BEFORE_COMMIT, **env) as dying:
        returncode = await asyncio.to_thread(dying.wait, 30)
    assert returncode == -signal.SIGKILL

    # Then nothing was committed or acked: every message is back in the queue
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
    assert await broker_depth(settings.queue) == 50

    # When a healthy worker runs
    with worker_process(settings, log, **env) as worker:
        await wait_for_consumer(amqp, settings.queue)

        async def done() -> bool:
            return await scalar(engine, "SELECT count(*) FROM ledger_entries") == 50

        await wait_until(done)
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0

    # Then each payment took effect once and the queue is empty
    assert await scalar(engine, "SELECT sum(balance_cents) FROM accounts") == sum(range(1, 51))
    assert await broker_depth(settings.queue) == 0
