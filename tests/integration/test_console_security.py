"""The console's security promises, against the real console on the test's database: off unless
started and on 127.0.0.1 by default, the session cookie's attributes (``Secure`` and ``__Host-``
behind TLS), failed logins refused, counted and throttled, ``next`` never leading off-site,
Hosts refused, the security headers on every answer, logout and every operator action needing
the session's CSRF token and the console's own origin (refusals audited), and bounded forms of
the one content type a form has.

Actions are aimed at ``POST /test-probe`` (``console_probe``): an operator action that does
nothing but write its audit entry, so whether it ran is whether its entry is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import free_port, rows, wait_until
from tests.integration import console_probe
from tests.integration.console_support import (
    OPERATOR,
    OPERATOR_TOKEN,
    VIEWER,
    VIEWER_TOKEN,
    RunningConsole,
    csrf_of,
    logged_in,
    running_console,
)
from tests.integration.support import ROOT, start_worker, wait_for_consumer, worker_process
from worker.console.guard import MAX_FORM_BYTES
from worker.console.throttle import LOGIN_ATTEMPTS
from worker.settings import Settings

TLS_URL = "https://console.example.com"
REQUIRED_HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "cache-control": "no-store",
    "referrer-policy": "same-origin",
}


async def audit_entries(engine: AsyncEngine) -> list[tuple[str, str, str, str]]:
    """(actor, action, target, outcome) of every audit entry, oldest first."""
    found = await rows(
        engine, "SELECT actor, action, target, outcome FROM console_audit ORDER BY id"
    )
    return [(actor, action, target, outcome) for actor, action, target, outcome in found]


async def refusals_counted(engine: AsyncEngine) -> list[int]:
    """How many times each refusal entry counts, oldest first."""
    found = await rows(
        engine, "SELECT repeats FROM console_audit WHERE outcome LIKE 'refused%' ORDER BY id"
    )
    return [repeats for (repeats,) in found]


async def login(
    client: httpx.AsyncClient, token: str, *, next_path: str = "/audit", **headers: str
) -> httpx.Response:
    """The login form fetched and posted with ``token`` (the client keeps the cookies)."""
    form = await client.get("/login")
    return await client.post(
        "/login",
        data={"login_csrf": csrf_of(form.text), "token": token, "next": next_path},
        headers=headers,
    )


def cookie_attributes(response: httpx.Response, name: str) -> tuple[str, set[str]]:
    """The value of the cookie ``name`` set by ``response``, and its attributes, lowercased."""
    for header in response.headers.get_list("set-cookie"):
        first, *attributes = (part.strip() for part in header.split(";"))
        key, _, value = first.partition("=")
        if key == name:
            return value, {attribute.lower() for attribute in attributes}
    raise AssertionError(f"no {name} cookie in {response.headers.get_list('set-cookie')}")


def assert_secured(response: httpx.Response) -> None:
    """The console's security headers are on ``response``."""
    where = f"{response.request.method} {response.request.url.path} ({response.status_code})"
    for name, value in REQUIRED_HEADERS.items():
        assert response.headers.get(name) == value, f"{name} on {where}"
    policy = response.headers.get("content-security-policy", "")
    directives = {part.split()[0]: part.split()[1:] for part in policy.split(";") if part.strip()}
    assert directives.get("default-src") == ["'none'"], where
    assert directives.get("script-src") == ["'self'"], where
    assert directives.get("style-src") == ["'self'"], where
    assert directives.get("frame-ancestors") == ["'none'"], where
    assert directives.get("form-action") == ["'self'"], where
    assert "unsafe-inline" not in policy, where
    assert "unsafe-eval" not in policy, where


def lands_on(console: RunningConsole, location: str) -> str:
    """The origin a browser goes to for a redirect to ``location`` from the console (as a
    browser reads it: tabs and newlines dropped, backslashes taken for slashes)."""
    cleaned = location.strip("\x00 ").replace("\t", "").replace("\n", "").replace("\r", "")
    target = urlsplit(urljoin(console.url + "/login", cleaned.replace("\\", "/")))
    return f"{target.scheme}://{target.netloc}"


