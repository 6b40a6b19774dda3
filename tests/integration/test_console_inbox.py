"""The console's inbox lookup against the real PostgreSQL: a completed key with its stored
result, a failed key with its error, a waiting workflow with its steps and what it waits for,
and a key the inbox does not have; every value a message or a handler chose comes back
escaped, a long one cut with a way to see it all."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import scalar
from tests.integration.console_support import VIEWER_TOKEN, logged_in, running_console
from tests.integration.test_hostile_input import TERMINAL_TRICKS
from worker import Context, Permanent, Router, Workflow
from worker.settings import Settings
from worker.testing import Harness

SCRIPT = "<script>alert(1)</script>"
HOSTILE_KEY = f"{SCRIPT}{TERMINAL_TRICKS[4]}&key=x"
"""An idempotency key a sender chose: markup, a right-to-left override, a query's characters."""

router = Router()
router.signal("parcel.confirmed", field="order_id")


@router.handler("thing.requested")
async def thing(body: dict[str, Any], ctx: Context) -> dict[str, Any]:
    if body.get("fail"):
        raise Permanent(f"refused {body['fail']}")
    return {"echo": body["say"]}


async def reserve(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    return {"reserved": order["sku"]}


@router.workflow("order.requested")
async def fulfil(order: dict[str, Any], wf: Workflow) -> dict[str, Any]:
    await wf.step("reserve", reserve, order)
    shipped = await wf.wait_for(
        "shipped", "parcel.confirmed", correlation=order["order_id"], timeout=timedelta(hours=1)
    )
    return {"shipped": shipped}


async def look_up(client: httpx.AsyncClient, handler: str, key: str, **more: str) -> httpx.Response:
    return await client.get("/inbox", params={"handler": handler, "key": key, **more})


async def test_a_completed_key_shows_its_stored_result_and_timestamps(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a key completed with a result that repeats what a hostile sender said
    done = await Harness(router, engine).deliver(
        "thing.requested", {"say": f"{SCRIPT} {TERMINAL_TRICKS[4]}"}, key="t-1"
    )
    assert done.outcome == "processed"
    fingerprint = await scalar(engine, "SELECT encode(fingerprint, 'hex') FROM inbox")

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user looks it up
        answer = await look_up(viewer.client, "thing.requested", "t-1")

    # Then its status, fingerprint, timestamps and result are shown, the result escaped
    assert answer.status_code == 200
    page = answer.text
    assert '<span class="status-completed" id="status">completed</span>' in page
    assert f"<code>{fingerprint}</code>" in page
    assert re.search(r"<dt>Created at</dt><dd>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</dd>", page)
    assert re.search(r"<dt>Updated at</dt><dd>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</dd>", page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt; \\u202egnp.exe" in page
    assert_inert(page)
    assert 'id="steps"' not in page  # (no workflow, no steps)


async def test_a_failed_key_shows_its_error_escaped(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a key that failed with an error carrying the sender's words
    failed = await Harness(router, engine).deliver(
        "thing.requested", {"fail": SCRIPT, "say": ""}, key="t-2"
    )
    assert failed.outcome == "dead_lettered"
    error = await scalar(engine, "SELECT error FROM inbox WHERE key = 't-2'")
    assert SCRIPT in error

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user looks it up
        page = (await look_up(viewer.client, "thing.requested", "t-2")).text

    # Then it is failed, and its error is shown, escaped
    assert '<span class="status-failed" id="status">failed</span>' in page
    assert re.search(r'<pre id="error-text"[^>]*>[^<]*refused &lt;script&gt;alert\(1\)', page)
    assert_inert(page)


async def test_a_waiting_workflow_shows_its_steps_and_what_it_waits_for(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a workflow that committed a step and waits for its parcel's confirmation
    waiting = await Harness(router, engine).deliver(
        "order.requested", {"order_id": "o-1", "sku": SCRIPT}, key="order-o-1"
    )
    assert waiting.outcome == "waiting"
    timer = await scalar(engine, "SELECT timer_id FROM workflow_waits")

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user looks its key up
        page = (await look_up(viewer.client, "order.requested", "order-o-1")).text

    # Then it is in progress, waits for the signal with its correlation until its deadline,
    # and lists the step it committed with its output, escaped
    assert '<span class="status-in_progress" id="status">in_progress</span>' in page
    assert re.search(
        r'id="open-wait">\s*Waits \(<code>shipped</code>\) for the signal '
        r"<code>parcel.confirmed</code> with correlation <code>o-1</code>, until "
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC",
        page,
    )
    assert f"Its timer is the scheduled event <code>{timer}</code>." in page
    steps = page[page.index('id="steps"') : page.index('id="waits"')]
    assert '<td class="wrap">reserve</td>' in steps
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in steps
    waits = page[page.index('id="waits"') :]
    assert '<span class="warn">open</span>' in waits
    assert_inert(page)


async def test_an_unknown_key_is_not_found(settings: Settings, engine: AsyncEngine) -> None:
    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        answer = await look_up(viewer.client, "thing.requested", SCRIPT)

    assert answer.status_code == 404
    assert 'id="not-found"' in answer.text
    assert "the inbox has no key <code>&lt;script&gt;alert(1)&lt;/script&gt;</code>" in answer.text
    assert_inert(answer.text)


async def test_the_keys_updated_last_link_to_their_lookup_whatever_their_characters(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a key a hostile sender chose, and a result past the first 4,096 characters
    await Harness(router, engine).deliver("thing.requested", {"say": "z" * 5000}, key=HOSTILE_KEY)

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user opens the inbox page, and follows the key's link
        start = (await viewer.client.get("/inbox")).text
        link = re.search(r'<a href="(/inbox\?handler=[^"]+)">', start)
        assert link is not None
        page = (await viewer.client.get(link.group(1).replace("&amp;", "&"))).text
        full = (await look_up(viewer.client, "thing.requested", HOSTILE_KEY, full="1")).text

    # Then the list shows the key escaped, and its link finds it
    assert "&lt;script&gt;alert(1)&lt;/script&gt;\\u202egnp.exe&amp;key=x" in start
    assert_inert(start)
    assert '<span class="status-completed" id="status">completed</span>' in page
    # And the result is cut, with a link to all of it
    assert "z" * 4000 in page
    assert "z" * 5000 not in page
    assert "The first 4,096 of 5," in page
    assert "z" * 5000 in full


def assert_inert(page: str) -> None:
    """No markup a stored value carried is live on ``page``."""
    assert re.findall(r"<script[^>]*>", page) == ['<script src="/static/console.js" defer>']
    assert "\u202e" not in page
