"""The console's dead-letter pages against the real RabbitMQ and PostgreSQL: groups by reason and
handler, a message's hostile headers and body rendered inert, replay and purge previewed by the
real dry run (which changes nothing) and confirmed through the code ``worker dlq`` runs, with its
refusals (too old, unverified) unless forced; a viewer's and a CSRF-less POST refused; each
action in the audit.

Messages are parked as the worker parks them (``test_dlq.park``), by the real consumer (the
ledger handler of ``test_dlq_provenance``), or by the broker itself (``forge``: unverified)."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any

import httpx
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import broker_depth, rows, wait_until
from tests.integration.console_support import (
    OPERATOR,
    OPERATOR_TOKEN,
    VIEWER_TOKEN,
    Browser,
    logged_in,
    running_console,
)
from tests.integration.support import running_worker
from tests.integration.test_dlq import (
    HANDLER,
    OLD,
    OTHER_HANDLER,
    Copy,
    failed_keys,
    park,
    parked_keys,
)
from tests.integration.test_dlq_provenance import (
    ROUTING_KEY,
    Switch,
    applied,
    dlq_depth,
    forge,
    forged_headers,
    ledger,
    ledger_table,
    send,
)
from tests.integration.test_hostile_input import INVALID_UTF8, NOT_JSON, TERMINAL_TRICKS
from worker.ops import dlq
from worker.settings import Settings

__all__ = ["ledger_table"]  # (a fixture this module's tests use)

HOSTILE_HTML = (
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(2)>",
    '"><svg onload=alert(3)>',
    "</pre><script>alert(4)</script>",
)
"""Markup a message may carry, which a page must show as text."""
HOSTILE_MARKUP = ("<script>alert", "<img", "<svg", "</pre><script")
"""What must never appear raw in a page: escaped, it is ``&lt;script&gt;…``."""


class Forms(HTMLParser):
    """The forms of a page: each one's id (or action) and its fields, in order."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.forms: dict[str, list[tuple[str, str]]] = {}
        self._current: list[tuple[str, str]] | None = None
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {name: value or "" for name, value in attrs}
        if tag == "form":
            self._current = self.forms.setdefault(found.get("id") or found["action"], [])
        elif (
            tag == "input"
            and self._current is not None
            and "name" in found
            and (found.get("type") != "checkbox" or "checked" in found)
        ):
            self._current.append((found["name"], found.get("value", "")))

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._current = None


def fields(page: str, form: str, **extra: str) -> dict[str, str | list[str]]:
    """The fields form ``form`` of ``page`` would post (and ``extra``)."""
    found: dict[str, list[str]] = {}
    for name, value in Forms(page).forms[form]:
        found.setdefault(name, []).append(value)
    for name, value in extra.items():
        found[name] = [value]
    return {name: values[0] if len(values) == 1 else values for name, values in found.items()}


