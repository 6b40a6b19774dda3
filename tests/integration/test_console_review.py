"""The console against what an attacker sends and what a tired operator configures, each test a
flaw found in review and fixed: ids past what PostgreSQL's ``BIGINT`` holds refused as a bad
request (never a server error).
"""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import rows
from tests.integration.console_support import (
    OPERATOR_TOKEN,
    VIEWER_TOKEN,
    logged_in,
    running_console,
)
from tests.integration.test_console_security import assert_secured
from worker.settings import Settings

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
