"""The worker's exceptions, and the one place that says whose fault a failure is (``classify``).

Every exception's docstring is its default message; ``Rejected`` subclasses carry a
machine-readable ``reason``. Where a failure sends its message is decided by ``core.policy``.
"""

from __future__ import annotations

import contextlib
import enum
import re
import ssl
from collections.abc import Iterator
from traceback import walk_tb
from typing import Any, ClassVar

import aiormq.exceptions
import asyncpg
import sqlalchemy.exc

from worker.redaction import redact


class WorkerError(Exception):
    """The worker failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(WorkerError):
    """The worker's configuration is invalid."""


class AccessRefused(ConfigurationError):
    """PostgreSQL or RabbitMQ refused the worker's credentials, database or TLS settings."""


class HandlerRegistrationError(ConfigurationError):
    """A handler cannot be registered."""


class Reason(enum.StrEnum):
    """Why a delivery was dead-lettered: its ``x-worker-reason`` header and the ``reason`` label
    of ``worker_dead_letters_total``. Each ``Rejected`` names its own; two have no exception."""

    REJECTED = "rejected"
    BODY_TOO_LARGE = "body-too-large"
    UNDECODABLE = "undecodable"
    INVALID = "invalid"
    MISSING_KEY = "missing-key"
    INVALID_KEY = "invalid-key"
    INVALID_PROPERTY = "invalid-property"
    BODY_TOO_DEEP = "body-too-deep"
    CHECK_FAILED = "check-failed"
    NO_HANDLER = "no-handler"
    KEY_REUSED = "key-reused"
    KEY_RESERVED = "key-reserved"
    """A key of the ingress's space (``http:``) that the ingress did not accept for this body."""
    HANDLER_ERROR = "handler-error"
    RETRIES_EXHAUSTED = "retries-exhausted"
    INTERNAL_ERROR = "internal-error"
    """A failure that is no ``Rejected`` and not transient: a bug in the worker, logged."""
    RETRY_FAILED = "retry-failed"
    """The broker refused a delayed-retry copy; its own dead-lettering parked the original."""


class Rejected(WorkerError):
    """The message cannot be processed and is dead-lettered."""

    reason: ClassVar[Reason] = Reason.REJECTED


class BodyTooLarge(Rejected):
    """The message body exceeds the configured size limit."""

    reason = Reason.BODY_TOO_LARGE


class UndecodableBody(Rejected):
    """The message body is not UTF-8 JSON."""

    reason = Reason.UNDECODABLE


class InvalidBody(Rejected):
    """The message body fails the handler's validation."""

    reason = Reason.INVALID


class MissingKey(Rejected):
    """The message has neither an idempotency-key header nor a message_id."""

    reason = Reason.MISSING_KEY


class InvalidKey(Rejected):
    """The message's idempotency key is empty or too long."""

    reason = Reason.INVALID_KEY


class InvalidProperty(Rejected):
    """The message's message_id or correlation id cannot be stored (a NUL, or too long)."""

    reason = Reason.INVALID_PROPERTY


class BodyTooDeep(Rejected):
    """The message body nests JSON arrays and objects deeper than the configured limit."""

    reason = Reason.BODY_TOO_DEEP


class CheckFailed(Rejected):
    """Checking the message raised an unexpected error; nothing was written."""

    reason = Reason.CHECK_FAILED


class NoHandler(Rejected):
    """No handler serves the message's routing key."""

    reason = Reason.NO_HANDLER


class KeyReused(Rejected):
    """idempotency key reused with a different payload"""

    reason = Reason.KEY_REUSED


class KeyReserved(Rejected):
    """The idempotency key is in the HTTP ingress's key space (``http:<client>:<key>``), but the
    ingress accepted no request of that key and body for this handler."""

    reason = Reason.KEY_RESERVED


class HandlerFailed(Rejected):
    """The handler raised an exception; its transaction was rolled back."""

    reason = Reason.HANDLER_ERROR


def handler_failed(exc: Exception) -> HandlerFailed:
    """The rejection of a message whose handler raised ``exc``, a permanent failure."""
    failed = HandlerFailed(f"{type(exc).__name__}: {exc}")
    failed.__cause__ = exc
    return failed


