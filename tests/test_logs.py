"""Logs: the message being handled on every record, JSON on request, never a URL's password."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import envelope, payment, scalar, wait_until
from tests.test_process import wait_for_consumer, worker_process
from worker import logs
from worker.envelope import Delivery
from worker.settings import Settings


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, logging.Handler]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.MessageFilter())
    logger = logging.getLogger("test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield stream, handler
    logger.removeHandler(handler)


def test_json_records_carry_the_message_being_handled(
    captured: tuple[io.StringIO, logging.Handler],
) -> None:
    stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    opened = envelope(payments, "payment.requested", payment("p1"), "k-1", message_id="m-1")
    with logs.message_context(Delivery(b"", "payment.requested", message_id="m-1")):
        logs.identify(opened)
        logging.getLogger("test.logs").warning("parked %s", "it")
    logging.getLogger("test.logs").info("between messages")

    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "parked it"
    assert first["level"] == "WARNING"
    assert (first["message_id"], first["key"], first["handler"]) == (
        "m-1",
        "k-1",
        "payment.requested",
    )
    assert "key" not in second


def test_no_record_shows_a_url_password(captured: tuple[io.StringIO, logging.Handler]) -> None:
    stream, handler = captured
    log = logging.getLogger("test.logs")
    for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
        handler.setFormatter(formatter)
        log.warning("cannot reach %s", "amqp://guest:s3cret@rabbit:5672/")
        try:
            raise ConnectionError("postgresql://app:hunter2@db:5432/app refused")
        except ConnectionError:
            log.exception("failed")
    text = stream.getvalue()
    assert "s3cret" not in text
    assert "hunter2" not in text
    assert "amqp://guest:***@rabbit:5672/" in text
    assert logs.redact_text("http://host/path?x=1") == "http://host/path?x=1"


async def test_worker_run_logs_json_lines_with_the_message_and_no_password(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    # Given a worker logging JSON, its database URL carrying a password (trust auth ignores it)
    url = urlsplit(settings.database_url)
    with_password = url._replace(netloc=f"{url.username}:hunter2@{url.hostname}:{url.port}")
    log = tmp_path / "worker.log"
    env = {
        "WORKER_HANDLERS": "examples.payments",
        "WORKER_LOG_FORMAT": "json",
        "WORKER_DATABASE_URL": with_password.geturl(),
    }
    with worker_process(settings, log, **env) as worker:
        await wait_for_consumer(amqp, settings.queue)
        channel = await amqp.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)

        async def publish(cents: int) -> None:
            await exchange.publish(
                Message(
                    json.dumps(payment("p-log", amount_cents=cents)).encode(),
                    headers={"idempotency-key": "k-log"},
                    message_id=f"m-{cents}",
                ),
                routing_key="payment.requested",
            )

        async def applied() -> bool:
            return await scalar(engine, "SELECT balance_cents FROM accounts") == 5

        # When a key is reused with another payload (parked with a warning); the reuse is sent
        # after the first commit, since concurrent consumers may take two messages in any order
        await publish(5)
        await wait_until(applied)
        await publish(6)

        async def parked() -> bool:
            return "dead-lettered" in log.read_text(errors="replace")

        await wait_until(parked)
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)

    # Then every line is JSON, the warning names the message, and the password never shows
    text = log.read_text(errors="replace")
    assert "hunter2" not in text
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert len(records) >= 3
    [warning] = [r for r in records if "dead-lettered" in r["message"]]
    assert (warning["key"], warning["handler"], warning["message_id"]) == (
        "k-log",
        "payment.requested",
        "m-6",
    )
    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 5
