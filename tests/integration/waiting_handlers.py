"""A handler module of workflows that wait, for the tests of waits in-process and in a worker
process: an order that reserves, waits for its shipment's confirmation (or compensates when it
times out) and records what it did; a reminder that sleeps. Every step writes a row of
``wait_effects`` (created by the tests), so a test can count how often each step ran."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import text

from worker import Context, Router, WaitTimedOut, Workflow

router = Router()

ORDER = "order.placed"
CONFIRMED = "shipping.confirmed"
REMINDER = "reminder.requested"
CONFIRM_TIMEOUT = timedelta(hours=1)
NAP = timedelta(hours=1)

router.signal(CONFIRMED, field="order_id")


async def record(ctx: Context, step: str, detail: Any = None) -> dict[str, Any]:
    await ctx.connection.execute(
        text("INSERT INTO wait_effects (key, step) VALUES (:k, :s)"), {"k": ctx.key, "s": step}
    )
    return {"step": step, "detail": detail}


@router.workflow(ORDER)
async def fulfil(order: dict[str, Any], wf: Workflow) -> dict[str, Any]:
    await wf.step("reserve", record, "reserve")
    try:
        confirmation = await wf.wait_for(
            "shipped", CONFIRMED, correlation=order["order_id"], timeout=CONFIRM_TIMEOUT
        )
    except WaitTimedOut:
        await wf.step("compensate", record, "compensate")
        return {"outcome": "timeout"}
    await wf.step("complete", record, "complete", confirmation)
    return {"outcome": "event", "confirmation": confirmation}


@router.workflow(REMINDER)
async def remind(body: dict[str, Any], wf: Workflow) -> dict[str, Any]:
    await wf.sleep("nap", NAP)
    await wf.step("remind", record, "remind")
    return {"reminded": body["who"]}