class RetriesExhausted(Rejected):
    """The message still failed transiently after its last delayed retry."""

    reason = Reason.RETRIES_EXHAUSTED


class Permanent(WorkerError):
    """A failure no retry can fix: the message is dead-lettered at once.

    Handlers raise it (or a subclass) to say so even when the cause looks transient, such as a
    remote service answering "no such account" over a connection that could have timed out.
    """


class MessageFailed(WorkerError):
    """Some messages of a batch handler's batch failed; the others may go on without them.

    A batch handler raises ``MessageFailed(i, j, ...) from exc`` to name the culprits by their
    indices in the bodies it was given: the batch runs again without them, and each runs on its
    own, where its failure takes its usual path, as ``exc`` (the cause is what is classified,
    logged and parked). Without it, the worker finds culprits by bisection, which costs more
    handler calls.
    """

    def __init__(self, *indices: int, message: str | None = None) -> None:
        if not indices:
            raise ValueError("MessageFailed names at least one message by its index")
        super().__init__(
            message or f"message(s) {', '.join(map(str, indices))} of the batch failed"
        )
        self.indices = indices


class Retryable(WorkerError):
    """A transient failure: the unit of work may succeed if tried again.

    Handlers raise it (or a subclass) for failures they know to be temporary.
    """


class NoPrimary(Retryable):
    """PostgreSQL answers but takes no writes (a standby or a read-only server): no primary."""


_TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57P01",  # admin_shutdown (backend terminated)
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "53300",  # too_many_connections
        "25006",  # read_only_sql_transaction: a write on a server that became read-only
    }
)
"""SQLSTATEs a later attempt may not meet. A failover brings 57P01 and 57P02 (the stopping
primary cuts its connections), 57P03 (a server starting or shutting down) and 25006 (a write on
a server that no longer takes writes)."""


_CLOSED_BY_AIO_PIKA = re.compile(
    r"<(Connection|Channel|RobustChannel)\b.*> closed|Connection was not opened", re.DOTALL
)
"""How aiormq and aio-pika word the RuntimeError for using a connection or channel that closed
(or, for a channel asked of a robust connection between its reconnect attempts, not opened)."""


class Fault(enum.Enum):
    """Whose fault a failure is (what ``core.policy.decide`` reads)."""

    TRANSIENT = "transient"
    """A later attempt may not meet it (connection loss, timeout, deadlock)."""
    DEPLOYMENT = "deployment"
    """The deployment's, not the message's (a table, column, function or privilege missing)."""
    PERMANENT = "permanent"
    """The message's (bad input, a handler's error on it)."""


class PauseReason(enum.Enum):
    """Why consumption is paused (a fault that is not the message's, see ``core.policy``)."""

    DATABASE_UNREACHABLE = "database-unreachable"
    DEPLOYMENT = "deployment"


