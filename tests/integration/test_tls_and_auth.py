"""TLS and authentication, against real servers: libpq's TLS options in the database URL (a
TLS-only PostgreSQL cluster of the tests' own), ``amqps://`` with a CA file, and refusals — a
wrong password, an untrusted certificate, a missing database or virtual host — that fail at the
first attempt with a message naming what to fix instead of being retried for a minute. Also:
SQL parameters (business data) never reach a recorded error."""

from __future__ import annotations

import asyncio
import gc
import os
import ssl
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq.exceptions
import asyncpg
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, rows, scalar, wait_until
from tests.integration.pg_tls import (
    PASSWORD,
    USER,
    Certificates,
    TlsCluster,
    certificates,
    tls_cluster,
)
from tests.integration.support import BASE, dead_letters, publish, running_worker
from tests.integration.tcp_proxy import tcp_proxy
from worker import Context, Router, backoff
from worker.database import check_durable_commits, connect_options, create_engine, probe
from worker.errors import (
    AccessRefused,
    ConfigurationError,
    is_transient,
    is_transient_at_start,
    refusal,
)
from worker.settings import Settings
from worker.telemetry import Count
from worker.testing import scratch_database
from worker.transport.connection import connect
from worker.transport.dead_letters import ERROR

# The database URL's TLS options, mapped without a server


def _ssl(query: str) -> Any:
    _, connect_args = connect_options(f"postgresql+asyncpg://u@db.example/app?{query}")
    return connect_args.get("ssl")


@pytest.fixture
def no_dot_postgresql(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home without ``~/.postgresql``, and no ``PGSSL*`` variables: the files libpq (and the
    worker) would use when the URL names none."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("PGSSLROOTCERT", "PGSSLCERT", "PGSSLKEY", "PGSSLCRL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def certs() -> Iterator[Certificates]:
    with certificates() as made:
        yield made


def test_without_sslmode_the_url_is_left_to_asyncpgs_defaults() -> None:
    url, connect_args = connect_options("postgresql+asyncpg://u:p@db.example:6432/app")
    assert connect_args == {}
    assert (
        url.render_as_string(hide_password=False) == "postgresql+asyncpg://u:p@db.example:6432/app"
    )


@pytest.mark.parametrize(
    ("query", "expected"),
    [("sslmode=disable", False), ("sslmode=allow", "allow"), ("sslmode=prefer", "prefer")],
)
def test_modes_that_may_go_without_tls_stay_asyncpgs_own(query: str, expected: object) -> None:
    assert _ssl(query) == expected


def test_require_encrypts_without_verifying_unless_given_a_root_certificate(
    certs: Certificates, no_dot_postgresql: Path
) -> None:
    plain = _ssl("sslmode=require")
    assert isinstance(plain, ssl.SSLContext)
    assert (plain.verify_mode, plain.check_hostname) == (ssl.CERT_NONE, False)
    # as in libpq, require with a root certificate verifies the chain (verify-ca)
    rooted = _ssl(f"sslmode=require&sslrootcert={certs.ca_file}")
    assert (rooted.verify_mode, rooted.check_hostname) == (ssl.CERT_REQUIRED, False)


def _trusted(context: ssl.SSLContext) -> list[str]:
    """The common names of the CAs ``context`` trusts."""
    return [dict(rdn[0] for rdn in ca["subject"])["commonName"] for ca in context.get_ca_certs()]


def test_files_come_from_libpqs_variables_when_the_url_names_none(
    certs: Certificates, no_dot_postgresql: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGSSLROOTCERT", str(certs.wrong_ca_file))
    from_variable = _ssl("sslmode=verify-ca")
    assert from_variable.verify_mode == ssl.CERT_REQUIRED
    assert _trusted(from_variable) == ["worker test wrong-ca"]
    # the URL wins over the variable
    assert _trusted(_ssl(f"sslmode=verify-ca&sslrootcert={certs.ca_file}")) == ["worker test ca"]


def test_verify_full_checks_the_chain_and_the_host_name(
    certs: Certificates, no_dot_postgresql: Path
) -> None:
    context = _ssl(f"sslmode=verify-full&sslrootcert={certs.ca_file}&sslcrl=")
    assert (context.verify_mode, context.check_hostname) == (ssl.CERT_REQUIRED, True)
    verify_ca = _ssl(f"ssl=verify-ca&sslrootcert={certs.ca_file}")
    assert (verify_ca.verify_mode, verify_ca.check_hostname) == (ssl.CERT_REQUIRED, False)


def test_the_tls_options_leave_the_url_and_the_others_stay(
    certs: Certificates, no_dot_postgresql: Path
) -> None:
    url, connect_args = connect_options(
        "postgresql+asyncpg://u@h/app?sslmode=verify-full"
        f"&sslrootcert={certs.ca_file}&sslcert={certs.server_cert}&sslkey={certs.server_key}"
        "&prepared_statement_cache_size=0"
    )
    assert dict(url.query) == {"prepared_statement_cache_size": "0"}
    assert isinstance(connect_args["ssl"], ssl.SSLContext)


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("sslmode=required", "sslmode='required' is not one of disable, allow, prefer"),
        ("sslmode=verify-full", "sslmode=verify-full needs sslrootcert=<CA certificate file>"),
        ("sslmode=require&sslrootcert=/nonexistent/ca.crt", "sslrootcert=/nonexistent/ca.crt"),
        ("sslmode=require&sslcert=/nonexistent/client.crt", "sslcert=/nonexistent/client.crt"),
        ("sslmode=require&connect_timeout=5", "unknown query parameter 'connect_timeout'"),
        ("sslmode=require&sslmode=disable", "sslmode is given more than once"),
    ],
)
def test_a_wrong_tls_option_is_a_configuration_error_that_names_it(
    query: str, says: str, no_dot_postgresql: Path
) -> None:
    with pytest.raises(ConfigurationError, match="database_url") as raised:
        _ssl(query)
    assert says in str(raised.value)


