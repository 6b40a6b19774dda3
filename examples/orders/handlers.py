"""Orders: fulfil a placed order as a workflow of three steps, each committed on its own.

``order.placed`` → ``reserve_inventory`` (take the quantity off ``stock``, write the reservation)
→ ``charge_payment`` (charge the account through the payment gateway) → ``dispatch_shipping``
(write the shipment, emit ``order.shipped``). Each step runs in a transaction of its own, and a
redelivery never runs a committed step again: it gets the step's stored output instead.

The gateway is an external service: its charge cannot roll back with a transaction, and a step
that crashes after the call but before its commit runs again. The step therefore gives the
gateway ``ctx.step_key``, the same on every re-run, and the gateway charges once per key.
Step outputs are plain JSON values, since a resumed workflow gets them back decoded from JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from examples.orders.gateway import FakeGateway
from examples.orders.tables import metadata, reservations, shipments, stock
from worker import Context, Permanent, Router, Workflow

router = Router(
    "orders", migrations=Path(__file__).parent / "migrations" / "versions", metadata=metadata
)


class OrderPlaced(BaseModel):
    """The body of ``order.placed``. Types are strict: ``"2"`` is not a quantity."""

    model_config = ConfigDict(strict=True)

    order_id: str = Field(min_length=1)
    sku: str = Field(min_length=1)
    quantity: int = Field(gt=0)
    amount_cents: int = Field(gt=0)
    account: str = Field(min_length=1)


class OrderShipped(OrderPlaced):
    """The body of ``order.shipped``: the order, and the charge that paid for it."""

    charge_id: str


@router.workflow("order.placed", publishes={"order.shipped": OrderShipped})
async def fulfil_order(order: OrderPlaced, wf: Workflow) -> dict[str, Any]:
    """Reserve the stock, charge the account, dispatch the shipment: each step once."""
    reservation = await wf.step("reserve_inventory", reserve_inventory, order)
    charge = await wf.step("charge_payment", charge_payment, order, reservation)
    shipment = await wf.step("dispatch_shipping", dispatch_shipping, order, charge)
    return {
        "order_id": order.order_id,
        "reservation": reservation["reservation"],
        "charge_id": charge["charge_id"],
        "shipment": shipment["shipment"],
    }


async def reserve_inventory(ctx: Context, order: OrderPlaced) -> dict[str, Any]:
    """Take the order's quantity off the sku's stock and record the reservation.

    An unknown sku or too little stock is ``Permanent``: no retry makes the stock appear.
    """
    taken = await ctx.session.execute(
        update(stock)
        .where(stock.c.sku == order.sku, stock.c.available >= order.quantity)
        .values(available=stock.c.available - order.quantity)
        .returning(stock.c.available)
    )
    if taken.scalar_one_or_none() is None:
        available = await ctx.session.scalar(
            select(stock.c.available).where(stock.c.sku == order.sku)
        )
        if available is None:
            raise Permanent(f"unknown sku {order.sku!r}")
        raise Permanent(
            f"out of stock: {order.quantity} of {order.sku!r} wanted, {available} available"
        )
    await ctx.session.execute(
        insert(reservations).values(order_id=order.order_id, sku=order.sku, quantity=order.quantity)
    )
    return {"reservation": order.order_id, "sku": order.sku, "quantity": order.quantity}


async def charge_payment(
    ctx: Context, order: OrderPlaced, reservation: dict[str, Any]
) -> dict[str, Any]:
    """Charge the order's amount through the gateway, once per order whatever the re-runs.

    The gateway records the call whether or not this step's transaction commits; the step key
    makes a re-run after a crash return the first call's charge instead of charging again.
    """
    gateway = FakeGateway(ctx.connection.engine)
    charge_id = await gateway.charge(idempotency_key=ctx.step_key, amount_cents=order.amount_cents)
    return {"charge_id": charge_id, "reservation": reservation["reservation"]}


async def dispatch_shipping(
    ctx: Context, order: OrderPlaced, charge: dict[str, Any]
) -> dict[str, Any]:
    """Record the shipment and emit ``order.shipped``, ordered per account, in one commit."""
    await ctx.session.execute(
        insert(shipments).values(order_id=order.order_id, charge_id=charge["charge_id"])
    )
    shipped = {
        "order_id": order.order_id,
        "account": order.account,
        "sku": order.sku,
        "quantity": order.quantity,
        "amount_cents": order.amount_cents,
        "charge_id": charge["charge_id"],
    }
    ctx.publish("order.shipped", shipped, ordering_key=order.account)
    return {"shipment": order.order_id}


async def add_stock(conn: AsyncConnection, sku: str, quantity: int) -> int:
    """Add ``quantity`` of ``sku`` to the stock (the row is created on first use); for demos and
    tests. Returns the quantity now available."""
    new = pg_insert(stock).values(sku=sku, available=quantity)
    upsert = new.on_conflict_do_update(
        index_elements=[stock.c.sku],
        set_={"available": stock.c.available + new.excluded.available},
    ).returning(stock.c.available)
    available: int = (await conn.execute(upsert)).scalar_one()
    return available