_DEPLOYMENT_SQLSTATE_CLASS = "42"
"""syntax_error_or_access_rule_violation: undefined table/column/function, insufficient
privilege — the schema or the grants do not match the code, whatever the message holds."""


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it wraps (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def classify(exc: BaseException) -> Fault:
    """Whose fault ``exc`` (or what it wraps) is: the one place that decides.

    Connection loss, timeouts, serialization failures, deadlocks, no primary (a write refused as
    read-only, no host matching ``target_session_attrs``) and ``Retryable`` are transient,
    and so is a refusal (``refusal``: a rotated password, an expired certificate) once running;
    a PostgreSQL error of SQLSTATE class 42 is the deployment's; everything else (a bug in a
    handler, a constraint violation, bad input, ``Permanent`` anywhere in the chain before a
    transient cause) is permanent.
    """
    for current in causes(exc):
        if isinstance(current, Permanent):
            return Fault.PERMANENT
        if _refused(current) is not None:
            return Fault.TRANSIENT  # not the message's fault: a rotated password, a certificate
        if _transient_by_type(current):
            return Fault.TRANSIENT
        sqlstate = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(sqlstate, str):
            if sqlstate in _TRANSIENT_SQLSTATES or sqlstate[:2] == "08":
                return Fault.TRANSIENT
            if sqlstate[:2] == _DEPLOYMENT_SQLSTATE_CLASS:
                return Fault.DEPLOYMENT
    return Fault.PERMANENT


_CONTENTION_SQLSTATES = frozenset({"40P01", "40001"})  # deadlock_detected, serialization_failure


def is_contention(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) is PostgreSQL giving up on concurrent transactions
    that wait on each other (a deadlock, a serialization failure): transient, and a sign that
    they touch the same rows in different orders."""
    for current in causes(exc):
        sqlstate = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if sqlstate in _CONTENTION_SQLSTATES:
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) is a failure that a later attempt may not meet."""
    return classify(exc) is Fault.TRANSIENT


def _transient_by_type(current: BaseException) -> bool:
    """True for the exception types that mean a lost connection, a timeout or ``Retryable``."""
    if isinstance(current, Retryable | TimeoutError | ConnectionError | OSError):
        return True
    if isinstance(current, aiormq.exceptions.ChannelInvalidStateError):
        return True  # the channel died with its connection; a robust one is reopening it
    if isinstance(current, RuntimeError) and _CLOSED_BY_AIO_PIKA.fullmatch(str(current)):
        return True  # aiormq / aio-pika: "<Connection …> closed" while it reconnects
    if isinstance(current, asyncpg.exceptions.PostgresConnectionError | asyncpg.InterfaceError):
        return True
    if isinstance(current, asyncpg.exceptions.InternalClientError):
        return True  # a connection no statement can use (its backend cut mid-operation)
    if isinstance(current, asyncpg.exceptions.TargetServerAttributeNotMatched):
        return True  # every host answered, none as target_session_attrs asks: no primary yet
    if isinstance(current, sqlalchemy.exc.DBAPIError) and current.connection_invalidated:
        return True
    return isinstance(current, sqlalchemy.exc.TimeoutError)


_REFUSED_BY_POSTGRES = {
    "28P01": "PostgreSQL refused the password: fix the user or password in WORKER_DATABASE_URL",
    "3D000": "PostgreSQL has no such database: create it, or fix the database name in "
    "WORKER_DATABASE_URL",
    "28": "PostgreSQL refused the login: fix the user or sslmode in WORKER_DATABASE_URL, or "
    "pg_hba.conf on the server",
}
"""What to fix, by SQLSTATE (or its class, by its first two characters)."""

_CLOSED_AT_OPEN = re.compile(r"Expected one of \['Connection\.OpenOk'\], got <Connection\.Close\b")
"""How aiormq words RabbitMQ closing the connection at ``Connection.Open``: the virtual host
does not exist or the user may not use it (the broker's reply text is lost)."""


_CUT_OFF = ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLSyscallError
"""TLS errors of a connection cut short (a server restarting mid-handshake): transient."""


def refusal(exc: BaseException) -> AccessRefused | None:
    """An ``AccessRefused`` naming what to fix when ``exc`` (or what it wraps) says PostgreSQL or
    RabbitMQ refused the worker's login, database, virtual host or TLS handshake; else None.

    Waiting does not fix these, so the start-up backoff (``backoff.while_starting``) does not
    retry them; on the message path they are transient (``is_transient``), never the message's
    fault.
    """
    for current in causes(exc):
        what = _refused(current)
        if what is not None:
            if _CLOSED_AT_OPEN.match(str(current)):  # (its text shows no more than an object)
                return AccessRefused(what)
            return AccessRefused(f"{what}; the server said: {_first_line(current)}")
    return None


class Service(enum.Enum):
    """A service the worker connects to, as an operator names it."""

    POSTGRESQL = "PostgreSQL"
    RABBITMQ = "RabbitMQ"


_CLIENT_MODULES = {
    Service.POSTGRESQL: ("asyncpg", "sqlalchemy", "alembic"),
    Service.RABBITMQ: ("aiormq", "aio_pika", "pamqp"),
}
"""The top-level packages of each service's client libraries."""


_SETTING_OF = {
    Service.POSTGRESQL: "WORKER_DATABASE_URL (--database-url)",
    Service.RABBITMQ: "WORKER_AMQP_URL (--amqp-url)",
}


def cannot_reach(service: Service, url: str, cause: str) -> str:
    """The one sentence for ``service`` not answering at ``url``: what, where (redacted), why
    (``cause``), and which setting to check."""
    return (
        f"cannot reach {service.value} at {redact(url)} ({cause}); is it running and listening "
        f"there? Check {_SETTING_OF[service]}"
    )


def innermost(exc: BaseException) -> BaseException:
    """What ``exc`` wraps at the bottom of its chain (``causes``): the driver's own error."""
    *_, last = causes(exc)
    return last


def unreachable_service(exc: BaseException) -> Service | None:
    """The service ``exc`` says the worker could not reach: a transient failure (a refused or
    timed-out connection, a server starting or shutting down; not a refusal of the login,
    which is an ``AccessRefused``) raised by, or from inside, that service's client library,
    the innermost exception first. None for any other failure."""
    if not is_transient(exc) or refusal(exc) is not None:
        return None
    for current in reversed(list(causes(exc))):
        frames = [
            frame.f_globals.get("__name__", "") for frame, _ in walk_tb(current.__traceback__)
        ]
        for module in (type(current).__module__, *reversed(frames)):
            for service, packages in _CLIENT_MODULES.items():
                if module.partition(".")[0] in packages:
                    return service
    return None


def is_transient_at_start(exc: BaseException) -> bool:
    """True when a connection attempt at start-up is worth repeating: a transient failure that
    is not a refusal (a server still starting, not a wrong password or certificate)."""
    return is_transient(exc) and refusal(exc) is None


@contextlib.contextmanager
def refusals_explained() -> Iterator[None]:
    """Turn a refusal raised inside the block into ``AccessRefused`` (see ``refusal``)."""
    try:
        yield
    except Exception as exc:
        refused = refusal(exc)
        if refused is None:
            raise
        raise refused from exc


def _refused(exc: BaseException) -> str | None:
    """What to fix when ``exc`` itself is a refusal; None otherwise."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            "the server's TLS certificate is not trusted: fix sslrootcert or sslmode in "
            "WORKER_DATABASE_URL, or cafile in WORKER_AMQP_URL, or the server's certificate"
        )
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, _CUT_OFF):
        return (
            "the TLS handshake failed: check sslmode in WORKER_DATABASE_URL, or amqps:// and "
            "its port in WORKER_AMQP_URL, against the server's TLS settings"
        )
    if isinstance(exc, ConnectionError) and "rejected SSL upgrade" in str(exc):
        return (
            "PostgreSQL does not offer TLS: enable ssl on the server, or lower sslmode in "
            "WORKER_DATABASE_URL"
        )
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
        return "RabbitMQ refused the login: fix the user or password in WORKER_AMQP_URL"
    if isinstance(exc, aiormq.exceptions.AuthenticationError):
        return "RabbitMQ offers none of the client's login mechanisms: fix auth= in WORKER_AMQP_URL"
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and _CLOSED_AT_OPEN.match(str(exc)):
        return (
            "RabbitMQ refused the virtual host: it does not exist or the user has no permission "
            "on it (check the path of WORKER_AMQP_URL, or the user's permissions)"
        )
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = exc.sqlstate or ""
        return _REFUSED_BY_POSTGRES.get(sqlstate) or _REFUSED_BY_POSTGRES.get(sqlstate[:2])
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def unusable_connection_is_a_disconnect(context: Any) -> None:
    """An ``handle_error`` hook: asyncpg's ``InternalClientError`` (e.g. "cannot switch to state
    15; another operation (2) is in progress", a connection whose backend was terminated while
    it still waited for the end of an error) means the connection can run nothing more; marked
    a disconnect, SQLAlchemy drops it from the pool instead of handing it out again."""
    if any(
        isinstance(cause, asyncpg.exceptions.InternalClientError)
        for cause in causes(context.original_exception)
    ):
        context.is_disconnect = True