# Refusals: which failures name what to fix instead of being retried


def _postgres_error(cls: type[asyncpg.PostgresError], message: str) -> asyncpg.PostgresError:
    return cls(message)


def _wrapped(cause: BaseException) -> Exception:
    try:
        raise ConnectionError("while connecting") from cause
    except ConnectionError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (
            _postgres_error(asyncpg.InvalidPasswordError, 'password failed for user "w"'),
            "PostgreSQL refused the password",
        ),
        (
            _postgres_error(asyncpg.InvalidAuthorizationSpecificationError, "no pg_hba entry"),
            "PostgreSQL refused the login",
        ),
        (
            _postgres_error(asyncpg.InvalidCatalogNameError, 'database "nope" does not exist'),
            "PostgreSQL has no such database",
        ),
        (_wrapped(ssl.SSLCertVerificationError(1, "unable to get local issuer")), "not trusted"),
        (ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number"), "handshake"),
        (
            aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED - Login was refused"),
            "RabbitMQ refused the login",
        ),
        (
            aiormq.exceptions.InvalidFrameError(
                "Expected one of ['Connection.OpenOk'], got <Connection.Close object at 0x7f>"
            ),
            "RabbitMQ refused the virtual host",
        ),
    ],
)
def test_refusals_name_what_to_fix_and_are_not_retried_at_start(
    exc: BaseException, says: str
) -> None:
    refused = refusal(exc)
    assert isinstance(refused, AccessRefused)
    assert says in str(refused)
    assert "\n" not in str(refused)
    assert not is_transient_at_start(exc)
    # while processing a message they are not the message's fault: never parked as permanent
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(111, "Connection refused"),
        ssl.SSLEOFError(8, "EOF occurred in violation of protocol"),
        _postgres_error(asyncpg.CannotConnectNowError, "the database system is starting up"),
        aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED"),
    ],
)
def test_a_server_still_starting_is_retried_at_start(exc: BaseException) -> None:
    assert refusal(exc) is None
    assert is_transient_at_start(exc)


def test_a_bug_is_neither_a_refusal_nor_transient() -> None:
    assert refusal(KeyError("account")) is None
    assert not is_transient_at_start(KeyError("account"))


# A TLS-only PostgreSQL cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[TlsCluster]:
    with tls_cluster() as started:
        yield started


def _on(cluster: TlsCluster, query: str, **url: Any) -> Settings:
    return BASE.replace(database_url=cluster.url(query, **url))


class Counted:
    """An async function whose calls are counted: the attempts a retry policy made."""

    def __init__(self, function: Callable[..., Awaitable[Any]]) -> None:
        self.function = function
        self.calls = 0

    async def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return await self.function(*args)


async def _start(settings: Settings, attempt: Counted) -> None:
    """Check the database as ``worker run`` does at start (``while_starting``)."""
    engine = create_engine(settings, pool_size=1)
    try:
        await backoff.while_starting()(attempt, engine)
    finally:
        await engine.dispose()


async def _refused_at_start(settings: Settings) -> tuple[str, int]:
    """The message of the refusal ``_start`` raises, and how many attempts it had made."""
    attempt = Counted(check_durable_commits)
    with pytest.raises(AccessRefused) as refused:
        await _start(settings, attempt)
    return str(refused.value), attempt.calls


