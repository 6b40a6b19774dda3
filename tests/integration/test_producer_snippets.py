"""The producers ``docs/publishing.md`` shows (``examples/producers``), run as its reader runs
them, against the real broker and a worker serving the payments example: over AMQP from Python
and from the shell (the page's own shell block, run by bash), and through the outbox with the
engine made from ``WORKER_DATABASE_URL`` as ``psql`` takes it. Each message is published twice
under one key; the payment is applied once.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from aio_pika.abc import AbstractRobustConnection
from aio_pika.exceptions import DeliveryError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from examples.producers.publish_amqp import publish
from tests.helpers import rows, scalar, wait_until, worker_environ
from tests.integration.support import RunningWorker, declare, running_worker
from worker import outbox
from worker.errors import ConfigurationError
from worker.settings import Settings
from worker.telemetry import Count

ROOT = Path(__file__).resolve().parents[2]


def shell_block(title: str) -> str:
    """The ``sh`` block of ``docs/publishing.md`` titled ``title``, as the page shows it."""
    page = (ROOT / "docs" / "publishing.md").read_text()
    found = re.search(rf'^```sh title="{re.escape(title)}"\n(.*?)^```$', page, re.M | re.S)
    assert found is not None, f"no sh block {title!r} on the publishing page"
    return found.group(1)


async def run(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``argv`` in a subprocess from the repository's root, off the event loop."""
    return await asyncio.to_thread(
        subprocess.run,
        argv,
        cwd=ROOT,
        env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def applied_once(engine: AsyncEngine, worker: RunningWorker, payment_id: str) -> None:
    """Wait until the worker has taken both copies of ``payment_id`` (one applied, one a
    duplicate), then check the ledger holds it once and the account was credited once."""

    async def both_taken() -> bool:
        return worker.stats[Count.DUPLICATE] >= 1 and worker.stats[Count.PROCESSED] >= 1

    await wait_until(both_taken)
    ledger = await rows(
        engine,
        "SELECT account, amount_cents FROM ledger_entries WHERE payment_id = :p",
        p=payment_id,
    )
    assert ledger == [("alice", 250)]
    balance = "SELECT balance_cents FROM accounts WHERE account = 'alice'"
    assert await scalar(engine, balance) == 250
    keys = await rows(
        engine,
        "SELECT status FROM inbox WHERE routing_key = 'payment.requested' AND key = :k",
        k=payment_id,
    )
    assert keys == [("completed",)]


async def test_the_aio_pika_snippet_publishes_a_payment_applied_once(
    settings: Settings, engine: AsyncEngine
) -> None:
    body = json.dumps({"payment_id": "p-amqp", "account": "alice", "amount_cents": 250}).encode()
    async with running_worker(settings, payments) as worker:
        for _ in range(2):  # a producer that retries with the same key
            await publish(settings.amqp_url, settings.exchange, "payment.requested", body, "p-amqp")
        await applied_once(engine, worker, "p-amqp")


async def test_the_shell_block_publishes_a_payment_applied_once(
    settings: Settings, engine: AsyncEngine
) -> None:
    command = shell_block("publish from the shell")
    env = worker_environ(settings)
    async with running_worker(settings, payments) as worker:
        for _ in range(2):
            result = await run("bash", "-ec", command, **env)
            assert result.returncode == 0, result.stderr
            assert result.stdout == ""
        await applied_once(engine, worker, "p-1")


async def test_the_aio_pika_snippet_refuses_a_routing_key_nobody_consumes(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    await declare(amqp, settings)
    with pytest.raises(DeliveryError):
        await publish(settings.amqp_url, settings.exchange, "nobody.listens", b"{}", "k-1")


async def test_the_outbox_snippet_with_a_plain_postgresql_url_is_applied_once(
    settings: Settings, engine: AsyncEngine
) -> None:
    assert settings.database_url.startswith("postgresql://")  # as psql takes it
    env = worker_environ(settings)
    async with running_worker(settings, payments) as worker:
        for _ in range(2):  # the same business transaction, retried
            result = await run(
                sys.executable, "-m", "examples.producers.publish_outbox", "p-outbox", "alice",
                "250", **env,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
        await applied_once(engine, worker, "p-outbox")


async def test_engine_from_env_takes_the_url_as_psql_does(settings: Settings) -> None:
    plain = settings.database_url
    for url in (plain, "postgres://" + plain.removeprefix("postgresql://")):
        engine = outbox.engine_from_env({"WORKER_DATABASE_URL": url})
        try:
            assert engine.url.drivername == "postgresql+asyncpg"
            async with engine.connect() as conn, conn.begin() as transaction:
                message_id = await outbox.publish(conn, "payment.requested", {}, key="k")
                found = "SELECT count(*) FROM outbox WHERE message_id = :m"
                assert (await conn.execute(text(found), {"m": message_id})).scalar() == 1
                await transaction.rollback()
            application = (
                "SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            )
            async with engine.connect() as conn:
                assert (await conn.execute(text(application))).scalar() == "worker-producer"
        finally:
            await engine.dispose()


def test_engine_from_env_refuses_another_driver() -> None:
    with pytest.raises(ConfigurationError, match=r"must be a postgresql:// URL, not mysql://"):
        outbox.engine_from_env({"WORKER_DATABASE_URL": "mysql://u@h/db"})
