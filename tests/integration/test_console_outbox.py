"""The console's outbox page against the real PostgreSQL and RabbitMQ: each state lists its rows
and counts them; retry, hurry and cancel are previewed without a change, then done by the
operator's confirmation, with their effect in the tables (and a relay publishing a retried
row), refused to a read-only user and to a form without the CSRF token, and written to the
audit; a row's hostile body, headers and error come back inert."""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta
from typing import Any

import httpx
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import rows, scalar, wait_until
from tests.integration.console_support import (
    OPERATOR,
    OPERATOR_TOKEN,
    VIEWER_TOKEN,
    logged_in,
    running_console,
)
from tests.integration.support import (
    ROUTING_KEY,
    add_outbox_row,
    declare,
    park,
    running_relay,
    schedule,
)
from tests.integration.test_hostile_input import INVALID_UTF8, NOT_JSON, TERMINAL_TRICKS
from worker import Router, Workflow
from worker.settings import Settings
from worker.sql import outbox
from worker.testing import Harness

OTHER_KEY = "stock.changed"
SCRIPT = "<script>alert(1)</script>"


async def backing_off(engine: AsyncEngine, settings: Settings) -> tuple[int, uuid.UUID]:
    """A row whose publish failed once, the way a relay records it: it backs off (5 min)."""
    row_id, message_id = await add_outbox_row(engine, settings)
    async with engine.begin() as conn:
        parked = await outbox.fail_outbox(
            conn, {row_id: "returned as unroutable: NO_ROUTE"}, max_attempts=5, retry_delay=3600.0
        )
    assert parked == []
    return row_id, message_id


async def audit_entries(engine: AsyncEngine) -> list[Any]:
    return await rows(
        engine,
        "SELECT actor, action, target, count, outcome, detail FROM console_audit"
        " WHERE action <> 'login' ORDER BY id",
    )


def done_id(answer: httpx.Response) -> str:
    """The result page an action redirects to."""
    assert answer.status_code == 303, answer.text
    location = answer.headers["location"]
    assert re.fullmatch(r"/outbox/done/\d+", location), location
    return location


