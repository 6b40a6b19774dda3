"""What an operator meets when things fail, from the real ``worker`` command: a service it
cannot reach ends a command in one sentence with its own exit status, a signal while it still
connects stops it at once, a closed pipe ends it quietly, and the client libraries' records about
a reconnect the worker handles never reach ERROR."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import (
    WORKER_SCRIPT,
    broker_depth,
    close_broker_connections,
    free_port,
    run,
    scalar,
    wait_until,
    worker_environ,
)
from tests.integration.support import ROOT, declare, publish, start_worker
from tests.integration.tcp_proxy import TcpProxy, tcp_proxy
from worker import testing
from worker.ops.cli import Exit
from worker.settings import Settings
from worker.transport.topology import declare_topology

UNREACHABLE_AMQP = "amqp://guest:guest@127.0.0.1:{port}/"
UNREACHABLE_DATABASE = "postgresql://postgres:pw@127.0.0.1:{port}/nothing"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>\S+): ")


def records(output: str) -> list[tuple[str, str, str]]:
    """(level, logger, line) of each log record of a text log; other lines are left out."""
    found = []
    for line in output.splitlines():
        if match := RECORD.match(line):
            found.append((match["level"], match["logger"], line))
    return found


def traceback_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Traceback (most recent")]


def environ(settings: Settings, **extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": str(ROOT),
        **worker_environ(settings, WORKER_HANDLERS="examples.payments", **extra),
    }


def worker(settings: Settings, *argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return run(WORKER_SCRIPT, *argv, **environ(settings, **extra))


@pytest.mark.parametrize(
    ("argv", "service"),
    [
        (["status"], "RabbitMQ"),
        (["verify"], "RabbitMQ"),
        (["declare"], "RabbitMQ"),
        (["dlq", "list"], "RabbitMQ"),
        (["dlq", "purge", "--all"], "RabbitMQ"),
        (["run"], "RabbitMQ"),
        (["relay"], "PostgreSQL"),
        (["gc"], "PostgreSQL"),
        (["outbox", "list"], "PostgreSQL"),
        (["workflows"], "PostgreSQL"),
        (["outbox", "retry", "--all"], "PostgreSQL"),
        (["migrate", "--no-declare"], "PostgreSQL"),
    ],
)
async def test_a_service_not_reached_ends_a_command_in_one_sentence(
    settings: Settings, amqp: AbstractRobustConnection, argv: list[str], service: str
) -> None:
    # Given the one service nothing listens for (the other one is the test's own, declared)
    await declare(amqp, settings)
    port = free_port()
    broken = (
        {"WORKER_AMQP_URL": UNREACHABLE_AMQP.format(port=port)}
        if service == "RabbitMQ"
        else {"WORKER_DATABASE_URL": UNREACHABLE_DATABASE.format(port=port)}
    )
    variable = next(iter(broken))
    # When a command needs it (one that retries at start gets a short deadline)
    done = await asyncio.to_thread(worker, settings, *argv, WORKER_STARTUP_TIMEOUT="1s", **broken)

    # Then it says so in one sentence, with the URL redacted and the variable to fix, and
    # exits with the status of an unreachable service; no traceback, no library ERROR
    # (``verify`` says it as its failed check)
    said = [*done.stderr.splitlines(), *done.stdout.splitlines()]
    errors = [line for line in said if line.startswith(("worker: error:", "FAIL "))]
    assert done.returncode == Exit.UNREACHABLE, done.stdout + done.stderr
    (sentence,) = [line for line in errors if f"cannot reach {service} at " in line]
    assert f":{port}" in sentence
    assert variable in sentence
    assert ":pw@" not in done.stderr
    assert "guest:guest@" not in done.stderr
    assert not traceback_lines(done.stdout + done.stderr)
    assert not [r for r in records(done.stderr) if r[0] in {"ERROR", "CRITICAL"}], done.stderr


def test_the_traceback_is_there_at_debug_level(settings: Settings) -> None:
    port = free_port()
    done = worker(
        settings,
        "gc",
        "--log-level",
        "DEBUG",
        WORKER_DATABASE_URL=UNREACHABLE_DATABASE.format(port=port),
    )
    assert done.returncode == Exit.UNREACHABLE
    assert traceback_lines(done.stderr), done.stderr
    assert done.stderr.splitlines()[-1].startswith("worker: error: cannot reach PostgreSQL at ")


@pytest.mark.parametrize("command", ["run", "relay", "serve"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_connecting_stops_the_command_at_once(
    settings: Settings, tmp_path: Path, command: str, signum: signal.Signals
) -> None:
    if command == "serve":
        pytest.importorskip("uvicorn")
    # Given a long-running command retrying an unreachable broker or database at start
    log = tmp_path / "worker.log"
    port = free_port()
    broken = (
        {"WORKER_DATABASE_URL": UNREACHABLE_DATABASE.format(port=port)}
        if command == "serve"
        else {"WORKER_AMQP_URL": UNREACHABLE_AMQP.format(port=port)}
    )
    process = start_worker(settings, log, command, WORKER_HANDLERS="examples.payments", **broken)
    try:

        def retries() -> bool:
            return "not answering yet" in log.read_text(errors="replace")

        deadline = time.monotonic() + 60
        while not retries() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert retries(), log.read_text(errors="replace")
        # When it gets the signal
        sent = time.monotonic()
        process.send_signal(signum)
        process.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # Then it stops promptly (a loose bound on a shared machine), with 128 + the signal
    output = log.read_text(errors="replace")
    assert process.returncode == 128 + signum, output
    assert took < 10, f"took {took:.1f} s"
    assert output.splitlines()[-1] == f"worker: {command} stopped by {signum.name} while starting"
    assert not traceback_lines(output), output
    assert not [r for r in records(output) if r[0] in {"ERROR", "CRITICAL"}], output


def test_a_queue_nobody_declared_is_a_sentence(settings: Settings) -> None:
    done = worker(settings, "dlq", "list")
    assert done.returncode == Exit.USAGE, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        f"worker: error: RabbitMQ says NOT_FOUND - no queue '{settings.queue}.dlq'"
    )
    assert "`worker declare`" in line


def test_a_wrong_virtual_host_is_a_sentence(settings: Settings) -> None:
    url = settings.amqp_url.rstrip("/") + "/no-such-vhost-for-the-test"
    done = worker(settings, "declare", WORKER_AMQP_URL=url)
    assert done.returncode == Exit.USAGE, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("worker: error:")]
    assert "RabbitMQ refused the virtual host" in line
    assert "WORKER_AMQP_URL" in line
    assert " object at 0x" not in done.stderr


async def test_a_health_port_another_process_holds_stops_run_before_it_consumes(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a payment waiting in the queue, and the health port taken by another listener
    channel = await amqp.channel()
    await declare_topology(channel, settings, ["payment.requested"])
    payment = {"payment_id": "p1", "account": "a", "amount_cents": 1}
    await publish(channel, settings, payment, key="held-port-1")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # When a second worker starts on that port
        done = await asyncio.to_thread(
            worker, settings, "run", WORKER_HTTP_HOST="127.0.0.1", WORKER_HTTP_PORT=str(port)
        )

    # Then it stops in one sentence naming the setting, before it took the payment
    assert done.returncode == Exit.USAGE, done.stderr
    assert traceback_lines(done.stderr) == []
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("worker: error:")]
    assert f"127.0.0.1:{port}" in line
    assert "WORKER_HTTP_PORT (--http-port)" in line
    assert not [r for r in records(done.stderr) if r[0] in ("ERROR", "CRITICAL")]
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
    assert await broker_depth(settings.queue) == 1


def test_an_ingress_port_another_process_holds_names_the_setting(settings: Settings) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = worker(
            settings, "serve", WORKER_INGRESS_HOST="127.0.0.1", WORKER_INGRESS_PORT=str(port)
        )

    assert done.returncode == Exit.USAGE, done.stderr
    assert traceback_lines(done.stderr) == []
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("worker: error:")]
    assert "WORKER_INGRESS_PORT (--ingress-port)" in line


def test_a_console_port_another_process_holds_names_the_console_setting(
    settings: Settings,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = worker(
            settings,
            "console",
            WORKER_CONSOLE_PORT=str(port),
            WORKER_CONSOLE_OPERATOR_TOKENS="olivia:operator-token-0123456789abcdef",
        )

    assert done.returncode == Exit.USAGE, done.stderr
    assert traceback_lines(done.stderr) == []
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("worker: error:")]
    assert "the console did not start" in line
    assert "WORKER_CONSOLE_PORT (--console-port)" in line


def test_a_console_on_a_database_behind_the_code_says_so_in_one_sentence(
    settings: Settings,
) -> None:
    # Given a database no migration has run on
    with testing.empty_database(settings, prefix="worker_console_behind") as empty:
        # When the console starts on it
        done = worker(
            empty,
            "console",
            WORKER_CONSOLE_PORT="0",
            WORKER_CONSOLE_OPERATOR_TOKENS="olivia:operator-token-0123456789abcdef",
        )

    # Then it exits 2 in one sentence that says what to run, before it listens
    assert done.returncode == Exit.USAGE, done.stderr
    assert traceback_lines(done.stderr) == []
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("worker: error:")]
    assert "worker migrate" in line
    assert "serving the console" not in done.stderr


@pytest.mark.parametrize(
    "argv", [["status"], ["--help"], ["dlq", "list"], ["asyncapi"], ["verify"]]
)
async def test_a_closed_pipe_ends_quietly(
    settings: Settings, amqp: AbstractRobustConnection, argv: list[str]
) -> None:
    # Given a reader that takes the first line and goes away
    await declare(amqp, settings)
    env = {**environ(settings)}
    shell = f'{WORKER_SCRIPT} {" ".join(argv)} | head -1; echo "status=${{PIPESTATUS[0]}}"'
    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", shell],
        capture_output=True,
        text=True,
        env={**_base_environ(), **env},
        timeout=60,
        check=False,
    )
    # Then the worker says nothing about it and exits as a command killed by SIGPIPE would
    assert "BrokenPipeError" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr == "", done.stderr
    status = done.stdout.splitlines()[-1]
    assert status in {"status=0", f"status={Exit.BROKEN_PIPE}"}, done.stdout


def _base_environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}


CAN_CLOSE_CONNECTIONS = shutil.which("rabbitmqctl") is not None and Path("/proc/net/tcp").exists()
"""Whether the broker can be told to close one process's connections."""


