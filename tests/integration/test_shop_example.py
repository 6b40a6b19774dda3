"""The shop example against the real services and a real uvicorn server: its migration, its
answers, one order row and one event per order however often a client retries, and the order
fulfilled end to end by the orders example through the outbox and the relay."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import add_stock
from examples.orders import router as orders
from examples.shop import router as shop
from examples.shop.app import create_app
from examples.shop.tables import metadata
from tests.helpers import rows, scalar, wait_until
from tests.integration.support import (
    BASE,
    inspect_database,
    require_services,
    running_worker,
    schema_diff,
    table_names,
)
from worker import schema, testing
from worker.settings import Settings


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """``app`` under a real uvicorn server on a free port, and a client of it."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: _started(server, task))
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield client
    finally:
        server.should_exit = True
        await task


async def _started(server: uvicorn.Server, task: asyncio.Task[None]) -> bool:
    if task.done():
        task.result()  # raises what stopped it
    return server.started


def order(order_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "sku": "widget",
        "quantity": 2,
        "amount_cents": 500,
        "account": "alice",
        **fields,
    }


def test_the_migration_builds_the_table_it_declares_and_undoes_it() -> None:
    require_services()
    with testing.empty_database(BASE, prefix="worker_shop_migrations") as empty:
        schema.upgrade(empty, shop)
        assert inspect_database(empty, schema_diff(metadata)) == []
        assert {"shop_orders", "alembic_version_shop"} <= inspect_database(empty, table_names)
        schema.downgrade(empty, shop)
        assert "shop_orders" not in inspect_database(empty, table_names)


async def test_an_order_and_its_event_are_written_once_however_often_it_is_sent(
    engine: AsyncEngine,
) -> None:
    async with serving(create_app(engine)) as client:
        # When a client sends an order, then retries it
        first = await client.post("/orders", json=order("o-1"))
        again = await client.post("/orders", json=order("o-1"))

        # Then the first answer is 201 with the event's id, the retry 200 with none
        assert first.status_code == 201
        assert again.status_code == 200
        assert again.json() == {"order_id": "o-1", "event": None}

        # And another order under the same id is refused, an invalid one too, writing nothing
        assert (await client.post("/orders", json=order("o-1", quantity=3))).status_code == 409
        assert (await client.post("/orders", json=order("o-2", quantity="2"))).status_code == 422

    assert await scalar(engine, "SELECT count(*) FROM shop_orders") == 1
    (event,) = await rows(engine, "SELECT message_id, routing_key, headers FROM outbox")
    assert str(event.message_id) == first.json()["event"]
    assert event.routing_key == "order.placed"
    assert event.headers == {"idempotency-key": "o-1"}


async def test_an_order_placed_through_the_api_is_fulfilled_once(
    engine: AsyncEngine, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given stock, and the app publishing to this test's exchange (the worker's setting)
    monkeypatch.setenv("WORKER_EXCHANGE", settings.exchange)
    async with engine.begin() as conn:
        await add_stock(conn, "widget", 10)

    # When a client places an order twice while the orders example runs with its relay
    async with running_worker(settings, orders), serving(create_app(engine)) as client:
        for _ in range(2):
            assert (await client.post("/orders", json=order("o-9"))).status_code in (200, 201)
        await wait_until(lambda: _waiting_for_the_carrier(engine))

    # Then it was reserved, charged and shipped once, and waits for the shipping confirmation
    assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'widget'") == 8
    assert await scalar(engine, "SELECT count(*) FROM gateway_calls") == 1
    assert await scalar(engine, "SELECT count(*) FROM shipments") == 1


async def _waiting_for_the_carrier(engine: AsyncEngine) -> bool:
    waits = await rows(engine, "SELECT correlation, outcome FROM workflow_waits")
    return [tuple(wait) for wait in waits] == [("o-9", None)]
