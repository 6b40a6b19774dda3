"""Waiting workflows on their failure paths, against the real PostgreSQL and RabbitMQ: a
workflow that fails after a wait resolved keeps what resolved it, so its DLQ replay resumes it
with that outcome instead of waiting again; a second copy of the message that resumes a wait,
coming while the workflow runs past that wait, is acked as a duplicate, not retried until it is
parked with the running workflow's key marked failed; and a timer that comes after the janitor
forgot its completed workflow does not start the workflow over."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import rows, scalar, wait_until
from tests.integration.support import dead_letters, publish, running_worker, settled
from tests.integration.waiting_handlers import CONFIRMED as SHIPPED
from tests.integration.waiting_handlers import ORDER
from tests.integration.waiting_handlers import router as order_router
from worker import Context, Permanent, Router, Workflow
from worker.core.workflows import TIMER_HEADER
from worker.ops import dlq
from worker.ops.janitor import sweep
from worker.settings import Settings
from worker.testing import Harness

REQUESTED = "payment.requested"
CONFIRMED = "payment.confirmed"
DISPATCHED = "parcel.dispatched"
DELIVERED = "parcel.delivered"

refusals: list[str] = []
"""How many times the ledger refuses to book (one entry per refusal still to come)."""


def payment_router() -> Router:
    """A workflow that waits for its payment's confirmation first thing (no step before the
    wait), then books it in a step that fails permanently while ``refusals`` lasts."""
    router = Router()
    router.signal(CONFIRMED, field="payment_id")

    async def book(ctx: Context, confirmation: dict[str, Any]) -> dict[str, Any]:
        if refusals:
            raise Permanent(f"the ledger refused: {refusals.pop()}")
        return {"booked": confirmation["amount"]}

    @router.workflow(REQUESTED)
    async def settle(body: dict[str, Any], wf: Workflow) -> dict[str, Any]:
        confirmation = await wf.wait_for(
            "paid", CONFIRMED, correlation=body["payment_id"], timeout=timedelta(hours=1)
        )
        return await wf.step("book", book, confirmation)  # type: ignore[no-any-return]

    return router


async def test_a_replay_of_a_workflow_that_failed_after_its_wait_resumes_with_its_signal(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    refusals[:] = ["closed for the night"]
    async with running_worker(settings, payment_router()) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        # Given a workflow that waits for its confirmation before any step of its own
        await publish(channel, settings, {"payment_id": "p-1"}, key="pay-1", routing_key=REQUESTED)
        await settled(worker, waiting=1)

        # When the confirmation resumes it and its next step fails permanently
        body = {"payment_id": "p-1", "amount": 5}
        await publish(channel, settings, body, key="confirm-p-1", routing_key=CONFIRMED)
        await settled(worker, dead_lettered=1)
        assert await scalar(engine, "SELECT status FROM inbox WHERE key = 'pay-1'") == "failed"

        # And the parked message is replayed once the ledger takes bookings again
        assert len(await dlq.replay(amqp, engine, settings)) == 1

        async def settled_again() -> bool:
            status = await scalar(engine, "SELECT status FROM inbox WHERE key = 'pay-1'")
            open_waits = await scalar(
                engine, "SELECT count(*) FROM workflow_waits WHERE outcome IS NULL"
            )
            return bool(status == "completed" or (status == "in_progress" and open_waits == 1))

        await wait_until(settled_again)
        await channel.close()

    # Then the replay resumed it with the confirmation that came (it did not wait again for a
    # confirmation that already came and would time out), and its wait is the one resolved
    assert await rows(engine, "SELECT status, result FROM inbox WHERE key = 'pay-1'") == [
        ("completed", {"booked": 5})
    ]
    assert await rows(engine, "SELECT name, outcome FROM workflow_waits") == [("paid", "event")]
    assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0


class Gate:
    """Holds the step after the wait until the test opens it; says when a run is inside it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()
        self.runs = 0


def parcel_router(gate: Gate) -> Router:
    """A workflow that waits for its parcel's delivery, then files it in a step held by
    ``gate`` (a step that takes longer than the retry chain)."""
    router = Router()
    router.signal(DELIVERED, field="parcel")

    async def file(ctx: Context, delivery: dict[str, Any]) -> dict[str, Any]:
        gate.runs += 1
        gate.entered.set()
        await gate.opened.wait()
        return {"filed": delivery["parcel"]}

    @router.workflow(DISPATCHED)
    async def track(body: dict[str, Any], wf: Workflow) -> dict[str, Any]:
        delivery = await wf.wait_for(
            "delivered", DELIVERED, correlation=body["parcel"], timeout=timedelta(hours=1)
        )
        return await wf.step("file", file, delivery)  # type: ignore[no-any-return]

    return router


