"""Logging in to the console in a real browser, as an operator and as a read-only user: the
form, the session it opens, the audit page with the user's name, and what a read-only session
is shown and refused."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.browser.page import Page
from tests.helpers import rows
from tests.integration import console_probe
from tests.integration.console_support import OPERATOR, OPERATOR_TOKEN, VIEWER, VIEWER_TOKEN

pytestmark = pytest.mark.integration

ACTION_FORMS = """
return Array.from(document.querySelectorAll("form"))
  .filter((form) => form.method.toLowerCase() === "post")
  .map((form) => new URL(form.action).pathname)
  .filter((path) => path !== "/logout");
"""
"""The paths the page's POST forms act on, its logout aside."""

FORGE_ACTION = """
const form = document.createElement("form");
form.method = "post";
form.action = arguments[0];
for (const [name, value] of [["csrf", arguments[1]], ["target", "from-the-viewer"]]) {
  const input = document.createElement("input");
  input.type = "hidden";
  input.name = name;
  input.value = value;
  form.appendChild(input);
}
document.body.appendChild(form);
form.submit();
"""
"""A POST of an action built in the page, with the page's own CSRF token (``arguments``: the
action's path, the token): what a read-only user could do with their browser's devtools."""


async def test_an_operator_logs_in_through_the_form_and_sees_their_name_on_the_audit(
    page: Page, engine: AsyncEngine
) -> None:
    # Given a browser without a session: the console sends it to the login form
    await page.open("/audit")
    await page.wait_for_path("/login")
    assert await page.attribute("input[name=next]", "value") == "/audit"
    assert await page.attribute("#token", "type") == "password"

    # When the operator types their token and clicks "Log in"
    await page.type("#token", OPERATOR_TOKEN)
    await page.screenshot("login")
    await page.click("#login")

    # Then the audit page opens, with their name and role in the bar and their login listed
    await page.wait_for_path("/audit")
    assert await page.text(".who") == f"{OPERATOR} operator"
    rows_shown = await page.texts("#audit tbody tr")
    assert len(rows_shown) == 1
    assert f"{OPERATOR} operator login" in rows_shown[0]
    assert rows_shown[0].endswith("done")
    await page.screenshot("audit")
    # And the token is nowhere: not in the page, the address or a script-readable cookie
    assert OPERATOR_TOKEN not in await page.source()
    assert OPERATOR_TOKEN not in await page.path()
    assert await page.script("return document.cookie") == ""


async def test_a_wrong_token_keeps_the_browser_on_the_login_form_and_where_it_was_going(
    page: Page, engine: AsyncEngine
) -> None:
    # Given a browser sent to the login form from a page of the console
    await page.open("/audit?before=1000")
    await page.wait_for_path("/login")

    # When a wrong token is typed
    await page.type("#token", "not-the-token-0123456789")
    await page.click("#login")

    # Then the form is back, says so, and still knows where the browser was going
    shown = await page.wait_for_text(".error", "not accepted")
    assert shown == "That token is not accepted."
    assert await page.path() == "/login"
    assert await page.attribute("input[name=next]", "value") == "/audit?before=1000"
    assert await rows(engine, "SELECT * FROM console_audit") == []

    # When the right one is typed next
    await page.type("#token", VIEWER_TOKEN)
    await page.click("#login")

    # Then the browser arrives where it was going
    await page.wait_for_path("/audit")
    assert await page.path() == "/audit?before=1000"


async def test_a_read_only_session_shows_no_action_and_its_post_is_refused(
    page: Page, engine: AsyncEngine
) -> None:
    # Given a read-only user logged in through the form
    await page.log_in(VIEWER_TOKEN, start="/audit")
    await page.wait_for_path("/audit")
    assert await page.text(".who") == f"{VIEWER} viewer"

    # Then no page of the navigation offers it an action: no POST form but its logout
    links = await page.script(
        'return Array.from(document.querySelectorAll("nav a")).map((a) => a.pathname);'
    )
    assert "/audit" in links
    for link in links:
        await page.open(link)
        await page.wait_for_path(link)
        assert await page.script(ACTION_FORMS) == [], link

    # When it posts an action from its page anyway, with its page's own CSRF token
    token = await page.attribute("form[action='/logout'] input[name=csrf]", "value")
    await page.script(FORGE_ACTION, console_probe.PATH, token)

    # Then the console refuses it, says why, and the audit says who tried
    refusal = await page.wait_for_text("#error", "refused")
    assert refusal == "refused: this user may only look"
    assert await page.path() == console_probe.PATH
    audit = await rows(engine, "SELECT actor, action, outcome FROM console_audit ORDER BY id")
    assert [tuple(row) for row in audit] == [
        (VIEWER, "login", "done"),
        (VIEWER, console_probe.PATH, "refused: read-only user"),
    ]


async def test_a_logout_ends_the_browser_s_session(page: Page, engine: AsyncEngine) -> None:
    await page.log_in(OPERATOR_TOKEN, start="/audit")
    await page.wait_for_path("/audit")

    # When the operator clicks "Log out"
    await page.click("form[action='/logout'] button")

    # Then the login form is back, and the audit page is out of reach again
    await page.wait_for_path("/login")
    await page.open("/audit")
    await page.wait_for_path("/login")
    audit = await rows(engine, "SELECT actor, action FROM console_audit ORDER BY id")
    assert [tuple(row) for row in audit] == [(OPERATOR, "login"), (OPERATOR, "logout")]
