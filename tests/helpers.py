"""Small builders shared by the tests."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import sqlalchemy.exc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments.demo import DemoPlan
from worker.core.envelope import Delivery, Envelope, open_envelope
from worker.core.router import Router
from worker.errors import NoPrimary
from worker.settings import Settings, format_duration


def payment(payment_id: str, account: str = "alice", amount_cents: int = 100) -> dict[str, Any]:
    return {"payment_id": payment_id, "account": account, "amount_cents": amount_cents}


def envelope(router: Router, routing_key: str, body: Any, key: str, **delivery: Any) -> Envelope:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return open_envelope(
        Delivery(body=raw, routing_key=routing_key, headers={"idempotency-key": key}, **delivery),
        router,
        max_body_bytes=1 << 20,
    )


async def scalar(engine: AsyncEngine, sql: str, **params: Any) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar()


async def rows(engine: AsyncEngine, sql: str, **params: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(sql), params)).all())


async def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.05) -> None:
    """Poll the async ``predicate`` until it returns true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


async def assert_each_payment_applied_once(engine: AsyncEngine, plan: DemoPlan) -> None:
    """The payments example's promise after a run that lost nodes or connections: every payment
    of ``plan`` applied once (balances, ledger) and its notice recorded, no key failed or left
    in progress, the outbox drained and nothing parked by the relay."""
    balances = dict(await rows(engine, "SELECT account, balance_cents FROM accounts"))
    assert balances == plan.expected_balances, "an effect was lost or applied twice"
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == len(plan.payments)
    assert await scalar(engine, "SELECT count(*) FROM settlement_notices") == len(plan.payments)
    stuck = await scalar(engine, "SELECT count(*) FROM inbox WHERE status <> 'completed'")
    assert stuck == 0, "an inbox row is stuck in progress or failed"
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 0, "an event was not published"
    assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def worker_environ(settings: Settings, **extra: str) -> dict[str, str]:
    """The ``WORKER_*`` variables that point a ``worker`` subprocess at this test's database,
    broker names and retry queues (no HTTP endpoint), plus ``extra``."""
    return {
        "WORKER_DATABASE_URL": settings.database_url,
        "WORKER_AMQP_URL": settings.amqp_url,
        "WORKER_EXCHANGE": settings.exchange,
        "WORKER_QUEUE": settings.queue,
        "WORKER_RETRY_DELAYS": ",".join(map(format_duration, settings.retry_delays)) or "none",
        "WORKER_HTTP_PORT": "0",
        **extra,
    }


async def broker_depth(queue: str) -> int:
    """Ready plus unacknowledged messages of ``queue``, as the broker counts them.

    (A passive declare's message count lags behind requeued messages, so ask rabbitmqctl.)
    """
    listing = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "list_queues", "name", "messages_ready", "messages_unacknowledged"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in listing.stdout.splitlines():
        name, *counts = line.split("\t")
        if name == queue:
            return sum(int(count) for count in counts)
    raise AssertionError(f"queue {queue} not found")


def broker_client_ports(pids: Iterable[int], amqp_url: str) -> set[int]:
    """The local ports of the TCP connections that the processes ``pids`` hold to the broker
    (read from Linux's ``/proc``; a process that has exited holds none)."""
    sockets: set[str] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                sockets.add(target.removeprefix("socket:[").removesuffix("]"))
    broker_port = urlsplit(amqp_url).port or 5672
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, remote, inode = (line.split()[i] for i in (1, 2, 9))
            if inode in sockets and int(remote.rpartition(":")[2], 16) == broker_port:
                ports.add(int(local.rpartition(":")[2], 16))
    return ports


async def close_broker_connections(pids: Iterable[int], amqp_url: str, explanation: str) -> int:
    """Have the broker close (``CONNECTION_FORCED``, with ``explanation``) every connection the
    processes ``pids`` hold to it, and no other: tests in other sessions share the broker.
    Returns how many it closed."""
    ports = broker_client_ports(pids, amqp_url)
    if not ports:
        return 0
    close = (
        f"Ports = [{','.join(map(str, sorted(ports)))}], "
        f"length([rabbit_networking:close_connection(P, {json.dumps(explanation)}) "
        "|| P <- rabbit_networking:connections(), lists:member(proplists:get_value(peer_port, "
        "rabbit_networking:connection_info(P, [peer_port])), Ports)])."
    )
    result = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "eval", close],
        capture_output=True,
        text=True,
        check=False,
    )
    # (a connection that closed meanwhile can make the broker's listing fail: none closed)
    return int(result.stdout) if result.returncode == 0 and result.stdout.strip().isdigit() else 0


WORKER_SCRIPT = Path(sys.executable).with_name("worker")


def _environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env["COLUMNS"] = "200"
    env.update(extra)
    return env


def run(*argv: str | Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        env=_environ(**extra_env),
        timeout=60,
        check=False,
    )


def _raised_from(cause: BaseException) -> Exception:
    """``cause`` as the cause of a ``RuntimeError`` (``raise ... from cause``)."""
    try:
        raise RuntimeError("wrapper") from cause
    except RuntimeError as exc:
        return exc


def _as_sqlalchemy_raises(cause: BaseException) -> Exception:
    """``cause`` wrapped as SQLAlchemy's asyncpg dialect raises a driver error."""
    wrapped = sqlalchemy.exc.InternalError("SELECT 1", None, cause)
    wrapped.__cause__ = cause
    return wrapped


FAILOVER_ERRORS = [
    # the primary stops: its backends are terminated, or the server crashes
    asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
    asyncpg.exceptions.CrashShutdownError("terminating connection because of crash"),
    # a server starting up, shutting down, or still in recovery refuses the connection
    asyncpg.exceptions.CannotConnectNowError("the database system is shutting down"),
    # every host refuses: the stopped primary, and nothing else listed
    ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5441)"),
    # the hosts that answer are standbys: none matches target_session_attrs=read-write
    asyncpg.exceptions.TargetServerAttributeNotMatched(
        "None of the hosts match the target attribute requirement read-write"
    ),
    _as_sqlalchemy_raises(
        asyncpg.exceptions.TargetServerAttributeNotMatched("None of the hosts match")
    ),
    # a write on a server that became read-only (demoted, default_transaction_read_only)
    asyncpg.exceptions.ReadOnlySQLTransactionError(
        "cannot execute INSERT in a read-only transaction"
    ),
    _raised_from(asyncpg.exceptions.ReadOnlySQLTransactionError("read-only")),
    # the worker's own probe: PostgreSQL answers, but takes no writes
    NoPrimary(),
    # a pooled connection whose backend was terminated while it waited for the end of an error
    _as_sqlalchemy_raises(
        asyncpg.exceptions.InternalClientError(
            "cannot switch to state 15; another operation (2) is in progress"
        )
    ),
]
"""What the worker meets while no primary answers, raised as the driver raises it."""