def listening_addresses(port: int) -> set[str]:
    """The local addresses a socket listens on at ``port`` (TCP, IPv4 and IPv6), read from
    Linux's ``/proc/net``."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(str(ipaddress.ip_address(words)))
    return found


@contextlib.asynccontextmanager
async def anonymous_client(
    settings: Settings,
) -> AsyncIterator[httpx.AsyncClient]:
    """A client without a session, of the console for ``settings``."""
    async with (
        running_console(settings) as console,
        httpx.AsyncClient(base_url=console.url) as client,
    ):
        yield client


@pytest.fixture
async def probed(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[RunningConsole]:
    """The console, with ``POST /test-probe`` beside its pages."""
    with console_probe.with_probe(monkeypatch):
        async with running_console(settings) as console:
            yield console


# --- off unless started, on 127.0.0.1 ------------------------------------------------------


def test_the_console_listens_on_127_0_0_1_by_default() -> None:
    assert Settings.load({}).console_host == "127.0.0.1"
    assert Settings.load({}).console_port == 8100


async def test_the_console_is_off_unless_started_and_then_listens_on_localhost_only(
    settings: Settings, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        "WORKER_CONSOLE_OPERATOR_TOKENS": f"{OPERATOR}:{OPERATOR_TOKEN}",
        "WORKER_CONSOLE_PORT": str(port),
    }
    # Given a worker running with the console's tokens and port configured
    with worker_process(settings, tmp_path / "worker.log", **env):
        await wait_for_consumer(amqp, settings.queue)
        # Then nothing listens on the console's port: configuring it starts nothing
        assert listening_addresses(port) == set()

    # When `worker console` is started, with no host given
    log = tmp_path / "console.log"
    console = start_worker(settings, log, "console", **env)
    try:
        line = f"serving the console on http://127.0.0.1:{port} "

        async def serving() -> bool:
            assert console.poll() is None, log.read_text(errors="replace")
            return line in log.read_text(errors="replace")

        await wait_until(serving, timeout=30)
        # Then it says it serves 127.0.0.1, listens there and nowhere else, and answers
        assert listening_addresses(port) == {"127.0.0.1"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/login")).status_code == 200
        assert OPERATOR_TOKEN not in log.read_text(errors="replace")
        # And SIGTERM stops it cleanly
        console.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(console.wait, 30) == 0
    finally:
        if console.poll() is None:
            console.kill()
            console.wait()
    assert listening_addresses(port) == set()
    assert "the console stopped" in log.read_text(errors="replace")


def run_console_command(settings: Settings, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """``worker console`` with the test's database and only ``env_vars`` besides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(PYTHONPATH=str(ROOT), WORKER_DATABASE_URL=settings.database_url, **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "worker", "console", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("tokens", "secret"),
    [
        ({}, None),
        ({"WORKER_CONSOLE_OPERATOR_TOKENS": "olivia:s3cr3t-Zq"}, "s3cr3t-Zq"),
        ({"WORKER_CONSOLE_OPERATOR_TOKENS": "s3cr3t-Zq-0123456789, olivia"}, "s3cr3t-Zq"),
    ],
    ids=["none", "too-short", "misplaced-comma"],
)
async def test_worker_console_without_a_usable_token_exits_2_naming_the_variable(
    settings: Settings, tokens: dict[str, str], secret: str | None
) -> None:
    # When the real command starts without a token it can log anyone in with
    done = await asyncio.to_thread(run_console_command, settings, **tokens)

    # Then it exits 2 with one message that names the setting, and prints no token
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "WORKER_CONSOLE_OPERATOR_TOKENS" in output
    assert "Traceback" not in output
    if secret is not None:
        assert secret not in output


# --- the session cookie ----------------------------------------------------------------------


