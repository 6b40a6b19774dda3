"""The dead letters in a real browser, parked by a real worker (in-process): an operator follows
the links from the groups to a group's messages to one message and reads it; replays a group
through its preview and confirmation and sees it leave the DLQ and its effect applied once, and
the same confirmation posted again replay nothing more; and a message whose body and headers
are markup, bidirectional overrides and bytes that are not UTF-8 is shown as text on every page,
inert even with the Content-Security-Policy out of the way."""

from __future__ import annotations

import json

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.browser.hostile import (
    BODY,
    BODY_SHOWN,
    IMAGE,
    NOT_UTF8,
    NOT_UTF8_SHOWN,
    RIGHT_TO_LEFT,
    RIGHT_TO_LEFT_SHOWN,
    SCRIPT,
    assert_inert,
)
from tests.browser.page import Page
from tests.helpers import rows, wait_until
from tests.integration.console_support import OPERATOR, OPERATOR_TOKEN
from tests.integration.support import publish, running_worker, settled
from tests.integration.test_dlq import parked_keys
from tests.integration.test_dlq_provenance import (
    ROUTING_KEY,
    Switch,
    applied,
    ledger,
    ledger_table,
    send,
)
from worker.settings import Settings

__all__ = ["ledger_table"]  # (a fixture this module's tests use)

pytestmark = pytest.mark.integration

CELLS = """
return Array.from(document.querySelectorAll(arguments[0] + " tbody tr"))
  .map((row) => Array.from(row.children).map((cell) => cell.textContent.trim()));
"""
"""The text of each cell of each body row of the table ``arguments[0]`` (a CSS selector)."""

FACTS = """
return Object.fromEntries(Array.from(document.querySelectorAll("#dlq-facts tr"))
  .map((row) => [row.querySelector("th").textContent.trim(),
                 row.querySelector("td").textContent.trim()]));
"""
"""A message page's facts (key, handler, reason, ...) by their names."""

FORM_FIELDS = """
return Array.from(new FormData(document.querySelector(arguments[0])).entries());
"""
"""The fields the form ``arguments[0]`` would post, in order."""

POST_AGAIN = """
const form = document.createElement("form");
form.method = "post";
form.action = arguments[0];
for (const [name, value] of arguments[1]) {
  const input = document.createElement("input");
  input.type = "hidden";
  input.name = name;
  input.value = value;
  form.appendChild(input);
}
document.body.appendChild(form);
form.submit();
"""
"""Post ``arguments[1]`` (the fields) to ``arguments[0]`` from the page: a confirmation posted
a second time, as a browser resubmitting it does."""


