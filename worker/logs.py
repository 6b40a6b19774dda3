"""Logging: plain text for people or one JSON object per line, with the message being handled.

While a delivery is handled, every log record carries its ``message_id``, ``key``, ``handler``
and ``correlation_id`` (a context variable, so concurrent units of work never mix them up). No
record ever shows a secret: every formatted record, traceback included, goes through
``worker.redaction.redact``. The client libraries' records about a reconnect the worker handles
are demoted to DEBUG (``LibraryNoise``).

No record can forge another: in the text format, a line that starts a record is a record.
``printable`` escapes every character that could end a line or drive a terminal (C0 and C1
controls, DEL, Unicode line separators, bidirectional overrides) as ``\\n``, ``\\x1b``, ``\\u2028``;
the text format applies it to the message, its context and each exception's own text, and keeps
only the line breaks of a traceback's frames. The JSON format needs none of it: ``json.dumps``
escapes every control character. The CLI prints every table through ``printable`` too.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import traceback
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from sqlalchemy.exc import DBAPIError

from worker import redaction
from worker.core.envelope import Delivery, Envelope
from worker.errors import ConfigurationError, unreachable_service
from worker.settings import Settings

MESSAGE_FIELDS = ("message_id", "key", "handler", "correlation_id")
"""What a record says about the message being handled, when there is one."""

_message: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "worker_message", default=MappingProxyType({})
)


def _escape(code: int) -> str:
    named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    return named.get(code) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


_UNPRINTABLE = (
    *range(0x00, 0x20),  # C0 controls: line breaks, escape sequences
    0x7F,  # DEL
    *range(0x80, 0xA0),  # C1 controls, NEL (U+0085) among them
    0x2028,  # line separator
    0x2029,  # paragraph separator
    # bidirectional marks, embeddings, overrides and isolates: they reorder what is shown
    0x061C,
    0x200E,
    0x200F,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
)
_ESCAPES = {code: _escape(code) for code in _UNPRINTABLE}


def printable(text: str) -> str:
    """``text`` on one line that drives no terminal: control characters, line separators and
    bidirectional overrides escaped as ``\\n``, ``\\x1b``, ``\\u202e``; anything else as it is."""
    return text if text.isprintable() else text.translate(_ESCAPES)


def printable_lines(text: str) -> str:
    """``text`` with its line breaks (``\\n``) kept and each line made ``printable``."""
    return "\n".join(map(printable, text.split("\n")))


redact_text = redaction.redact
"""``text`` with every secret hidden (``worker.redaction.redact``)."""


def describe_error(exc: BaseException) -> str:
    """The exception's type and text (for a database error, the driver's, without the SQL), with
    the password of any URL in it redacted: fit for a log, a status report or a check."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        driver = exc.orig.__cause__ or exc.orig
        return redact_text(f"{type(driver).__name__}: {exc.orig}")
    return redact_text(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def message_context(delivery: Delivery, envelope: Envelope | None = None) -> Iterator[None]:
    """Tag the records logged inside the block with the delivery's identity."""
    fields = {
        "message_id": delivery.message_id or "",
        "correlation_id": delivery.correlation_id or "",
        "key": envelope.key if envelope is not None else "",
        "handler": envelope.handler.name if envelope is not None else "",
    }
    token = _message.set({name: value for name, value in fields.items() if value})
    try:
        yield
    finally:
        _message.reset(token)


def identify(envelope: Envelope) -> None:
    """Add the key and handler to the current message context once the envelope is open."""
    _message.set({**_message.get(), "key": envelope.key, "handler": envelope.handler.name})


class MessageFilter(logging.Filter):
    """Copies the current message context onto each record (the formatters redact)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name in MESSAGE_FIELDS:
            setattr(record, name, _message.get().get(name, ""))
        return True


class TextFormatter(logging.Formatter):
    """``time level logger: message [key=… handler=…]`` on one line, then the traceback if any;
    control characters escaped (``printable``), passwords redacted."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        context = " ".join(
            f"{name}={value}" for name in MESSAGE_FIELDS if (value := getattr(record, name, ""))
        )
        text = self.formatMessage(record) + (f" [{context}]" if context else "")
        parts = [printable(text)]
        # Formatted here, not taken from ``record.exc_text``: another handler may have cached
        # an unescaped one there.
        if record.exc_info and record.exc_info[1] is not None:
            parts.append(format_traceback(record.exc_info[1]))
        elif record.exc_text:
            parts.append(printable_lines(record.exc_text))
        if record.stack_info:
            parts.append(printable_lines(self.formatStack(record.stack_info)))
        return redact_text("\n".join(parts))


