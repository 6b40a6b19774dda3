"""Orders: fulfil a placed order as a workflow of steps, each committed on its own, that waits
for the carrier's confirmation and compensates when it does not come in time.

``order.placed`` → ``reserve_inventory`` (take the quantity off ``stock``, write the reservation)
→ ``charge_payment`` (charge the account through the payment gateway) → ``dispatch_shipping``
(write the shipment, emit ``order.shipped``) → wait for ``shipping.confirmed`` carrying the
order's id, at most ``ORDERS_SHIPPING_TIMEOUT_SECONDS`` (by the database's clock). Confirmed: the
workflow completes with the tracking number. Timed out: ``release_reservation`` (stock back, the
reservation marked released) → ``refund_payment`` (the gateway's refund) → ``cancel_order``
(emit ``order.cancelled``). Each step runs in a transaction of its own, and a redelivery never
runs a committed step again: it gets the step's stored output instead. While it waits the
workflow holds nothing; exactly one of the confirmation and the timeout resumes it.

The gateway is an external service: its charge (or refund) cannot roll back with a transaction,
and a step that crashes after the call but before its commit runs again. The step therefore gives
the gateway ``ctx.step_key``, the same on every re-run, and the gateway charges (or refunds) once
per key.
Step outputs are plain JSON values, since a resumed workflow gets them back decoded from JSON.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from examples.orders.gateway import FakeGateway
from examples.orders.tables import metadata, reservations, shipments, stock
from worker import Context, Permanent, Router, WaitTimedOut, Workflow
from worker.core.events import due
from worker.errors import ConfigurationError
from worker.settings import positive_float

SHIPPING_TIMEOUT_ENV = "ORDERS_SHIPPING_TIMEOUT_SECONDS"
DEFAULT_SHIPPING_TIMEOUT = timedelta(minutes=30)


def shipping_timeout(environ: Mapping[str, str]) -> timedelta:
    """How long a dispatched order waits for ``shipping.confirmed`` before it is cancelled:
    ``ORDERS_SHIPPING_TIMEOUT_SECONDS`` (a positive number of seconds), else 30 minutes."""
    raw = environ.get(SHIPPING_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_SHIPPING_TIMEOUT
    try:
        timeout = timedelta(seconds=positive_float(raw))
        due(timeout, None)  # the limits of any scheduled delay, checked now instead of per order
    except (ValueError, OverflowError) as exc:
        raise ConfigurationError(f"{SHIPPING_TIMEOUT_ENV}={raw!r}: {exc}") from None
    return timeout


SHIPPING_TIMEOUT = shipping_timeout(os.environ)
"""Read once, when the handler module is imported (``worker run`` fails to start on a bad value)."""

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


class OrderCancelled(OrderShipped):
    """The body of ``order.cancelled``: the order, its charge, and the refund that undid it."""

    refund_id: str


class ShippingConfirmed(BaseModel):
    """The body of ``shipping.confirmed``, the carrier's word that it has the order's parcel;
    one without a string ``tracking`` is parked as ``invalid`` before it resumes anything."""

    model_config = ConfigDict(strict=True)

    order_id: str = Field(min_length=1)
    tracking: str


router.signal("shipping.confirmed", field="order_id", body=ShippingConfirmed)


@router.workflow(
    "order.placed",
    publishes={"order.shipped": OrderShipped, "order.cancelled": OrderCancelled},
)
async def fulfil_order(order: OrderPlaced, wf: Workflow) -> dict[str, Any]:
    """Reserve the stock, charge the account, dispatch the shipment, then wait for the carrier's
    confirmation; if none comes in time, release the stock, refund and cancel. Each step once."""
    reservation = await wf.step("reserve_inventory", reserve_inventory, order)
    charge = await wf.step("charge_payment", charge_payment, order, reservation)
    shipment = await wf.step("dispatch_shipping", dispatch_shipping, order, charge)
    fulfilled = {
        "order_id": order.order_id,
        "reservation": reservation["reservation"],
        "charge_id": charge["charge_id"],
        "shipment": shipment["shipment"],
    }
    try:
        confirmation = await wf.wait_for(
            "shipping_confirmed",
            "shipping.confirmed",
            correlation=order.order_id,
            timeout=SHIPPING_TIMEOUT,
        )
    except WaitTimedOut:
        await wf.step("release_reservation", release_reservation, order)
        refund = await wf.step("refund_payment", refund_payment, order, charge)
        await wf.step("cancel_order", cancel_order, order, refund)
        return {**fulfilled, "status": "cancelled", "refund_id": refund["refund_id"]}
    tracking = ShippingConfirmed.model_validate(confirmation).tracking
    return {**fulfilled, "status": "shipped", "tracking": tracking}


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


async def release_reservation(ctx: Context, order: OrderPlaced) -> dict[str, Any]:
    """Give the reservation's quantity back to the stock and mark the reservation released, in
    one commit; a reservation already released gives nothing back again."""
    released = await ctx.session.execute(
        update(reservations)
        .where(reservations.c.order_id == order.order_id, reservations.c.released_at.is_(None))
        .values(released_at=func.now())
        .returning(reservations.c.sku, reservations.c.quantity)
    )
    row = released.one_or_none()
    if row is not None:
        await ctx.session.execute(
            update(stock)
            .where(stock.c.sku == row.sku)
            .values(available=stock.c.available + row.quantity)
        )
    return {"released": order.order_id, "quantity": 0 if row is None else row.quantity}


async def refund_payment(
    ctx: Context, order: OrderPlaced, charge: dict[str, Any]
) -> dict[str, Any]:
    """Refund the order's charge through the gateway, once per order whatever the re-runs (the
    step key is the refund's idempotency key, as ``charge_payment``'s is the charge's)."""
    gateway = FakeGateway(ctx.connection.engine)
    refund_id = await gateway.refund(
        idempotency_key=ctx.step_key,
        charge_id=charge["charge_id"],
        amount_cents=order.amount_cents,
    )
    return {"refund_id": refund_id, "charge_id": charge["charge_id"]}


async def cancel_order(ctx: Context, order: OrderPlaced, refund: dict[str, Any]) -> dict[str, Any]:
    """Emit ``order.cancelled``, ordered per account after the order's ``order.shipped``."""
    cancelled = {
        "order_id": order.order_id,
        "account": order.account,
        "sku": order.sku,
        "quantity": order.quantity,
        "amount_cents": order.amount_cents,
        "charge_id": refund["charge_id"],
        "refund_id": refund["refund_id"],
    }
    ctx.publish("order.cancelled", cancelled, ordering_key=order.account)
    return {"cancelled": order.order_id}


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