async def test_an_operator_opens_a_dead_letter_then_replays_its_group_once(
    page: Page,
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    ledger_table: None,
) -> None:
    # Given a worker whose ledger handler fails for good, which parked three messages of it,
    # and a message of the ledger that is not JSON (undecodable)
    class Ledger(Switch):
        failing = "permanent"

    async with running_worker(settings, ledger(Ledger)) as running:
        for n in (1, 2, 3):
            await send(amqp, settings, json.dumps({"n": n}).encode(), {"idempotency-key": f"k{n}"})
        await send(amqp, settings, b"{not json", {"idempotency-key": "k-invalid"})
        await settled(running, dead_lettered=4)

        # When the operator opens the dead letters
        await page.log_in(OPERATOR_TOKEN, start="/dead-letters")
        await page.wait_for_path("/dead-letters")

        # Then they are grouped by reason and handler, with their counts
        groups = await page.script(CELLS, "#dlq-groups")
        assert sorted(row[:3] for row in groups) == [
            ["handler-error", ROUTING_KEY, "3"],
            ["undecodable", ROUTING_KEY, "1"],
        ]
        assert "4" in await page.text("#dlq-depth")
        await page.screenshot("dead-letters")

        # When they follow the handler errors' link, then the group's three messages are listed
        link = "#dlq-groups a[href*='reason=handler-error']"
        await page.click_and_wait(link, "/dead-letters/messages")
        listed = await page.script(CELLS, "#dlq-messages")
        assert sorted(row[2] for row in listed) == ["k1", "k2", "k3"]
        assert {row[4] for row in listed} == {"handler-error"}

        # When they open the first message, then it shows what the worker recorded of it
        await page.click("#dlq-messages tbody a")
        await page.wait_for_path_under("/dead-letters/message/")
        facts = await page.script(FACTS)
        key = facts["Key"]
        assert key in ("k1", "k2", "k3")
        assert facts["Handler"] == ROUTING_KEY
        assert facts["Reason"] == "handler-error"
        assert facts["Routing key"] == ROUTING_KEY
        assert facts["Attempts"] == "1"
        assert "the ledger is closed" in facts["Error"]
        assert facts["Key recorded as failed"] == "yes"
        assert (await page.text("#dlq-provenance")).startswith("Parked by the worker")
        assert await page.text("#dlq-body") == json.dumps({"n": int(key[1])})

        # When the handler is fixed, and the operator asks to replay the group
        Ledger.failing = None
        await page.click_and_wait("a[href='/dead-letters']", "/dead-letters")
        await page.click_and_wait(
            "#dlq-groups form:has(input[name=reason][value=handler-error]) button[value=replay]",
            "/dead-letters/preview",
        )

        # Then the preview says the three would be replayed and none refused, and nothing moved
        assert await page.text("#dlq-would") == "3"
        assert await page.text("#dlq-refused") == "0"
        previewed = await page.script(CELLS, "#dlq-preview")
        assert sorted((row[1], row[5]) for row in previewed) == [
            (f"k{n}", "replayed") for n in (1, 2, 3)
        ]
        assert sorted(await parked_keys(amqp, engine, settings)) == ["k-invalid", "k1", "k2", "k3"]
        assert await applied(engine) == []
        assert (await page.text("#dlq-confirm p")).startswith(
            "Replay the 3 message(s) above? Messages parked after this preview are left alone."
        )
        await page.screenshot("replay-preview")

        # When they confirm
        confirmation = await page.script(FORM_FIELDS, "#dlq-confirm")
        await page.click("#dlq-confirm button[type=submit]")
        await page.wait_for_text("#dlq-result", "replayed")

        # Then the result says three were replayed, and each took effect, once
        assert (await page.text("#dlq-result")).startswith("3 message(s) replayed")
        assert await page.script(CELLS, "#dlq-done-by-group") == [
            ["handler-error", ROUTING_KEY, "3"]
        ]

        async def all_applied() -> bool:
            return len(await applied(engine)) == 3

        await wait_until(all_applied)
        assert await applied(engine) == [("k1", 1), ("k2", 2), ("k3", 3)]
        # and the group is gone from the DLQ: only the invalid message is left
        assert await parked_keys(amqp, engine, settings) == ["k-invalid"]
        await page.click_and_wait("a[href='/dead-letters']", "/dead-letters")
        groups = await page.script(CELLS, "#dlq-groups")
        assert [row[:3] for row in groups] == [["undecodable", ROUTING_KEY, "1"]]

        # When the handler fails again and parks a fourth message of the group, and the same
        # confirmation is posted again
        Ledger.failing = "permanent"
        await send(amqp, settings, json.dumps({"n": 4}).encode(), {"idempotency-key": "k4"})
        await settled(running, dead_lettered=5)
        await page.script(POST_AGAIN, "/dead-letters/confirm", confirmation)
        await page.wait_for_text("#dlq-result", "replayed")

        # Then it replays nothing more: the three are gone, and the fourth was parked after the
        # preview that was confirmed; nothing took effect twice
        assert (await page.text("#dlq-result")).startswith("0 message(s) replayed")
        assert await parked_keys(amqp, engine, settings) == ["k-invalid", "k4"]
        assert await applied(engine) == [("k1", 1), ("k2", 2), ("k3", 3)]

        # And the audit page lists both replays
        await page.open("/audit")
        await page.wait_for_path("/audit")
        shown = await page.texts("#audit tbody tr")
        assert [entry.split(" UTC ", 1)[1] for entry in shown] == [
            f"{OPERATOR} operator dlq replay reason=handler-error handler={ROUTING_KEY} 0 done",
            f"{OPERATOR} operator dlq replay reason=handler-error handler={ROUTING_KEY} 3 done",
            f"{OPERATOR} operator login 0 done",
        ]
        await page.screenshot("audit")

    # And the audit table has both, by whom, of what, how many
    audit = await rows(
        engine,
        "SELECT actor, action, target, count, outcome FROM console_audit "
        "WHERE action = 'dlq replay' ORDER BY id",
    )
    target = f"reason=handler-error handler={ROUTING_KEY}"
    assert [tuple(row) for row in audit] == [
        (OPERATOR, "dlq replay", target, 3, "done"),
        (OPERATOR, "dlq replay", target, 0, "done"),
    ]