async def test_the_session_cookie_is_httponly_and_samesite_strict_over_plain_http(
    settings: Settings,
) -> None:
    async with anonymous_client(settings) as client:
        form = await client.get("/login")
        # When an operator logs in over plain http
        answer = await login(client, OPERATOR_TOKEN)

    # Then the session cookie is HttpOnly, SameSite=Strict, for the whole console, and not
    # Secure (a browser would not send it back over http)
    assert answer.status_code == 303
    value, attributes = cookie_attributes(answer, "worker-console")
    assert len(value) >= 43
    assert OPERATOR_TOKEN not in value
    assert {"httponly", "samesite=strict", "path=/"} <= attributes
    assert "secure" not in attributes
    assert not any(
        attribute.startswith(("domain=", "expires=", "max-age=")) for attribute in attributes
    )
    # and the login form's own cookie is as strict, and only for /login
    _, login_attributes = cookie_attributes(form, "worker-console-login")
    assert {"httponly", "samesite=strict", "path=/login"} <= login_attributes
    assert "secure" not in login_attributes


async def test_behind_tls_the_session_cookie_is_secure_and_bound_to_the_host(
    settings: Settings,
) -> None:
    # Given a console whose users reach it at an https address (a TLS proxy in front)
    async with anonymous_client(settings.replace(console_url=TLS_URL)) as client:
        form = await client.get("/login", headers={"host": "console.example.com"})
        login_cookie, login_attributes = cookie_attributes(form, "worker-console-login")
        assert "secure" in login_attributes
        # When the operator logs in through the proxy (which forwards the Secure cookie)
        answer = await client.post(
            "/login",
            data={"login_csrf": csrf_of(form.text), "token": OPERATOR_TOKEN, "next": "/"},
            headers={
                "host": "console.example.com",
                "origin": TLS_URL,
                "cookie": f"worker-console-login={login_cookie}",
            },
        )

    # Then the session cookie is Secure, named __Host- (bound to this host, path /, no Domain)
    assert answer.status_code == 303, answer.text
    _, attributes = cookie_attributes(answer, "__Host-worker-console")
    assert {"secure", "httponly", "samesite=strict", "path=/"} <= attributes
    assert not any(attribute.startswith("domain=") for attribute in attributes)
    assert not [
        header
        for header in answer.headers.get_list("set-cookie")
        if header.startswith("worker-console=")
    ]


# --- logging in ------------------------------------------------------------------------------


