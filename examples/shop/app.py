"""The shop's API: ``POST /orders`` records an order and announces it, atomically.

Run it with ``uvicorn --factory examples.shop.app:create_app`` (``WORKER_DATABASE_URL`` names
the database) and the worker with ``--handlers examples.orders``, which fulfils each
``order.placed`` event.

Invariant: an order row exists if and only if its ``order.placed`` event does. Both are written
in ONE transaction (``worker.outbox.publish`` on the endpoint's own connection); the relay
publishes the event after the commit. The order id is the event's idempotency key, so a client's
retry neither records the order twice nor announces it twice, and even an event published twice
(a relay crash between publish and delete) is fulfilled once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Response, status
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import OrderPlaced
from examples.shop.tables import shop_orders
from worker import outbox
from worker.database import create_engine
from worker.settings import Settings


def create_app(engine: AsyncEngine | None = None) -> FastAPI:
    """The shop's app on ``engine`` (default: one for ``WORKER_DATABASE_URL``, owned by the app
    and disposed of at its shutdown)."""
    owned = engine is None
    database = engine if engine is not None else create_engine(Settings.load(), pool_size=5)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:
            await database.dispose()

    app = FastAPI(title="shop (worker example)", lifespan=lifespan)

    @app.post("/orders", status_code=status.HTTP_201_CREATED)
    async def place_order(order: OrderPlaced, response: Response) -> dict[str, Any]:
        """Record the order and its ``order.placed`` event in one transaction. The same order
        again answers 200 with nothing written; another order under a taken id answers 409."""
        async with database.begin() as conn:
            inserted = await conn.scalar(
                insert(shop_orders)
                .values(**order.model_dump())
                .on_conflict_do_nothing()
                .returning(shop_orders.c.order_id)
            )
            if inserted is None:
                recorded = (
                    await conn.execute(
                        select(*[shop_orders.c[name] for name in OrderPlaced.model_fields]).where(
                            shop_orders.c.order_id == order.order_id
                        )
                    )
                ).one()
                if dict(recorded._mapping) != order.model_dump():
                    raise HTTPException(status.HTTP_409_CONFLICT, "order id taken by another order")
                response.status_code = status.HTTP_200_OK
                return {"order_id": order.order_id, "event": None}
            event = await outbox.publish(
                conn, "order.placed", order.model_dump(), key=order.order_id
            )
        return {"order_id": order.order_id, "event": str(event)}

    return app
