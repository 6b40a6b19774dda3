"""The SQLAlchemy engines the worker runs on (asyncpg driver), sized to its concurrency.

Every engine comes from ``engine_for``, so each one reads ``WORKER_DATABASE_URL`` the same way
(libpq's ``sslmode``, ``sslrootcert``, ``sslcert``, ``sslkey``, ``sslcrl`` and ``sslpassword``
mean what they mean to ``psql``; several hosts and ``target_session_attrs`` too) and none ever
writes a statement's parameters, which are business data, into an error message
(``hide_parameters``). A pooled connection is checked at every checkout, with no round trip:
one asyncpg knows to be closed, or whose server said more after its last answer (its farewell:
``_ReadyWatch``), is replaced, and, when the URL asks for a writable server
(``target_session_attrs=read-write`` or ``primary``), so is one whose server has since reported
itself read-only, with every connection pooled before it; the new one goes to the primary, if
one answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DisconnectionError, InvalidatePoolError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from worker.errors import (
    ConfigurationError,
    NoPrimary,
    refusals_explained,
    unusable_connection_is_a_disconnect,
)
from worker.liveness import Liveness
from worker.logs import describe_error
from worker.settings import Settings, asyncpg_url, field
from worker.sql import maintenance

PROBE_TIMEOUT = 5.0
"""Seconds PostgreSQL has to answer a probe before it counts as unreachable."""

SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
"""libpq's ``sslmode`` values, weakest first."""

SSL_PARAMETERS = frozenset(
    {"sslmode", "ssl", "sslrootcert", "sslcert", "sslkey", "sslcrl", "sslpassword"}
)
"""URL query parameters turned into the ``ssl`` connect argument (``ssl`` is an alias of
``sslmode``, as SQLAlchemy's asyncpg documentation spells it)."""

PASSED_THROUGH = frozenset(
    {
        "prepared_statement_cache_size",
        "target_session_attrs",
        "passfile",
        "krbsrvname",
        "gsslib",
        "host",
        "port",
    }
)
"""URL query parameters handed to asyncpg as they are (``host`` and ``port``: several hosts as
libpq's ``?host=h1,h2&port=p1,p2``, the form ``Settings.sqlalchemy_url`` writes
``postgresql://u@h1:p1,h2:p2/db`` in)."""

WRITABLE_TARGETS = {
    "read-write": ("default_transaction_read_only", "in_hot_standby"),
    "primary": ("in_hot_standby",),
}
"""The ``target_session_attrs`` that ask for a writable server, and the parameters a server
reports (PostgreSQL 14 and later) that, ``on``, say it is not one."""


def engine_for(
    sqlalchemy_url: str,
    *,
    application_name: str = "worker",
    liveness: Liveness | None = None,
    **pool: Any,
) -> AsyncEngine:
    """An engine for ``sqlalchemy_url`` (``postgresql://`` or ``postgresql+asyncpg://``, which
    may carry libpq's TLS options and several hosts: ``asyncpg_url``), with statement parameters
    hidden from its errors; ``pool`` sizes its pool.

    Every connection it opens is given ``liveness`` (default: the settings' defaults): a
    connect timeout, and TCP keepalive and user timeout on both its ends (``worker.liveness``),
    so a connection whose path went silent fails within seconds and the pool replaces it."""
    liveness = liveness or Liveness.default()
    url, connect_args = connect_options(asyncpg_url(sqlalchemy_url))
    connect_args["server_settings"] = {
        "application_name": application_name,
        **liveness.server_settings(),
    }
    connect_args["timeout"] = liveness.connect_timeout
    engine = create_async_engine(url, hide_parameters=True, connect_args=connect_args, **pool)
    event.listen(engine.sync_engine, "connect", _sockets_configured(liveness))
    event.listen(engine.sync_engine, "connect", _ReadyWatch.install)
    target = url.query.get("target_session_attrs") or os.environ.get("PGTARGETSESSIONATTRS")
    read_only_when = WRITABLE_TARGETS.get(target, ()) if isinstance(target, str) else ()
    event.listen(engine.sync_engine, "checkout", _live_connections_only(read_only_when))
    event.listen(engine.sync_engine, "handle_error", unusable_connection_is_a_disconnect)
    return engine