HOSTILE_KEY = SCRIPT + IMAGE
HOSTILE_HEADERS = {
    "x-script": SCRIPT,
    "x-image": IMAGE,
    "x-right-to-left": RIGHT_TO_LEFT,
    "x-bytes": bytearray(NOT_UTF8[:1] + IMAGE.encode()),
    SCRIPT: "a header's name",
}


async def test_a_hostile_message_is_shown_as_text_on_every_dead_letter_page(
    page: Page, settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a message parked by the worker (its body is not UTF-8) whose key, body and headers
    # are markup that would run a script, a right-to-left override and bytes that are not UTF-8
    async with running_worker(settings, payments) as running:
        channel = await amqp.channel()
        await publish(channel, settings, BODY, key=HOSTILE_KEY, headers=HOSTILE_HEADERS)
        await settled(running, dead_lettered=1)
    # and a browser that ignores the Content-Security-Policy: only the escaping protects it
    await page.bypass_csp(True)
    try:
        await page.log_in(OPERATOR_TOKEN, start="/dead-letters")
        await page.wait_for_path("/dead-letters")

        # When the operator opens the groups, the messages, the message and all of it
        # Then none of it is live on any page, and each shows the text as it came
        await assert_inert(page)
        assert [row[:3] for row in await page.script(CELLS, "#dlq-groups")] == [
            ["undecodable", "payment.requested", "1"]
        ]

        await page.click_and_wait(
            "#dlq-groups a[href*='reason=undecodable']", "/dead-letters/messages"
        )
        await assert_inert(page)
        [listed] = await page.script(CELLS, "#dlq-messages")
        assert listed[2] == HOSTILE_KEY

        await page.click("#dlq-messages tbody a")
        await page.wait_for_path_under("/dead-letters/message/")
        shown = await assert_inert(page)
        assert (await page.script(FACTS))["Key"] == HOSTILE_KEY
        body = await page.text("#dlq-body")
        assert body == BODY_SHOWN
        assert "Not UTF-8" in shown
        headers = dict(await page.script(CELLS.replace(" tbody tr", " tr"), "#dlq-headers"))
        assert headers["x-script"] == SCRIPT
        assert headers["x-image"] == IMAGE
        assert headers["x-right-to-left"] == RIGHT_TO_LEFT_SHOWN
        assert headers["x-bytes"] == NOT_UTF8_SHOWN[:4] + IMAGE
        assert headers[SCRIPT] == "a header's name"
        await page.screenshot("dead-letter", whole=True)

        await page.open(await page.path() + "?full=1")
        assert (await page.path()).endswith("?full=1")
        await assert_inert(page)
        assert await page.text("#dlq-body") == body
    finally:
        await page.bypass_csp(False)
