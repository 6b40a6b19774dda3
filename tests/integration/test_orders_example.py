"""The orders example without the workflow engine: its migration, its stock helper and its fake
payment gateway."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import FakeGateway, add_stock
from examples.orders import router as orders
from examples.orders.gateway import charge_id_for
from examples.orders.tables import gateway_calls, metadata, stock
from tests.integration.support import (
    BASE,
    inspect_database,
    require_services,
    schema_diff,
    table_names,
)
from worker import schema, testing

ORDERS_TABLES = {"stock", "reservations", "shipments", "gateway_calls"}


def test_the_migration_builds_the_tables_it_declares_and_undoes_them() -> None:
    require_services()
    with testing.empty_database(BASE, prefix="worker_orders_migrations") as empty:
        # When the worker's and the orders example's migrations run on an empty database
        schema.upgrade(empty, orders)

        # Then the example's tables are exactly its metadata, in a history of their own
        assert inspect_database(empty, schema_diff(metadata)) == []
        assert ORDERS_TABLES | {"alembic_version_orders"} <= inspect_database(empty, table_names)

        # And downgrading removes them
        schema.downgrade(empty, orders)
        assert not ORDERS_TABLES & inspect_database(empty, table_names)


async def test_add_stock_creates_the_row_then_adds_to_it(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        assert await add_stock(conn, "sku-1", 3) == 3
        assert await add_stock(conn, "sku-1", 4) == 7
        assert await conn.scalar(select(stock.c.available).where(stock.c.sku == "sku-1")) == 7


async def test_the_gateway_records_every_call_and_charges_once_per_key(
    engine: AsyncEngine,
) -> None:
    gateway = FakeGateway(engine)

    # When the same key is used three times and another key once
    first = await gateway.charge(idempotency_key="order-1:charge_payment", amount_cents=500)
    again = [
        await gateway.charge(idempotency_key="order-1:charge_payment", amount_cents=500)
        for _ in range(2)
    ]
    other = await gateway.charge(idempotency_key="order-2:charge_payment", amount_cents=500)

    # Then every call with the key got the same charge, and another key another one
    assert again == [first, first]
    assert first == charge_id_for("order-1:charge_payment")
    assert other != first

    # And each call has its row
    async with engine.connect() as conn:
        calls = (
            await conn.execute(
                select(
                    gateway_calls.c.idempotency_key,
                    func.count(),
                    func.min(gateway_calls.c.charge_id),
                )
                .group_by(gateway_calls.c.idempotency_key)
                .order_by(gateway_calls.c.idempotency_key)
            )
        ).all()
    assert [tuple(row) for row in calls] == [
        ("order-1:charge_payment", 3, first),
        ("order-2:charge_payment", 1, other),
    ]


async def test_a_call_stays_recorded_when_the_callers_transaction_rolls_back(
    engine: AsyncEngine,
) -> None:
    # Given a caller whose transaction calls the gateway and then rolls back
    gateway = FakeGateway(engine)
    async with engine.connect() as caller:
        await caller.begin()
        await add_stock(caller, "sku-1", 1)
        await gateway.charge(idempotency_key="order-3:charge_payment", amount_cents=700)
        await caller.rollback()

    # Then the caller's write is gone, and the gateway's record of the call is not
    async with engine.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(stock)) == 0
        keys = (await conn.scalars(select(gateway_calls.c.idempotency_key))).all()
    assert keys == ["order-3:charge_payment"]
