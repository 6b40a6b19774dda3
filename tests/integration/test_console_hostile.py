"""Hostile clients of the console must never slow or lock out its logged-in users: slow
anonymous logins take none of a session's capacity, a hostile login form is a 403 (never a
traceback), a loop of refused actions adds one audit row per window (and the janitor keeps the
audit within its retention), failed logins are budgeted per address, per network and overall
(a right token from an address that has not failed still gets in), and the edge's own answers
carry the security headers. Against the real console served by uvicorn (real sockets, several
loopback addresses) on the test's database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.console_attack import SLOW_LOGIN, slow_logins
from tests.helpers import rows, scalar, wait_until
from tests.integration import console_probe
from tests.integration.console_support import (
    OPERATOR_TOKEN,
    VIEWER_TOKEN,
    RunningConsole,
    csrf_of,
    logged_in,
    running_console,
)
from tests.integration.test_console_security import REQUIRED_HEADERS
from worker.console.app import PER_ADDRESS
from worker.console.audit import REFUSALS_WINDOW
from worker.console.throttle import LOGIN_ATTEMPTS, NETWORK_ATTEMPTS
from worker.ops.janitor import sweep
from worker.settings import Settings


def port_of(console: RunningConsole) -> int:
    return int(console.url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def client_from(console: RunningConsole, address: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``console`` whose connections come from the loopback ``address``."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    async with httpx.AsyncClient(base_url=console.url, transport=transport, timeout=30) as client:
        yield client


async def try_login(client: httpx.AsyncClient, token: str, **headers: str) -> int:
    """The status of a login with ``token`` through the login form."""
    form = await client.get("/login", headers=headers)
    answer = await client.post(
        "/login",
        data={"login_csrf": csrf_of(form.text), "token": token, "next": "/audit"},
        headers=headers,
    )
    return answer.status_code


# --- capacity --------------------------------------------------------------------------------


async def test_slow_anonymous_logins_never_take_a_logged_in_operator_s_pages(
    settings: Settings,
) -> None:
    # Given a logged-in operator, and 100 clients that send login headers declaring 1,000
    # bytes and send one, again and again
    async with (
        running_console(settings) as console,
        logged_in(console, OPERATOR_TOKEN) as operator,
        slow_logins(port_of(console), 100, pause=0.5) as answers,
    ):

        async def anonymous_refused() -> bool:
            async with httpx.AsyncClient(base_url=console.url) as anonymous:
                return (await anonymous.get("/login")).status_code == 503

        # (the attack holds every slot an anonymous client could have)
        await wait_until(anonymous_refused)
        # When the operator loads pages during the attack
        statuses = Counter([(await operator.client.get("/audit")).status_code for _ in range(30)])
    # Then every page is answered
    assert statuses == Counter({200: 30})
    # And the attackers were refused (503) or cut off at their form's deadline (408)
    assert set(answers) <= {503, 408}, answers


# --- hostile forms ---------------------------------------------------------------------------


async def test_a_login_form_value_that_is_not_ascii_is_refused_403_without_a_traceback(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_console(settings) as console, httpx.AsyncClient(base_url=console.url) as c:
        form = await c.get("/login")
        assert form.status_code == 200
        # When logins are posted whose form value is not ASCII
        statuses = [
            (
                await c.post(
                    "/login", data={"login_csrf": "é" * 43 if n % 2 else "\u2603", "token": "x"}
                )
            ).status_code
            for n in range(20)
        ]
    # Then each is refused as a stale form would be, and nothing is logged as an error
    assert statuses == [403] * 20
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


# --- the audit's bounds ----------------------------------------------------------------------


async def audit_rows(engine: AsyncEngine) -> list[tuple[str, str, int]]:
    found = await rows(engine, "SELECT actor, outcome, repeats FROM console_audit ORDER BY id")
    return [(actor, outcome, repeats) for actor, outcome, repeats in found]


async def test_a_session_s_repeated_refusals_are_one_entry_counted_per_window(
    settings: Settings, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with console_probe.with_probe(monkeypatch):
        async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
            # When a read-only user posts a refused action 60 times
            for _ in range(60):
                assert (await viewer.post(console_probe.PATH, {"target": "x"})).status_code == 403
            # Then the audit holds one entry for them, counting 60
            assert await audit_rows(engine) == [
                ("victor", "done", 1),
                ("victor", "refused: read-only user", 60),
            ]
            # And once the window of that entry has passed, the next refusal is a new entry
            await engine_execute(
                engine,
                "UPDATE console_audit SET at = at - make_interval(secs => :s) "
                "WHERE outcome LIKE 'refused%'",
                s=REFUSALS_WINDOW + 1,
            )
            assert (await viewer.post(console_probe.PATH, {"target": "x"})).status_code == 403
            # (and a refusal for another reason is an entry of its own)
            assert (
                await viewer.client.post(console_probe.PATH, data={"target": "x"})
            ).status_code == 403
    assert await audit_rows(engine) == [
        ("victor", "done", 1),
        ("victor", "refused: read-only user", 60),
        ("victor", "refused: read-only user", 1),
        ("victor", "refused: no valid CSRF token", 1),
    ]


async def engine_execute(engine: AsyncEngine, statement: str, **values: object) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(statement), values)


async def test_the_janitor_deletes_audit_entries_older_than_their_retention(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with running_console(settings) as console:
        for token in (OPERATOR_TOKEN, VIEWER_TOKEN):
            async with logged_in(console, token):
                pass
    # Given two entries, the operator's older than the retention
    await engine_execute(
        engine,
        "UPDATE console_audit SET at = now() - make_interval(secs => :s) WHERE actor = 'olivia'",
        s=settings.console_audit_retention + 60,
    )
    # (and one as old but repeated lately: it is kept by its last time)
    await engine_execute(
        engine,
        "INSERT INTO console_audit (at, last_at, actor, role, action, target, count, outcome,"
        " repeats) VALUES (now() - make_interval(secs => :s), now(), 'mallory', 'viewer',"
        " '/x', '', 0, 'refused: read-only user', 9)",
        s=settings.console_audit_retention + 60,
    )
    # When the janitor sweeps
    done = await sweep(engine, settings)
    # Then the old entry is gone, the others are kept
    assert done is not None
    assert done.audit_entries == 1
    assert [actor for actor, _, _ in await audit_rows(engine)] == ["victor", "mallory"]
    assert await scalar(engine, "SELECT count(*) FROM console_audit") == 2


# --- the login throttle ----------------------------------------------------------------------


async def test_guesses_from_rotating_addresses_are_throttled_but_a_right_token_gets_in(
    settings: Settings,
) -> None:
    async with running_console(settings) as console:
        statuses: Counter[int] = Counter()
        # Given 400 guesses from 40 addresses of one /24, ten each (each within its own budget)
        for n in range(2, 42):
            async with client_from(console, f"127.0.0.{n}") as client:
                for _ in range(LOGIN_ATTEMPTS):
                    statuses[await try_login(client, "w" * 32)] += 1
        # Then once the network's budget is spent, each address gets one guess a window
        assert statuses[401] == NETWORK_ATTEMPTS + (40 - NETWORK_ATTEMPTS // LOGIN_ATTEMPTS)
        assert statuses[429] == 400 - statuses[401]
        # And the operator, from an address of the same network that has not failed, gets in
        async with client_from(console, "127.0.0.200") as operator:
            assert await try_login(operator, OPERATOR_TOKEN) == 303
        # while an address whose own budget is spent is refused even its right token
        async with client_from(console, "127.0.0.2") as spent:
            assert await try_login(spent, OPERATOR_TOKEN) == 429


async def test_guesses_spread_over_networks_spend_the_global_budget(settings: Settings) -> None:
    async with running_console(settings) as console:
        # Given 99 failed guesses from 11 networks, 9 from each (each address and network
        # within its own budget), and a 100th
        for network in range(1, 12):
            async with client_from(console, f"127.0.{network}.1") as client:
                for _ in range(LOGIN_ATTEMPTS - 1):
                    assert await try_login(client, "w" * 32) == 401
        # Then an address that has failed once is refused: the global budget is spent
        async with client_from(console, "127.0.13.1") as guesser:
            assert await try_login(guesser, "w" * 32) == 401
            assert await try_login(guesser, "w" * 32) == 429
        # But a right token from an address that has not failed gets in
        async with client_from(console, "127.0.14.1") as operator:
            assert await try_login(operator, OPERATOR_TOKEN) == 303


async def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_budget(
    settings: Settings,
) -> None:
    proxied = settings.replace(console_trusted_proxies=("127.0.0.1",))
    async with running_console(proxied) as console, client_from(console, "127.0.0.1") as proxy:
        # Given one client behind the proxy that spent its budget
        for _ in range(LOGIN_ATTEMPTS):
            assert await try_login(proxy, "w" * 32, **{"x-forwarded-for": "10.0.0.1"}) == 401
        assert await try_login(proxy, OPERATOR_TOKEN, **{"x-forwarded-for": "10.0.0.1"}) == 429
        # Then another client behind the same proxy gets in (what it claims before the
        # proxy's own entry counts for nothing)
        forwarded = {"x-forwarded-for": "10.0.0.1, 10.9.0.2"}
        assert await try_login(proxy, OPERATOR_TOKEN, **forwarded) == 303
    # And without the setting, the header is not believed: the proxy is one address
    async with running_console(settings) as console, client_from(console, "127.0.0.1") as proxy:
        for n in range(LOGIN_ATTEMPTS):
            assert await try_login(proxy, "w" * 32, **{"x-forwarded-for": f"10.0.{n}.1"}) == 401
        assert await try_login(proxy, OPERATOR_TOKEN, **{"x-forwarded-for": "10.9.0.2"}) == 429


# --- the edge's own answers ------------------------------------------------------------------


async def raw_answer(
    port: int, request: bytes, *, address: str = "127.0.0.1"
) -> tuple[int, dict[str, str]]:
    """The status and headers of the answer to ``request``, sent as it is."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
    try:
        writer.write(request)
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.transport.abort()
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, _, value in (line.partition(":") for line in lines if line)
    )
    return int(status_line.split()[1]), headers


