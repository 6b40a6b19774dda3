"""The console's foundation against the real database: a login opens a session, a page needs
one, an action needs an operator and the session's CSRF token, and the audit shows both."""

from __future__ import annotations

import httpx

from tests.integration.console_support import (
    OPERATOR,
    OPERATOR_TOKEN,
    VIEWER,
    VIEWER_TOKEN,
    logged_in,
    running_console,
)
from worker.settings import Settings


async def test_a_login_opens_the_audit_and_a_logout_ends_the_session(settings: Settings) -> None:
    async with running_console(settings) as console:
        # Given no session, a page sends the browser to the login
        async with httpx.AsyncClient(base_url=console.url) as anonymous:
            answer = await anonymous.get("/audit")
        assert answer.status_code == 303
        assert answer.headers["location"].startswith("/login?next=")

        # When the operator logs in
        async with logged_in(console, OPERATOR_TOKEN) as operator:
            page = await operator.client.get("/audit")
            # Then the audit shows the login, by name
            assert OPERATOR in page.text
            assert "login" in page.text
            # And a logout ends the session
            await operator.post("/logout", {})
            assert (await operator.client.get("/audit")).status_code == 303

        async with logged_in(console, VIEWER_TOKEN) as viewer:
            assert VIEWER in (await viewer.client.get("/audit")).text
