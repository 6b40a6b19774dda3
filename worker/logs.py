"""Logging: plain text for people or one JSON object per line, with the message being handled.

While a delivery is handled, every log record carries its ``message_id``, ``key``, ``handler``
and ``correlation_id`` (a context variable, so concurrent units of work never mix them up). No
record ever shows a password from a URL: any ``scheme://user:password@host`` in a message or a
traceback is redacted before it is formatted.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from sqlalchemy.exc import DBAPIError

from worker.envelope import Delivery, Envelope
from worker.settings import Settings

MESSAGE_FIELDS = ("message_id", "key", "handler", "correlation_id")
"""What a record says about the message being handled, when there is one."""

_message: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "worker_message", default=MappingProxyType({})
)

_PASSWORD_IN_URL = re.compile(r"(?P<prefix>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^@\s]*@")


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _PASSWORD_IN_URL.sub(r"\g<prefix>***@", text)


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
    """``time level logger: message [key=… handler=…]``; tracebacks redacted."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        context = " ".join(
            f"{name}={value}" for name in MESSAGE_FIELDS if (value := getattr(record, name, ""))
        )
        return redact_text(f"{text} [{context}]" if context else text)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the message context, and the
    exception when there is one."""

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
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return redact_text(json.dumps(entry, default=str))


def configure(settings: Settings) -> None:
    """Send the process's logs to stderr in ``settings.log_format`` at ``settings.log_level``."""
    handler = logging.StreamHandler()
    handler.addFilter(MessageFilter())
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)
