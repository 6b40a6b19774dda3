"""The ingress's bounds against a real uvicorn server and the real PostgreSQL: idle and slow
clients, floods beyond the caps (open files and RSS of a ``worker serve`` process measured in
``/proc``), client aborts, the Host check and the access log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.footprint import rss_kib
from benchmarks.ingress import (
    Streams,
    close_all,
    closed_by_server,
    idle_connections,
    open_files,
    probe,
    slow_bodies,
    status_of,
)
from tests.helpers import wait_until
from tests.integration.support import HANG_GUARD
from tests.integration.test_ingress import (
    REQUESTED,
    TOKEN,
    count,
    ingress,
    is_problem,
    keyed,
    nothing_stored,
    payment,
    served_port,
    start_serve,
)
from worker.ingress.serve import BACKLOG
from worker.logs import JsonFormatter, MessageFilter
from worker.settings import Settings

MIB = 1024 * 1024


class Served:
    """A ``worker serve`` process, its port and its log."""

    def __init__(self, process_pid: int, port: int, log: Path) -> None:
        self.pid = process_pid
        self.port = port
        self.log = log

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture
async def served(
    settings: Settings, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Served]:
    """``worker serve`` in a process of its own, with the test's parameter (indirect) added to
    its environment."""
    environ: dict[str, str] = getattr(request, "param", {})
    log = tmp_path / "serve.log"
    process = start_serve(settings, log, **environ)
    try:
        yield Served(process.pid, await served_port(log), log)
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)


@contextlib.asynccontextmanager
async def held_bodies(port: int, count: int) -> AsyncIterator[None]:
    """``count`` requests in progress, their bodies a tenth sent, until the block ends."""
    held = await slow_bodies(port, count, declared=1000, sent=100)
    try:
        await asyncio.sleep(0.2)  # (read by the ingress meanwhile)
        yield
    finally:
        await close_all([writer for _, writer in held])


async def healthz_answers(port: int, times: int = 5) -> list[int | None]:
    return [(await probe(port, within=HANG_GUARD))[0] for _ in range(times)]


@pytest.mark.parametrize(
    "served",
    [dict(WORKER_INGRESS_MAX_CONNECTIONS="100", WORKER_INGRESS_HEADER_TIMEOUT="2s")],
    indirect=True,
)
async def test_an_idle_flood_beyond_the_cap_keeps_healthz_answering_and_files_bounded(
    served: Served,
) -> None:
    files_before = open_files(served.pid)
    streams: Streams = []
    try:
        # Given six times the connection cap of clients that connect and send nothing
        streams = await idle_connections(served.port, 600)
        files_under = open_files(served.pid)

        # Then /healthz is answered every time
        assert await healthz_answers(served.port) == [200] * 5
        # And the process holds at most the cap of them, plus the overflow's few and those
        # accepted in one turn of its event loop (whose room is made in the next)
        assert files_under <= files_before + 100 + 16 + BACKLOG, (files_before, files_under)
        assert len(streams) == 600

        # And every idle connection is closed by the server, none left to wait
        async def all_closed() -> bool:
            return closed_by_server(streams) == len(streams)

        await wait_until(all_closed, timeout=HANG_GUARD * 3)
    finally:
        await close_all([writer for _, writer in streams])


async def test_slow_headers_and_a_slow_body_are_cut_off(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings, ingress_header_timeout=0.5, ingress_body_timeout=0.5) as client:
        port = client.base_url.port or 0
        # Given a client that sends half its headers and stalls
        slow_head = await asyncio.open_connection("127.0.0.1", port)
        slow_head[1].write(b"POST /messages/payment.requested HTTP/1.1\r\nHost: localhost\r\n")
        # And one that sends its headers and a tenth of its body, and stalls
        (slow_body,) = await slow_bodies(port, 1, declared=1000, sent=100)
        try:
            # Then the first is closed without an answer
            assert await status_of(slow_head[0], HANG_GUARD) is None
            assert slow_head[0].at_eof()
            # And the second gets a 408 problem, and is closed
            assert await status_of(slow_body[0], HANG_GUARD) == 408
            rest = await asyncio.wait_for(slow_body[0].read(), HANG_GUARD)
            assert b"urn:rabbit-outbox-worker:problem:body-timeout" in rest
            assert slow_body[0].at_eof()
        finally:
            await close_all([slow_head[1], slow_body[1]])
        # And the ingress goes on serving
        accepted = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
    assert accepted.status_code == 202
    assert await count(engine, "ingress_requests") == 1


@pytest.mark.parametrize(
    "served",
    [
        {
            "WORKER_INGRESS_BODY_TIMEOUT": "5s",
            "WORKER_INGRESS_ACCESS_LOG": "false",
            "WORKER_LOG_LEVEL": "INFO",
        }
    ],
    indirect=True,
)
async def test_a_slow_body_flood_holds_bounded_memory_that_returns_after_it(
    served: Served,
) -> None:
    rss_before = rss_kib(served.pid) / 1024
    # Given 300 clients that declare the largest body allowed (1 MiB), send 99 % and stall
    streams = await slow_bodies(served.port, 300, declared=MIB, sent=MIB * 99 // 100)
    try:
        # Then /healthz is answered meanwhile
        assert await healthz_answers(served.port) == [200] * 5
        rss_under = rss_kib(served.pid) / 1024
        # And those beyond ingress_max_requests (100) are answered 503 at once, the others
        # 408 once the body timeout passes
        statuses = await asyncio.gather(*(status_of(r, HANG_GUARD * 3) for r, _ in streams))
        assert Counter(statuses) == {503: 200, 408: 100}
    finally:
        await close_all([writer for _, writer in streams])

    # And the memory held under the attack was bounded by the 100 bodies read at most
    assert rss_under - rss_before < 250, (rss_before, rss_under)

    # And it returns once the attack is over (loosely: the allocator keeps some)
    async def returned() -> bool:
        return rss_kib(served.pid) / 1024 - rss_before < 64

    await wait_until(returned, timeout=HANG_GUARD * 2)
    assert "Traceback" not in served.text()


async def test_requests_over_the_cap_are_answered_503_at_once(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings, ingress_max_requests=2) as client:
        port = client.base_url.port or 0
        # Given two requests in progress, their bodies still coming
        async with held_bodies(port, 2):
            # When a third request comes
            busy = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
            health = await client.get("/healthz")
        # Then it is answered 503 at once, a problem saying to retry later; health as ever
        assert is_problem(busy, 503, "busy"), busy.text
        assert busy.headers["retry-after"] == "1"
        assert health.status_code == 200
        assert await nothing_stored(engine)
        # And once they are gone, a request is served
        accepted = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
    assert accepted.status_code == 202


async def test_connections_over_the_cap_are_answered_503_and_closed_health_as_ever(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given as many connections as the cap, each with a request in progress
    async with (
        ingress(settings, ingress_max_connections=4) as client,
        held_bodies(client.base_url.port or 0, 4),
    ):
        # When another client connects, a request is answered 503, health as ever
        async with httpx.AsyncClient(base_url=str(client.base_url)) as another:
            refused = await another.post(REQUESTED, json=payment("p2"), headers=keyed("p2"))
        async with httpx.AsyncClient(base_url=str(client.base_url)) as prober:
            health = await prober.get("/healthz")
    assert is_problem(refused, 503, "busy"), refused.text
    assert refused.headers["connection"] == "close"
    assert health.status_code == 200
    assert await nothing_stored(engine)


@pytest.mark.parametrize("served", [{"WORKER_INGRESS_BODY_TIMEOUT": "30s"}], indirect=True)
async def test_clients_that_abort_mid_body_are_one_quiet_line_each(
    served: Served, engine: AsyncEngine
) -> None:
    # Given 20 clients that send half a body and go away
    streams = await slow_bodies(served.port, 20, declared=2000, sent=1000)
    await asyncio.sleep(0.5)
    await close_all([writer for _, writer in streams])

    # Then each is one access line with 499, and nothing is logged as an error
    async def logged() -> bool:
        return served.text().count(" 499 ") == 20

    await wait_until(logged)
    text = served.text()
    assert "ERROR" not in text, text
    assert "Traceback" not in text
    assert " 500 " not in text
    aborts = [line for line in text.splitlines() if "worker.ingress" in line and "POST" in line]
    assert len(aborts) == 20, text
    assert await nothing_stored(engine)


async def test_a_host_not_allowed_is_refused_while_no_token_is_asked(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings) as client:
        port = client.base_url.port
        rebound = await client.post(
            REQUESTED, json=payment("p1"), headers=keyed("p1", host=f"evil.example:{port}")
        )
        docs = await client.get("/openapi.json", headers={"host": "evil.example"})
        health = await client.get("/healthz", headers={"host": "10.0.0.7:8000"})
        named = await client.post(
            REQUESTED, json=payment("p2"), headers=keyed("p2", host=f"localhost:{port}")
        )
        bracketed = await client.post(
            REQUESTED, json=payment("p3"), headers=keyed("p3", host=f"[::1]:{port}")
        )
    assert is_problem(rebound, 400, "host-not-allowed"), rebound.text
    assert is_problem(docs, 400, "host-not-allowed"), docs.text
    assert health.status_code == 200
    assert (named.status_code, bracketed.status_code) == (202, 202)
    assert await count(engine, "ingress_requests") == 2

    async with ingress(settings, ingress_allowed_hosts=("api.example",)) as client:
        listed = await client.post(
            REQUESTED, json=payment("p4"), headers=keyed("p4", host="API.example:443")
        )
        loopback = await client.post(REQUESTED, json=payment("p5"), headers=keyed("p5"))
    assert listed.status_code == 202
    assert is_problem(loopback, 400, "host-not-allowed"), loopback.text


async def test_with_tokens_any_host_is_served(settings: Settings) -> None:
    async with ingress(settings, ingress_tokens=(TOKEN,)) as client:
        response = await client.post(
            REQUESTED,
            json=payment("p1"),
            headers=keyed("p1", host="ingress.example", authorization=f"Bearer {TOKEN}"),
        )
    assert response.status_code == 202, response.text


async def test_the_access_log_says_each_request_in_one_line_without_secrets(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.ingress.access")
    long_key = "k" * 300
    async with ingress(settings, ingress_tokens=(TOKEN,)) as client:
        bearer = {"authorization": f"Bearer {TOKEN}"}
        await client.post(
            REQUESTED, json=payment("p1", account="secret-account"), headers=keyed("p1", **bearer)
        )
        await client.post(REQUESTED, json=payment("p2"), headers=keyed(long_key, **bearer))
        await client.get(f"{REQUESTED}/p1", headers=bearer)
        await client.get(f"{REQUESTED}/p1")
    records = [r for r in caplog.records if r.name == "worker.ingress.access"]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 4, lines
    assert re.fullmatch(
        r"POST /messages/payment\.requested 202 \d+\.\dms key=p1 client=127\.0\.0\.1:\d+", lines[0]
    ), lines[0]
    assert f"key={'k' * 128}... " in lines[1]
    assert lines[2].startswith("GET /messages/payment.requested/p1 200 ")
    assert " key=- " in lines[2]
    assert lines[3].startswith("GET /messages/payment.requested/p1 401 ")
    # never a token or a body, in the text or in the JSON format
    formatter = JsonFormatter()
    for record in records:
        MessageFilter().filter(record)
        formatted = formatter.format(record)
        assert TOKEN not in formatted
        assert "secret-account" not in formatted
    first = json.loads(formatter.format(records[0]))
    assert {k: first[k] for k in ("method", "path", "status", "key")} == {
        "method": "POST",
        "path": REQUESTED,
        "status": 202,
        "key": "p1",
    }
    assert first["client"].startswith("127.0.0.1:")
    assert isinstance(first["duration_ms"], float)


async def test_the_access_log_can_be_turned_off(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.ingress.access")
    async with ingress(settings, ingress_access_log=False) as client:
        await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
    assert not [r for r in caplog.records if r.name == "worker.ingress.access"]