async def test_a_wrong_token_is_refused_401_and_leaves_the_audit_unchanged(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with running_console(settings) as console:
        async with logged_in(console, VIEWER_TOKEN):
            pass
        before = await audit_entries(engine)
        async with httpx.AsyncClient(base_url=console.url) as client:
            for wrong in ("x" * 40, OPERATOR_TOKEN + "x", OPERATOR_TOKEN[:-1], OPERATOR, ""):
                # When someone logs in with a token that is not one
                answer = await login(client, wrong)
                # Then it is refused, and no session cookie is set
                assert answer.status_code == 401, wrong
                assert "That token is not accepted." in answer.text
                # (the form comes back leading where the login was going)
                assert 'name="next" value="/audit"' in answer.text
                assert "worker-console=" not in " ".join(answer.headers.get_list("set-cookie"))
                if wrong:
                    assert wrong not in answer.text
            # and no page opens
            assert (await client.get("/audit")).status_code == 303
    # And the audit has nothing new
    assert await audit_entries(engine) == before


async def test_the_eleventh_failed_login_in_a_minute_is_refused_429_even_with_a_right_token(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with anonymous_client(settings) as client:
        # Given ten failed logins from this address
        page = await client.get("/login")
        for _ in range(LOGIN_ATTEMPTS):
            page = await client.post(
                "/login",
                data={"login_csrf": csrf_of(page.text), "token": "w" * 32, "next": "/"},
            )
            assert page.status_code == 401
        # When the eleventh comes, with the operator's token
        answer = await client.post(
            "/login",
            data={"login_csrf": csrf_of(page.text), "token": OPERATOR_TOKEN, "next": "/"},
        )
        # Then it is refused 429 without looking at the token
        assert answer.status_code == 429
        assert "Too many failed logins" in answer.text
        assert (await client.get("/audit")).status_code == 303
    assert await audit_entries(engine) == []


OFF_SITE = [
    "//evil.com",
    "///evil.com",
    "https://evil.com",
    "http:evil.com",
    "/\\evil.com",
    "\\\\evil.com",
    "/\\/evil.com",
    "/\t/evil.com",
    "/\n/evil.com",
    " //evil.com",
    "javascript:alert(1)",
    "evil.com",
]


async def test_next_never_leads_off_site(settings: Settings) -> None:
    async with running_console(settings) as console:
        origin = console.url
        for target in OFF_SITE:
            async with httpx.AsyncClient(base_url=console.url) as client:
                # When a login is posted with an off-site next
                answer = await login(client, VIEWER_TOKEN, next_path=target)
                # Then it leads to the console itself
                assert answer.status_code == 303, target
                assert lands_on(console, answer.headers["location"]) == origin, target
                # and so does the login page for a logged-in browser
                again = await client.get("/login", params={"next": target})
                assert again.status_code == 303
                assert lands_on(console, again.headers["location"]) == origin, target
        # (and a path of the console is kept, query and all)
        async with httpx.AsyncClient(base_url=console.url) as client:
            answer = await login(client, VIEWER_TOKEN, next_path="/audit?before=7")
            assert answer.headers["location"] == "/audit?before=7"


async def test_a_hostile_next_is_shown_escaped_in_the_login_form(settings: Settings) -> None:
    hostile = '/"><script>alert(1)</script>'
    async with anonymous_client(settings) as client:
        page = await client.get("/login", params={"next": hostile})
    assert page.status_code == 200
    assert "<script>alert(1)" not in page.text
    assert "&#34;&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page.text


async def test_a_login_without_its_form_value_or_from_another_origin_is_refused(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with anonymous_client(settings) as client:
        form = await client.get("/login")
        value = csrf_of(form.text)
        refused = [
            # (the login form's double-submitted value missing, or wrong)
            await client.post("/login", data={"token": OPERATOR_TOKEN}),
            await client.post("/login", data={"login_csrf": "x" * 43, "token": OPERATOR_TOKEN}),
            # (a right form posted from another site: login CSRF)
            await client.post(
                "/login",
                data={"login_csrf": value, "token": OPERATOR_TOKEN},
                headers={"origin": "http://evil.example"},
            ),
            await client.post(
                "/login",
                data={"login_csrf": value, "token": OPERATOR_TOKEN},
                headers={"sec-fetch-site": "cross-site"},
            ),
        ]
        assert [answer.status_code for answer in refused] == [403] * 4
        assert (await client.get("/audit")).status_code == 303
    assert await audit_entries(engine) == []


# --- Host and headers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["evil.example", "127.0.0.1.evil.example", "localhost.evil.example", "console.example.com", ""],
)
async def test_a_host_the_console_does_not_serve_is_refused_400(
    settings: Settings, host: str
) -> None:
    async with anonymous_client(settings) as client:
        answer = await client.get("/login", headers={"host": host})
    assert answer.status_code == 400
    assert "set WORKER_CONSOLE_URL" in answer.text
    assert_secured(answer)


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8100", "127.0.0.1:1", "[::1]:8100", "console.example.com"]
)
async def test_the_local_names_and_console_url_s_host_are_served(
    settings: Settings, host: str
) -> None:
    async with anonymous_client(settings.replace(console_url=TLS_URL)) as client:
        answer = await client.get("/login", headers={"host": host})
    assert answer.status_code == 200


async def test_every_answer_carries_the_security_headers(settings: Settings) -> None:
    async with running_console(settings) as console:
        async with httpx.AsyncClient(base_url=console.url) as anonymous:
            answers = [
                await anonymous.get("/login"),
                await anonymous.get("/audit"),  # (303 to the login)
                await anonymous.get("/static/console.css"),
                await anonymous.get("/static/console.js"),
                await anonymous.get("/no-such-page"),
                await anonymous.post("/logout", data={}),  # 401
                await anonymous.post("/login", json={"token": OPERATOR_TOKEN}),  # 415
                await anonymous.get("/login", headers={"host": "evil.example"}),  # 400
            ]
        async with logged_in(console, OPERATOR_TOKEN) as operator:
            answers += [
                await operator.client.get("/audit"),
                await operator.client.get("/audit", params={"before": "<x>"}),  # 400
                await operator.client.get("/no-such-page"),
                await operator.client.post("/logout", data={"csrf": operator.csrf}),
            ]
    statuses = sorted({answer.status_code for answer in answers})
    assert statuses == [200, 303, 400, 401, 404, 415]
    for answer in answers:
        assert_secured(answer)
    # (and the pages themselves hold no inline script or style the policy would block)
    for answer in answers:
        if answer.headers.get("content-type", "").startswith("text/html"):
            assert "<script>" not in answer.text
            assert " style=" not in answer.text
            assert " onclick=" not in answer.text


# --- CSRF and origins ------------------------------------------------------------------------


async def test_logout_needs_the_session_s_csrf_token_and_its_own_origin(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with running_console(settings) as console:
        async with logged_in(console, OPERATOR_TOKEN) as operator:
            own = {"origin": console.url, "sec-fetch-site": "same-origin"}
            # When logouts come without the token, with a wrong one, or from another origin
            for data, headers in [
                ({}, own),
                ({"csrf": ""}, own),
                ({"csrf": "x" * 43}, own),
                ({"csrf": operator.csrf}, {"origin": "http://evil.example"}),
                ({"csrf": operator.csrf}, {"origin": "http://127.0.0.1:1"}),
                ({"csrf": operator.csrf}, {"sec-fetch-site": "cross-site"}),
                ({"csrf": operator.csrf}, {"sec-fetch-site": "same-site"}),
            ]:
                await operator.client.post("/logout", data=data, headers=headers)
                # Then the session lives on
                assert (await operator.client.get("/audit")).status_code == 200, (data, headers)
            assert [action for _, action, _, _ in await audit_entries(engine)] == ["login"]

            # When the logout carries the token, from the console's own page
            kept_cookie = operator.client.cookies["worker-console"]
            answer = await operator.client.post(
                "/logout", data={"csrf": operator.csrf}, headers=own
            )
            # Then the session has ended, for this cookie wherever it is replayed
            assert answer.status_code == 303
            assert (await operator.client.get("/audit")).status_code == 303
        async with httpx.AsyncClient(base_url=console.url) as replay:
            replay.cookies.set("worker-console", kept_cookie)
            assert (await replay.get("/audit")).status_code == 303
    assert await audit_entries(engine) == [
        (OPERATOR, "login", "", "done"),
        (OPERATOR, "logout", "", "done"),
    ]


CROSS_ORIGIN = [
    {"origin": "http://evil.example"},
    {"origin": "http://127.0.0.1:1"},
    {"origin": "null"},
    {"sec-fetch-site": "cross-site"},
    {"sec-fetch-site": "same-site"},
]


async def test_an_operator_post_from_another_origin_is_refused_403_and_audited(
    probed: RunningConsole, engine: AsyncEngine
) -> None:
    async with logged_in(probed, OPERATOR_TOKEN) as operator:
        for headers in CROSS_ORIGIN:
            # When an operator's browser is made to POST an action, token and all, from
            # another origin
            answer = await operator.client.post(
                console_probe.PATH,
                data={"csrf": operator.csrf, "target": "attack"},
                headers=headers,
            )
            # Then it is refused
            assert answer.status_code == 403, headers
            assert_secured(answer)
        # When the same POST comes from the console's own page
        done = await operator.client.post(
            console_probe.PATH,
            data={"csrf": operator.csrf, "target": "own"},
            headers={"origin": probed.url, "sec-fetch-site": "same-origin"},
        )
        assert done.status_code == 303

    # Then the audit holds the refusals (one entry, the session's same refusal counted on it),
    # and the one action done
    refusal = (OPERATOR, console_probe.PATH, "", "refused: no valid CSRF token")
    assert await audit_entries(engine) == [
        (OPERATOR, "login", "", "done"),
        refusal,
        (OPERATOR, console_probe.ACTION, "own", "done"),
    ]
    assert await refusals_counted(engine) == [len(CROSS_ORIGIN)]


async def test_an_action_without_the_csrf_token_or_by_a_viewer_is_refused_and_audited(
    probed: RunningConsole, engine: AsyncEngine
) -> None:
    async with logged_in(probed, OPERATOR_TOKEN) as operator:
        # When an operator's POST lacks the token, or carries another
        for data in (
            {"target": "a"},
            {"csrf": "", "target": "b"},
            {"csrf": "x" * 43, "target": "c"},
        ):
            answer = await operator.client.post(console_probe.PATH, data=data)
            assert answer.status_code == 403
            assert "CSRF" in answer.text
    async with logged_in(probed, VIEWER_TOKEN) as viewer:
        # When a read-only user POSTs an action with its own valid token
        answer = await viewer.post(console_probe.PATH, {"target": "d"})
        assert answer.status_code == 403
        assert "may only look" in answer.text
    async with httpx.AsyncClient(base_url=probed.url) as anonymous:
        # When nobody logged in POSTs one
        answer = await anonymous.post(console_probe.PATH, data={"csrf": "", "target": "e"})
        assert answer.status_code == 401

    # Then nothing was done, and each refusal of a logged-in user is audited (a session's same
    # refusal counted on one entry)
    assert await audit_entries(engine) == [
        (OPERATOR, "login", "", "done"),
        (OPERATOR, console_probe.PATH, "", "refused: no valid CSRF token"),
        (VIEWER, "login", "", "done"),
        (VIEWER, console_probe.PATH, "", "refused: read-only user"),
    ]
    assert await refusals_counted(engine) == [3, 1]


# --- forms -----------------------------------------------------------------------------------


async def chunks(body: bytes, size: int = 16 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def test_a_form_over_max_form_bytes_is_refused_413_and_changes_nothing(
    probed: RunningConsole, engine: AsyncEngine
) -> None:
    async with logged_in(probed, OPERATOR_TOKEN) as operator:
        body = f"csrf={operator.csrf}&target=big&filler=".encode()
        body += b"x" * (MAX_FORM_BYTES + 1 - len(body))
        form = {"content-type": "application/x-www-form-urlencoded"}
        # When the form is one byte too large, declared or streamed (chunked, no length)
        declared = await operator.client.post(console_probe.PATH, content=body, headers=form)
        streamed = await operator.client.post(
            console_probe.PATH, content=chunks(body), headers=form
        )
        login = await operator.client.post("/login", content=body, headers=form)
        # Then each is refused 413
        assert [declared.status_code, streamed.status_code, login.status_code] == [413] * 3
        for answer in (declared, streamed, login):
            assert_secured(answer)
        # (while a form just within the limit is read)
        fits = body[:MAX_FORM_BYTES]
        assert (
            await operator.client.post(console_probe.PATH, content=fits, headers=form)
        ).status_code == 303
    assert [action for _, action, _, _ in await audit_entries(engine)] == [
        "login",
        console_probe.ACTION,
    ]


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "multipart/form-data; boundary=x", "text/plain", ""],
)
async def test_a_body_that_is_not_a_url_encoded_form_is_refused_415(
    probed: RunningConsole, engine: AsyncEngine, content_type: str
) -> None:
    async with logged_in(probed, OPERATOR_TOKEN) as operator:
        body = f"csrf={operator.csrf}&target=typed".encode()
        headers = {"content-type": content_type} if content_type else {}
        answers = [
            await operator.client.post(console_probe.PATH, content=body, headers=headers),
            await operator.client.post("/logout", content=body, headers=headers),
            await operator.client.post("/login", content=body, headers=headers),
        ]
        assert [answer.status_code for answer in answers] == [415] * 3
        assert (await operator.client.get("/audit")).status_code == 200  # (still logged in)
    assert [action for _, action, _, _ in await audit_entries(engine)] == ["login"]


async def test_audited_names_and_targets_come_back_escaped(
    probed: RunningConsole, engine: AsyncEngine
) -> None:
    hostile = "<script>alert(1)</script>\"'&<img src=x onerror=alert(1)>"
    async with logged_in(probed, OPERATOR_TOKEN) as operator:
        # When an action's target, as the user typed it, is markup
        await operator.post(console_probe.PATH, {"target": hostile})
        page = await operator.client.get("/audit")
    # Then the audit page shows it as text
    assert (OPERATOR, console_probe.ACTION, hostile, "done") in await audit_entries(engine)
    assert "<script>alert(1)" not in page.text
    assert "<img src=x" not in page.text
    assert (
        "&lt;script&gt;alert(1)&lt;/script&gt;&#34;&#39;&amp;&lt;img src=x onerror=alert(1)&gt;"
        in page.text
    )
