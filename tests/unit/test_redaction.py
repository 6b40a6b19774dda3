"""One redaction for everything the worker prints, and the client libraries' reconnect records
demoted: tables of what is hidden, kept and demoted."""

from __future__ import annotations

import logging

import aiormq.exceptions
import pytest

from worker import redaction
from worker.errors import Service, unreachable_service
from worker.logs import LibraryNoise


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://u:secret@db:5432/x", "postgresql://u:***@db:5432/x"),
        ("postgresql://u:p@ss@db/x", "postgresql://u:***@db/x"),
        ("amqp://a:b1@h1,amqp://a:b2@h2/v", "amqp://a:***@h1,amqp://a:***@h2/v"),
        (
            "postgresql://u@db/x?password=pw&sslmode=require",
            "postgresql://u@db/x?password=***&sslmode=require",
        ),
        ("postgresql://u@db/x?sslpassword=k1&x=1", "postgresql://u@db/x?sslpassword=***&x=1"),
        ("host=db password='a b' user=u", "host=db password=*** user=u"),
        ("WORKER_INGRESS_TOKENS=abc,def", "WORKER_INGRESS_TOKENS=***"),
        ("?api_key=k&access_token=t", "?api_key=***&access_token=***"),
        ("key=order-1 handler=payment.requested", "key=order-1 handler=payment.requested"),
        ("http://host/path?x=1", "http://host/path?x=1"),
        ("PostgreSQL refused the password: fix it", "PostgreSQL refused the password: fix it"),
    ],
)
def test_what_is_hidden_and_what_is_kept(text: str, shown: str) -> None:
    assert redaction.redact(text) == shown


def test_remembered_secrets_are_hidden_anywhere_and_short_ones_ignored() -> None:
    redaction.remember(["tok-remembered-0123456789", "short"])
    assert redaction.redact("got tok-remembered-0123456789!") == "got ***!"
    assert redaction.redact("a short word") == "a short word"


def _refused() -> BaseException:
    try:
        raise aiormq.exceptions.AMQPConnectionError(111, "Connect call failed")
    except aiormq.exceptions.AMQPConnectionError as exc:
        return exc


def test_a_refused_connection_names_its_service() -> None:
    assert unreachable_service(_refused()) is Service.RABBITMQ
    assert unreachable_service(ValueError("a bug")) is None


def _record(
    name: str, level: int, msg: str, *args: object, exc: BaseException | None = None
) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord(name, level, __file__, 1, msg, args, info)


@pytest.mark.parametrize(
    ("record", "kept", "level"),
    [
        # a reconnect the worker handles: demoted to DEBUG (not shown at INFO)
        (
            _record(
                "aiormq.connection",
                logging.ERROR,
                "Unexpected connection close from remote %s",
                "x",
            ),
            False,
            "DEBUG",
        ),
        (
            _record(
                "aiormq.connection", logging.ERROR, "error when creating transport: %r", _refused()
            ),
            False,
            "DEBUG",
        ),
        (
            _record(
                "aio_pika.tools", logging.ERROR, "Callback %r error: %s: %s", "cb", "E", _refused()
            ),
            False,
            "DEBUG",
        ),
        (
            _record("asyncio", logging.ERROR, "Task exception was never retrieved", exc=_refused()),
            False,
            "DEBUG",
        ),
        # said by nobody else: kept, as a WARNING without traceback
        (
            _record(
                "aio_pika.robust_connection", logging.ERROR, "Reconnect attempt failed %s", "x"
            ),
            True,
            "WARNING",
        ),
        # a real failure keeps its level
        (_record("aiormq.connection", logging.ERROR, "Unexpected frame %r", "f"), True, "ERROR"),
        (
            _record(
                "aio_pika.tools",
                logging.ERROR,
                "Callback %r error: %s: %s",
                "cb",
                "E",
                ValueError("bug"),
            ),
            True,
            "ERROR",
        ),
        # the worker's own records are not touched
        (
            _record("worker", logging.ERROR, "error when creating transport: %r", _refused()),
            True,
            "ERROR",
        ),
    ],
)
def test_library_records_about_a_handled_reconnect_are_demoted(
    record: logging.LogRecord, kept: bool, level: str
) -> None:
    assert LibraryNoise(logging.INFO).filter(record) is kept
    assert record.levelname == level


def test_at_debug_a_demoted_record_is_shown_with_its_traceback() -> None:
    record = _record("asyncio", logging.ERROR, "Task exception was never retrieved", exc=_refused())
    assert LibraryNoise(logging.DEBUG).filter(record)
    assert record.levelname == "DEBUG"
    assert record.exc_info is not None
