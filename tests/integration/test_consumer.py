"""The consumer end to end against the real PostgreSQL and RabbitMQ: effects once, acks after
commit, and every bad message parked in the dead-letter queue with its reason."""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections import Counter
from typing import Any

import aio_pika
import pytest
from aio_pika import Message
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import payment, rows, scalar, wait_until
from tests.integration.support import (
    dead_letters,
    publish,
    queue_empty,
    ready_messages,
    running_worker,
)
from worker import Context, Router
from worker.settings import Settings
from worker.telemetry import Count


async def test_a_burst_with_duplicates_changes_each_balance_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given 300 payments, a quarter of them delivered twice, some with only a message_id
    rng = random.Random(7)
    unique = [payment(f"p{i}", f"acct-{rng.randrange(4)}", rng.randint(1, 500)) for i in range(240)]
    sends = unique + [rng.choice(unique) for _ in range(60)]
    rng.shuffle(sends)
    expected: dict[str, int] = {}
    for p in unique:
        expected[p["account"]] = expected.get(p["account"], 0) + p["amount_cents"]

    async with running_worker(settings, payments):
        channel = await amqp.channel(publisher_confirms=True)
        for i, p in enumerate(sends):
            if i % 3:
                await publish(channel, settings, p, key=p["payment_id"])
            else:
                await publish(channel, settings, p, message_id=p["payment_id"])

        async def all_noticed() -> bool:
            return await scalar(engine, "SELECT count(*) FROM settlement_notices") == len(unique)

        # (each settlement's event comes back through the relay to the notice handler)
        await wait_until(all_noticed)
        await wait_until(lambda: queue_empty(channel, settings.queue))

    balances = dict(await rows(engine, "SELECT account, balance_cents FROM accounts"))
    assert balances == expected
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == 240
    completed = "SELECT count(*) FROM inbox WHERE status = 'completed'"
    assert await scalar(engine, completed) == 240 * 2  # each payment, and each payment's event
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 0
    assert await ready_messages(channel, settings.queue) == 0  # everything was acked
    assert await dead_letters(channel, settings) == []


def _failing_router() -> Router:
    router = Router()

    @router.handler("always.fails")
    async def always_fails(body: dict[str, Any], ctx: Context) -> None:
        raise LookupError("no such customer")

    router.include(payments)
    return router