def format_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` (and its causes) as ``logging`` shows it, each exception's own
    text (its message and notes) escaped onto one line, every other line ``printable``."""
    formatted = traceback.TracebackException.from_exception(exc, compact=True)
    own_text = {chunk for each in _chain(formatted) for chunk in each.format_exception_only()}
    return "".join(
        printable(chunk.removesuffix("\n")) + "\n" if chunk in own_text else printable_lines(chunk)
        for chunk in formatted.format()
    ).removesuffix("\n")


def _chain(formatted: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    """``formatted`` and every exception it shows: causes, contexts, members of a group."""
    pending, seen = [formatted], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        pending += current.exceptions or []


FIELDS = "fields"
"""The ``extra`` of a record whose values JSON logs carry as fields of their own:
``log.info("stats %s", text, extra={FIELDS: {"stats": counts}})`` writes ``"stats": {...}``
beside ``message``, so a log pipeline reads the numbers without parsing the text."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the message context, the
    record's own ``FIELDS`` (never in place of the others), and the exception when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in MESSAGE_FIELDS:
            if value := getattr(record, name, ""):
                entry[name] = value
        own = getattr(record, FIELDS, None)
        if isinstance(own, dict):
            entry.update({name: value for name, value in own.items() if name not in entry})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return redact_text(json.dumps(entry, default=str))


CLIENT_LIBRARIES = frozenset({"aio_pika", "aiormq", "pamqp", "asyncpg", "asyncio"})
"""The loggers (by top-level name) whose records ``LibraryNoise`` looks at: the clients of
PostgreSQL and RabbitMQ, and asyncio (its "exception was never retrieved" of a connection's dead
task). Not uvicorn: an exception that reaches it failed a request, whatever its cause."""

RECONNECT_MESSAGES = {
    "Unexpected connection close from remote": logging.DEBUG,
    "Got frame for closed channel": logging.DEBUG,
    "Reconnect attempt failed": logging.WARNING,
}
"""What aiormq and aio-pika say while a robust connection reconnects, by how the message
starts, and the level it deserves: the worker logs the loss itself (a WARNING with the cause,
``worker.transport.connection``); a failed attempt to reconnect it does not, so that one stays a
WARNING."""


class LibraryNoise(logging.Filter):
    """The client libraries' records about a reconnect the worker handles, demoted.

    A record of ``CLIENT_LIBRARIES`` at WARNING or above is demoted when it is one of
    ``RECONNECT_MESSAGES``, or when the exception it carries is a failure to reach PostgreSQL or
    RabbitMQ (``errors.unreachable_service``: a refused or lost connection, raised inside their
    clients), which the worker retries and reports in its own words; it then goes to DEBUG,
    with its traceback, and is shown only at that level. Anything else (a library's bug, an
    unexpected frame, an error the worker does not handle) keeps its level: a real failure
    still reaches ERROR.
    """

    def __init__(self, shown_from: int) -> None:
        super().__init__()
        self.shown_from = shown_from

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.levelno < logging.WARNING
            or record.name.partition(".")[0] not in CLIENT_LIBRARIES
        ):
            return True
        level = self._demoted_level(record)
        if level is None or level >= record.levelno:
            return True
        record.levelno, record.levelname = level, logging.getLevelName(level)
        if level > logging.DEBUG:
            record.exc_info, record.exc_text = None, None
        return level >= self.shown_from

    @staticmethod
    def _demoted_level(record: logging.LogRecord) -> int | None:
        template = str(record.msg)
        for start, level in RECONNECT_MESSAGES.items():
            if template.startswith(start):
                return level
        carried = record.exc_info[1] if record.exc_info else None
        if carried is None and isinstance(record.args, tuple):
            carried = next((a for a in record.args if isinstance(a, BaseException)), None)
        if carried is not None and unreachable_service(carried) is not None:
            return logging.DEBUG
        return None


def configure(settings: Settings) -> None:
    """Send the process's logs to stderr in ``settings.log_format`` at ``settings.log_level``,
    the libraries' records about reconnects the worker handles demoted (``LibraryNoise``), and
    the ingress's tokens hidden from whatever the process prints from now on (URLs' secrets
    have a shape ``redact_text`` recognises; a token has none)."""
    redaction.remember(settings.ingress_tokens)
    handler = logging.StreamHandler()
    handler.addFilter(MessageFilter())
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    try:
        root.setLevel(settings.log_level.upper())
    except ValueError:
        raise ConfigurationError(
            f"log_level {settings.log_level!r}: must be DEBUG, INFO, WARNING, ERROR or CRITICAL"
        ) from None
    handler.addFilter(LibraryNoise(root.getEffectiveLevel()))
    root.handlers[:] = [handler]
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # start-up noise
