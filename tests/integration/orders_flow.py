"""The orders example driven from outside, as its clients and its carrier would: place an order,
confirm its shipping, let its wait run out (by moving its deadline in SQL, never by sleeping),
and read back what it did, so that each test can assert that every effect happened once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractQueue
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders.gateway import charge_id_for, refund_id_for
from tests.helpers import rows, scalar
from tests.integration.support import publish
from worker.settings import Settings
from worker.sql.outbox import OUTBOX_CHANNEL, SCHEDULED_NOTICE

EVENTS = ("order.shipped", "order.cancelled")

EXPIRE_WAIT = f"""
WITH expired AS (
    UPDATE workflow_waits SET due_at = now()
    WHERE key = :key AND outcome IS NULL
    RETURNING timer_id
), timers AS (
    UPDATE outbox_scheduled SET due_at = now()
    WHERE message_id IN (SELECT timer_id FROM expired)
    RETURNING id
)
SELECT (SELECT count(*) FROM expired), (SELECT count(*) FROM timers),
       pg_notify('{OUTBOX_CHANNEL}', '{SCHEDULED_NOTICE}')
"""
"""The wait's deadline and its timer's due time moved to now, as if the timeout had passed;
the relay is woken as by a commit that scheduled events."""


def order(order_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "sku": "tea",
        "quantity": 2,
        "amount_cents": 700,
        "account": "ann",
        **fields,
    }


def key_of(order_id: str) -> str:
    return f"order-{order_id}"


async def place_order(channel: AbstractChannel, settings: Settings, order_id: str) -> None:
    await publish(
        channel, settings, order(order_id), key=key_of(order_id), routing_key="order.placed"
    )


async def confirm_shipping(
    channel: AbstractChannel, settings: Settings, order_id: str, tracking: str = "TRK-1"
) -> None:
    """The carrier's ``shipping.confirmed``; its message id is its idempotency key."""
    await publish(
        channel,
        settings,
        {"order_id": order_id, "tracking": tracking},
        message_id=f"confirmed-{order_id}-{tracking}",
        routing_key="shipping.confirmed",
    )


async def events_queue(channel: AbstractChannel, settings: Settings) -> AbstractQueue:
    """A queue of this test's own that gets every ``order.shipped`` and ``order.cancelled``."""
    queue = await channel.declare_queue(f"{settings.queue}.order-events", exclusive=True)
    for routing_key in EVENTS:
        await queue.bind(settings.exchange, routing_key)
    return queue


async def drain(queue: AbstractQueue) -> list[tuple[str, str]]:
    """(routing key, order id) of every message in ``queue``, taken off it."""
    events = []
    while (message := await queue.get(fail=False, no_ack=True)) is not None:
        events.append((message.routing_key or "", json.loads(message.body)["order_id"]))
    return events


async def waiting(engine: AsyncEngine, order_id: str) -> bool:
    """The order's workflow waits for its confirmation, holding no lease and no owner."""
    found = await rows(
        engine,
        "SELECT i.owner, w.outcome FROM inbox i JOIN workflow_waits w USING (handler, key)"
        " WHERE i.key = :key AND i.status = 'in_progress'",
        key=key_of(order_id),
    )
    return [(row.owner, row.outcome) for row in found] == [(None, None)]


async def expire_wait(engine: AsyncEngine, order_id: str, *, racing: bool = False) -> None:
    """Move the open wait's deadline and its timer to now, and wake the relay. Unless
    ``racing`` (a confirmation may have resolved the wait already), there is one of each."""
    async with engine.begin() as conn:
        expired, timers, _ = (
            await conn.execute(text(EXPIRE_WAIT), {"key": key_of(order_id)})
        ).one()
    assert racing or (expired, timers) == (1, 1)


async def completed(engine: AsyncEngine, order_id: str) -> bool:
    status = await scalar(engine, "SELECT status FROM inbox WHERE key = :key", key=key_of(order_id))
    return bool(status == "completed")


async def relayed(engine: AsyncEngine) -> bool:
    return await scalar(engine, "SELECT count(*) FROM outbox") == 0


@dataclass(frozen=True)
class Effects:
    """Everything the order's workflow did, read back from the database."""

    result: dict[str, Any]
    reserved: int
    released: int
    charges: set[str]
    refunds: set[str]
    refund_calls: int


async def effects(engine: AsyncEngine, order_id: str) -> Effects:
    key = key_of(order_id)
    result = await scalar(engine, "SELECT result FROM inbox WHERE key = :key", key=key)
    reservations = await rows(
        engine,
        "SELECT released_at IS NOT NULL AS released FROM reservations WHERE order_id = :o",
        o=order_id,
    )
    calls = await rows(
        engine,
        "SELECT operation, charge_id, refund_id FROM gateway_calls"
        " WHERE idempotency_key LIKE :prefix",
        prefix=f"{key}:%",
    )
    return Effects(
        result=result if isinstance(result, dict) else json.loads(result or "{}"),
        reserved=len(reservations),
        released=sum(row.released for row in reservations),
        charges={row.charge_id for row in calls if row.operation == "charge"},
        refunds={row.refund_id for row in calls if row.operation == "refund"},
        refund_calls=sum(row.operation == "refund" for row in calls),
    )


def shipped_once(found: Effects, order_id: str, tracking: str = "TRK-1") -> bool:
    """Reserved, charged and kept: the confirmation resumed the workflow, the timeout did not."""
    key = key_of(order_id)
    return (
        found.result.get("status") == "shipped"
        and found.result.get("tracking") == tracking
        and (found.reserved, found.released) == (1, 0)
        and found.charges == {charge_id_for(f"{key}:charge_payment")}
        and found.refunds == set()
    )


def cancelled_once(found: Effects, order_id: str) -> bool:
    """Reserved and released once, charged once and refunded once (however many refund calls a
    re-run made, all under the one step key)."""
    key = key_of(order_id)
    refund_id = refund_id_for(f"{key}:refund_payment")
    return (
        found.result.get("status") == "cancelled"
        and found.result.get("refund_id") == refund_id
        and (found.reserved, found.released) == (1, 1)
        and found.charges == {charge_id_for(f"{key}:charge_payment")}
        and found.refunds == {refund_id}
    )
