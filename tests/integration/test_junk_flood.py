"""A flood of junk ahead of good work, against the real PostgreSQL and RabbitMQ: every junk
message is parked exactly once with its record, at full speed (the throttle at its default is for
handler failures), and the good messages behind it are applied exactly once."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections import Counter

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import payment, rows, wait_until
from tests.integration.support import RunningWorker, ready_messages, running_worker
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, ROUTING_KEY_HEADER
from worker.settings import Settings
from worker.telemetry import Count
from worker.transport.dead_letters import PARKING_ID, REASON

JUNK = 10_000
GOOD = 50
MAX_BODY = 4096
HANG_GUARD = 150.0
"""Seconds the flood may take before the test calls it hung, within pytest's 180 s (it takes a
few; a throttled consumer, one junk message a second, would take hours)."""

KINDS = {
    "undecodable": (b"\xff\xfe not json", "payment.requested", "undecodable"),
    "invalid": (b'{"not": "a payment"}', "payment.requested", "invalid"),
    "no-handler": (b'{"amount_cents": 1}', "nobody.handles.this", "no-handler"),
    "too-large": (b"x" * (MAX_BODY + 1), "payment.requested", "body-too-large"),
}
"""Junk by kind: its body, the routing key it claims, the reason it is parked for."""


def junk(n: int) -> tuple[aio_pika.Message, str]:
    """The ``n``-th junk message (the kinds in turn) and the reason it must be parked for."""
    kind = list(KINDS)[n % len(KINDS)]
    body, routing_key, reason = KINDS[kind]
    key = f"junk-{kind}-{n}"
    headers = {IDEMPOTENCY_KEY_HEADER: key, ROUTING_KEY_HEADER: routing_key}
    return aio_pika.Message(body, message_id=key, headers=headers), reason


async def publish_confirmed(
    channel: AbstractChannel, queue: str, messages: list[aio_pika.Message]
) -> None:
    """Publish ``messages`` to ``queue`` through the default exchange, 1000 confirms at a time."""
    pending = iter(messages)
    while window := list(itertools.islice(pending, 1000)):
        await asyncio.gather(*(channel.default_exchange.publish(m, queue) for m in window))


async def parked_copies(channel: AbstractChannel, queue: str, count: int) -> list[Counter[str]]:
    """Consume ``count`` copies from the DLQ ``queue``: how often each message id, and each
    (message id, reason, parking id) came."""
    ids, parked = Counter[str](), Counter[str]()
    done = asyncio.get_running_loop().create_future()

    async def take(message: AbstractIncomingMessage) -> None:
        headers = message.headers
        ids[str(message.message_id)] += 1
        parked[f"{message.message_id} {headers.get(REASON)} {headers.get(PARKING_ID)}"] += 1
        if ids.total() >= count and not done.done():
            done.set_result(None)

    dlq = await channel.get_queue(queue)
    tag = await dlq.consume(take, no_ack=True)
    try:
        await asyncio.wait_for(done, 120)
    finally:
        await dlq.cancel(tag)
    return [ids, parked]


async def _ended(worker: RunningWorker) -> bool:
    return worker.stats[Count.DEAD_LETTERED] >= JUNK and worker.stats[Count.PROCESSED] >= GOOD


async def test_a_junk_flood_is_parked_once_each_at_full_speed_and_good_work_behind_it_applies(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a worker with its throttle at the default, and 10,000 junk messages of every kind
    # (no JSON, an invalid body, no handler, too large) ahead of good payments in its queue
    settings = settings.replace(max_body_bytes=MAX_BODY, relay=False)
    assert settings.failure_throttle_after > 0
    sent = [junk(n) for n in range(JUNK)]
    goods = [payment(f"good-{n}", account=f"acct-{n % 7}") for n in range(GOOD)]
    channel = await amqp.channel(publisher_confirms=True)
    async with running_worker(settings, payments) as worker:
        await publish_confirmed(channel, settings.queue, [m for m, _ in sent])
        await publish_confirmed(
            channel,
            settings.queue,
            [
                aio_pika.Message(
                    json.dumps(body).encode(),
                    message_id=str(uuid.uuid4()),
                    headers={
                        IDEMPOTENCY_KEY_HEADER: f"k-{body['payment_id']}",
                        ROUTING_KEY_HEADER: "payment.requested",
                    },
                )
                for body in goods
            ],
        )

        # When the worker has worked through them (the bound only tells a hang)
        await wait_until(lambda: _ended(worker), timeout=HANG_GUARD, interval=0.2)
        ids, parked = await parked_copies(channel, settings.dead_letter_queue, JUNK)
        assert await ready_messages(channel, settings.dead_letter_queue) == 0
        assert await ready_messages(channel, settings.queue) == 0
        stats = dict(worker.stats)

    # Then every junk message is in the DLQ exactly once, with its reason and its own record
    assert ids == Counter(m.message_id for m, _ in sent)
    records = await rows(engine, "SELECT parking_id::text, key, reason FROM dead_letters")
    by_id = {parking_id: (key, reason) for parking_id, key, reason in records}
    assert len(records) == JUNK
    expected = {m.message_id: reason for m, reason in sent}
    for entry, times in parked.items():
        message_id, reason, parking_id = entry.split(" ")
        assert times == 1
        assert reason == expected[message_id], entry
        assert by_id[parking_id][1] == reason, entry
    assert stats[Count.DEAD_LETTERED] == JUNK, stats
    # and no junk message slowed the worker down: it never throttled
    assert stats.get(Count.THROTTLED, 0) == 0, stats
    # and every good payment is applied exactly once
    ledger = await rows(engine, "SELECT payment_id FROM ledger_entries ORDER BY payment_id")
    assert sorted(p for (p,) in ledger) == sorted(str(g["payment_id"]) for g in goods)
    completed = await rows(engine, "SELECT key FROM inbox WHERE status = 'completed'")
    assert len(completed) == GOOD