async def test_bad_messages_are_parked_with_a_reason_and_the_worker_keeps_going(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    settings = settings.replace(max_body_bytes=2048)
    router = _failing_router()
    cases: dict[str, str] = {}  # message_id -> expected reason

    async with running_worker(settings, router):
        channel = await amqp.channel(publisher_confirms=True)

        async def send(reason: str, body: Any, **kwargs: Any) -> None:
            case = f"{reason}-{len(cases)}"
            cases[case] = reason
            kwargs.setdefault("key", case)
            kwargs.setdefault("message_id", case)
            await publish(channel, settings, body, headers={"test-case": case}, **kwargs)

        await send("undecodable", b"{not json")
        await send("undecodable", b"\xff\xfe\x00")
        await send("undecodable", b"NaN")
        await send("undecodable", b"<xml/>", content_type="application/xml")
        await send("invalid", payment("p-zero", amount_cents=0))
        await send("invalid", {"payment_id": "p-str", "account": "a", "amount_cents": "100"})
        await send("invalid", {"payment_id": "p-missing"})
        # (a message with no key at all cannot be sent with aio-pika, which always sets a
        # message_id; test_envelope covers that case)
        await send("invalid-key", payment("p-longkey"), key="k" * 600)
        await send("body-too-large", {"pad": "x" * 4096})
        await send("handler-error", {"any": 1}, routing_key="always.fails")
        # a routing key no handler serves, delivered straight to the work queue
        cases["no-handler"] = "no-handler"
        await channel.default_exchange.publish(
            Message(b"{}", headers={"idempotency-key": "x", "test-case": "no-handler"}),
            routing_key=settings.queue,
        )
        # the same key twice with different payloads: the second is parked
        await publish(
            channel,
            settings,
            payment("p-orig", amount_cents=10),
            key="reused",
            message_id="reused-first",
        )
        await wait_until(lambda: _inbox_has(engine, "reused"))
        await send("key-reused", payment("p-orig", amount_cents=99), key="reused")
        # and a good message after all of that is still processed
        await publish(channel, settings, payment("p-good", "bob", 5), key="good")

        parked: list[AbstractIncomingMessage] = []

        async def all_parked() -> bool:
            parked.extend(await dead_letters(channel, settings))
            return len(parked) >= len(cases)

        await wait_until(all_parked)
        await wait_until(lambda: _inbox_has(engine, "good"))

    by_id = {m.headers["test-case"]: m for m in parked}
    assert len(parked) == len(cases)
    assert set(by_id) == set(cases)
    for case, reason in cases.items():
        headers = by_id[case].headers
        assert headers["x-worker-reason"] == reason, case
        assert headers["x-worker-error"]
        assert headers["x-worker-original-exchange"] in (settings.exchange, "")
    assert by_id["key-reused-11"].headers["x-worker-error"] == (
        "idempotency key reused with a different payload"
    )
    assert by_id["handler-error-9"].headers["x-worker-handler"] == "always.fails"
    assert by_id["handler-error-9"].headers["x-worker-exception-type"] == "LookupError"
    assert by_id["undecodable-0"].body == b"{not json"  # the body is kept as it came
    assert by_id["invalid-4"].headers["x-worker-original-routing-key"] == "payment.requested"
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='alice'") == 10
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='bob'") == 5


async def _inbox_has(engine: AsyncEngine, key: str) -> bool:
    return bool(await scalar(engine, "SELECT count(*) FROM inbox WHERE key = :k", k=key))


async def test_topology_is_declared_idempotently_and_bound_per_handler(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    router = _failing_router()
    async with running_worker(settings, router):
        pass
    async with running_worker(settings, router):  # a second start redeclares without conflict
        channel = await amqp.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(settings.exchange)
        # routable: each handler's routing key is bound
        for key in ("payment.requested", "always.fails"):
            await exchange.publish(Message(b"{}", message_id=f"route-{key}"), routing_key=key)
        # not routable: nothing is bound for it
        with pytest.raises(aio_pika.exceptions.PublishError):
            await exchange.publish(Message(b"{}"), routing_key="nobody.listens")
        await channel.get_queue(settings.dead_letter_queue)


async def unacked(queue: str) -> int:
    """Deliveries of ``queue`` the broker counts as unacknowledged."""
    listing = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "list_queues", "name", "messages_unacknowledged"],
        capture_output=True,
        text=True,
        check=True,
    )
    counts = dict(line.split("\t") for line in listing.stdout.splitlines())
    return int(counts[queue])


async def test_acks_held_behind_a_delivery_in_flight_are_sent_when_the_worker_stops(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a handler that holds the first delivery in its transaction until told, and a worker
    # running one message per transaction on two consumer tasks
    router = Router()
    release = asyncio.Event()

    @router.handler("gate")
    async def gate(body: str, ctx: Context) -> None:
        if body == "wait":
            await release.wait()

    quick = settings.replace(batch_size=1, concurrency=2, shutdown_grace=0.5, relay=False)
    async with running_worker(quick, router) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, "wait", key="k-wait", routing_key="gate")
        for n in range(5):
            await publish(channel, settings, f"go-{n}", key=f"k{n}", routing_key="gate")

        # When the five after it commit while it is still in flight
        await wait_until(lambda: _at_least(worker.stats, "processed", 5))

        # Then their acks wait for it (one multiple-ack would settle them with it)
        assert await unacked(settings.queue) == 6

        # And when the worker stops before it ends (rolled back after the grace period)
        await worker.shutdown()
    release.set()

    # Then the five were acked on the way out: only the one rolled back is queued again
    assert worker.stats[Count.PROCESSED] == 5
    assert await ready_messages(channel, settings.queue) == 1
    assert await unacked(settings.queue) == 0
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE handler = 'gate'") == 5


async def _at_least(stats: Counter[str], name: str, count: int) -> bool:
    return stats[name] >= count
