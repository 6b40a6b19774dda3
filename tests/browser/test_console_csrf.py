"""Cross-site request forgery against the console's real replay of the dead letters, in a real
browser. A page of another origin whose form posts itself to the console while the operator is
logged in there, carrying even the session's real CSRF token (as if it had leaked): from another
site (127.0.0.2) the browser sends no session cookie (SameSite=Strict); from another port of the
same host, a same-site origin, it sends the cookie and the console refuses the POST by its
Origin. And the operator's own confirmation form, its CSRF field removed from the page before it
is submitted, is refused. Each time nothing is replayed (the DLQ and the work queue are as they
were), and the operator's session lives on."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.browser.attacker import attacker_site, forging_page
from tests.browser.page import Page
from tests.helpers import rows
from tests.integration.console_support import OPERATOR, OPERATOR_TOKEN, RunningConsole
from tests.integration.support import ready_messages
from tests.integration.test_dlq import Copy, park, parked_keys
from worker.console.pages import NAV
from worker.settings import Settings

pytestmark = pytest.mark.integration

SITES = {
    "another-site": "127.0.0.2",
    "same-site-another-port": "127.0.0.1",
}

CONFIRM = "/dead-letters/confirm"

STATUS = "return performance.getEntriesByType('navigation')[0].responseStatus;"
"""The HTTP status of the page the browser shows."""


async def audit(engine: AsyncEngine) -> list[tuple[str, str, str, str]]:
    found = await rows(
        engine, "SELECT actor, action, target, outcome FROM console_audit ORDER BY id"
    )
    return [(actor, action, target, outcome) for actor, action, target, outcome in found]


async def logged_in_operator(page: Page) -> str:
    """Log the operator in through the form; the session's CSRF token, read from the page."""
    await page.log_in(OPERATOR_TOKEN, start="/audit")
    await page.wait_for_path("/audit")
    token = await page.attribute("form[action='/logout'] input[name=csrf]", "value")
    assert token
    return token


async def nothing_replayed(
    amqp: AbstractRobustConnection, engine: AsyncEngine, settings: Settings
) -> None:
    """Assert that both parked messages are parked still, and none went to the work queue."""
    assert await parked_keys(amqp, engine, settings) == ["k1", "k2"]
    async with amqp.channel() as channel:
        assert await ready_messages(channel, settings.queue) == 0


@pytest.mark.parametrize("site", SITES)
async def test_a_forged_replay_from_another_origin_is_not_done(
    page: Page,
    console: RunningConsole,
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    site: str,
) -> None:
    # Given two parked messages, the operator logged in, and their CSRF token leaked
    await park(amqp, engine, settings, Copy("k1"), Copy("k2"))
    token = await logged_in_operator(page)
    forged = forging_page(
        console.url + CONFIRM,
        {
            "csrf": token,
            "action": "replay",
            "scope": "filter",
            "before": datetime.now(UTC).isoformat(),
        },
    )

    # When the operator's browser visits the attacker's page, which posts itself at once
    with attacker_site(SITES[site], forged) as url:
        await page.open(url)
        await page.wait_for_path(CONFIRM)
        shown = await page.text("#error")
        status = await page.script(STATUS)

    # Then nothing was replayed
    await nothing_replayed(amqp, engine, settings)
    entries = await audit(engine)
    if site == "another-site":
        # (the browser sent no session cookie: the console saw nobody)
        assert (status, shown) == (401, "log in first")
        assert entries == [(OPERATOR, "login", "", "done")]
    else:
        # (the cookie went along, the token was right: the Origin gave the forgery away, and
        # the refusal is audited)
        assert (status, shown) == (403, "refused: the form's CSRF token is missing")
        assert entries == [
            (OPERATOR, "login", "", "done"),
            (OPERATOR, CONFIRM, "", "refused: no valid CSRF token"),
        ]
    # And the operator is still logged in
    await page.open("/audit")
    await page.wait_for_path("/audit")
    assert OPERATOR in await page.text(".who")


async def test_a_confirmation_whose_csrf_field_was_removed_is_refused(
    page: Page, settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given two parked messages, and the operator on the preview of their replay
    await park(amqp, engine, settings, Copy("k1"), Copy("k2"))
    await page.log_in(OPERATOR_TOKEN, start="/dead-letters")
    await page.wait_for_path("/dead-letters")
    await page.click_and_wait("#dlq-groups button[value=replay]", "/dead-letters/preview")
    assert await page.text("#dlq-would") == "2"

    # When the CSRF field is taken out of the confirmation form, and the form is submitted
    await page.script('document.querySelector("#dlq-confirm input[name=csrf]").remove();')
    assert (
        await page.script(
            'return document.querySelectorAll("form#dlq-confirm [name=csrf]").length;'
        )
        == 0
    )
    await page.click("#dlq-confirm button[type=submit]")
    await page.wait_for_path(CONFIRM)

    # Then the console refuses it, says why, replays nothing, and the audit has the refusal
    assert await page.script(STATUS) == 403
    assert await page.text("#error") == "refused: the form's CSRF token is missing"
    await nothing_replayed(amqp, engine, settings)
    assert await audit(engine) == [
        (OPERATOR, "login", "", "done"),
        (OPERATOR, CONFIRM, "", "refused: no valid CSRF token"),
    ]


@pytest.mark.parametrize("site", SITES)
async def test_a_forged_logout_from_another_origin_leaves_the_session(
    page: Page, console: RunningConsole, engine: AsyncEngine, site: str
) -> None:
    # Given the operator is logged in, and their CSRF token has leaked
    token = await logged_in_operator(page)

    # When the attacker's page posts the logout form, token and all
    with attacker_site(SITES[site], forging_page(console.url + "/logout", {"csrf": token})) as url:
        await page.open(url)
        if site == "another-site":
            await page.wait_for_path("/logout")
            assert await page.text("#error") == "log in first"
        else:
            await page.wait_for_path(NAV[0][1])  # (refused, back to the console's first page)

    # Then the session lives on, and no logout is audited
    await page.open("/audit")
    await page.wait_for_path("/audit")
    assert OPERATOR in await page.text(".who")
    assert [action for _, action, _, _ in await audit(engine)] == ["login"]
