"""Metrics and health against the real PostgreSQL and RabbitMQ: counters and histograms render
with their labels, the gauges read the outbox and the inbox, and the HTTP endpoint answers
``/metrics``, ``/healthz`` (200, or 503 naming what fails) and nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tests.helpers import wait_until
from tests.integration.support import BASE, HANG_GUARD, request
from worker.database import create_engine
from worker.errors import PauseReason
from worker.ops.health import Health, Monitor
from worker.ops.http import HttpServer, local_url
from worker.ops.metrics import Metrics
from worker.settings import Settings
from worker.sql import inspection, outbox
from worker.sql.rows import OutboxMessage

UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``render()``, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


@pytest.fixture
async def unreachable_engine(settings: Settings) -> AsyncIterator[AsyncEngine]:
    """An engine whose PostgreSQL refuses every connection."""
    engine = create_engine(settings.replace(database_url=UNREACHABLE))
    yield engine
    await engine.dispose()


@pytest.fixture
async def closed_amqp() -> AbstractRobustConnection:
    connection = await aio_pika.connect_robust(BASE.amqp_url)
    await connection.close()
    return connection


async def served(metrics: Metrics, health: Health) -> HttpServer:
    server = HttpServer(metrics, health)
    await server.start("127.0.0.1", 0)
    return server


def outbox_message(routing_key: str = "thing.happened") -> OutboxMessage:
    return OutboxMessage(
        message_id=uuid.uuid4(),
        exchange="events",
        routing_key=routing_key,
        body=b"{}",
        content_type="application/json",
        headers={},
        correlation_id=None,
        causation_id=None,
        ordering_key=None,
    )


async def test_counters_and_histograms_render_with_their_labels() -> None:
    metrics = Metrics()
    metrics.message("payments", "processed")
    metrics.message("payments", "processed")
    metrics.message("payments", "duplicate")
    metrics.message(None, "requeued")
    metrics.dead_letter(None, "invalid")
    metrics.dead_letter("payments", "handler-error")
    with metrics.transaction("payments"):
        pass
    with pytest.raises(RuntimeError), metrics.transaction("payments"):
        raise RuntimeError("rolled back")  # a failed unit of work is timed too
    metrics.paused(PauseReason.DATABASE_UNREACHABLE)
    metrics.relay_batch(5, published=3, failed=2, parked=1)
    metrics.relay_batch(0, published=0)
    metrics.expired(7)
    metrics.batch(1)
    metrics.batch(40)

    counts = samples(metrics)
    total = "worker_messages_total"
    assert counts[(total, (("handler", "payments"), ("outcome", "processed")))] == 2
    assert counts[(total, (("handler", "payments"), ("outcome", "duplicate")))] == 1
    assert counts[(total, (("handler", ""), ("outcome", "requeued")))] == 1
    assert counts[(total, (("handler", ""), ("outcome", "dead_lettered")))] == 1
    assert counts[(total, (("handler", "payments"), ("outcome", "dead_lettered")))] == 1
    dead = "worker_dead_letters_total"
    assert counts[(dead, (("handler", ""), ("reason", "invalid")))] == 1
    assert counts[(dead, (("handler", "payments"), ("reason", "handler-error")))] == 1
    assert counts[("worker_transaction_seconds_count", (("handler", "payments"),))] == 2
    assert counts[("worker_transaction_seconds_bucket", (("handler", "payments"), ("le", "10.0")))]
    assert counts[("worker_consumer_pauses_total", ())] == 1
    assert counts[("worker_relay_batch_rows_count", ())] == 1  # the empty batch is not observed
    assert counts[("worker_relay_batch_rows_sum", ())] == 5
    assert counts[("worker_batch_messages_count", ())] == 2
    assert counts[("worker_batch_messages_sum", ())] == 41
    relayed = "worker_relay_messages_total"
    assert counts[(relayed, (("result", "published"),))] == 3
    assert counts[(relayed, (("result", "failed"),))] == 2
    assert counts[(relayed, (("result", "parked"),))] == 1
    assert counts[("worker_inbox_expired_total", ())] == 7


async def test_every_relay_result_and_inbox_status_is_rendered_before_it_happens() -> None:
    metrics = Metrics()
    for result in ("published", "failed", "parked"):
        assert sample(metrics, "worker_relay_messages_total", result=result) == 0
    for status in ("completed", "failed", "in_progress"):
        assert sample(metrics, "worker_inbox_rows", status=status) == 0


async def test_unknown_outcomes_are_refused() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match="unknown outcome"):
        metrics.message("payments", "procesed")
    with pytest.raises(ValueError, match="dead_letter"):
        metrics.message("payments", "dead_lettered")


async def test_two_metrics_objects_share_nothing() -> None:
    first, second = Metrics(), Metrics()
    first.message("h", "processed")
    assert sample(first, "worker_messages_total", handler="h", outcome="processed") == 1
    assert sample(second, "worker_messages_total", handler="h", outcome="processed") is None


async def insert_inbox_keys(conn: AsyncConnection, **counts: int) -> None:
    """``counts[status]`` inbox keys of each status, of one handler."""
    await conn.execute(
        text(
            "INSERT INTO inbox (handler, key, fingerprint, status, routing_key) "
            "VALUES ('h', :key, '\\x00', :status, 'k')"
        ),
        [
            {"key": f"{status}-{i}", "status": status}
            for status, count in counts.items()
            for i in range(count)
        ],
    )


async def test_refresh_of_an_empty_database_reports_zero(engine: AsyncEngine) -> None:
    metrics = Metrics()
    await metrics.refresh(engine)
    assert sample(metrics, "worker_outbox_backlog") == 0
    assert sample(metrics, "worker_outbox_oldest_age_seconds") == 0
    assert sample(metrics, "worker_outbox_parked") == 0
    assert sample(metrics, "worker_outbox_scheduled") == 0
    assert sample(metrics, "worker_outbox_scheduled_overdue_seconds") == 0
    for status in ("completed", "failed", "in_progress"):
        assert sample(metrics, "worker_inbox_rows", status=status) == 0


async def test_refresh_reports_the_outbox_backlog_its_age_parked_rows_and_inbox_keys(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        await outbox.append_outbox(conn, [outbox_message() for _ in range(3)])
        await conn.execute(
            text(
                "UPDATE outbox SET created_at = now() - interval '90 seconds' "
                "WHERE id = (SELECT min(id) FROM outbox)"
            )
        )
        await conn.execute(
            text(
                "INSERT INTO outbox_parked (id, message_id, exchange, routing_key, body, "
                "content_type, headers, attempts, created_at) "
                "VALUES (1000, gen_random_uuid(), 'events', 'k', '\\x00', 'application/json', "
                "'{}', 10, now())"
            )
        )
        await insert_inbox_keys(conn, completed=4, failed=2, in_progress=1)
    metrics = Metrics()
    await metrics.refresh(engine)
    assert sample(metrics, "worker_outbox_backlog") == 3
    assert (sample(metrics, "worker_outbox_oldest_age_seconds") or 0) >= 90
    assert sample(metrics, "worker_outbox_parked") == 1
    assert sample(metrics, "worker_inbox_rows", status="completed") == 4
    assert sample(metrics, "worker_inbox_rows", status="failed") == 2
    assert sample(metrics, "worker_inbox_rows", status="in_progress") == 1

    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM inbox WHERE status = 'failed'"))
        await conn.execute(text("DELETE FROM outbox"))
    await metrics.refresh(engine, inbox=False)
    assert sample(metrics, "worker_outbox_backlog") == 0
    assert sample(metrics, "worker_outbox_oldest_age_seconds") == 0
    assert sample(metrics, "worker_inbox_rows", status="failed") == 2  # not counted this time
    await metrics.refresh(engine)
    assert sample(metrics, "worker_inbox_rows", status="failed") == 0
    assert sample(metrics, "worker_inbox_rows_estimated") == 0


async def test_refresh_reports_scheduled_events_and_how_long_a_due_one_waits_to_be_moved(
    engine: AsyncEngine,
) -> None:
    # Given three events scheduled an hour ahead, and no relay to move any of them
    async with engine.begin() as conn:
        later = [dataclasses.replace(outbox_message(), due_in=3600.0) for _ in range(3)]
        await outbox.append_outbox(conn, later)
    metrics = Metrics()

    # When the gauges are read, then they count the three, none of them overdue, none backlog
    await metrics.refresh(engine)
    assert sample(metrics, "worker_outbox_scheduled") == 3
    assert sample(metrics, "worker_outbox_scheduled_overdue_seconds") == 0
    assert sample(metrics, "worker_outbox_backlog") == 0

    # When the earliest two become due, 45 and 20 seconds ago (in SQL: no waiting)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE outbox_scheduled SET due_at = now() - interval '45 seconds' "
                "WHERE id = (SELECT min(id) FROM outbox_scheduled)"
            )
        )
        await conn.execute(
            text(
                "UPDATE outbox_scheduled SET due_at = now() - interval '20 seconds' "
                "WHERE id = (SELECT max(id) FROM outbox_scheduled)"
            )
        )
    await metrics.refresh(engine)

    # Then the overdue age is the earliest one's; they are still scheduled, not yet backlog
    assert (sample(metrics, "worker_outbox_scheduled_overdue_seconds") or 0) >= 45
    assert sample(metrics, "worker_outbox_scheduled") == 3
    assert sample(metrics, "worker_outbox_backlog") == 0

    # When a relay's mover has moved them into the outbox, then nothing scheduled is overdue
    async with engine.begin() as conn:
        assert await outbox.move_due(conn, 10) == 2
    await metrics.refresh(engine)
    assert sample(metrics, "worker_outbox_scheduled") == 1
    assert sample(metrics, "worker_outbox_scheduled_overdue_seconds") == 0
    assert sample(metrics, "worker_outbox_backlog") == 2


async def test_many_scheduled_events_are_estimated_from_the_statistics_not_counted(
    engine: AsyncEngine,
) -> None:
    # Given 50 scheduled events the statistics know of
    async with engine.begin() as conn:
        soon = [dataclasses.replace(outbox_message(), due_in=60.0 + n) for n in range(50)]
        await outbox.append_outbox(conn, soon)
        await conn.execute(text("ANALYZE outbox_scheduled"))

    # When the stats count exactly up to 10 rows, then up to 50
    async with engine.connect() as conn:
        estimated = await inspection.outbox_stats(conn, exact_scheduled_up_to=10)
        exact = await inspection.outbox_stats(conn, exact_scheduled_up_to=50)

    # Then beyond the limit the statistics' count is taken, and within it the rows are counted
    # (the statistics may still hold an earlier test's rows, reported late: never fewer)
    assert estimated.scheduled_estimated
    assert estimated.scheduled >= 50
    assert (exact.scheduled, exact.scheduled_estimated) == (50, False)
    assert estimated.scheduled_overdue_seconds == exact.scheduled_overdue_seconds == 0


async def test_a_large_inbox_is_estimated_from_the_statistics_not_read_whole(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        await insert_inbox_keys(conn, completed=30, failed=10, in_progress=2)
        await conn.execute(text("ANALYZE inbox"))
    async with engine.begin() as conn:
        # a scan of the whole inbox stays possible, only costed out: the count below takes
        # the in-progress index, and whatever read the whole inbox would still show here
        await conn.execute(text("SET LOCAL enable_seqscan = off"))
        scans = text("SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = 'inbox'")
        before = await conn.scalar(scans)
        gauge = await inspection.inbox_gauge(conn, exact_up_to=10)
        after = await conn.scalar(scans)
        exact = await inspection.inbox_gauge(conn, exact_up_to=42)
        after_exact = await conn.scalar(scans)
    assert gauge.estimated
    assert gauge.counts == {"completed": 30, "failed": 10, "in_progress": 2}
    assert after == before
    assert after_exact == after + 1  # (the exact count does read the whole inbox)
    assert not exact.estimated
    assert exact.counts == {"completed": 30, "failed": 10, "in_progress": 2}


async def test_the_endpoint_serves_metrics_health_and_nothing_else(
    engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    metrics, health = Metrics(), Health()
    metrics.message("payments", "processed")
    await health.probe(engine, amqp, lambda: True)
    async with await served(metrics, health) as server:
        assert server.port
        scraped = await request(server.port, "/metrics")
        assert scraped.status == 200
        assert scraped.headers["content-type"] == CONTENT_TYPE_LATEST
        families = {f.name for f in text_string_to_metric_families(scraped.body.decode())}
        assert {"worker_messages", "worker_transaction_seconds", "worker_outbox_backlog"} <= (
            families
        )

        healthz = await request(server.port, "/healthz?verbose=1")
        assert healthz.status == 200
        assert healthz.headers["content-type"] == "application/json"
        assert json.loads(healthz.body) == {
            "status": "ok",
            "database": True,
            "broker": True,
            "consuming": True,
        }

        head = await request(server.port, "/healthz", method="HEAD")
        assert (head.status, head.body) == (200, b"")
        assert int(head.headers["content-length"]) == len(healthz.body)

        assert (await request(server.port, "/")).status == 404
        assert (await request(server.port, "/metrics/x")).status == 404
        assert (await request(server.port, "/metrics", method="POST")).status == 405
        assert (await request(server.port, "", raw=b"nonsense\r\n\r\n")).status == 400


async def test_healthz_is_503_naming_an_unreachable_database(
    unreachable_engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    health = Health()
    await health.probe(unreachable_engine, amqp, lambda: True)
    async with await served(Metrics(), health) as server:
        assert server.port
        response = await request(server.port, "/healthz")
    assert response.status == 503
    assert json.loads(response.body) == {
        "status": "failing",
        "database": False,
        "broker": True,
        "consuming": True,
    }


async def test_healthz_is_503_naming_a_closed_broker_connection_and_a_stopped_consumer(
    engine: AsyncEngine, closed_amqp: AbstractRobustConnection
) -> None:
    health = Health()
    await health.probe(engine, closed_amqp, lambda: False)
    healthy, report = health.report()
    assert not healthy
    assert report == {"status": "failing", "database": True, "broker": False, "consuming": False}


async def test_health_leaves_consuming_out_of_a_process_that_does_not_consume(
    engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    health = Health()
    assert health.report() == (
        False,
        {"status": "starting", "database": False, "broker": False},
    )
    await health.probe(engine, amqp)
    assert health.report() == (True, {"status": "ok", "database": True, "broker": True})


async def test_the_monitor_serves_refreshes_and_stops(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with engine.begin() as conn:
        await outbox.append_outbox(conn, [outbox_message(), outbox_message()])
    metrics = Metrics()
    local = settings.replace(http_host="127.0.0.1")
    monitor = Monitor(local, engine, amqp, metrics, consuming=lambda: True, port=0)
    stop = asyncio.Event()
    port = await monitor.start()
    assert port
    task = asyncio.create_task(monitor.run(stop))
    try:

        async def healthy() -> bool:
            return (await request(port, "/healthz")).status == 200

        await wait_until(healthy)

        async def backlog_scraped() -> bool:
            body = (await request(port, "/metrics")).body.decode()
            return "worker_outbox_backlog 2.0" in body

        await wait_until(backlog_scraped)
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD)
    assert monitor.port is None
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_the_monitor_outlives_a_database_outage(
    settings: Settings, unreachable_engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    monitor = Monitor(
        settings.replace(http_host="127.0.0.1"), unreachable_engine, amqp, Metrics(), port=0
    )
    stop = asyncio.Event()
    task = asyncio.create_task(monitor.run(stop))
    try:

        async def failing() -> bool:
            return monitor.health.probed

        await wait_until(failing)
        assert monitor.health.report() == (
            False,
            {"status": "failing", "database": False, "broker": True},
        )
        assert not task.done()
        assert monitor.port
        assert (await request(monitor.port, "/healthz")).status == 503
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD)


async def test_the_monitor_recovers_when_a_refresh_fails_transiently(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    """A refresh that fails after the probe answered marks the database failing, until the
    next round finds it answering again."""
    metrics = Metrics()
    monitor = Monitor(settings, engine, amqp, metrics)

    async def broken_refresh(engine: AsyncEngine, *, inbox: bool = True) -> None:
        raise ConnectionResetError("connection lost mid-query")

    original = metrics.refresh
    metrics.refresh = broken_refresh  # type: ignore[method-assign]
    await monitor.check()
    assert monitor.health.report()[1]["database"] is False
    metrics.refresh = original  # type: ignore[method-assign]
    await monitor.check()
    assert monitor.health.report() == (True, {"status": "ok", "database": True, "broker": True})


async def test_no_server_when_the_port_is_0(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    monitor = Monitor(settings.replace(http_port=0), engine, amqp, Metrics())
    assert await monitor.start() is None
    stop = asyncio.Event()
    stop.set()
    await asyncio.wait_for(monitor.run(stop), HANG_GUARD)
    assert monitor.port is None


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed (or reset) the connection, the client having sent nothing."""
    try:
        async with asyncio.timeout(HANG_GUARD):
            return await reader.read() == b""
    except ConnectionResetError:
        return True