async def test_a_second_copy_of_a_resume_while_the_workflow_runs_is_a_duplicate(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    gate = Gate()
    async with running_worker(settings, parcel_router(gate)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        # Given a waiting workflow, and a tap on the messages that resume it
        await publish(channel, settings, {"parcel": "x-1"}, key="parcel-1", routing_key=DISPATCHED)
        await settled(worker, waiting=1)
        tap = await channel.declare_queue(exclusive=True)
        await tap.bind(settings.exchange, DISPATCHED)

        # When its signal resumes it and it runs past the wait, in a step that takes long
        body = {"parcel": "x-1"}
        await publish(channel, settings, body, key="delivered-x-1", routing_key=DELIVERED)
        await gate.entered.wait()

        # And a second copy of the resume message comes meanwhile (a relay's publish repeated
        # after a lost confirm; as the timer published before the signal cancelled it does)
        resume = await tap.get(timeout=10)
        exchange = await channel.get_exchange(settings.exchange)
        await exchange.publish(resume, routing_key=DISPATCHED)

        async def copy_settled() -> bool:
            return worker.stats["duplicate"] + worker.stats["retry_scheduled"] >= 1

        await wait_until(copy_settled)
        gate.opened.set()
        await settled(worker, processed=2)  # (the signal, then the workflow)

        # Then the copy was acked as a duplicate, not retried (its retries would outlast the
        # step, be parked, and mark the running workflow's key failed): the workflow completed
        # once, nothing parked
        assert (worker.stats["duplicate"], worker.stats["retry_scheduled"]) == (1, 0)
        assert await dead_letters(channel, settings) == []
        await channel.close()
    assert await rows(engine, "SELECT status, result FROM inbox WHERE key = 'parcel-1'") == [
        ("completed", {"filed": "x-1"})
    ]
    assert gate.runs == 1


async def test_a_timer_that_comes_after_its_workflow_was_forgotten_does_not_start_it_over(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS wait_effects "
                "(id bigserial PRIMARY KEY, key text NOT NULL, step text NOT NULL)"
            )
        )
        await conn.execute(text("TRUNCATE wait_effects"))
    harness = Harness(order_router, engine)
    body = {"order_id": "f-1"}

    # Given an order its confirmation resumed and completed
    assert (await harness.deliver(ORDER, body, key="order-f-1")).outcome == "waiting"
    await harness.deliver(SHIPPED, {"order_id": "f-1"}, key="c-f-1")
    assert (await harness.deliver(ORDER, body, key="order-f-1")).outcome == "processed"

    # And forgotten by the janitor once older than the retention
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE inbox SET updated_at = now() - make_interval(secs => :s)"),
            {"s": settings.inbox_retention + 60},
        )
    await sweep(engine, settings)
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE key = 'order-f-1'") == 0

    # When its wait's timer comes after all (an outbox row parked when its publish failed,
    # retried by an operator later: a signal's cancel leaves a parked row alone)
    late = await harness.deliver(ORDER, body, key="order-f-1", headers={TIMER_HEADER: "shipped"})

    # Then it is dropped: the order is not reserved again nor left waiting for a second time
    assert late.outcome == "duplicate"
    found = await rows(engine, "SELECT step FROM wait_effects ORDER BY id")
    assert [step for (step,) in found] == ["reserve", "complete"]
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE key = 'order-f-1'") == 0


async def test_a_wait_called_inside_a_step_fails_the_workflow_instead_of_hanging_it(
    engine: AsyncEngine,
) -> None:
    # Given a workflow whose step sleeps (a wait inside a step: the step's transaction holds
    # the workflow's row, which the wait's own transaction must lock too)
    nested = Router()

    @nested.workflow("nested.started")
    async def sleep_in_step(body: Any, wf: Workflow) -> None:
        async def nap(ctx: Context) -> None:
            await wf.sleep("nap", timedelta(minutes=1))

        await wf.step("outer", nap)

    # When it runs (bounded: on a hang the delivery never ends)
    ended = await asyncio.wait_for(
        Harness(nested, engine).deliver("nested.started", {}, key="n-1"), timeout=30
    )

    # Then it is parked with the reason, and nothing of the step or the wait is kept
    assert ended.outcome == "dead_lettered"
    assert "called while step 'outer' runs" in str(ended.error)
    assert await scalar(engine, "SELECT count(*) FROM workflow_waits") == 0
    assert await scalar(engine, "SELECT count(*) FROM workflow_steps") == 0
