"""The inventory's handlers, run by the worker's pytest plugin against a real PostgreSQL.

``worker_harness`` delivers a message exactly as the worker would (the idempotency key, one
transaction, the outbox), on a scratch database migrated for the worker and for
``inventory.handlers`` (named by ``worker_handlers`` in pyproject.toml), emptied before each test.
"""

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine
from worker.testing import Harness

from inventory.tables import stock_levels

RECEIVED = {"sku": "apple", "quantity": 5}


async def on_hand(engine: AsyncEngine, sku: str) -> int | None:
    async with engine.connect() as conn:
        return await conn.scalar(select(stock_levels.c.on_hand).where(stock_levels.c.sku == sku))


async def test_a_delivery_received_twice_counts_once(
    worker_harness: Harness, worker_engine: AsyncEngine
) -> None:
    first = await worker_harness.deliver("stock.received", RECEIVED, key="delivery-1")
    again = await worker_harness.deliver("stock.received", RECEIVED, key="delivery-1")

    assert (first.outcome, again.outcome) == ("processed", "duplicate")
    assert await on_hand(worker_engine, "apple") == 5


async def test_a_change_is_published(worker_harness: Harness) -> None:
    await worker_harness.deliver("stock.received", RECEIVED, key="delivery-1")
    await worker_harness.deliver("stock.received", RECEIVED, key="delivery-2")

    assert [(e.routing_key, e.body) for e in worker_harness.published] == [
        ("stock.changed", {"sku": "apple", "on_hand": 5}),
        ("stock.changed", {"sku": "apple", "on_hand": 10}),
    ]


async def test_a_reservation_beyond_the_stock_is_parked(
    worker_harness: Harness, worker_engine: AsyncEngine
) -> None:
    await worker_harness.deliver("stock.received", RECEIVED, key="delivery-1")

    refused = await worker_harness.deliver(
        "stock.reserved", {"sku": "apple", "quantity": 6}, key="order-1"
    )

    assert (refused.outcome, refused.reason, refused.exception_type) == (
        "dead_lettered",
        "handler-error",
        "OutOfStock",
    )
    assert [letter.key for letter in worker_harness.dead_letters] == ["order-1"]
    assert await on_hand(worker_engine, "apple") == 5  # nothing taken
    assert [e.body["on_hand"] for e in worker_harness.published] == [5]  # nothing announced


async def test_a_reservation_takes_from_the_stock(worker_harness: Harness) -> None:
    await worker_harness.deliver("stock.received", RECEIVED, key="delivery-1")

    reserved = await worker_harness.deliver(
        "stock.reserved", {"sku": "apple", "quantity": 5}, key="order-1"
    )

    assert reserved.outcome == "processed"
    assert reserved.result == {"sku": "apple", "on_hand": 0}
