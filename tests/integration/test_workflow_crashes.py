"""The orders workflow in a real ``worker run`` process, killed with SIGKILL at a crash point in
or after each step: the key waits in progress at its recovery point (``worker workflows`` shows
it), and a restarted worker resumes at the next step without waiting for the dead owner's lease,
so the gateway charges once; the workflow
then waits for the carrier's confirmation and completes when it comes."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import add_stock
from examples.orders.gateway import charge_id_for
from tests.helpers import WORKER_SCRIPT, rows, run, scalar, wait_until
from tests.integration.orders_flow import (
    completed,
    confirm_shipping,
    effects,
    key_of,
    place_order,
    relayed,
    shipped_once,
    waiting,
)
from tests.integration.support import wait_for_consumer, worker_process
from worker.core.workflows import AFTER_STEP, BEFORE_COMMIT
from worker.settings import Settings

KEY = key_of("o-1")


@pytest.mark.parametrize(
    ("crash_at", "recovery_point", "gateway_calls"),
    [
        (AFTER_STEP + "reserve_inventory", "reserve_inventory", 1),
        (AFTER_STEP + "charge_payment", "charge_payment", 1),
        (AFTER_STEP + "dispatch_shipping", "dispatch_shipping", 1),
        # the gateway was called, the step did not commit: it runs again under the same key
        (BEFORE_COMMIT + "charge_payment", "reserve_inventory", 2),
    ],
)
async def test_a_killed_workflow_resumes_after_its_last_committed_step(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    tmp_path: Path,
    crash_at: str,
    recovery_point: str,
    gateway_calls: int,
) -> None:
    async with engine.begin() as conn:
        await add_stock(conn, "tea", 10)
    log = tmp_path / "worker.log"
    handlers = {"WORKER_HANDLERS": "examples.orders"}

    # Given a worker that kills itself at the crash point, and a queue for the shipped events
    with worker_process(settings, log, WORKER_CRASH_AT=crash_at, **handlers) as worker:
        await wait_for_consumer(amqp, settings.queue)
        channel = await amqp.channel(publisher_confirms=True)
        shipped = await channel.declare_queue(f"{settings.queue}.shipped", exclusive=True)
        await shipped.bind(settings.exchange, "order.shipped")
        await place_order(channel, settings, "o-1")
        await asyncio.to_thread(worker.wait, 60)
        assert worker.returncode == -signal.SIGKILL, log.read_text(errors="replace")

    # Then the key waits in progress at its last committed step, and the admin CLI shows it
    status, point = (await rows(engine, "SELECT status, recovery_point FROM inbox"))[0]
    assert (status, point) == ("in_progress", recovery_point)
    listed = await asyncio.to_thread(
        run, WORKER_SCRIPT, "workflows", WORKER_DATABASE_URL=settings.database_url
    )
    assert f"key={KEY} recovery_point={recovery_point}" in listed.stdout, listed.stderr

    # When a worker starts again, the dead owner's lease still running (its process is gone, so
    # the redelivery takes the workflow over at once)
    with worker_process(settings, log, **handlers) as worker:
        # Then it resumes and waits for the shipping confirmation; when that comes, it completes
        await wait_until(lambda: waiting(engine, "o-1"), timeout=40)
        await confirm_shipping(channel, settings, "o-1")
        await wait_until(lambda: completed(engine, "o-1"))
        await wait_until(lambda: relayed(engine))
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)

    # Then every step took effect once and the gateway charged once
    calls = await rows(engine, "SELECT idempotency_key, charge_id FROM gateway_calls")
    assert calls == [(f"{KEY}:charge_payment", charge_id_for(f"{KEY}:charge_payment"))] * (
        gateway_calls
    )
    assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'tea'") == 8
    assert await scalar(engine, "SELECT count(*) FROM reservations") == 1
    assert await scalar(engine, "SELECT count(*) FROM shipments") == 1
    assert shipped_once(await effects(engine, "o-1"), "o-1")
    steps = await rows(engine, "SELECT step FROM workflow_steps ORDER BY position")
    assert [step for (step,) in steps] == [
        "reserve_inventory",
        "charge_payment",
        "dispatch_shipping",
    ]
    event = await shipped.get(timeout=5)
    assert json.loads(event.body)["order_id"] == "o-1"
    assert await shipped.get(fail=False) is None  # one order.shipped, from the one shipment
    await channel.close()