async def _uses_tls(engine: AsyncEngine) -> bool:
    return bool(await scalar(engine, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"))


async def test_sslmode_require_connects_over_tls(cluster: TlsCluster) -> None:
    attempt = Counted(check_durable_commits)
    await _start(_on(cluster, "sslmode=require"), attempt)
    assert attempt.calls == 1
    engine = create_engine(_on(cluster, "sslmode=require"), pool_size=1)
    try:
        assert await _uses_tls(engine)
    finally:
        await engine.dispose()


def test_verify_full_with_the_right_ca_creates_and_migrates_a_database(
    cluster: TlsCluster,
) -> None:
    # Given the cluster's CA, and a database URL that insists on a verified server name
    settings = _on(cluster, f"sslmode=verify-full&sslrootcert={cluster.certificates.ca_file}")

    # When a scratch database is created, migrated and dropped through it
    with scratch_database(settings) as scratch:

        async def check() -> tuple[bool, int]:
            engine = create_engine(scratch, pool_size=1)
            try:
                await probe(engine)
                tables = await scalar(
                    engine, "SELECT count(*) FROM pg_tables WHERE tablename IN ('inbox', 'outbox')"
                )
                return await _uses_tls(engine), int(tables)
            finally:
                await engine.dispose()

        # Then every connection was verified TLS, and the worker's tables are there
        assert asyncio.run(check()) == (True, 2)


def _worker(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    queue = f"test-{uuid.uuid4().hex[:10]}"
    return subprocess.run(
        [str(WORKER_SCRIPT), *argv],
        env={**os.environ, "WORKER_QUEUE": queue, "WORKER_HTTP_PORT": "0", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _refused_once(result: subprocess.CompletedProcess[str], says: str) -> None:
    """The command stopped at its first refusal: exit 2, one line naming the fix, no retry."""
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("worker: error:")]
    assert len(errors) == 1, result.stderr
    assert says in errors[0]
    assert "Traceback" not in result.stderr
    assert "Retrying" not in result.stderr + result.stdout


async def test_verify_full_with_a_wrong_ca_fails_at_the_first_attempt(
    cluster: TlsCluster,
) -> None:
    wrong = cluster.certificates.wrong_ca_file
    message, attempts = await _refused_at_start(
        _on(cluster, f"sslmode=verify-full&sslrootcert={wrong}")
    )
    assert attempts == 1
    assert "TLS certificate is not trusted: fix sslrootcert" in message
    assert "certificate verify failed" in message


def test_worker_migrate_with_a_wrong_ca_says_so(cluster: TlsCluster) -> None:
    wrong = cluster.certificates.wrong_ca_file
    result = _worker(
        "migrate",
        WORKER_DATABASE_URL=cluster.url(f"sslmode=verify-full&sslrootcert={wrong}"),
    )
    _refused_once(result, "TLS certificate is not trusted")


async def test_sslmode_disable_against_a_tls_only_server_is_refused_clearly(
    cluster: TlsCluster,
) -> None:
    message, attempts = await _refused_at_start(_on(cluster, "sslmode=disable"))
    assert attempts == 1
    assert "PostgreSQL refused the login: fix the user or sslmode" in message
    assert "no encryption" in message


async def test_a_missing_database_fails_at_the_first_attempt(cluster: TlsCluster) -> None:
    settings = BASE.replace(
        database_url=cluster.url("sslmode=require").replace(f"/{USER}?", "/no_such_db?")
    )
    message, attempts = await _refused_at_start(settings)
    assert attempts == 1
    assert "PostgreSQL has no such database" in message


def test_worker_run_with_a_wrong_database_password_stops_at_once(cluster: TlsCluster) -> None:
    result = _worker(
        "run",
        WORKER_HANDLERS="examples.payments",
        WORKER_DATABASE_URL=cluster.url("sslmode=require", password="not-the-password"),
    )
    _refused_once(result, "PostgreSQL refused the password")
    assert "not-the-password" not in result.stderr + result.stdout
    assert PASSWORD not in result.stderr + result.stdout


# RabbitMQ: a wrong password, a missing virtual host, and amqps:// with a CA file


def test_a_wrong_broker_password_stops_a_command_at_once() -> None:
    result = _worker("dlq", "list", WORKER_AMQP_URL="amqp://guest:bogus@127.0.0.1:5672/")
    _refused_once(result, "RabbitMQ refused the login: fix the user or password")
    assert "bogus" not in result.stderr + result.stdout


async def _connect(url: str) -> tuple[AbstractRobustConnection, Counted]:
    """Connect as the worker does at start (``while_starting``); with the attempts counted."""
    attempt = Counted(connect)
    connection: AbstractRobustConnection = await backoff.while_starting()(attempt, url)
    return connection, attempt


async def _refused_broker(url: str) -> tuple[str, int]:
    """The refusal connecting to ``url`` raised at start, and the attempts it took."""
    attempt = Counted(connect)
    with pytest.raises(AccessRefused) as refused:
        await backoff.while_starting()(attempt, url)
    return str(refused.value), attempt.calls


async def test_a_missing_virtual_host_fails_at_the_first_attempt() -> None:
    message, attempts = await _refused_broker("amqp://guest:guest@127.0.0.1:5672/no-such-vhost")
    assert "RabbitMQ refused the virtual host" in message
    assert attempts == 1


def _tls_server(certs: Certificates) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    return context


async def test_amqps_with_a_cafile_in_the_url_connects(certs: Certificates) -> None:
    # Given RabbitMQ behind a TLS listener whose certificate our CA signed
    async with tcp_proxy("127.0.0.1", 5672, tls=_tls_server(certs)) as listener:
        url = f"amqps://guest:guest@localhost:{listener.port}/?cafile={certs.ca_file}"

        # When the worker connects with the CA named in the URL
        connection, attempt = await _connect(url)
        try:
            # Then the AMQP session works over the verified TLS connection
            channel = await connection.channel()
            queue = await channel.declare_queue(exclusive=True)
            assert queue.declaration_result.message_count == 0
            assert attempt.calls == 1
        finally:
            await connection.close()


async def test_amqps_with_a_wrong_cafile_fails_at_the_first_attempt(certs: Certificates) -> None:
    async with tcp_proxy("127.0.0.1", 5672, tls=_tls_server(certs)) as listener:
        wrong = f"amqps://guest:guest@localhost:{listener.port}/?cafile={certs.wrong_ca_file}"
        message, attempts = await _refused_broker(wrong)
        assert "TLS certificate is not trusted" in message
        assert attempts == 1

        # and no_verify_ssl=1, also read from the URL, accepts the same server
        unverified = f"amqps://guest:guest@localhost:{listener.port}/?no_verify_ssl=1"
        connection, _ = await _connect(unverified)
        await connection.close()


# SQL parameters never reach a recorded error

SECRET_ID = "acct-7c1f-0042-SECRET"
SECRET_NOTE = "card 4111 1111 1111 1111"


def _leaky_router() -> Router:
    """A handler whose inserts break a constraint with business data in the row."""
    router = Router()

    @router.handler("secret.write")
    async def write_secret(body: dict[str, Any], ctx: Context) -> None:
        await ctx.connection.execute(
            text("INSERT INTO secret_rows (id, note) VALUES (:id, :note)"),
            {"id": body["id"], "note": body["note"]},
        )

    return router


@pytest.fixture
async def secret_rows(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS secret_rows "
                "(id text PRIMARY KEY, note text CHECK (note NOT LIKE 'card %'))"
            )
        )
        await conn.execute(text("TRUNCATE secret_rows"))
        await conn.execute(
            text("INSERT INTO secret_rows VALUES (:id, 'exists')"), {"id": SECRET_ID}
        )


async def test_constraint_violations_record_no_sql_parameters(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, secret_rows: None
) -> None:
    # Given a handler that breaks a unique and a check constraint with business data
    bodies = {
        "dup-1": {"id": SECRET_ID, "note": "fine"},
        "chk-1": {"id": "new-row", "note": SECRET_NOTE},
    }
    async with running_worker(settings, _leaky_router()) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        for key, body in bodies.items():
            await publish(channel, settings, body, key=key, routing_key="secret.write")

        async def parked() -> bool:
            return worker.stats[Count.DEAD_LETTERED] >= len(bodies)

        await wait_until(parked)

    # Then the recorded errors say what failed, without the values
    recorded = dict(
        await rows(engine, "SELECT key, error FROM inbox WHERE key IN ('dup-1', 'chk-1')")
    )
    copies = {
        m.headers["idempotency-key"]: m.headers[ERROR]
        for m in await dead_letters(channel, settings)
    }
    assert "violates unique constraint" in recorded["dup-1"]
    assert "violates check constraint" in recorded["chk-1"]
    assert set(copies) == set(bodies)
    for error in [*recorded.values(), *map(str, copies.values())]:
        for value in (SECRET_ID, SECRET_NOTE, "4111"):
            assert value not in error, error


async def test_a_failed_first_connect_leaves_no_open_connection_behind() -> None:
    # Given nothing listens on the port; when the worker's one attempt to connect fails
    with pytest.raises(ConnectionError):
        await connect("amqp://guest:guest@127.0.0.1:1/")
    # Then the half-made connection is closed already: the garbage collector, which may run in
    # a thread with no event loop, finds nothing to close
    gc.collect()
    left = [
        o
        for o in gc.get_objects()
        if isinstance(o, aio_pika.RobustConnection) and o.url.port == 1 and not o.is_closed
    ]
    assert left == []