async def _read(log: Path) -> str:
    return await asyncio.to_thread(log.read_text, errors="replace")


@pytest.mark.parametrize("cut", ["closed by the broker", "a 5 s outage"])
async def test_a_handled_reconnect_logs_no_error(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    tmp_path: Path,
    cut: str,
) -> None:
    if cut == "closed by the broker" and not CAN_CLOSE_CONNECTIONS:
        pytest.skip("needs rabbitmqctl and Linux's /proc to close the worker's broker connections")
    # Given a worker consuming a steady stream of payments (through a proxy that can cut the
    # broker off from it, for the outage)
    await declare(amqp, settings)
    log = tmp_path / "worker.log"
    broker = urlsplit(settings.amqp_url)
    async with tcp_proxy(broker.hostname or "127.0.0.1", broker.port or 5672) as proxy:
        url = settings.amqp_url.replace(
            broker.netloc, f"{broker.netloc.rpartition('@')[0]}@127.0.0.1:{proxy.port}"
        )
        env = {"WORKER_AMQP_URL": url} if cut == "a 5 s outage" else {}
        process = start_worker(settings, log, WORKER_HANDLERS="examples.payments", **env)
        try:
            sent = await _cut_under_load(settings, engine, amqp, log, process, proxy, cut)
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, 60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    output = log.read_text(errors="replace")
    # Then the worker says what happened at WARNING, and nothing reaches ERROR or shows a
    # traceback, from the worker or its libraries
    assert process.returncode == 0, output
    found = records(output)
    warnings = [line for level, logger, line in found if level == "WARNING"]
    assert any("lost" in line and "reconnecting" in line for line in warnings), output
    assert not [line for level, _, line in found if level in {"ERROR", "CRITICAL"}], output
    assert not traceback_lines(output), output
    assert "processed" in output
    print(f"{cut}: published {sent}; {len(found)} records", file=sys.stderr)


