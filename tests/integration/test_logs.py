"""Logs: the message being handled on every record, JSON on request, never a URL's password."""

from __future__ import annotations

import ast
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
from tests.integration.support import wait_for_consumer, worker_process
from worker import logs
from worker.core.envelope import Delivery
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

    # And the totals at the stop are fields of their own, not only text in the message
    [stopped] = [r for r in records if r["message"].startswith("stopped")]
    assert stopped["stats"]["dead_lettered"] == 1
    assert stopped["stats"] == ast.literal_eval(stopped["message"].removeprefix("stopped; "))


def test_a_records_own_fields_are_json_fields_and_never_replace_the_others() -> None:
    record = logging.LogRecord("worker", logging.INFO, __file__, 1, "stats %s", ("x=1",), None)
    record.fields = {"stats": {"x": 1}, "message": "forged", "level": "forged"}
    entry = json.loads(logs.JsonFormatter().format(record))
    assert entry["stats"] == {"x": 1}
    assert (entry["message"], entry["level"]) == ("stats x=1", "INFO")


FORGED = "2026-01-01 00:00:00,000 CRITICAL worker: forged"
HOSTILE = f"k\n{FORGED}\r\x1b[2J\x85\u2028\u202e"


def assert_one_record(output: str) -> None:
    """``output`` is one record: its lines are printable, and only the first starts a record."""
    first, *rest = output.rstrip("\n").split("\n")
    for line in (first, *rest):
        assert line.isprintable(), repr(line)
    assert not [line for line in rest if line[:4].isdigit()]


def hostile_record(log: logging.Logger) -> None:
    """A record whose message, argument, message context and exception all carry ``HOSTILE``."""
    delivery = Delivery(b"", "payment.requested", message_id=HOSTILE, correlation_id=HOSTILE)
    with logs.message_context(delivery):
        try:
            try:
                raise KeyError(HOSTILE)
            except KeyError as exc:
                raise ValueError(f"bad {HOSTILE}") from exc
        except ValueError:
            log.exception(f"failed {HOSTILE}: %s", HOSTILE)


def test_text_records_cannot_forge_a_line_or_drive_a_terminal(
    captured: tuple[io.StringIO, logging.Handler],
) -> None:
    stream, handler = captured
    handler.setFormatter(logs.TextFormatter())

    hostile_record(logging.getLogger("test.logs"))

    first, *traceback_lines = stream.getvalue().rstrip("\n").split("\n")
    shown = logs.printable(HOSTILE)
    assert first.endswith(
        f"ERROR test.logs: failed {shown}: {shown} [message_id={shown} correlation_id={shown}]"
    )
    assert traceback_lines[0] == "Traceback (most recent call last):"
    assert f"KeyError: {logs.printable(repr(HOSTILE))}" in traceback_lines
    assert traceback_lines[-1] == f"ValueError: bad {shown}"
    assert_one_record(stream.getvalue())


def test_text_records_escape_a_traceback_another_formatter_cached(
    captured: tuple[io.StringIO, logging.Handler],
) -> None:
    stream, handler = captured
    log = logging.getLogger("test.logs")
    plain = logging.StreamHandler(io.StringIO())
    log.handlers.insert(0, plain)  # formats first, caching an unescaped record.exc_text
    handler.setFormatter(logs.TextFormatter())
    try:
        hostile_record(log)
    finally:
        log.removeHandler(plain)

    assert_one_record(stream.getvalue())


def test_json_records_escape_control_characters_and_keep_the_text(
    captured: tuple[io.StringIO, logging.Handler],
) -> None:
    stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())

    hostile_record(logging.getLogger("test.logs"))

    (line,) = stream.getvalue().rstrip("\n").split("\n")
    assert line.isprintable()
    record = json.loads(line)
    assert record["message"] == f"failed {HOSTILE}: {HOSTILE}"
    assert (record["message_id"], record["correlation_id"]) == (HOSTILE, HOSTILE)
    assert record["exception"].endswith(f"ValueError: bad {HOSTILE}")
