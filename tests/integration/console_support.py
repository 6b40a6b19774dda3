"""The console under test: served for real (uvicorn on a free port, in this event loop) on the
test's database and broker, and HTTP clients logged in as an operator or a read-only user."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from worker.console import serve
from worker.settings import Settings

OPERATOR = "olivia"
OPERATOR_TOKEN = "operator-token-0123456789abcdef"
VIEWER = "victor"
VIEWER_TOKEN = "viewer-token-0123456789abcdefgh"

_CSRF = re.compile(r'name="(?:login_)?csrf" value="([^"]+)"')


def console_settings(settings: Settings) -> Settings:
    """``settings`` with an operator and a read-only user, on a free port."""
    return settings.replace(
        console_operator_tokens=(f"{OPERATOR}:{OPERATOR_TOKEN}",),
        console_viewer_tokens=(f"{VIEWER}:{VIEWER_TOKEN}",),
        console_port=0,
    )


@dataclass(frozen=True)
class RunningConsole:
    url: str
    settings: Settings


@contextlib.asynccontextmanager
async def running_console(settings: Settings) -> AsyncIterator[RunningConsole]:
    """``worker console`` for ``console_settings(settings)``, until the block ends."""
    settings = console_settings(settings)
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve.serve(settings, stop, started=port.set_result))
    try:
        await asyncio.wait({port, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        yield RunningConsole(f"http://127.0.0.1:{port.result()}", settings)
    finally:
        stop.set()
        await task


def csrf_of(html: str) -> str:
    """The CSRF token a console page's forms carry."""
    found = _CSRF.search(html)
    assert found is not None, "no CSRF token on the page"
    return found.group(1)


@dataclass
class Browser:
    """An HTTP client logged in to the console, with its session's CSRF token."""

    client: httpx.AsyncClient
    csrf: str

    async def post(self, path: str, data: dict[str, str | list[str]]) -> httpx.Response:
        """POST a form with the session's CSRF token."""
        return await self.client.post(path, data={"csrf": self.csrf, **data})


@contextlib.asynccontextmanager
async def logged_in(console: RunningConsole, token: str) -> AsyncIterator[Browser]:
    """A client logged in with ``token`` (``OPERATOR_TOKEN``, ``VIEWER_TOKEN``)."""
    async with httpx.AsyncClient(base_url=console.url, timeout=30) as client:
        form = await client.get("/login")
        answer = await client.post(
            "/login", data={"login_csrf": csrf_of(form.text), "token": token, "next": "/audit"}
        )
        assert answer.status_code == 303, answer.text
        page = await client.get("/audit")
        assert page.status_code == 200, page.text
        yield Browser(client, csrf_of(page.text))