def _sockets_configured(liveness: Liveness) -> Callable[[Any, Any], None]:
    """A pool ``connect`` hook: the new connection's TCP socket gets ``liveness``'s keepalive
    and user timeout (asyncpg has no connect argument for them, and libpq's ``keepalives*``
    URL options mean nothing to it)."""

    def configure(dbapi_connection: Any, _record: Any) -> None:
        transport = getattr(dbapi_connection.driver_connection, "_transport", None)
        if transport is not None:
            liveness.configure(transport.get_extra_info("socket"))

    return configure


def _live_connections_only(read_only_when: tuple[str, ...]) -> Callable[[Any, Any, Any], None]:
    """A pool checkout hook that refuses a pooled connection asyncpg knows to be closed (its
    server went away; a statement sent on the driver directly would not have told the pool),
    and one whose server has reported one of ``read_only_when`` as ``on`` since it connected (a
    server reports a change with its next answer): then every connection pooled before it is
    dropped too. The pool opens a new one instead, through ``target_session_attrs``. No round
    trip: it reads what asyncpg already knows."""

    def refuse(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        driver = dbapi_connection.driver_connection
        if driver.is_closed():
            raise DisconnectionError("the connection was closed")
        if _ReadyWatch.spoke_since_its_last_answer(dbapi_connection):
            driver.terminate()  # (its server said goodbye: nothing is left to tell it)
            raise DisconnectionError("the server ended the connection")
        reported = driver.get_settings()
        for parameter in read_only_when:
            if getattr(reported, parameter, "off") == "on":
                raise InvalidatePoolError(f"the server reports {parameter}=on: not a primary")

    return refuse


READY_FOR_QUERY = b"Z\x00\x00\x00\x05"
"""A ReadyForQuery message but its last byte (the transaction status): the end of every answer."""


class _ReadyWatch(asyncio.Protocol):
    """asyncpg's protocol for one connection, seen through on its transport: it notes whether
    the last thing the server sent was a ReadyForQuery, and passes everything on unchanged.

    Why: a server that ends a session (``pg_terminate_backend``, a fast shutdown,
    ``idle_session_timeout``) sends a FATAL ErrorResponse, then closes the socket. asyncpg,
    with no operation in progress, takes the unasked error for a fault of its own and waits
    for a ReadyForQuery that never comes (state 2, PROTOCOL_ERROR_CONSUME), while
    ``is_closed()`` stays False until the close itself is read: on a loaded host or a slow
    path, well after. The pool handed such a connection out, and its first statement (``BEGIN``,
    a simple query: state 15) failed with "cannot switch to state 15; another operation (2) is
    in progress": no two operations ever shared it. Every answer ends with a ReadyForQuery, so
    a connection nobody uses is ready only if that is the last thing its server said."""

    def __init__(self, inner: asyncio.Protocol) -> None:
        self.inner = inner
        self.tail = READY_FOR_QUERY + b"I"  # (installed on a connection that just logged in)

    @classmethod
    def install(cls, dbapi_connection: Any, _record: Any) -> None:
        """A pool ``connect`` hook: watch the new connection's transport."""
        transport = getattr(dbapi_connection.driver_connection, "_transport", None)
        if transport is not None:
            transport.set_protocol(cls(transport.get_protocol()))

    @classmethod
    def spoke_since_its_last_answer(cls, dbapi_connection: Any) -> bool:
        """True when the server sent ``dbapi_connection`` more after its last ReadyForQuery
        (at checkout: its farewell, read before its close)."""
        transport = getattr(dbapi_connection.driver_connection, "_transport", None)
        watch = transport.get_protocol() if transport is not None else None
        return isinstance(watch, cls) and watch.tail[:-1] != READY_FOR_QUERY

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.tail = data[-6:] if len(data) >= 6 else (self.tail + data)[-6:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def engine_from_env(
    environ: Mapping[str, str] | None = None,
    *,
    application_name: str = "worker-producer",
    **pool: Any,
) -> AsyncEngine:
    """An engine on the worker's database for your own code (``worker.outbox.publish`` in your
    transactions), from ``WORKER_DATABASE_URL`` in ``environ`` (default: ``os.environ``; unset,
    the worker's default, a local PostgreSQL), read as the worker reads it: ``postgresql://`` is
    given to asyncpg (not to psycopg, as SQLAlchemy alone would), libpq's TLS options and
    several hosts mean what they mean to ``psql``. No other ``WORKER_*`` variable is read.
    ``pool`` goes to SQLAlchemy (``pool_size``, ``max_overflow``, ``pool_timeout``, ...); the
    engine is yours to ``await engine.dispose()``. Also ``worker.outbox.engine_from_env``."""
    url = field("database_url").read(environ)
    return engine_for(url, application_name=application_name, **pool)


def create_engine(
    settings: Settings, *, application_name: str = "worker", pool_size: int | None = None
) -> AsyncEngine:
    """An engine whose pool holds one connection per concurrent unit of work (or ``pool_size``)."""
    return engine_for(
        settings.sqlalchemy_url,
        application_name=application_name,
        liveness=Liveness.of(settings),
        pool_size=settings.concurrency if pool_size is None else pool_size,
        max_overflow=2,
        pool_timeout=60,
    )


def connect_options(sqlalchemy_url: str) -> tuple[URL, dict[str, Any]]:
    """``sqlalchemy_url`` without its TLS options, and the asyncpg connect arguments they mean.

    Without ``sslmode`` nothing is set, and asyncpg applies libpq's defaults (``prefer``, or
    ``PGSSLMODE``). Raises ``ConfigurationError`` for an unknown parameter or value, or a
    certificate file that cannot be read.
    """
    url = make_url(sqlalchemy_url)
    query = {name: _single(name, value) for name, value in url.query.items()}
    unknown = sorted(set(query) - SSL_PARAMETERS - PASSED_THROUGH)
    if unknown:
        raise ConfigurationError(
            f"database_url: unknown query parameter {unknown[0]!r}; the worker understands "
            f"{', '.join(sorted(SSL_PARAMETERS | PASSED_THROUGH))}"
        )
    connect_args: dict[str, Any] = {}
    if "ssl" in query or "sslmode" in query:
        connect_args["ssl"] = ssl_argument(query)
    return url.difference_update_query(SSL_PARAMETERS), connect_args


def ssl_argument(options: Mapping[str, str]) -> ssl.SSLContext | str | bool:
    """asyncpg's ``ssl`` argument for libpq's TLS ``options`` (``sslmode`` and its files).

    ``disable`` is False; ``allow`` and ``prefer`` stay asyncpg's own modes, which fall back to
    (or from) plain TCP and never verify the server; ``require``, ``verify-ca`` and
    ``verify-full`` are a context that insists on TLS. As in libpq, ``require`` verifies the
    server's chain when a root certificate is given (then it acts as ``verify-ca``), and
    ``verify-full`` also checks that the certificate names the host.
    """
    mode = options.get("sslmode", options.get("ssl", ""))
    if mode not in SSL_MODES:
        raise ConfigurationError(
            f"database_url: sslmode={mode!r} is not one of {', '.join(SSL_MODES)}"
        )
    if mode == "disable":
        return False
    if mode in {"allow", "prefer"}:
        return mode
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = mode == "verify-full"
    _trust_root(context, mode, _file(options, "sslrootcert", "root.crt"))
    if crl := _file(options, "sslcrl"):
        _load("sslcrl", crl, lambda: context.load_verify_locations(cafile=crl))
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN
    if cert := _file(options, "sslcert", "postgresql.crt"):
        key = _file(options, "sslkey", "postgresql.key")
        password = options.get("sslpassword")
        _load("sslcert", cert, lambda: context.load_cert_chain(cert, key, password))
    return context


def _trust_root(context: ssl.SSLContext, mode: str, root: str | None) -> None:
    """Verify the server's chain against ``root`` (``system``: the system's CAs), or not at all
    under plain ``require`` without one; the ``verify-*`` modes need one."""
    if root == "system":
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    elif root is not None:
        _load("sslrootcert", root, lambda: context.load_verify_locations(cafile=root))
    elif mode == "require":
        context.verify_mode = ssl.CERT_NONE
        return
    else:
        raise ConfigurationError(
            f"database_url: sslmode={mode} needs sslrootcert=<CA certificate file> "
            "(or sslrootcert=system to trust the system's certificate authorities)"
        )
    context.verify_mode = ssl.CERT_REQUIRED


def _load(option: str, path: str, load: Callable[[], None]) -> None:
    """Run ``load`` (reading ``path``); a file that cannot be read or parsed names its option."""
    try:
        load()
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigurationError(f"database_url: {option}={path}: {reason}") from exc


def _file(options: Mapping[str, str], option: str, default: str | None = None) -> str | None:
    """The file ``option`` names, as libpq finds it: in the URL, else in its environment
    variable (``sslrootcert``: ``PGSSLROOTCERT``), else ``~/.postgresql/<default>`` if it
    exists."""
    if found := options.get(option) or os.environ.get(f"PG{option.upper()}"):
        return found
    path = Path("~/.postgresql", default).expanduser() if default else None
    return str(path) if path is not None and path.is_file() else None


def _single(name: str, value: str | tuple[str, ...]) -> str:
    if isinstance(value, tuple):
        raise ConfigurationError(f"database_url: {name} is given more than once")
    return value


@contextlib.asynccontextmanager
async def one_connection(settings: Settings, application_name: str) -> AsyncIterator[AsyncEngine]:
    """A one-connection engine for a command or a check, disposed of on exit; a refused login
    or TLS handshake raises ``AccessRefused`` naming what to fix."""
    engine = create_engine(settings, application_name=application_name, pool_size=1)
    try:
        with refusals_explained():
            yield engine
    finally:
        await engine.dispose()


async def check_durable_commits(engine: AsyncEngine) -> None:
    """Refuse to run with ``synchronous_commit=off``: an ack could then outlive a lost commit."""
    async with engine.connect() as conn:
        if await maintenance.synchronous_commit(conn) == "off":
            raise ConfigurationError(
                "synchronous_commit is off for the worker's database role: a crash could lose "
                "a commit whose message was already acked. Set it to 'on' (or stronger)."
            )


def unreachable(exc: BaseException, within: float = PROBE_TIMEOUT) -> str:
    """Why PostgreSQL counts as unreachable, in words, from what ``probe`` raised: a pause's
    reason, as ``/healthz`` and ``worker status`` show it."""
    if isinstance(exc, TimeoutError):
        return f"PostgreSQL unreachable: no answer in {within:g} s"
    return f"PostgreSQL unreachable: {describe_error(exc)}"


async def probe(engine: AsyncEngine, *, within: float = PROBE_TIMEOUT) -> None:
    """Ask a pooled connection, within ``within`` seconds, whether its server takes writes;
    raises when PostgreSQL does not answer, and ``NoPrimary`` when it answers read-only (a
    standby, a server made read-only), after dropping that connection so that the next one is
    opened anew (through ``target_session_attrs``, to the primary if one answers). The one
    check behind the consumer's pause, ``/healthz`` and ``worker verify``."""
    async with asyncio.timeout(within), engine.connect() as conn:
        if not await maintenance.takes_writes(conn):
            await conn.invalidate()
            raise NoPrimary()
