"""``/healthz`` and ``/metrics`` of a running worker, against the real services."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import urllib.error
import urllib.request

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import free_port, payment, wait_until
from tests.integration.support import publish, request, running_worker, settled
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
