"""The orders example: its migrations, its stock helper, its fake payment gateway and its
shipping timeout; then its workflow in a real worker, waiting for the carrier's confirmation:
confirmed, it ships; unconfirmed in time, it releases the stock, refunds and cancels, once; with
both racing, exactly one of the two happens."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import SHIPPING_TIMEOUT, FakeGateway, add_stock, shipping_timeout
from examples.orders import router as orders
from examples.orders.gateway import charge_id_for, refund_id_for
from examples.orders.handlers import SHIPPING_TIMEOUT_ENV
from examples.orders.tables import gateway_calls, metadata, stock
from tests.helpers import WORKER_SCRIPT, rows, run, scalar, wait_until
from tests.integration.orders_flow import (
    cancelled_once,
    completed,
    confirm_shipping,
    drain,
    effects,
    events_queue,
    expire_wait,
    key_of,
    order,
    place_order,
    relayed,
    shipped_once,
    waiting,
)
from tests.integration.support import (
    BASE,
    dead_letters,
    declare,
    inspect_database,
    publish,
    require_services,
    running_relay,
    running_worker,
    schema_diff,
    table_names,
    worker_process,
)
from worker import schema, testing
from worker.errors import ConfigurationError
from worker.ops import dlq
from worker.settings import Settings
from worker.testing import Harness

ORDERS_TABLES = {"stock", "reservations", "shipments", "gateway_calls"}
STEPS = ("reserve_inventory", "charge_payment", "dispatch_shipping")
COMPENSATION = ("release_reservation", "refund_payment", "cancel_order")


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


async def test_the_gateway_refunds_once_per_key_and_records_each_call_as_a_refund(
    engine: AsyncEngine,
) -> None:
    gateway = FakeGateway(engine)
    charge = await gateway.charge(idempotency_key="order-1:charge_payment", amount_cents=500)

    # When a refund of the charge is asked twice under one key
    refunds = [
        await gateway.refund(
            idempotency_key="order-1:refund_payment", charge_id=charge, amount_cents=500
        )
        for _ in range(2)
    ]

    # Then both calls got the one refund, recorded as refunds of that charge
    assert refunds == [refund_id_for("order-1:refund_payment")] * 2
    async with engine.connect() as conn:
        calls = (
            await conn.execute(
                select(
                    gateway_calls.c.operation, gateway_calls.c.charge_id, gateway_calls.c.refund_id
                ).order_by(gateway_calls.c.id)
            )
        ).all()
    assert [tuple(row) for row in calls] == [
        ("charge", charge, None),
        ("refund", charge, refunds[0]),
        ("refund", charge, refunds[0]),
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


def test_the_shipping_timeout_is_read_from_the_environment_and_checked() -> None:
    # Unset: half an hour; set: that many seconds
    assert shipping_timeout({}) == timedelta(minutes=30)
    assert shipping_timeout({SHIPPING_TIMEOUT_ENV: "90"}) == timedelta(seconds=90)
    assert shipping_timeout({SHIPPING_TIMEOUT_ENV: "0.5"}) == timedelta(milliseconds=500)

    # Anything but a positive, finite number of seconds is refused, naming the variable
    for bad in ("0", "-5", "soon", "inf", "nan", "1e300", str(200 * 366 * 86400)):
        with pytest.raises(ConfigurationError, match=SHIPPING_TIMEOUT_ENV):
            shipping_timeout({SHIPPING_TIMEOUT_ENV: bad})


def test_a_bad_shipping_timeout_stops_the_worker_from_starting(
    settings: Settings, tmp_path: Path
) -> None:
    # When the worker starts with a shipping timeout that is not a number of seconds
    log = tmp_path / "worker.log"
    with worker_process(
        settings, log, WORKER_HANDLERS="examples.orders", **{SHIPPING_TIMEOUT_ENV: "soon"}
    ) as worker:
        worker.wait(60)

    # Then it exits with an error that names the variable
    assert worker.returncode not in (0, None)
    assert SHIPPING_TIMEOUT_ENV in log.read_text(errors="replace")


async def test_a_confirmed_order_completes_with_its_tracking_number_and_no_refund(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await seed_tea(engine)
    async with running_worker(settings, orders):
        channel = await amqp.channel(publisher_confirms=True)
        events = await events_queue(channel, settings)

        # Given an order dispatched and waiting for its confirmation
        await place_order(channel, settings, "o-1")
        await wait_until(lambda: waiting(engine, "o-1"))
        assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 1  # its timer
        listed = await asyncio.to_thread(
            run, WORKER_SCRIPT, "workflows", WORKER_DATABASE_URL=settings.database_url
        )
        # (worker workflows shows it with no owner, and what it waits for until when)
        assert f"key={key_of('o-1')} recovery_point=dispatch_shipping owner=-" in listed.stdout
        waits_for = "waiting=shipping_confirmed signal=shipping.confirmed correlation=o-1 until="
        assert waits_for in listed.stdout, listed.stderr

        # When the carrier confirms it
        await confirm_shipping(channel, settings, "o-1", tracking="TRK-7")
        await wait_until(lambda: completed(engine, "o-1"))
        await wait_until(lambda: relayed(engine))

    # Then the workflow completed with the tracking number, kept the stock and the charge
    assert shipped_once(await effects(engine, "o-1"), "o-1", tracking="TRK-7")
    assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'tea'") == 8
    # And its timer was cancelled, and only order.shipped went out
    assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0
    assert await drain(events) == [("order.shipped", "o-1")]
    await channel.close()


async def test_an_unconfirmed_order_is_released_refunded_and_cancelled_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await seed_tea(engine)
    async with running_worker(settings, orders):
        channel = await amqp.channel(publisher_confirms=True)
        events = await events_queue(channel, settings)

        # Given an order dispatched and waiting for its confirmation
        await place_order(channel, settings, "o-1")
        await wait_until(lambda: waiting(engine, "o-1"))

        # When its timeout passes with no confirmation (the deadline moved in SQL)
        await expire_wait(engine, "o-1")
        await wait_until(lambda: completed(engine, "o-1"))
        await wait_until(lambda: relayed(engine))

        # And the confirmation comes late
        await confirm_shipping(channel, settings, "o-1")
        await wait_until(lambda: signal_recorded(engine, "o-1"))
        await wait_until(lambda: relayed(engine))

    # Then the stock came back once, the charge was refunded once, the order cancelled once
    found = await effects(engine, "o-1")
    assert cancelled_once(found, "o-1")
    assert found.refund_calls == 1
    assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'tea'") == 10
    steps = await rows(engine, "SELECT step FROM workflow_steps ORDER BY position")
    assert [step for (step,) in steps] == [*STEPS, *COMPENSATION]
    assert await drain(events) == [("order.shipped", "o-1"), ("order.cancelled", "o-1")]
    # And the late confirmation was recorded, never applied: the wait stays timed out
    assert await scalar(engine, "SELECT outcome FROM workflow_waits") == "timeout"


async def test_a_confirmation_without_tracking_is_parked_and_the_order_keeps_waiting(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await seed_tea(engine)
    async with running_worker(settings, orders):
        channel = await amqp.channel(publisher_confirms=True)

        # Given an order waiting for its confirmation
        await place_order(channel, settings, "o-1")
        await wait_until(lambda: waiting(engine, "o-1"))

        # When a confirmation without its tracking number comes (its correlation is fine)
        await publish(
            channel,
            settings,
            {"order_id": "o-1"},
            message_id="confirmed-o-1",
            routing_key="shipping.confirmed",
        )
        parked = []

        async def one_parked() -> bool:
            parked.extend(await dead_letters(channel, settings))
            return bool(parked)

        await wait_until(one_parked)

        # Then the confirmation is parked once as invalid, before it resolved anything
        assert [m.headers[dlq.REASON] for m in parked] == ["invalid"]
        assert await scalar(engine, "SELECT outcome FROM workflow_waits") is None
        assert await waiting(engine, "o-1")

        # And a valid confirmation still ships the order
        await confirm_shipping(channel, settings, "o-1", tracking="TRK-1")
        await wait_until(lambda: completed(engine, "o-1"))
    assert shipped_once(await effects(engine, "o-1"), "o-1", tracking="TRK-1")
    await channel.close()


async def test_the_harness_lets_the_shipping_timeout_pass_and_the_order_is_cancelled(
    engine: AsyncEngine,
) -> None:
    await seed_tea(engine)
    harness = Harness(orders, engine)

    # Given an order dispatched and waiting, and time short of its timeout passed
    placed = await harness.deliver("order.placed", order("o-1"), key=key_of("o-1"))
    assert placed.outcome == "waiting"
    assert await harness.advance(SHIPPING_TIMEOUT - timedelta(seconds=1)) == []

    # When the rest of the timeout passes and its timer is delivered
    (timer,) = await harness.advance(timedelta(seconds=1))
    resumed = await harness.deliver_event(timer)

    # Then the order was released, refunded and cancelled, once
    assert resumed.outcome == "processed"
    assert cancelled_once(await effects(engine, "o-1"), "o-1")
    assert [e.routing_key for e in harness.published] == [
        "order.shipped",
        "order.placed",  # the timer
        "order.cancelled",
    ]
    assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'tea'") == 10


async def test_a_confirmation_racing_the_timeout_ships_or_cancels_each_order_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    order_ids = [f"o-{i}" for i in range(8)]
    early, late = order_ids[:4], order_ids[4:]
    await seed_tea(engine, 2 * len(order_ids))
    await declare(amqp, settings)
    channel = await amqp.channel(publisher_confirms=True)
    events = await events_queue(channel, settings)

    # Given orders dispatched and waiting for their confirmations, and the worker stopped
    async with running_worker(settings, orders):
        for order_id in order_ids:
            await place_order(channel, settings, order_id)
        for order_id in order_ids:
            await wait_until(lambda order_id=order_id: waiting(engine, order_id))

    # When every order's timer fires (published by a relay alone) and its confirmation comes:
    # some queued before their timer, some sent once the worker is taking the timers
    for order_id in early:
        await confirm_shipping(channel, settings, order_id)
    async with running_relay(settings):
        for order_id in order_ids:
            await expire_wait(engine, order_id)
        await wait_until(lambda: timers_published(engine))
    async with running_worker(settings, orders):
        await wait_until(lambda: any_wait_resolved(engine))
        for order_id in late:
            await confirm_shipping(channel, settings, order_id)
        for order_id in order_ids:
            await wait_until(lambda order_id=order_id: completed(engine, order_id))
        await wait_until(lambda: relayed(engine))

    # Then each order was either shipped or cancelled, its effects once
    shipped = set()
    for order_id in order_ids:
        found = await effects(engine, order_id)
        assert shipped_once(found, order_id) != cancelled_once(found, order_id), found
        if shipped_once(found, order_id):
            shipped.add(order_id)
    cancelled = set(order_ids) - shipped
    print("DEBUG shipped", sorted(shipped))
    # And the stock, the events and the waits agree with the outcomes
    available = await scalar(engine, "SELECT available FROM stock WHERE sku = 'tea'")
    assert available == 2 * len(cancelled)
    assert sorted(await drain(events)) == sorted(
        [("order.shipped", o) for o in order_ids] + [("order.cancelled", o) for o in cancelled]
    )
    outcomes = dict(await rows(engine, "SELECT correlation, outcome FROM workflow_waits"))
    assert outcomes == {o: "event" if o in shipped else "timeout" for o in order_ids}
    # And a confirmation that lost to its timeout was recorded, not applied
    unapplied = await rows(engine, "SELECT correlation FROM workflow_signals")
    assert {o for (o,) in unapplied} == cancelled
    await channel.close()


async def any_wait_resolved(engine: AsyncEngine) -> bool:
    resolved = await scalar(engine, "SELECT count(*) FROM workflow_waits WHERE outcome IS NOT NULL")
    return bool(resolved > 0)


async def timers_published(engine: AsyncEngine) -> bool:
    scheduled = await scalar(engine, "SELECT count(*) FROM outbox_scheduled")
    return bool(scheduled == 0 and await relayed(engine))


async def seed_tea(engine: AsyncEngine, quantity: int = 10) -> None:
    async with engine.begin() as conn:
        await add_stock(conn, "tea", quantity)


async def signal_recorded(engine: AsyncEngine, order_id: str) -> bool:
    count = await scalar(
        engine, "SELECT count(*) FROM workflow_signals WHERE correlation = :o", o=order_id
    )
    return bool(count == 1)
