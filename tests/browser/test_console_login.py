"""Logging in to the console in a real browser, as an operator and as a read-only user: the
form, the session it opens, the audit page with the user's name, and what a read-only session
is shown (no action on the pages where an operator has them) and refused (a replay of the dead
letters, which stay parked)."""

from __future__ import annotations

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.browser.page import Page
from tests.helpers import rows
from tests.integration.console_support import OPERATOR, OPERATOR_TOKEN, VIEWER, VIEWER_TOKEN
from tests.integration.support import park as park_outbox_row
from tests.integration.support import ready_messages
from tests.integration.test_dlq import Copy, park, parked_keys
from worker.settings import Settings

pytestmark = pytest.mark.integration

ACTIONS = """
// (a form's attributes are read with getAttribute: its `action` property is its field named
// "action" when it has one, as the dead letters' forms do)
const forms = Array.from(document.querySelectorAll("form"))
  .filter((form) => (form.getAttribute("method") || "get").toLowerCase() === "post")
  .map((form) => new URL(form.getAttribute("action") || "", location.href).pathname)
  .filter((path) => path !== "/logout");
const buttons = Array.from(document.querySelectorAll("button, input[type=submit]"))
  .map((button) => (button.textContent || button.value).trim())
  .filter((label) => /replay|purge|retry|hurry|cancel/i.test(label));
return forms.concat(buttons);
"""
"""The paths the page's POST forms act on (its logout aside) and the labels of its buttons that
would act on messages: what a read-only user must not be offered."""

FORGE_REPLAY = """
const form = document.createElement("form");
form.method = "post";
form.action = "/dead-letters/confirm";
const fields = [["csrf", arguments[0]], ["action", "replay"], ["scope", "filter"],
                ["before", new Date().toISOString()]];
for (const [name, value] of fields) {
  const input = document.createElement("input");
  input.type = "hidden";
  input.name = name;
  input.value = value;
  form.appendChild(input);
}
document.body.appendChild(form);
form.submit();
"""
"""The confirmation of a replay of every dead letter, built in the page with the page's own
CSRF token (``arguments[0]``): what a read-only user could post with their browser's devtools."""

STATUS = "return performance.getEntriesByType('navigation')[0].responseStatus;"
"""The HTTP status of the page the browser shows."""


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


async def pages_with_actions(page: Page) -> dict[str, list[str]]:
    """Each page a user reaches from the navigation, a group's messages, a message and an outbox
    row, with the actions it offers (``ACTIONS``)."""
    found = {}
    links = await page.script(
        'return Array.from(document.querySelectorAll("nav a")).map((a) => a.pathname);'
    )
    for link in links:
        await page.open(link)
        await page.wait_for_path(link)
        found[link] = await page.script(ACTIONS)
    await page.open("/dead-letters")
    await page.click_and_wait("#dlq-groups td.num a", "/dead-letters/messages")
    found["messages"] = await page.script(ACTIONS)
    await page.click("#dlq-messages tbody a")
    await page.wait_for_path_under("/dead-letters/message/")
    found["message"] = await page.script(ACTIONS)
    await page.open("/outbox?state=parked")
    await page.click("#outbox-rows tbody a")
    await page.wait_for_path_under("/outbox/row/")
    found["outbox row"] = await page.script(ACTIONS)
    return found


async def test_a_read_only_session_shows_no_action_and_its_replay_is_refused(
    page: Page, settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given two parked dead letters and a parked outbox row, which an operator is offered to
    # replay, purge and retry on the pages that show them
    await park(amqp, engine, settings, Copy("k1"), Copy("k2"))
    await park_outbox_row(engine, settings)
    await page.log_in(OPERATOR_TOKEN, start="/dead-letters")
    await page.wait_for_path("/dead-letters")
    offered = await pages_with_actions(page)
    assert "/dead-letters/preview" in offered["/dead-letters"]
    assert "Replay…" in offered["/dead-letters"]
    assert "Purge…" in offered["message"]
    assert "/outbox/retry/preview" in offered["/outbox"]
    assert "/outbox/retry/preview" in offered["outbox row"]
    await page.click("form[action='/logout'] button")
    await page.wait_for_path("/login")

    # When a read-only user logs in through the form
    await page.log_in(VIEWER_TOKEN, start="/dead-letters")
    await page.wait_for_path("/dead-letters")
    assert await page.text(".who") == f"{VIEWER} viewer"

    # Then no page offers it an action: no POST form but its logout, no button that acts
    shown = await pages_with_actions(page)
    assert shown.keys() == offered.keys()
    assert {name: actions for name, actions in shown.items() if actions} == {}

    # When it posts a replay of every dead letter anyway, with its page's own CSRF token
    token = await page.attribute("form[action='/logout'] input[name=csrf]", "value")
    await page.script(FORGE_REPLAY, token)
    await page.wait_for_path("/dead-letters/confirm")

    # Then the console refuses it, says why, replays nothing, and the audit says who tried
    assert await page.script(STATUS) == 403
    assert await page.text("#error") == "refused: this user may only look"
    assert await parked_keys(amqp, engine, settings) == ["k1", "k2"]
    async with amqp.channel() as channel:
        assert await ready_messages(channel, settings.queue) == 0
    audit = await rows(engine, "SELECT actor, action, outcome FROM console_audit ORDER BY id")
    assert [tuple(row) for row in audit] == [
        (OPERATOR, "login", "done"),
        (OPERATOR, "logout", "done"),
        (VIEWER, "login", "done"),
        (VIEWER, "/dead-letters/confirm", "refused: read-only user"),
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