async def _cut_under_load(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    log: Path,
    process: subprocess.Popen[bytes],
    proxy: TcpProxy,
    cut: str,
) -> int:
    """Publish payments steadily while the worker's broker connections are cut twice (closed by
    the broker, or the proxy down for 5 s); returns how many were sent, once all are handled."""
    stop_publishing = asyncio.Event()
    sent = 0

    async def publish_steadily() -> None:
        nonlocal sent
        channel = await amqp.channel()
        exchange = await channel.get_exchange(settings.exchange)
        while not stop_publishing.is_set():
            body = {"payment_id": f"p-{sent}", "account": "noise", "amount_cents": 1}
            await exchange.publish(
                Message(json.dumps(body).encode(), headers={"idempotency-key": f"p-{sent}"}),
                routing_key="payment.requested",
            )
            sent += 1
            await asyncio.sleep(0.005)

    async def started() -> bool:
        return "consuming" in await _read(log)

    await wait_until(started, timeout=60)
    publisher = asyncio.create_task(publish_steadily())
    for times in (1, 2):
        await asyncio.sleep(1.0)
        if cut == "a 5 s outage":
            await proxy.down()
            await asyncio.sleep(5)
            await proxy.up()
        else:
            assert await close_broker_connections([process.pid], settings.amqp_url, "cut")

        async def reconnected(times: int = times) -> bool:
            return (await _read(log)).count("reconnected to") >= times

        await wait_until(reconnected, timeout=60)
    await asyncio.sleep(1.0)
    stop_publishing.set()
    await publisher

    async def all_handled() -> bool:
        count = await scalar(engine, "SELECT count(*) FROM inbox WHERE key LIKE 'p-%'")
        return bool(count >= sent)

    await wait_until(all_handled, timeout=90)
    return sent