def text_of(markup: str) -> str:
    """What ``markup`` reads as: tags dropped, entities decoded, whitespace squeezed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


def cells(page: str, table: str) -> list[list[str]]:
    """The text of each body row's cells of table ``table`` of ``page``, whitespace squeezed."""
    body = page.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    return [
        [text_of(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)
        if "<td" in row
    ]


def assert_inert(page: str) -> None:
    """No markup a message carried is live in ``page``, and no control character reached it."""
    for raw in HOSTILE_MARKUP:
        assert raw not in page, raw
    assert page.count("<script") == 1  # the console's own script tag
    assert not re.search(r"<[^>]*\son\w+=", page)  # no tag has an event handler
    for control in ("\x1b", "\x07", "\r", "\u202e", "\x00"):
        assert control not in page


async def preview(browser: Browser, **form: str | list[str]) -> httpx.Response:
    answer = await browser.post("/dead-letters/preview", form)
    assert answer.status_code == 200, answer.text
    return answer


async def confirm(browser: Browser, preview_page: str) -> httpx.Response:
    """Post the preview's confirm form as it is, and follow it to the result page."""
    answer = await browser.client.post(
        "/dead-letters/confirm", data=fields(preview_page, "dlq-confirm")
    )
    assert answer.status_code == 303, answer.text
    result = await browser.client.get(answer.headers["location"])
    assert result.status_code == 200, result.text
    return result


async def audit_rows(engine: AsyncEngine) -> list[Sequence[Any]]:
    return await rows(
        engine,
        "SELECT actor, action, target, count, outcome, detail FROM console_audit "
        "WHERE action LIKE 'dlq %' OR outcome LIKE 'refused%' ORDER BY id",
    )


async def test_the_groups_count_each_reason_and_handler_and_link_their_messages(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given three handler errors of one handler, an invalid message of it, a handler error of
    # another handler, and a copy the broker dead-lettered itself (no record: unverified)
    await park(
        amqp,
        engine,
        settings,
        Copy("k1", age=timedelta(minutes=10)),
        Copy("k2", reason="invalid"),
        Copy("k3"),
        Copy("k4", handler=OTHER_HANDLER),
        Copy("k5", age=timedelta(minutes=1)),
    )
    await forge(amqp, settings, b'{"n": 6}', forged_headers("k6", "not-a-parking-id"))
    await dlq_depth(settings, 6)

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a read-only user opens the dead letters
        page = (await viewer.client.get("/dead-letters")).text

        # Then the DLQ's depth is at the top and each group has its count, its first and last
        # parking and an example error; a viewer is offered no action
        assert f"<code>{settings.dead_letter_queue}</code> holds <strong>6</strong>" in page
        groups = cells(page, "dlq-groups")
        assert [row[:3] for row in groups] == [
            ["handler-error", HANDLER, "3"],
            ["handler-error", OTHER_HANDLER, "1"],
            ["invalid", HANDLER, "1"],
            ["unverified", "-", "1"],
        ]
        first, last = groups[0][3:5]
        assert first < last  # k1 ten minutes ago, k3 now
        assert groups[0][5] == "KeyError: 'account'"
        assert groups[3][5].startswith("unverified: no record of its parking id")
        assert "6 message(s) in 4 group(s)" in text_of(page)
        assert "it holds more" not in page
        assert "Replay…" not in page

        # When they follow a group's link, then its messages are listed, oldest first
        link = html.unescape(re.findall(r'<a href="(/dead-letters/messages[^"]*)"', page)[1])
        assert link == f"/dead-letters/messages?reason=handler-error&handler={HANDLER}"
        listed = cells((await viewer.client.get(link)).text, "dlq-messages")
        assert [row[1] for row in listed] == ["k1", "k3", "k5"]
        assert all(row[4] == "KeyError: 'account'" for row in listed)

        # And the filters select as the CLI's do (`-`: the messages without a handler)
        invalid = (await viewer.client.get("/dead-letters?reason=invalid")).text
        assert [row[:3] for row in cells(invalid, "dlq-groups")] == [["invalid", HANDLER, "1"]]
        none = (await viewer.client.get("/dead-letters/messages?handler=-")).text
        assert [(row[1], row[3]) for row in cells(none, "dlq-messages")] == [("k6", "unverified")]
        by_key = (await viewer.client.get("/dead-letters/messages?key=k4")).text
        assert [row[2] for row in cells(by_key, "dlq-messages")] == [OTHER_HANDLER]
        typo = await viewer.client.get("/dead-letters?reason=handler_error")
        assert typo.status_code == 400
        assert "unknown reason" in typo.text

    # And looking changed nothing
    assert await parked_keys(amqp, engine, settings) == ["k1", "k2", "k3", "k4", "k5", "k6"]


async def test_the_messages_are_listed_a_page_at_a_time(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, *(Copy(f"k{n:03}") for n in range(105)))

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        first = (await op.client.get("/dead-letters/messages")).text
        later = re.search(r'<a href="([^"]+)">Later</a>', first)
        assert later is not None
        second = (await op.client.get(html.unescape(later.group(1)))).text

    assert [row[2] for row in cells(first, "dlq-messages")] == [f"k{n:03}" for n in range(100)]
    assert [row[2] for row in cells(second, "dlq-messages")] == [
        f"k{n:03}" for n in range(100, 105)
    ]
    assert "Messages 101 to 105" in second
    assert "Later" not in second
    # an operator gets a box per message and one that ticks them all
    assert first.count('type="checkbox" name="id"') == 100
    assert 'data-select-all value="id"' in first


async def test_a_missing_dlq_is_said_and_never_declared(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given no worker has declared the queues yet
    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When the dead letters are opened
        page = (await viewer.client.get("/dead-letters")).text
        messages = (await viewer.client.get("/dead-letters/messages")).text

    # Then the page says the DLQ does not exist, and it still does not
    assert "does not exist" in page
    assert "does not exist" in messages
    assert await dlq.depth(amqp, settings) is None


async def test_a_message_page_renders_hostile_headers_and_bodies_inert(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given copies the broker dead-lettered with markup, terminal tricks, NUL, bodies that are
    # not JSON and bytes that are not UTF-8, in their bodies, header values and header names
    markup = "".join(HOSTILE_HTML)
    hostile_headers = forged_headers(markup, "<b>no</b>") | {
        "x-note": markup + "".join(TERMINAL_TRICKS),
        "<script>name</script>": "value",
        "x-bytes": bytearray(INVALID_UTF8[0] + b"<img src=x onerror=alert(5)>"),
        "x-nested": {"deep": [markup]},
    }
    bodies = [
        (markup + "\n" + "".join(TERMINAL_TRICKS)).encode() + b"\x00",
        b"".join(INVALID_UTF8) + b"<script>alert(6)</script>",
        *NOT_JSON[-3:],
    ]
    for body in bodies:
        await forge(amqp, settings, body, hostile_headers)
    await dlq_depth(settings, len(bodies))
    parked = await dlq.list_parked(amqp, engine, settings)

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the groups, the list and each message are shown
        pages = [
            (await op.client.get("/dead-letters")).text,
            (await op.client.get("/dead-letters/messages")).text,
        ]
        for copy in parked:
            answer = await op.client.get(f"/dead-letters/message/{copy.id}")
            assert answer.status_code == 200, answer.text
            answer.content.decode("utf-8")  # (strict: the page is UTF-8 whatever the body)
            pages.append(answer.text)
            pages.append((await op.client.get(f"/dead-letters/message/{copy.id}?full=1")).text)

    # Then nothing the messages carried is live: markup is text, control characters escaped
    for page in pages:
        assert_inert(page)
    text_page, binary_page = pages[2], pages[4]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;" in text_page
    assert "\\u001b[2J\\u001b[H" in text_page
    assert "\\u202egnp.exe" in text_page
    assert "\\u0000" in text_page
    assert "&lt;script&gt;name&lt;/script&gt;" in text_page  # a header's name
    assert "x-worker-reason" in text_page  # every header, the claims too
    assert "Unverified (its body is not the one the worker parked)" not in text_page
    assert "Unverified (no record of its parking id)" in text_page
    # and bytes that are not UTF-8 are escapes, the page says so
    assert "\\xff\\xc3\\xed\\xa0\\x80" in binary_page
    assert "&lt;script&gt;alert(6)&lt;/script&gt;" in binary_page
    assert "Not UTF-8" in binary_page
    assert "Not UTF-8" not in text_page
    assert "\\xff&lt;img src=x onerror=alert(5)&gt;" in text_page  # a header's bytes
    assert await broker_depth(settings.dead_letter_queue) == len(bodies)


async def test_a_long_body_is_cut_at_4_kib_with_a_link_to_all_of_it(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a parked body of 5000 "é" (two bytes each) and an end mark, and a header of 2000
    body = "é".encode() * 5000 + b"END"
    await forge(amqp, settings, body, {"idempotency-key": "k-long", "x-long": "h" * 2000 + "|"})
    await dlq_depth(settings, 1)
    [copy] = await dlq.list_parked(amqp, engine, settings)

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        cut = (await viewer.client.get(f"/dead-letters/message/{copy.id}")).text
        whole = (await viewer.client.get(f"/dead-letters/message/{copy.id}?full=1")).text
        missing = await viewer.client.get("/dead-letters/message/sha256:" + "0" * 32)
        malformed = await viewer.client.get("/dead-letters/message/..%2Faudit")

    # Then the page shows the first 4096 bytes (whole characters only), the header cut, and
    # links to all; ?full=1 shows everything
    assert "10,003 bytes; the first 4,096 shown" in text_of(cut)
    shown = cut.split('<pre id="dlq-body">', 1)[1].split("</pre>", 1)[0]
    assert shown == "é" * 2048
    assert "END" not in cut
    assert f'href="/dead-letters/message/{copy.id.replace(":", "%3A")}?full=1"' in cut
    assert "h" * 1024 + '<span class="hint">… (cut)' in cut
    assert "h" * 2000 + "|" in whole
    assert whole.split('<pre id="dlq-body">', 1)[1].startswith("é" * 5000 + "END</pre>")
    assert missing.status_code == 404
    assert malformed.status_code == 404


async def test_a_preview_changes_nothing_and_the_confirm_replays_the_group_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, ledger_table: None
) -> None:
    # Given three messages whose handler failed for good, parked by the worker with their
    # keys failed, and a message of another group
    class Broken(Switch):
        failing = "permanent"

    async with running_worker(settings, ledger(Broken)):
        for n in (1, 2, 3):
            await send(amqp, settings, f'{{"n": {n}}}'.encode(), {"idempotency-key": f"k{n}"})
        await dlq_depth(settings, 3)
    await park(amqp, engine, settings, Copy("k-other", reason="invalid"))

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the operator previews the replay of the ledger's group, from the groups page
        groups = (await op.client.get("/dead-letters")).text
        assert cells(groups, "dlq-groups")[0][:3] == ["handler-error", ROUTING_KEY, "3"]
        group_form = fields(groups, "dlq-group-1", action="replay")
        assert group_form["reason"] == "handler-error"
        page = (await preview(op, **group_form)).text

        # Then it lists what the dry run says would be done, and nothing changed
        assert re.search(r'id="dlq-would">3<', page)
        assert re.search(r'id="dlq-refused">0<', page)
        # (in the order the consumer parked them: any)
        assert sorted(row[1] for row in cells(page, "dlq-preview")) == ["k1", "k2", "k3"]
        assert [row[5] for row in cells(page, "dlq-preview")] == ["replayed"] * 3
        assert "dlq-force" not in page
        assert await broker_depth(settings.dead_letter_queue) == 4
        assert await broker_depth(settings.queue) == 0
        assert await failed_keys(engine) == ["k-other", "k1", "k2", "k3"]

        # When they confirm
        result = (await confirm(op, page)).text

        # Then the group left the DLQ for the work queue, and the result says so
        assert "3 message(s) replayed" in text_of(result)
        assert cells(result, "dlq-done-by-group") == [["handler-error", ROUTING_KEY, "3"]]
        assert await parked_keys(amqp, engine, settings) == ["k-other"]
        assert await broker_depth(settings.queue) == 3

        # And the same confirmation posted again replays nothing more
        again = (await confirm(op, page)).text
        assert "0 message(s) replayed" in text_of(again)

    # When the handler is fixed, then each replayed message takes effect once
    class Fixed(Switch):
        failing = None

    async with running_worker(settings, ledger(Fixed)) as running:
        await wait_until(lambda: _processed(running.stats, 3))
    assert await applied(engine) == [("k1", 1), ("k2", 2), ("k3", 3)]
    assert await failed_keys(engine) == ["k-other"]

    # And the audit has the replay, by whom, of what, how many
    [replayed, nothing] = await audit_rows(engine)
    assert replayed[:5] == (
        OPERATOR,
        "dlq replay",
        f"reason=handler-error handler={ROUTING_KEY}",
        3,
        "done",
    )
    assert replayed[5]["refused"] == 0
    assert replayed[5]["done_by"] == [["handler-error", ROUTING_KEY, 3]]
    assert nothing[3:5] == (0, "done")


async def _processed(stats: Any, count: int) -> bool:
    return bool(stats["processed"] >= count)


async def test_a_too_old_or_unverified_copy_is_refused_unless_forced(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a copy parked longer ago than the inbox retention, one parked now, and one the
    # broker dead-lettered (no record of the worker's)
    await park(amqp, engine, settings, Copy("k-old", age=OLD), Copy("k-new"))
    await forge(amqp, settings, b'{"n": 3}', forged_headers("k-forged", "0" * 32))
    await dlq_depth(settings, 3)

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the operator previews the replay of everything
        page = (await preview(op, action="replay", scope="filter")).text

        # Then the preview shows the two refused, and why, and offers force with its warning
        assert re.search(r'id="dlq-would">1<', page)
        assert re.search(r'id="dlq-refused">2<', page)
        outcomes = {row[1]: row[5] for row in cells(page, "dlq-preview")}
        assert outcomes["k-new"] == "replayed"
        assert outcomes["k-old"].startswith("refused: parked longer ago than inbox_retention")
        assert outcomes["k-forged"].startswith("refused: unverified (no record of its parking id)")
        assert [row[1] for row in cells(page, "dlq-refused-by-why")] == ["1", "1"]
        assert "may have left the inbox, so nothing would stop its effect" in text_of(page)
        assert "force" not in fields(page, "dlq-confirm")

        # When they confirm without force, then only the new copy goes back
        result = (await confirm(op, page)).text
        assert "1 message(s) replayed" in text_of(result)
        assert "2 refused and left parked" in text_of(result)
        assert await parked_keys(amqp, engine, settings) == ["k-old", "k-forged"]

        # When they preview the forced replay, then both would go, and confirmed they do
        forced = (await preview(op, **fields(page, "dlq-force-form"))).text
        assert 'id="dlq-forced"' in forced
        assert re.search(r'id="dlq-would">2<', forced)
        assert (await confirm(op, forced)).status_code == 200
        assert await parked_keys(amqp, engine, settings) == []
        assert await broker_depth(settings.queue) == 3

    entries = await audit_rows(engine)
    assert [entry[1:5] for entry in entries] == [
        ("dlq replay", "everything", 1, "done"),
        ("dlq replay", "everything (forced)", 2, "done"),
    ]
    assert entries[0][5]["refused"] == 2
    assert entries[1][5]["force"] is True


async def test_purging_a_selection_of_two_purges_those_two_only(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given four parked messages
    await park(amqp, engine, settings, *(Copy(f"k{n}") for n in range(1, 5)))
    ids = {copy.key: copy.id for copy in await dlq.list_parked(amqp, engine, settings)}

    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as op:
        # When the operator ticks the second and the fourth and previews their purge
        listed = (await op.client.get("/dead-letters/messages")).text
        ticked = fields(listed, "dlq-selected", action="purge")
        ticked["id"] = [ids["k2"], ids["k4"]]
        page = (await preview(op, **ticked)).text

        # Then the preview names those two, and confirmed, only those two are gone
        assert [row[1] for row in cells(page, "dlq-preview")] == ["k2", "k4"]
        result = (await confirm(op, page)).text
        assert "2 message(s) purged" in text_of(result)
        # (a result page is an audit entry of the dead letters', no other: not the login's)
        [(login,)] = await rows(engine, "SELECT id FROM console_audit WHERE action = 'login'")
        assert (await op.client.get(f"/dead-letters/done/{login}")).status_code == 404

    assert await parked_keys(amqp, engine, settings) == ["k1", "k3"]
    records = await rows(engine, "SELECT key FROM dead_letters ORDER BY key")
    assert [key for (key,) in records] == ["k1", "k3"]
    [entry] = await audit_rows(engine)
    assert entry[1:5] == ("dlq purge", f"ids={','.join(sorted([ids['k2'], ids['k4']]))}", 2, "done")
    assert sorted(entry[5]["ids"]) == sorted([ids["k2"], ids["k4"]])


async def test_a_viewer_and_a_post_without_the_csrf_token_are_refused_and_change_nothing(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, Copy("k1"), Copy("k2"))

    async with running_console(settings) as console:
        async with logged_in(console, OPERATOR_TOKEN) as op:
            page = (await preview(op, action="purge", scope="filter")).text
            confirmation = fields(page, "dlq-confirm")
            # When the confirmation is posted without its CSRF token
            del confirmation["csrf"]
            forged = await op.client.post("/dead-letters/confirm", data=confirmation)
            # or without the preview's time, or with an id that is none
            untimed = fields(page, "dlq-confirm")
            del untimed["before"]
            no_time = await op.client.post("/dead-letters/confirm", data=untimed)
            bad_id = await op.post(
                "/dead-letters/preview", {"action": "purge", "scope": "ids", "id": "k1"}
            )
        async with logged_in(console, VIEWER_TOKEN) as viewer:
            # When a read-only user posts a preview and a confirmation, with their own token
            looked = await viewer.post(
                "/dead-letters/preview", {"action": "purge", "scope": "filter"}
            )
            acted = await viewer.post(
                "/dead-letters/confirm", fields(page, "dlq-confirm", csrf=viewer.csrf)
            )

    # Then each is refused and nothing changed
    assert forged.status_code == 403
    assert no_time.status_code == 400
    assert bad_id.status_code == 400
    assert looked.status_code == 403
    assert acted.status_code == 403
    assert await parked_keys(amqp, engine, settings) == ["k1", "k2"]
    # and the refusals are in the audit, who tried what
    refusals = [entry[:5] for entry in await audit_rows(engine)]
    assert refusals == [
        (OPERATOR, "/dead-letters/confirm", "", 0, "refused: no valid CSRF token"),
        ("victor", "/dead-letters/preview", "", 0, "refused: read-only user"),
        ("victor", "/dead-letters/confirm", "", 0, "refused: read-only user"),
    ]
