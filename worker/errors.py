"""The worker's exceptions, and the one place that decides whether a failure is transient.

Every exception's docstring is its default message. ``Rejected`` subclasses carry a machine-readable
``reason`` and park the message in the dead-letter queue; nothing else does.
"""

from __future__ import annotations

import re

import aiormq.exceptions
import asyncpg
import sqlalchemy.exc


class WorkerError(Exception):
    """The worker failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(WorkerError):
    """The worker's configuration is invalid."""


class HandlerRegistrationError(ConfigurationError):
    """A handler cannot be registered."""


class Rejected(WorkerError):
    """The message cannot be processed and is dead-lettered."""

    reason = "rejected"


class BodyTooLarge(Rejected):
    """The message body exceeds the configured size limit."""

    reason = "body-too-large"


class UndecodableBody(Rejected):
    """The message body is not UTF-8 JSON."""

    reason = "undecodable"


class InvalidBody(Rejected):
    """The message body fails the handler's validation."""

    reason = "invalid"


class MissingKey(Rejected):
    """The message has neither an idempotency-key header nor a message_id."""

    reason = "missing-key"


class InvalidKey(Rejected):
    """The message's idempotency key is empty or too long."""

    reason = "invalid-key"


class NoHandler(Rejected):
    """No handler serves the message's routing key."""

    reason = "no-handler"


class KeyReused(Rejected):
    """idempotency key reused with a different payload"""

    reason = "key-reused"


class HandlerFailed(Rejected):
    """The handler raised an exception; its transaction was rolled back."""

    reason = "handler-error"


class RetriesExhausted(Rejected):
    """The message still failed transiently after its last delayed retry."""

    reason = "retries-exhausted"


class Permanent(WorkerError):
    """A failure no retry can fix: the message is dead-lettered at once.

    Handlers raise it (or a subclass) to say so even when the cause looks transient, such as a
    remote service answering "no such account" over a connection that could have timed out.
    """


class Retryable(WorkerError):
    """A transient failure: the unit of work may succeed if tried again.

    Handlers raise it (or a subclass) for failures they know to be temporary.
    """


_TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57P01",  # admin_shutdown (backend terminated)
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "53300",  # too_many_connections
    }
)


_CLOSED_BY_AIO_PIKA = re.compile(
    r"<(Connection|Channel|RobustChannel)\b.*> closed|Connection was not opened", re.DOTALL
)
"""How aiormq and aio-pika word the RuntimeError for using a connection or channel that closed
(or, for a channel asked of a robust connection between its reconnect attempts, not opened)."""


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) is a failure that a later attempt may not meet.

    Connection loss, timeouts, serialization failures, deadlocks and ``Retryable`` are transient;
    everything else (a bug in a handler, a constraint violation, bad input, ``Permanent``
    anywhere in the chain before a transient cause) is permanent.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, Permanent | aiormq.exceptions.AuthenticationError):
            return False
        if isinstance(current, Retryable | TimeoutError | ConnectionError | OSError):
            return True
        if isinstance(current, aiormq.exceptions.ChannelInvalidStateError):
            return True  # the channel died with its connection; a robust one is reopening it
        if isinstance(current, RuntimeError) and _CLOSED_BY_AIO_PIKA.fullmatch(str(current)):
            return True  # aiormq / aio-pika: "<Connection …> closed" while it reconnects
        if isinstance(current, asyncpg.exceptions.PostgresConnectionError | asyncpg.InterfaceError):
            return True
        if isinstance(current, sqlalchemy.exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, sqlalchemy.exc.TimeoutError):
            return True
        sqlstate = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if sqlstate in _TRANSIENT_SQLSTATES or (isinstance(sqlstate, str) and sqlstate[:2] == "08"):
            return True
        current = current.__cause__ or current.__context__
    return False