async def _publish_payment(
    amqp: AbstractRobustConnection, settings: Settings, body: object, key: str
) -> None:
    channel = await amqp.channel()
    exchange = await channel.get_exchange(settings.exchange)
    await exchange.publish(
        Message(json.dumps(body).encode(), headers={"idempotency-key": key}),
        routing_key="payment.requested",
    )


async def _healthz_until(port: int, condition: str) -> dict[str, object]:
    """The worker's /healthz once it shows ``condition`` (``paused``, ``throttled``)."""

    async def shown() -> bool:
        return bool((await asyncio.to_thread(_healthz, port)).get(condition))

    await wait_until(shown, timeout=90)
    return await asyncio.to_thread(_healthz, port)


def _status_lines(stdout: str) -> dict[str, str]:
    """``worker status``'s text output, by label."""
    return {
        line.partition("  ")[0].strip(): line.partition("  ")[2].strip()
        for line in stdout.splitlines()
        if line.partition("  ")[0].strip()
    }


def _healthz(port: int) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        body = error.read()
    except OSError:
        return {}
    found = json.loads(body)
    assert isinstance(found, dict)
    return found


@contextlib.asynccontextmanager
async def _consuming_worker(
    settings: Settings, amqp: AbstractRobustConnection, log: Path, port: int, **env: str
) -> AsyncIterator[None]:
    """A ``worker run`` of the payments example serving /healthz on ``port``, consuming;
    stopped with SIGTERM afterwards."""
    await declare(amqp, settings)
    process = start_worker(
        settings, log, WORKER_HANDLERS="examples.payments", WORKER_HTTP_PORT=str(port), **env
    )
    try:

        async def consuming() -> bool:
            return "consuming" in await _read(log)

        await wait_until(consuming, timeout=60)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 60)