async def test_a_new_connection_at_the_cap_closes_the_oldest_idle_one_and_probes_get_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, health = Metrics(), Health()
    server = HttpServer(metrics, health, max_connections=3, timeout=HANG_GUARD * 3)
    await server.start("127.0.0.1", 0)
    assert server.port
    async with server:
        # Given as many idle connections as the cap allows
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]

        # When more connect, and sit idle too
        extra = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(5)]

        # Then the oldest idle ones are closed, unread, to make room, and counted
        oldest = idle + extra[:2]
        assert all([await closed_by_server(reader) for reader, _ in oldest])
        assert sample(metrics, "worker_http_connections_refused_total") == 5

        # And a probe made while the cap is full of idle clients is answered, every time
        for _ in range(5):
            assert (await request(server.port, "/livez")).status == 200
        for _, writer in idle + extra:
            writer.close()
    # one warning for the closings, no traceback
    assert [r.levelname for r in caplog.records if r.levelno >= logging.WARNING] == ["WARNING"]
    assert not [r for r in caplog.records if r.exc_info]


async def test_idle_clients_reconnecting_beyond_the_cap_never_fail_a_probe() -> None:
    server = HttpServer(Metrics(), Health(), max_connections=8, timeout=HANG_GUARD * 3)
    await server.start("127.0.0.1", 0)
    assert server.port
    port = server.port
    stop = asyncio.Event()

    async def idle_client() -> None:
        # connects, sends nothing, and reconnects as soon as it is closed
        while not stop.is_set():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                with contextlib.suppress(ConnectionError):
                    await reader.read()
            finally:
                writer.close()

    async with server:
        # Given ten times the cap of clients that reconnect and sit idle
        clients = [asyncio.create_task(idle_client()) for _ in range(80)]
        try:
            await asyncio.sleep(0.5)
            # When the liveness and readiness probes ask meanwhile, from outside the server's
            # event loop as the kubelet does
            answers = [
                await asyncio.to_thread(probe, port, path) for path in ["/livez", "/readyz"] * 12
            ]
        finally:
            stop.set()
            for client in clients:
                client.cancel()
            await asyncio.gather(*clients, return_exceptions=True)

    # Then every probe was answered (Health()'s own verdicts: alive, not ready)
    assert answers == [200, 503] * 12


def probe(port: int, path: str) -> int | None:
    """The status of a GET of ``path``, made with a blocking socket; None without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split()[1]) if answer else None


async def test_an_idle_connection_is_dropped_after_the_timeout() -> None:
    server = HttpServer(Metrics(), Health(), max_connections=1, timeout=0.2)
    await server.start("127.0.0.1", 0)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await closed_by_server(reader)
        writer.close()


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:9180/healthz"),
        ("0.0.0.0", "http://127.0.0.1:9180/healthz"),
        ("", "http://127.0.0.1:9180/healthz"),
        ("::", "http://[::1]:9180/healthz"),
        ("::1", "http://[::1]:9180/healthz"),
        ("fd00::7", "http://[fd00::7]:9180/healthz"),
        ("10.1.2.3", "http://10.1.2.3:9180/healthz"),
        ("worker.internal", "http://worker.internal:9180/healthz"),
    ],
)
def test_the_local_url_asks_the_bound_address_or_the_loopback_for_a_wildcard(
    host: str, url: str
) -> None:
    assert local_url(host, 9180, "/healthz") == url