async def test_each_state_lists_its_rows_under_its_count(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a row in each state
    (scheduled,) = await schedule(engine, settings, timedelta(hours=1))
    pending_id, pending = await add_outbox_row(engine, settings)
    backing_id, backing = await backing_off(engine, settings)
    parked_id, parked = await park(engine, settings)

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user opens the outbox, then each state
        first = await viewer.client.get("/outbox")
        pages = {
            state: (await viewer.client.get("/outbox", params={"state": state})).text
            for state in ("scheduled", "pending", "backing-off", "parked")
        }

    # Then the page opens on the parked rows (trouble first), and every state counts one row
    assert first.status_code == 200
    assert str(parked) in first.text
    for state in pages:
        assert re.search(
            rf'id="count-{state}">\s*<span class="label">{state}</span>\s*'
            r'<span class="value">1</span>',
            first.text,
        ), state
    # And each state's page lists its own row, and only it
    shown = {scheduled: "scheduled", pending: "pending", backing: "backing-off", parked: "parked"}
    for message_id, state in shown.items():
        for other, page in pages.items():
            assert (str(message_id) in page) == (other == state), (state, other)
    assert f'href="/outbox/row/pending/{pending_id}"' in pages["pending"]
    assert "returned as unroutable: NO_ROUTE" in pages["backing-off"]
    assert f'href="/outbox/row/backing-off/{backing_id}"' in pages["backing-off"]
    assert "unroutable: NO_ROUTE" in pages["parked"]
    assert f'href="/outbox/row/parked/{parked_id}"' in pages["parked"]
    # And a read-only user is offered no action
    assert all('type="checkbox"' not in page for page in pages.values())
    assert all("/preview" not in page for page in pages.values())


async def next_page(client: httpx.AsyncClient, page: str) -> str:
    """The page the ``Next`` link of ``page`` leads to."""
    following = re.search(r'href="([^"]+)" id="next-page"', page)
    assert following is not None, "no next page"
    return (await client.get(following.group(1).replace("&amp;", "&"))).text


def listed_ids(state: str, page: str) -> list[int]:
    return [int(n) for n in re.findall(rf'href="/outbox/row/{state}/(\d+)"', page)]


async def test_a_long_state_is_counted_up_to_its_cap_and_paged_by_keyset(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given 1,001 parked rows, and 201 events scheduled a minute apart
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO outbox_parked (id, message_id, exchange, routing_key, body,"
                " content_type, headers, attempts, last_error, created_at)"
                " SELECT n, gen_random_uuid(), 'events', :key, '\\x7b7d', 'application/json',"
                " '{}', 5, 'returned', now() FROM generate_series(1, 1001) AS n"
            ),
            {"key": ROUTING_KEY},
        )
    await schedule(engine, settings, *(timedelta(minutes=201 - n) for n in range(201)))
    earliest_due = await rows(engine, "SELECT id FROM outbox_scheduled ORDER BY due_at, id")

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user opens each state, then its next page
        parked = (await viewer.client.get("/outbox", params={"state": "parked"})).text
        parked_next = await next_page(viewer.client, parked)
        scheduled = (await viewer.client.get("/outbox", params={"state": "scheduled"})).text
        scheduled_next = await next_page(viewer.client, scheduled)

    # Then the count says more than it counts, and the pages follow each other, 200 each
    assert re.search(r'id="count-parked">.*?&gt; 1,000</span>', parked, re.DOTALL)
    assert re.search(r'id="count-scheduled">.*?>201</span>', parked, re.DOTALL)
    assert listed_ids("parked", parked) == list(range(1, 201))
    assert listed_ids("parked", parked_next) == list(range(201, 401))
    # (scheduled events earliest due first, the second page after the first's last due time)
    assert listed_ids("scheduled", scheduled) == [row_id for (row_id,) in earliest_due[:200]]
    assert listed_ids("scheduled", scheduled_next) == [earliest_due[200][0]]
    assert 'id="next-page"' not in scheduled_next


async def test_retry_of_a_ticked_parked_row_is_previewed_then_done_and_a_relay_publishes_it(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given the topology and a parked row, and one parked row left alone
    await declare(amqp, settings)
    parked_id, parked = await park(engine, settings)
    other_id, _ = await park(engine, settings)

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the operator ticks it and asks for a preview
        listed = (await op.client.get("/outbox", params={"state": "parked"})).text
        assert f'name="id" value="{parked_id}"' in listed
        preview = await op.post("/outbox/retry/preview", {"id": str(parked_id)})

        # Then the preview says what the retry would do, and nothing changed
        assert preview.status_code == 200, preview.text
        assert re.search(r"<strong>1</strong> parked row\(s\) would be moved", preview.text)
        assert str(parked) in preview.text
        assert f'<input type="hidden" name="id" value="{parked_id}">' in preview.text
        assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 2
        assert await scalar(engine, "SELECT count(*) FROM outbox") == 0

        # When the operator confirms
        answer = await op.post("/outbox/retry", {"id": str(parked_id)})
        result = (await op.client.get(done_id(answer))).text

    # Then the row is back in the outbox under its message id, with 0 attempts; the other stays
    assert await rows(engine, "SELECT message_id, attempts FROM outbox") == [(parked, 0)]
    assert await rows(engine, "SELECT id FROM outbox_parked") == [(other_id,)]
    assert re.search(r"<strong>1</strong> parked row\(s\) moved back into the outbox", result)
    # And the audit names who did what to which row, and how many
    ((actor, action, target, count, outcome, detail),) = await audit_entries(engine)
    assert (actor, action, target, count, outcome) == (
        OPERATOR,
        "outbox.retry",
        f"parked ids {parked_id}",
        1,
        "done",
    )
    assert detail["done"] == {"first": [str(parked_id)], "total": 1}
    # And a relay publishes it, under its message id
    async with running_relay(settings):

        async def published() -> bool:
            return bool(await scalar(engine, "SELECT count(*) FROM outbox") == 0)

        await wait_until(published)
    async with amqp.channel() as channel:
        queue = await channel.get_queue(settings.queue)
        message = await queue.get(no_ack=True, fail=False)
    assert message is not None
    assert message.message_id == str(parked)


async def test_hurry_of_a_routing_key_makes_its_backing_off_rows_due_and_no_other(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given two rows of a routing key backing off, and one of another key
    (first_id, _), (second_id, _) = [await backing_off(engine, settings) for _ in range(2)]
    other_id, _ = await backing_off(engine, settings)
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE outbox SET routing_key = :k WHERE id = :i"),
            {"k": OTHER_KEY, "i": other_id},
        )
    due = "SELECT id FROM outbox WHERE available_at <= now() ORDER BY id"

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the operator filters the backing-off rows by the key and previews a hurry of all
        listed = await op.client.get(
            "/outbox", params={"state": "backing-off", "routing_key": ROUTING_KEY}
        )
        assert 'id="whole-key"' in listed.text
        preview = await op.post("/outbox/hurry/preview", {"routing_key": ROUTING_KEY})

        # Then the preview names both rows, and nothing is due yet
        assert preview.status_code == 200, preview.text
        assert re.search(r"<strong>2</strong> backing-off row\(s\) would be made due", preview.text)
        assert f'<input type="hidden" name="routing_key" value="{ROUTING_KEY}">' in preview.text
        assert await rows(engine, due) == []

        # When the operator confirms
        answer = await op.post("/outbox/hurry", {"routing_key": ROUTING_KEY})
        result = (await op.client.get(done_id(answer))).text

    # Then both are due now and keep their attempt; the other key's row still backs off
    assert await rows(engine, due) == [(first_id,), (second_id,)]
    assert await rows(engine, "SELECT DISTINCT attempts FROM outbox") == [(1,)]
    assert re.search(r"<strong>2</strong> backing-off row\(s\) made due now", result)
    ((_, action, target, count, outcome, _),) = await audit_entries(engine)
    assert (action, target, count, outcome) == (
        "outbox.hurry",
        f"backing-off rows of routing key {ROUTING_KEY}",
        2,
        "done",
    )


async def test_cancel_removes_a_scheduled_event_and_refuses_a_workflows_timer(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a workflow sleeping for an hour (its timer scheduled) and an event scheduled too
    router = Router()

    @router.workflow("nap.requested")
    async def nap(body: dict[str, str], wf: Workflow) -> None:
        await wf.sleep("nap", timedelta(hours=1))

    napping = await Harness(router, engine).deliver("nap.requested", {}, key="n1")
    assert napping.outcome == "waiting"
    timer = await scalar(engine, "SELECT timer_id FROM workflow_waits WHERE outcome IS NULL")
    (scheduled,) = await schedule(engine, settings, timedelta(hours=1))
    both = {"message_id": [str(timer), str(scheduled)]}

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the operator lists the scheduled events
        listed = (await op.client.get("/outbox", params={"state": "scheduled"})).text
        # Then only the event can be ticked; the timer says whose it is
        assert f'name="message_id" value="{scheduled}"' in listed
        assert f'value="{timer}"' not in listed
        assert "timer of a waiting workflow's wait <code>nap</code>: not cancellable" in listed

        # When a form asks to cancel both (the timer forged in), first as a preview
        preview = await op.post("/outbox/cancel/preview", both)
        # Then the preview cancels the event, refuses the timer, and changes nothing
        assert preview.status_code == 200, preview.text
        assert re.search(r"<strong>1</strong> event\(s\) would be cancelled", preview.text)
        assert re.search(rf'id="refused-timers">.*?<code>{timer}</code>', preview.text, re.DOTALL)
        assert f'<input type="hidden" name="message_id" value="{timer}">' not in preview.text
        assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 2

        # When the operator confirms
        answer = await op.post("/outbox/cancel", both)
        result = (await op.client.get(done_id(answer))).text

    # Then the event is gone for good and the timer stays scheduled
    assert await rows(engine, "SELECT message_id FROM outbox_scheduled") == [(timer,)]
    assert re.search(r"<strong>1</strong> event\(s\) cancelled", result)
    assert re.search(rf'id="refused-timers">.*?<code>{timer}</code>', result, re.DOTALL)
    ((_, action, _, count, outcome, detail),) = await audit_entries(engine)
    assert (action, count, outcome) == ("outbox.cancel", 1, "done")
    assert detail["timers"] == {"first": [str(timer)], "total": 1}
    assert detail["done"] == {"first": [str(scheduled)], "total": 1}


ACTIONS = [
    ("/outbox/retry/preview", "parked"),
    ("/outbox/retry", "parked"),
    ("/outbox/hurry/preview", "backing-off"),
    ("/outbox/hurry", "backing-off"),
    ("/outbox/cancel/preview", "scheduled"),
    ("/outbox/cancel", "scheduled"),
]


async def test_a_read_only_user_and_a_form_without_the_csrf_token_change_nothing(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a row in each state an action takes
    parked_id, _ = await park(engine, settings)
    backing_id, _ = await backing_off(engine, settings)
    (scheduled,) = await schedule(engine, settings, timedelta(hours=1))
    forms: dict[str, dict[str, str | list[str]]] = {
        "parked": {"id": str(parked_id)},
        "backing-off": {"id": str(backing_id)},
        "scheduled": {"message_id": str(scheduled)},
    }
    tables = "SELECT (SELECT count(*) FROM outbox_parked), (SELECT count(*) FROM outbox_scheduled)"
    before = await rows(engine, tables)
    backing = "SELECT available_at FROM outbox WHERE id = :i"
    backing_before = await scalar(engine, backing, i=backing_id)

    async with running_console(settings) as console:
        async with logged_in(console, VIEWER_TOKEN) as viewer:
            # When a read-only user posts each action, with the session's CSRF token
            refused = [
                (await viewer.post(path, forms[state])).status_code for path, state in ACTIONS
            ]
        async with logged_in(console, OPERATOR_TOKEN) as op:
            # And an operator posts each one without the token
            forged = [
                (await op.client.post(path, data=forms[state])).status_code
                for path, state in ACTIONS
            ]
            wrong = await op.client.post(
                "/outbox/retry", data={"csrf": "not-the-token", **forms["parked"]}
            )

    # Then each is refused, and nothing changed
    assert refused == [403] * len(ACTIONS)
    assert forged == [403] * len(ACTIONS)
    assert wrong.status_code == 403
    assert await rows(engine, tables) == before
    assert await scalar(engine, backing, i=backing_id) == backing_before
    # And the audit has each refusal, by whom and why
    outcomes = [(action, outcome) for _, action, _, _, outcome, _ in await audit_entries(engine)]
    paths = [path for path, _ in ACTIONS]
    assert outcomes == [
        *((path, "refused: read-only user") for path in paths),
        *((path, "refused: no valid CSRF token") for path in paths),
        ("/outbox/retry", "refused: no valid CSRF token"),
    ]


async def hostile_parked_row(engine: AsyncEngine, body: bytes) -> int:
    """A parked row whose routing key, headers, body and last error a hostile sender chose."""
    headers = {
        "x-note": '<img src=x onerror="alert(1)">',
        "correlation-id": TERMINAL_TRICKS[3],
        "x-bidi": TERMINAL_TRICKS[4],
    }
    async with engine.begin() as conn:
        return int(
            (
                await conn.execute(
                    text(
                        "INSERT INTO outbox_parked (id, message_id, exchange, routing_key, body,"
                        " content_type, headers, correlation_id, attempts, last_error,"
                        " created_at) VALUES (7, :m, 'events', :k, :b, 'text/html', :h, :c, 5,"
                        " :e, now()) RETURNING id"
                    ),
                    {
                        "m": uuid.uuid4(),
                        "k": f"<b>{SCRIPT}</b>",
                        "b": body,
                        "h": json.dumps(headers),
                        "c": "</code><script>alert(2)</script>",
                        "e": f"{SCRIPT} {TERMINAL_TRICKS[0]} {TERMINAL_TRICKS[4]} " + "x" * 300,
                    },
                )
            ).scalar_one()
        )


def assert_inert(page: str) -> None:
    """No markup a stored value carried is live on ``page``: it is there escaped."""
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page
    assert "<b>" not in page
    assert "\u202e" not in page  # (the right-to-left override is shown, not obeyed)
    assert "\x1b" not in page
    assert re.findall(r"<script[^>]*>", page) == ['<script src="/static/console.js" defer>']


async def test_a_hostile_body_headers_and_error_come_back_escaped_and_cut(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a parked row whose values are hostile: markup, terminal escapes, a right-to-left
    # override, bytes that are not UTF-8 and JSON that is not, and a body past 4 KiB
    body = (
        SCRIPT.encode()
        + b"".join(NOT_JSON[:6])
        + b"".join(INVALID_UTF8)
        + TERMINAL_TRICKS[4].encode()
        + b"\x00"
        + b"y" * 5000
    )
    row_id = await hostile_parked_row(engine, body)

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the operator lists the parked rows, opens the row, and asks for all of its body
        listed = (await op.client.get("/outbox", params={"state": "parked"})).text
        row = (await op.client.get(f"/outbox/row/parked/{row_id}")).text
        full = (await op.client.get(f"/outbox/row/parked/{row_id}", params={"full": "1"})).text

    # Then every value is there, escaped, with its hidden characters shown as escapes
    for page in (listed, row, full):
        assert_inert(page)
        assert "&lt;b&gt;&lt;script&gt;alert(1)&lt;/script&gt;&lt;/b&gt;" in page
        assert "\\u202egnp.exe" in page
    assert "\\u001b[2J\\u001b[H" in row
    assert "&lt;img src=x onerror=\\&#34;alert(1)\\&#34;&gt;" in row
    assert "&lt;/code&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in row
    # And the list cuts the error, the row shows the body's first 4 KiB and links to the rest
    assert "x" * 300 not in listed
    assert "x" * 300 in row
    assert "\\xff\\xc3\\xed\\xa0\\x80" in row
    assert "\\u0000" in row
    assert f"The first 4,096 of {len(body):,} bytes." in row
    assert f'href="/outbox/row/parked/{row_id}?full=1" id="see-all"' in row
    assert "y" * 5000 not in row
    assert "y" * 5000 in full
    assert 'id="body-cut"' not in full


async def test_an_unknown_state_or_row_is_not_found(settings: Settings) -> None:
    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        state = await viewer.client.get("/outbox", params={"state": "backing_off"})
        row = await viewer.client.get("/outbox/row/parked/12345")
        other = await viewer.client.get("/outbox/row/sent/1")
        result = await viewer.client.get("/outbox/done/999999")

    assert state.status_code == 404
    assert row.status_code == 404
    assert "No parked row has id 12345" in row.text
    assert other.status_code == 404
    assert result.status_code == 404


async def test_a_selection_that_is_no_selection_is_refused_and_changes_nothing(
    settings: Settings, engine: AsyncEngine
) -> None:
    await park(engine, settings)

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        nothing = await op.post("/outbox/retry", {})
        not_an_id = await op.post("/outbox/retry", {"id": "1 OR 1=1"})
        not_a_uuid = await op.post("/outbox/cancel", {"message_id": "'; DROP TABLE outbox"})
        too_long = await op.post("/outbox/hurry", {"routing_key": "k" * 256})

    assert [r.status_code for r in (nothing, not_an_id, not_a_uuid, too_long)] == [400] * 4
    assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 1
    assert await audit_entries(engine) == []
