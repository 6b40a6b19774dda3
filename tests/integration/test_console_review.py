"""The console against what an attacker sends and what a tired operator configures, each test a
flaw found in review and fixed:

- ids past what PostgreSQL's ``BIGINT`` holds, and NUL characters its text cannot hold, are
  refused as bad requests (never a server error, never a lost audit entry);
- ``WORKER_CONSOLE_URL`` written with its default port or in capitals still takes a login;
- the audit shows a target's invisible and bidirectional characters as escapes, as every other
  page does;
- views of the dead letters queueing for the one sweep at a time are bounded, so no user can
  make every other page wait;
- a replay cut short by the console's stop is still audited with what it did;
- a page of one routing key of the outbox reads a bounded window of its state, never the whole
  outbox;
- with PostgreSQL unreachable, a page says so (503), with the security headers, instead of a
  bare 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from aio_pika.abc import AbstractRobustConnection
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import broker_depth, rows, wait_until
from tests.integration.console_support import (
    OPERATOR_TOKEN,
    VIEWER_TOKEN,
    csrf_of,
    logged_in,
    running_console,
)
from tests.integration.tcp_proxy import tcp_proxy
from tests.integration.test_console_outbox import listed_ids, next_page
from tests.integration.test_console_security import (
    anonymous_client,
    assert_secured,
    cookie_attributes,
)
from tests.integration.test_dlq import HANDLER, Copy, park, parked_keys
from tests.integration.test_monitoring import through_proxy
from worker.console import serve
from worker.console.pages import dead_letters
from worker.console.pages import outbox as outbox_page
from worker.ingress import serve as ingress_serve
from worker.settings import Settings, field
from worker.sql import inspection
from worker.transport.topology import declare_topology

ANSWER_WITHIN = 20.0
"""Seconds a request the console should answer at once is given before the test fails (a bound
on a hang, not a measure of speed)."""
PAST_BIGINT = str(2**63)
"""An id no ``BIGINT`` holds: PostgreSQL refuses it as a parameter."""


@pytest.mark.parametrize(
    "path",
    [
        f"/outbox/row/parked/{PAST_BIGINT}",
        f"/outbox?state=parked&after_id={PAST_BIGINT}",
        f"/outbox/done/{PAST_BIGINT}",
        f"/dead-letters/done/{PAST_BIGINT}",
        f"/dead-letters/done/{2**63 - 1}",
        f"/audit?before={PAST_BIGINT}",
    ],
)
async def test_an_id_past_a_bigint_is_a_bad_request_not_a_server_error(
    settings: Settings, path: str
) -> None:
    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a logged-in user asks for an id PostgreSQL cannot even take as a parameter
        answer = await viewer.client.get(path)
    # Then it is the console's own 400 page (with its security headers), not a 500
    assert answer.status_code == 400, answer.text
    assert 'id="error"' in answer.text
    assert_secured(answer)


async def test_a_ticked_row_id_past_a_bigint_is_a_bad_request_not_an_audited_failure(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as operator:
        # When an operator's form names a row id no BIGINT holds
        answer = await operator.post("/outbox/retry/preview", {"id": PAST_BIGINT})
    # Then it is refused as a bad selection, before any transaction: no "failed" action audited
    assert answer.status_code == 400, answer.text
    assert "not a row&#39;s id" in answer.text
    assert await rows(engine, "SELECT action FROM console_audit WHERE action <> 'login'") == []


@pytest.mark.parametrize(
    "path",
    [
        "/inbox?handler=orders.place%00&key=k1",
        "/outbox?state=pending&routing_key=order.placed%00",
        "/dead-letters?key=k1%00",
    ],
)
async def test_a_nul_character_in_a_query_is_a_bad_request_not_a_server_error(
    settings: Settings, path: str
) -> None:
    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user's query carries a NUL character (which no PostgreSQL text holds)
        answer = await viewer.client.get(path)
    # Then it is refused as a bad request, with the console's security headers
    assert answer.status_code == 400, answer.text
    assert "NUL" in answer.text
    assert_secured(answer)


@pytest.mark.parametrize(
    ("path", "form"),
    [
        ("/outbox/retry", {"routing_key": "order.placed\x00"}),
        ("/outbox/hurry/preview", {"routing_key": "order.placed\x00"}),
        (
            "/dead-letters/confirm",
            {
                "action": "purge",
                "scope": "filter",
                "key": "k1\x00",
                "before": "2030-01-01T00:00:00+00:00",
            },
        ),
    ],
)
async def test_an_action_whose_form_carries_a_nul_character_is_refused_before_it_begins(
    settings: Settings, engine: AsyncEngine, path: str, form: dict[str, str]
) -> None:
    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as operator:
        # When an operator's form names a selection with a NUL character in it
        answer = await operator.post(path, form)
    # Then it is a bad request, not a server error that also lost the action's audit entry:
    # nothing began, so there is nothing to audit
    assert answer.status_code == 400, answer.text
    assert "NUL" in answer.text
    assert await rows(engine, "SELECT action FROM console_audit WHERE action <> 'login'") == []


@pytest.mark.parametrize(
    "configured",
    [
        "https://console.example.com:443",
        "https://Console.Example.COM",
        "HTTPS://console.example.com/",
    ],
)
async def test_a_console_url_with_its_default_port_or_capitals_still_takes_a_login(
    settings: Settings, configured: str
) -> None:
    # Given WORKER_CONSOLE_URL as an operator may well write it (read as the variable is)
    console_url = field("console_url").parse(configured)
    async with anonymous_client(settings.replace(console_url=console_url)) as client:
        form = await client.get("/login", headers={"host": "console.example.com"})
        login_cookie, _ = cookie_attributes(form, "worker-console-login")
        # When a browser at that address logs in: it names the origin as browsers serialize it
        # (lower case, no default port)
        answer = await client.post(
            "/login",
            data={"login_csrf": csrf_of(form.text), "token": OPERATOR_TOKEN, "next": "/"},
            headers={
                "host": "console.example.com",
                "origin": "https://console.example.com",
                "cookie": f"worker-console-login={login_cookie}",
            },
        )
    # Then the login is taken (not refused as a form from another origin), with a Secure cookie
    assert answer.status_code == 303, answer.text
    _, attributes = cookie_attributes(answer, "__Host-worker-console")
    assert "secure" in attributes


async def test_a_console_url_with_another_port_still_refuses_the_default_one(
    settings: Settings,
) -> None:
    # Given a console reached at https://console.example.com:8443
    console_url = field("console_url").parse("https://console.example.com:8443")
    async with anonymous_client(settings.replace(console_url=console_url)) as client:
        form = await client.get("/login", headers={"host": "console.example.com"})
        login_cookie, _ = cookie_attributes(form, "worker-console-login")
        # When a form posted from the same host's default port (another origin) logs in
        answer = await client.post(
            "/login",
            data={"login_csrf": csrf_of(form.text), "token": OPERATOR_TOKEN, "next": "/"},
            headers={
                "host": "console.example.com",
                "origin": "https://console.example.com",
                "cookie": f"worker-console-login={login_cookie}",
            },
        )
    # Then it is refused: the port is part of the origin
    assert answer.status_code == 403, answer.text


async def test_the_audit_shows_a_target_s_bidirectional_and_control_characters_as_escapes(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a routing key that reads backwards from its U+202E on (a link an attacker sent the
    # operator: /outbox?state=parked&routing_key=...), with a terminal escape in it
    routing_key = "invoice\u202egnp.exe\x1b[2J"
    async with running_console(settings) as console, logged_in(console, OPERATOR_TOKEN) as operator:
        # When the operator retries every parked row of it, and opens the audit
        done = await operator.post("/outbox/retry", {"routing_key": routing_key})
        assert done.status_code == 303, done.text
        page = await operator.client.get("/audit")
    # Then the entry keeps the target as chosen, and the page shows its characters as escapes:
    # nothing in the audit reads otherwise than it was written
    [(target,)] = await rows(engine, "SELECT target FROM console_audit WHERE action <> 'login'")
    assert target == f"parked rows of routing key {routing_key}"
    assert "\u202e" not in page.text
    assert "\x1b" not in page.text
    assert "invoice\\u202egnp.exe\\u001b[2J" in page.text


@pytest.fixture
def served_apps(monkeypatch: pytest.MonkeyPatch) -> list[FastAPI]:
    """The applications ``running_console`` serves in this test, to reach their state."""
    made: list[FastAPI] = []
    create_app = serve.create_app

    def keep(*args: Any, **kwargs: Any) -> FastAPI:
        made.append(create_app(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(serve, "create_app", keep)
    return made


async def test_views_of_the_dead_letters_wait_in_a_bounded_line_and_the_rest_still_answer(
    settings: Settings, served_apps: list[FastAPI], amqp: AbstractRobustConnection
) -> None:
    async with amqp.channel() as channel:
        await declare_topology(channel, settings, [])
    async with (
        running_console(settings) as console,
        logged_in(console, VIEWER_TOKEN) as viewer,
        logged_in(console, OPERATOR_TOKEN) as operator,
    ):
        sweeps = dead_letters.sweeps_of(served_apps[0].state.console)
        # Given a sweep of the DLQ in progress (a view of 10,000 messages takes seconds)
        await sweeps.lock.acquire()
        try:
            # And views of it waiting their turn, as many as may wait
            waiting = [
                asyncio.create_task(viewer.client.get("/dead-letters"))
                for _ in range(dead_letters.MAX_WAITING_VIEWS)
            ]

            async def all_wait() -> bool:
                return sweeps.waiting_views == dead_letters.MAX_WAITING_VIEWS

            await wait_until(all_wait)
            # When a user asks for yet another view, and an operator previews a purge
            refused = await asyncio.wait_for(
                viewer.client.get("/dead-letters/messages"), ANSWER_WITHIN
            )
            previewing = asyncio.create_task(
                operator.post("/dead-letters/preview", {"action": "purge", "scope": "filter"})
            )
            # Then that view is answered at once, 503, saying why; other pages still answer
            assert refused.status_code == 503, refused.text
            assert "ask again in a few seconds" in refused.text
            audit = await asyncio.wait_for(viewer.client.get("/audit"), ANSWER_WITHIN)
            assert audit.status_code == 200
            assert not any(task.done() for task in [*waiting, previewing])
        finally:
            sweeps.lock.release()
        # And once the sweep ends, every view that waited and the operator's preview are served
        answers: list[httpx.Response] = await asyncio.wait_for(
            asyncio.gather(*waiting, previewing), ANSWER_WITHIN * 3
        )
        assert [answer.status_code for answer in answers] == [200] * len(answers)


async def test_a_replay_cut_short_by_the_console_s_stop_is_audited_with_what_it_did(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given three parked messages whose keys the worker recorded as failed
    await park(amqp, engine, settings, Copy("k1"), Copy("k2"), Copy("k3"))
    # And a console that gives requests in flight a short grace when it stops
    monkeypatch.setattr(ingress_serve, "SHUTDOWN_GRACE", 0.5)
    async with engine.connect() as holder, holder.begin():
        # And the second key's inbox row held by another transaction, so the replay, having
        # replayed the first message, waits there to clear the second one's failed state
        await holder.execute(
            text("SELECT 1 FROM inbox WHERE key = 'k2' FOR UPDATE"),
        )
        async with (
            running_console(settings) as console,
            logged_in(console, OPERATOR_TOKEN) as operator,
        ):
            confirming = asyncio.create_task(
                operator.post(
                    "/dead-letters/confirm",
                    {
                        "action": "replay",
                        "scope": "filter",
                        "reason": "handler-error",
                        "handler": HANDLER,
                        "before": datetime.now(UTC).isoformat(),
                    },
                )
            )

            async def first_replayed() -> bool:
                return await broker_depth(settings.queue) == 1

            await wait_until(first_replayed)
            # When the console is stopped (a deploy) while the replay is in its middle
        with contextlib.suppress(httpx.HTTPError):
            await confirming

    # Then the audit says the replay was cut short, after the one message it replayed
    found = await rows(
        engine, "SELECT count, outcome FROM console_audit WHERE action = 'dlq replay'"
    )
    assert len(found) == 1, found
    [(count, outcome)] = found
    assert count == 1
    assert outcome.startswith("failed: "), outcome
    # And what it had not replayed is still parked
    assert sorted(await parked_keys(amqp, engine, settings)) == ["k2", "k3"]


async def pending_rows(engine: AsyncEngine, routing_keys: list[str]) -> list[int]:
    """Pending outbox rows of ``routing_keys``, due one second apart in that order (the last
    due last, the order a relay and the console's list take them in); their ids."""
    async with engine.begin() as conn:
        found = await conn.execute(
            text(
                "INSERT INTO outbox (message_id, exchange, routing_key, body, content_type,"
                " available_at) SELECT gen_random_uuid(), 'events', key, '\\x7b7d',"
                " 'application/json', now() - make_interval(secs => 1000 - n)"
                " FROM unnest(CAST(:keys AS text[])) WITH ORDINALITY AS k(key, n)"
                " ORDER BY n RETURNING id"
            ),
            {"keys": routing_keys},
        )
        return [row_id for (row_id,) in found]


async def test_a_rare_routing_key_is_sought_a_bounded_window_of_rows_at_a_time(
    settings: Settings, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given 25 pending rows of one routing key, then one of a rare one, due last
    ids = await pending_rows(engine, ["order.placed"] * 25 + ["order.refunded"])
    # And a console that reads 10 rows of a state at most to fill a page of one routing key
    monkeypatch.setattr(outbox_page, "SCAN_ROWS", 10, raising=False)
    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When a user asks for the pending rows of the rare routing key
        first = (
            await viewer.client.get(
                "/outbox", params={"state": "pending", "routing_key": "order.refunded"}
            )
        ).text
        second = await next_page(viewer.client, first)
        third = await next_page(viewer.client, second)
    # Then each page says it read the next 10 pending rows and found none of it, and leads on
    assert listed_ids("pending", first) == []
    assert listed_ids("pending", second) == []
    assert re.search(r'id="window">.*?the next 10 pending rows', first, re.DOTALL)
    # And the page that reads the window it is in shows it, and no page after it
    assert listed_ids("pending", third) == [ids[-1]]
    assert 'id="next-page"' not in third


async def test_the_read_of_a_routing_key_reads_no_more_rows_than_its_window(
    engine: AsyncEngine,
) -> None:
    # Given 3,000 pending rows, none of the routing key asked for
    await pending_rows(engine, ["order.placed"] * 3000)
    async with engine.begin() as conn:
        await conn.execute(text("ANALYZE outbox"))
        # When the console's read of a page of that routing key is run, with a window of 500
        statement = inspection.entries_query("pending", 201, routing_key="order.refunded", scan=500)
        compiled = statement.compile(conn.sync_connection)
        [(plan,)] = (
            await conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {compiled.string}",
                tuple(compiled.params[name] for name in compiled.positiontup or ()),
            )
        ).all()
    # Then it read 500 rows of the outbox, not all 3,000
    read = [
        node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        for node in plan_nodes((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"])
        if node.get("Relation Name") == "outbox"
    ]
    assert read == [500], read


def plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """``node`` of an EXPLAIN (FORMAT JSON) plan and every node under it."""
    return [node, *(found for child in node.get("Plans", []) for found in plan_nodes(child))]


async def test_with_postgresql_unreachable_a_page_says_so_and_answers_again_once_it_is_back(
    settings: Settings,
) -> None:
    # Given a console that reaches PostgreSQL through a proxy
    url = urlsplit(settings.database_url)
    async with tcp_proxy(url.hostname or "127.0.0.1", url.port or 5432) as proxy:
        proxied = settings.replace(database_url=through_proxy(settings, proxy.port))
        async with (
            running_console(proxied) as console,
            logged_in(console, OPERATOR_TOKEN) as operator,
        ):
            # When PostgreSQL becomes unreachable, and the operator opens pages and acts
            await proxy.down()
            pages = [
                await operator.client.get(path)
                for path in ("/outbox", "/inbox?handler=orders.place&key=k1", "/audit")
            ]
            action = await operator.post("/outbox/retry", {"id": "1"})
            # Then each says PostgreSQL cannot be reached (503), on a page of the console
            for answer in [*pages, action]:
                assert answer.status_code == 503, answer.text
                assert "PostgreSQL cannot be reached" in answer.text
                assert 'id="error"' in answer.text
                assert_secured(answer)
            # And once it is back, so are the pages
            await proxy.up()

            async def answers() -> bool:
                return (await operator.client.get("/outbox")).status_code == 200

            await wait_until(answers)
