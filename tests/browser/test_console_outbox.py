"""The outbox in a real browser: a parked row whose routing key, headers, body and last error a
hostile sender chose is shown as text in the list of parked rows and on its own page, inert even
with the Content-Security-Policy out of the way."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.browser.hostile import (
    BODY,
    BODY_SHOWN,
    IMAGE,
    RIGHT_TO_LEFT,
    RIGHT_TO_LEFT_SHOWN,
    SCRIPT,
    assert_inert,
)
from tests.browser.page import Page
from tests.integration.console_support import OPERATOR_TOKEN
from tests.integration.support import park
from worker import outbox as public_outbox
from worker.settings import Settings
from worker.sql import outbox

pytestmark = pytest.mark.integration

ERROR = f"returned: NO_ROUTE for {SCRIPT}{IMAGE} {RIGHT_TO_LEFT} " + "x" * 300
"""A last error that repeats what the sender chose, longer than a list shows."""

ROWS = """
return Array.from(document.querySelectorAll("#outbox-rows tbody tr"))
  .map((row) => Array.from(row.children).map((cell) => cell.textContent.trim()));
"""


async def park_hostile_row(engine: AsyncEngine, settings: Settings) -> int:
    """An event appended through ``worker.outbox.publish`` with the sender's routing key,
    headers and body, parked the way the relay parks one (its only attempt failed with
    ``ERROR``); its id."""
    async with engine.begin() as conn:
        message_id = await public_outbox.publish(
            conn,
            SCRIPT,
            BODY,
            headers={"x-script": SCRIPT, "x-image": IMAGE, "x-right-to-left": RIGHT_TO_LEFT},
            exchange=settings.exchange,
            correlation_id=IMAGE,
            content_type="text/html",
        )
        row_id = (
            await conn.execute(
                text("SELECT id FROM outbox WHERE message_id = :m"), {"m": message_id}
            )
        ).scalar_one()
        parked = await outbox.fail_outbox(conn, {row_id: ERROR}, max_attempts=1, retry_delay=1.0)
    assert parked == [row_id]
    return int(row_id)


async def test_a_hostile_outbox_row_is_shown_as_text_in_the_list_and_on_its_page(
    page: Page, settings: Settings, engine: AsyncEngine
) -> None:
    # Given two parked rows, and one whose routing key, headers, body and last error are markup
    # that would run a script, a right-to-left override and bytes that are not UTF-8
    await park(engine, settings)
    await park(engine, settings)
    row_id = await park_hostile_row(engine, settings)
    # and a browser that ignores the Content-Security-Policy: only the escaping protects it
    await page.bypass_csp(True)
    try:
        # When the operator opens the outbox (the parked rows first)
        await page.log_in(OPERATOR_TOKEN, start="/outbox")
        await page.wait_for_path("/outbox")

        # Then the hostile row is listed, its routing key and its error cut as text, inert
        await assert_inert(page)
        listed = {row[1]: row for row in await page.script(ROWS)}
        assert len(listed) == 3
        hostile = listed[str(row_id)]
        assert hostile[3] == SCRIPT
        assert hostile[7].startswith(
            f"returned: NO_ROUTE for {SCRIPT}{IMAGE} {RIGHT_TO_LEFT_SHOWN}"
        )
        assert hostile[7].endswith("… all")
        await page.screenshot("outbox")

        # When they open the row
        await page.click_and_wait(
            f"#outbox-rows a[href='/outbox/row/parked/{row_id}']", f"/outbox/row/parked/{row_id}"
        )

        # Then every value is there as text: the body, the whole error, the headers
        shown = await assert_inert(page)
        assert await page.text("#body") == BODY_SHOWN
        assert await page.text("#last-error") == ERROR.replace(RIGHT_TO_LEFT, RIGHT_TO_LEFT_SHOWN)
        headers = await page.text("#headers")
        assert SCRIPT in headers
        assert RIGHT_TO_LEFT_SHOWN in headers
        assert f"Correlation id\n{IMAGE}" in shown
    finally:
        await page.bypass_csp(False)
