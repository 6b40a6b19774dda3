"""Recipe: publish through the outbox from synchronous code (a Django or Flask view): the write
and its event in one transaction on an asyncio engine, run to its end from the synchronous
caller (docs/recipes/web-frameworks.md)."""

from __future__ import annotations

import asyncio

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.pool import NullPool

from examples.shop.tables import shop_orders
from worker import outbox


async def _place_order(order: dict[str, str | int]) -> str | None:
    # NullPool: each asyncio.run() is an event loop of its own, and a pooled asyncpg connection
    # cannot move from one loop to the next. One connection per call, closed at its end.
    engine = outbox.engine_from_env(poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            inserted = await conn.scalar(
                insert(shop_orders)
                .values(**order)
                .on_conflict_do_nothing()
                .returning(shop_orders.c.order_id)
            )
            if inserted is None:
                return None  # placed before: its event was published with it
            event = await outbox.publish(conn, "order.placed", order, key=str(order["order_id"]))
            return str(event)
    finally:
        await engine.dispose()


def place_order(order: dict[str, str | int]) -> str | None:
    """Record ``order`` and its ``order.placed`` event, both or neither; the event's message id,
    or None for an order placed before. For synchronous code only: inside a running event loop
    (an async view), write the transaction with ``await``, as the FastAPI example does."""
    return asyncio.run(_place_order(order))
