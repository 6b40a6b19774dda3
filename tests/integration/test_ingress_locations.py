"""What the ingress tells about itself must be true: its start-up line names the routing keys it
serves (not those it withholds), and an accepted message's ``Location`` is the request's own
path, which a client resolves to nowhere else. Against a real uvicorn server and PostgreSQL."""

from __future__ import annotations

import logging
from urllib.parse import urljoin

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.integration.test_ingress import (
    REQUESTED,
    count,
    ingress,
    is_problem,
    keyed,
    payment,
)
from worker.settings import Settings


async def test_the_start_up_line_names_only_the_routing_keys_served(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    # Given the payments example, whose payment.settled is published by a handler (withheld)
    with caplog.at_level(logging.INFO, logger="worker.ingress"):
        async with ingress(settings) as client:
            settled = await client.post(
                "/messages/payment.settled", json=payment("p1"), headers=keyed("k1")
            )
    # Then the line says it serves payment.requested, and only that, as the 404 shows
    assert is_problem(settled, 404, "no-handler"), settled.text
    [line] = [r.getMessage() for r in caplog.records if "serving the ingress for" in r.getMessage()]
    assert line.startswith("serving the ingress for payment.requested on http://"), line
    assert "payment.settled" not in line


@pytest.mark.parametrize("key", [".", ".."])
async def test_a_dot_segment_key_is_refused_400_and_stores_nothing(
    settings: Settings, engine: AsyncEngine, key: str
) -> None:
    async with ingress(settings) as client:
        # When a client posts with the key "." or ".."
        answer = await client.post(REQUESTED, json=payment("p1"), headers=keyed(key))
    # Then it is refused, before anything is stored: its Location would be another path
    assert is_problem(answer, 400, "invalid-key"), answer.text
    assert "location" not in answer.headers
    assert await count(engine, "ingress_requests") == 0


@pytest.mark.parametrize("key", ["...", "a/..", "%2e%2e", "./a", ".a"])
async def test_a_location_resolves_to_the_request_s_own_path(settings: Settings, key: str) -> None:
    async with ingress(settings) as client:
        answer = await client.post(REQUESTED, json=payment(f"p-{key}"), headers=keyed(key))
        # Then the Location, resolved as a client resolves it, is under the request's path
        assert answer.status_code == 202, answer.text
        base = f"{client.base_url}{REQUESTED}"
        resolved = urljoin(base, answer.headers["location"])
        assert resolved.startswith(base + "/"), resolved
        assert httpx.URL(resolved).path.startswith(REQUESTED + "/")
        # and reading it back names the key posted
        status = await client.get(answer.headers["location"])
        assert status.status_code == 200, status.text
