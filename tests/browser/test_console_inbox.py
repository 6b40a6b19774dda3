"""The inbox lookup in a real browser: a user types a waiting workflow's handler and key into
the form and reads its status, the steps it committed and the signal it waits for."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.browser.page import Page
from tests.helpers import scalar
from tests.integration.console_support import VIEWER_TOKEN
from worker import Context, Router, Workflow
from worker.testing import Harness

pytestmark = pytest.mark.integration

HANDLER = "order.placed"

router = Router()
router.signal("parcel.shipped", field="order_id")


async def reserve(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    return {"reserved": order["sku"], "warehouse": "north"}


async def charge(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    return {"charged_cents": order["cents"], "receipt": f"r-{order['order_id']}"}


@router.workflow(HANDLER)
async def fulfil(order: dict[str, Any], wf: Workflow) -> dict[str, Any]:
    await wf.step("reserve", reserve, order)
    await wf.step("charge", charge, order)
    shipped = await wf.wait_for(
        "shipped", "parcel.shipped", correlation=order["order_id"], timeout=timedelta(days=2)
    )
    return {"shipped": shipped}


CELLS = """
return Array.from(document.querySelectorAll(arguments[0] + " tbody tr"))
  .map((row) => Array.from(row.children).map((cell) => cell.textContent.trim()));
"""


async def test_a_user_looks_up_a_waiting_workflow_and_reads_its_steps_and_wait(
    page: Page, engine: AsyncEngine
) -> None:
    # Given an order's workflow that committed two steps and waits for its parcel to ship
    waiting = await Harness(router, engine).deliver(
        HANDLER, {"order_id": "o-1042", "sku": "lamp-7", "cents": 4900}, key="order-o-1042"
    )
    assert waiting.outcome == "waiting"
    timer = await scalar(engine, "SELECT timer_id::text FROM workflow_waits")

    # When a user opens the inbox, types the handler and the key, and looks it up
    await page.log_in(VIEWER_TOKEN, start="/inbox")
    await page.wait_for_path("/inbox")
    assert await page.script(CELLS, "#recent-keys") == [
        [
            HANDLER,
            "order-o-1042",
            "in_progress",
            await page.text("#recent-keys tbody td:last-child"),
        ]
    ]
    await page.type("#lookup input[name=handler]", HANDLER)
    await page.type("#lookup input[name=key]", "order-o-1042")
    await page.click("#lookup button[type=submit]")
    await page.wait_for_text("h2", "order-o-1042")

    # Then the page shows the key in progress, its two steps with their outputs, and its wait
    assert await page.path() == f"/inbox?handler={HANDLER}&key=order-o-1042"
    assert await page.text("#status") == "in_progress"
    steps = await page.script(CELLS, "#steps")
    assert [row[:3] for row in steps] == [
        ["1", "reserve", '{"reserved": "lamp-7", "warehouse": "north"}'],
        ["2", "charge", '{"receipt": "r-o-1042", "charged_cents": 4900}'],
    ]
    waited = await page.text("#open-wait")
    assert waited.startswith(
        "Waits (shipped) for the signal parcel.shipped with correlation o-1042, until "
    )
    assert waited.endswith(f"Its timer is the scheduled event {timer}.")
    [wait] = await page.script(CELLS, "#waits")
    assert wait[:3] == ["shipped", "parcel.shipped", "o-1042"]
    assert wait[4] == "open"
    await page.screenshot("inbox", whole=True)