def assert_raw_secured(status: int, headers: dict[str, str]) -> None:
    for name, value in REQUIRED_HEADERS.items():
        assert headers.get(name) == value, f"{name} on a {status}"
    assert "frame-ancestors 'none'" in headers.get("content-security-policy", ""), status


async def test_the_edge_s_408_and_503_and_the_server_s_400_carry_the_security_headers(
    settings: Settings,
) -> None:
    async with running_console(settings.replace(ingress_body_timeout=1.0)) as console:
        port = port_of(console)
        # Given as many slow anonymous logins from one address as it may have in flight
        held = [
            asyncio.create_task(raw_answer(port, SLOW_LOGIN, address="127.0.0.7"))
            for _ in range(PER_ADDRESS)
        ]

        async def busy() -> bool:
            answer = await raw_answer(
                port, b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", address="127.0.0.7"
            )
            return answer[0] == 503

        # When one more asks, it is answered 503, and the slow ones 408 at their deadline
        await wait_until(busy)
        refused = await raw_answer(
            port, b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", address="127.0.0.7"
        )
        timed_out = await asyncio.gather(*held)
        # and a request the server cannot parse is its 400
        garbage = await raw_answer(port, b"\x00\x01 nonsense\r\n\r\n")
    assert refused[0] == 503
    assert {status for status, _ in timed_out} == {408}
    assert garbage[0] == 400
    for status, headers in [refused, *timed_out, garbage]:
        assert_raw_secured(status, headers)

    # And a connection over the connection cap is answered 503 with them too
    async with running_console(settings.replace(ingress_max_connections=2)) as console:
        port = port_of(console)
        holders = [asyncio.create_task(raw_answer(port, SLOW_LOGIN)) for _ in range(2)]
        await asyncio.sleep(0.2)  # (both are accepted, their bodies in progress)
        over = await raw_answer(port, b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    assert over[0] == 503
    assert_raw_secured(*over)