async def test_status_shows_a_throttled_worker_and_since_when(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    # Given a worker that takes one message at a time after 2 handler failures in a row
    port = free_port()
    async with _consuming_worker(
        settings, amqp, tmp_path / "worker.log", port, WORKER_FAILURE_THROTTLE_AFTER="2"
    ):
        before = datetime.now(UTC).replace(microsecond=0)
        payment = {"payment_id": "p-once", "account": "acct-1", "amount_cents": 100}
        await _publish_payment(amqp, settings, payment, "good-0")

        async def settled() -> bool:
            sql = "SELECT count(*) FROM ledger_entries WHERE payment_id = 'p-once'"
            return bool(await scalar(engine, sql))

        await wait_until(settled, timeout=30)
        # When 3 messages in a row fail in the handler (the payment again, under other keys)
        for n in range(3):
            await _publish_payment(amqp, settings, payment, f"again-{n}")
        health = await _healthz_until(port, "throttled")
        done = await asyncio.to_thread(worker, settings, "status", WORKER_HTTP_PORT=str(port))
    # Then /healthz and `worker status` say it is throttled, and since when
    since = datetime.fromisoformat(str(health["throttled_since"]))
    assert before <= since <= datetime.now(UTC), health
    assert done.returncode == Exit.OK, done.stdout + done.stderr
    shown = _status_lines(done.stdout)
    assert shown["worker on this host"] == f"failing at http://127.0.0.1:{port}/healthz" or (
        shown["worker on this host"] == f"ok at http://127.0.0.1:{port}/healthz"
    ), done.stdout
    assert shown["throttled"] == (
        f"since {health['throttled_since']}: one message at a time after dead letters in a row"
    ), done.stdout
    assert "paused" not in shown


async def test_status_shows_a_paused_worker_its_reason_and_since_when(
    settings: Settings, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    # Given a worker that reaches PostgreSQL through a proxy, consuming
    port = free_port()
    database = urlsplit(settings.database_url)
    async with tcp_proxy(database.hostname or "127.0.0.1", database.port or 5432) as proxy:
        userinfo = database.netloc.rpartition("@")[0]
        url = settings.database_url.replace(
            database.netloc,
            f"{userinfo}@127.0.0.1:{proxy.port}" if userinfo else f"127.0.0.1:{proxy.port}",
        )
        log = tmp_path / "worker.log"
        async with _consuming_worker(settings, amqp, log, port, WORKER_DATABASE_URL=url):
            # When PostgreSQL goes away from it and a message arrives
            await proxy.down()
            body = {"payment_id": "paused-1", "account": "p", "amount_cents": 1}
            await _publish_payment(amqp, settings, body, "paused-1")
            health = await _healthz_until(port, "paused")
            done = await asyncio.to_thread(worker, settings, "status", WORKER_HTTP_PORT=str(port))
            await proxy.up()
    # Then `worker status` says it is paused, why, and since when, as /healthz does
    assert done.returncode == Exit.OK, done.stdout + done.stderr
    lines = _status_lines(done.stdout)
    assert lines["paused"] == (
        f"{health['paused']} since {health['paused_since']}: {health['paused_because']}"
    ), done.stdout
    assert health["paused"] == "database-unreachable"
    assert lines["worker on this host"] == f"failing at http://127.0.0.1:{port}/healthz"
