"""``/healthz`` and ``/metrics`` of a running worker, against the real services."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import free_port, payment, wait_until
from tests.integration.support import publish, request, running_relay, running_worker, settled
from tests.integration.tcp_proxy import tcp_proxy
from worker.ops.health import STUCK_AFTER, Health
from worker.ops.http import HttpServer
from worker.ops.metrics import Metrics
from worker.settings import Settings


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def test_a_running_worker_reports_health_and_counts_by_handler(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    port = free_port()
    settings = settings.replace(http_host="127.0.0.1", http_port=port)
    async with running_worker(settings, payments) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, payment("p-m1"), key="p-m1")
        await publish(channel, settings, payment("p-m1"), key="p-m1")
        await publish(channel, settings, {"payment_id": "bad"}, key="p-bad")
        await settled(worker, processed=1, duplicate=1, dead_lettered=1)

        status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz")
        assert status == 200, body
        assert json.loads(body) == {
            "status": "ok",
            "database": True,
            "broker": True,
            "consuming": True,
            "throttled": False,
        }

        status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
        text = body.decode()
        assert status == 200
        assert 'worker_messages_total{handler="payment.requested",outcome="processed"} 1.0' in text
        assert 'worker_messages_total{handler="payment.requested",outcome="duplicate"} 1.0' in text
        assert 'worker_dead_letters_total{handler="payment.requested",reason="invalid"} 1.0' in text
        assert 'worker_transaction_seconds_count{handler="payment.requested"}' in text
    # the endpoint closes with the worker
    status, _ = await asyncio.to_thread(get_or_refused, f"http://127.0.0.1:{port}/healthz")
    assert status == 0


def get_or_refused(url: str) -> tuple[int, bytes]:
    try:
        return get(url)
    except urllib.error.URLError:
        return 0, b""


async def test_worker_health_answers_for_the_local_process(
    settings: Settings, engine: AsyncEngine
) -> None:
    from tests.helpers import WORKER_SCRIPT, run

    port = free_port()
    async with running_worker(settings.replace(http_host="127.0.0.1", http_port=port), payments):
        healthy = await asyncio.to_thread(run, WORKER_SCRIPT, "health", WORKER_HTTP_PORT=str(port))
    assert healthy.returncode == 0, healthy.stderr
    assert json.loads(healthy.stdout)["status"] == "ok"
    gone = await asyncio.to_thread(run, WORKER_SCRIPT, "health", WORKER_HTTP_PORT=str(port))
    assert gone.returncode == 1
    assert "no answer" in gone.stderr


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_idle_connections_beyond_the_cap_cannot_pin_the_endpoint(
    settings: Settings, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    port, cap, clients = free_port(), 8, 200
    settings = settings.replace(http_host="127.0.0.1", http_port=port, http_max_connections=cap)
    async with running_worker(settings, payments) as worker:
        before = open_files()
        idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        held_by_worker = 0
        try:
            # Given far more idle connections than the cap, each sending nothing
            for _ in range(clients):
                idle.append(await asyncio.open_connection("127.0.0.1", port))
                held_by_worker = max(held_by_worker, open_files() - before - len(idle))

            # Then the worker held at most the cap of them (plus sockets being closed, and room
            # for a database connection or two): it closed the others at once
            assert held_by_worker <= cap + 16

            # and once those it holds time out, a new client gets its answer
            async def healthy() -> bool:
                with contextlib.suppress(ConnectionError):
                    return (await request(port, "/healthz")).status == 200
                return False

            await wait_until(healthy)
            assert not worker.task.done()
        finally:
            for _, writer in idle:
                writer.close()
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert [r.levelname for r in refused] == ["WARNING"]
    assert not [r for r in caplog.records if r.exc_info]


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.2",
        pytest.param(
            "::",
            marks=pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
)
async def test_worker_health_asks_the_address_the_endpoint_listens_on(
    settings: Settings, engine: AsyncEngine, host: str
) -> None:
    from tests.helpers import WORKER_SCRIPT, run

    port = free_port()
    env = {"WORKER_HTTP_HOST": host, "WORKER_HTTP_PORT": str(port)}
    async with running_worker(settings.replace(http_host=host, http_port=port), payments):
        healthy = await asyncio.to_thread(run, WORKER_SCRIPT, "health", **env)
    assert healthy.returncode == 0, healthy.stderr
    assert json.loads(healthy.stdout)["status"] == "ok"


def through_proxy(settings: Settings, port: int) -> str:
    """``settings.database_url`` pointed at a TCP proxy on 127.0.0.1:``port``."""
    url = urlsplit(settings.database_url)
    return url._replace(netloc=f"{url.username}@127.0.0.1:{port}").geturl()


async def test_a_worker_paused_by_an_outage_is_alive_but_not_ready(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    """What a liveness probe asks (``/livez``) never depends on PostgreSQL: an orchestrator that
    restarts on it leaves a correctly paused worker alone, and takes it out of rotation on
    ``/readyz`` (``/healthz``) instead."""
    url = urlsplit(settings.database_url)
    async with tcp_proxy(url.hostname or "127.0.0.1", url.port or 5432) as proxy:
        port = free_port()
        worker_settings = settings.replace(
            database_url=through_proxy(settings, proxy.port),
            relay=False,
            http_host="127.0.0.1",
            http_port=port,
        )
        async with running_worker(worker_settings, payments) as worker:
            channel = await amqp.channel(publisher_confirms=True)

            async def ready() -> bool:
                return (await request(port, "/readyz")).status == 200

            await wait_until(ready)
            assert (await request(port, "/livez")).status == 200

            # When PostgreSQL becomes unreachable and a payment arrives, the worker pauses
            await proxy.down()
            await publish(channel, settings, payment("p-live"), key="p-live")
            await settled(worker, paused=1)

            async def reports_paused() -> bool:
                response = await request(port, "/readyz")
                return response.status == 503 and json.loads(response.body).get("paused") == (
                    "database-unreachable"
                )

            await wait_until(reports_paused)

            # Then it is not ready, the same answer as /healthz, but it is alive
            healthz = await request(port, "/healthz")
            assert healthz.status == 503
            assert json.loads(healthz.body)["paused"] == "database-unreachable"
            livez = await request(port, "/livez")
            assert livez.status == 200, livez.body
            assert json.loads(livez.body)["status"] == "alive"

            # When PostgreSQL is back, it is ready again and handles the payment
            await proxy.up()
            await wait_until(ready)
            await settled(worker, processed=1)


async def test_a_relay_without_its_database_is_alive_but_not_ready(settings: Settings) -> None:
    url = urlsplit(settings.database_url)
    async with tcp_proxy(url.hostname or "127.0.0.1", url.port or 5432) as proxy:
        port = free_port()
        relay_settings = settings.replace(
            database_url=through_proxy(settings, proxy.port), http_host="127.0.0.1", http_port=port
        )
        async with running_relay(relay_settings):

            async def status_of(path: str) -> int:
                return (await request(port, path)).status

            async def ready() -> bool:
                return await status_of("/readyz") == 200

            await wait_until(ready)

            # When PostgreSQL becomes unreachable
            await proxy.down()

            async def not_ready() -> bool:
                return await status_of("/readyz") == 503

            await wait_until(not_ready)

            # Then the relay is alive all the same
            assert await status_of("/livez") == 200
            await proxy.up()
            await wait_until(ready)


async def test_livez_reports_a_process_whose_probes_stopped_as_stuck(
    engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    health = Health()
    await health.probe(engine, amqp, lambda: True)
    server = HttpServer(Metrics(), health)
    port = await server.start("127.0.0.1", 0)
    async with server:
        fresh = await request(port, "/livez")
        assert fresh.status == 200
        assert json.loads(fresh.body)["status"] == "alive"

        # When no probe has finished for longer than STUCK_AFTER (the clock moved, not slept)
        health.probed_at = time.monotonic() - STUCK_AFTER - 1

        # Then /livez says the process is stuck, and the readiness answer is unchanged
        stuck = await request(port, "/livez")
        assert stuck.status == 503
        assert json.loads(stuck.body)["status"] == "stuck"
        assert json.loads(stuck.body)["probed_seconds_ago"] > STUCK_AFTER
        assert (await request(port, "/readyz")).status == 200

        # And a probe that finishes makes it alive again
        await health.probe(engine, amqp, lambda: True)
        assert (await request(port, "/livez")).status == 200
