"""Cross-site request forgery against the console, in a real browser: a page of another origin
whose form posts itself to the console while the operator is logged in there, carrying even
the session's real CSRF token (as if it had leaked). From another site (127.0.0.2) the
browser sends no session cookie (SameSite=Strict); from another port of the same host, a
same-site origin, it sends the cookie and the console refuses the POST by its Origin. Either
way nothing is done, and the operator's session lives on."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.browser.attacker import attacker_site, forging_page
from tests.browser.page import Page
from tests.helpers import rows
from tests.integration import console_probe
from tests.integration.console_support import OPERATOR, OPERATOR_TOKEN, RunningConsole
from worker.console.pages import NAV

pytestmark = pytest.mark.integration

SITES = {
    "another-site": "127.0.0.2",
    "same-site-another-port": "127.0.0.1",
}


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


@pytest.mark.parametrize("site", SITES)
async def test_a_forged_action_from_another_origin_is_not_done(
    page: Page, console: RunningConsole, engine: AsyncEngine, site: str
) -> None:
    # Given the operator is logged in, and their CSRF token has leaked
    token = await logged_in_operator(page)
    forged = forging_page(console.url + console_probe.PATH, {"csrf": token, "target": "forged"})

    # When the operator's browser visits the attacker's page, which posts itself at once
    with attacker_site(SITES[site], forged) as url:
        await page.open(url)
        await page.wait_for_path(console_probe.PATH)
        shown = await page.text("#error")

    # Then the action was not done
    entries = await audit(engine)
    assert (OPERATOR, console_probe.ACTION, "forged", "done") not in entries
    if site == "another-site":
        # (the browser sent no session cookie: the console saw nobody)
        assert shown == "log in first"
        assert entries == [(OPERATOR, "login", "", "done")]
    else:
        # (the cookie went along, the token was right: the Origin gave the forgery away, and
        # the refusal is audited)
        assert shown == "refused: the form's CSRF token is missing"
        assert entries == [
            (OPERATOR, "login", "", "done"),
            (OPERATOR, console_probe.PATH, "", "refused: no valid CSRF token"),
        ]
    # And the operator is still logged in
    await page.open("/audit")
    await page.wait_for_path("/audit")
    assert OPERATOR in await page.text(".who")


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
