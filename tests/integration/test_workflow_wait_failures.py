"""Waiting workflows on their failure paths, against the real PostgreSQL and RabbitMQ: a
workflow that fails after a wait resolved keeps what resolved it, so its DLQ replay resumes it
with that outcome instead of waiting again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import rows, scalar, wait_until
from tests.integration.support import publish, running_worker, settled
from worker import Context, Permanent, Router, Workflow
from worker.ops import dlq
from worker.settings import Settings

REQUESTED = "payment.requested"
CONFIRMED = "payment.confirmed"

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
            return status == "completed" or (status == "in_progress" and open_waits == 1)

        await wait_until(settled_again)
        await channel.close()

    # Then the replay resumed it with the confirmation that came (it did not wait again for a
    # confirmation that already came and would time out), and its wait is the one resolved
    assert await rows(engine, "SELECT status, result FROM inbox WHERE key = 'pay-1'") == [
        ("completed", {"booked": 5})
    ]
    assert await rows(engine, "SELECT name, outcome FROM workflow_waits") == [("paid", "event")]
    assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0
