"""A PostgreSQL primary and its synchronous replica for the failover tests, made and dropped by
``scripts/pg-failover`` (the script a person runs by hand), beside the main cluster.

The session brings the pair up once and drops it at the end, leaving the machine as it was. A
test that needs a healthy pair asks ``pair.up()`` again: nothing to do if it is, a fresh pair
(a few seconds) after a test that failed it over. Without ``pg_createcluster`` the tests are
skipped, unless ``CI`` is set: there they must run, so they fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aio_pika
import asyncpg
import pytest

from tests.helpers import wait_until
from tests.integration.support import BASE, EXAMPLES, ROOT, TEST_RETRY_DELAYS, require_services
from worker.settings import Settings
from worker.testing import scratch_database
from worker.transport.topology import delete_topology

SCRIPT = ROOT / "scripts" / "pg-failover"


@dataclass(frozen=True)
class Pair:
    """The two clusters ``scripts/pg-failover`` manages, on the ports it reads from the same
    environment variables."""

    first_primary: int = int(os.environ.get("PG_FAILOVER_PRIMARY_PORT", "5441"))
    first_standby: int = int(os.environ.get("PG_FAILOVER_STANDBY_PORT", "5442"))

    def run(self, command: str) -> str:
        """``scripts/pg-failover <command>``; its output (stdout and stderr)."""
        done = subprocess.run(
            [str(SCRIPT), command],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"pg-failover {command} failed:\n{output}"
        return output

    def up(self) -> None:
        self.run("up")

    def url(self, database: str) -> str:
        """The multi-host URL the worker is given: the primary wherever it is."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.first_primary},"
            f"127.0.0.1:{self.first_standby}/{database}?target_session_attrs=read-write"
        )

    def direct_url(self, port: int, database: str) -> str:
        """One server of the pair, whatever its role (a standby answers reads)."""
        return f"postgresql://postgres@127.0.0.1:{port}/{database}"

    async def replayed(self) -> None:
        """Return once the standby has applied all the primary wrote so far: a commit returns
        when the standby has flushed it (``synchronous_commit=on``), before it is visible there
        (that would be ``remote_apply``)."""
        primary = await asyncpg.connect(self.direct_url(self.first_primary, "postgres"))
        try:
            written = await primary.fetchval("SELECT pg_current_wal_lsn()::text")
        finally:
            await primary.close()
        standby = await asyncpg.connect(self.direct_url(self.first_standby, "postgres"))
        try:

            async def applied() -> bool:
                lsn = "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn"
                return bool(await standby.fetchval(lsn, written))

            await wait_until(applied, timeout=30)
        finally:
            await standby.close()


@pytest.fixture(scope="session")
def pair() -> Iterator[Pair]:
    if shutil.which("pg_createcluster") is None:
        reason = "needs pg_createcluster (postgresql-common) to make a primary and its replica"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI is set, where the failover tests must run")
        pytest.skip(reason)
    require_services()
    made = Pair()
    made.up()
    try:
        yield made
    finally:
        made.run("down")


@pytest.fixture
def failover_settings(pair: Pair) -> Iterator[Settings]:
    """A healthy pair, a fresh database on it with the examples' tables (made through the
    multi-host URL, as ``worker.testing.scratch_database`` makes one), and broker names of
    this test's own on the main RabbitMQ."""
    pair.up()
    suffix = uuid.uuid4().hex[:10]
    base = BASE.replace(
        database_url=pair.url("postgres"),
        exchange=f"failover-{suffix}-events",
        queue=f"failover-{suffix}",
        retry_delays=TEST_RETRY_DELAYS,
        http_port=0,
    )
    with scratch_database(base, EXAMPLES, prefix="worker_failover") as scratch:
        asyncio.run(pair.replayed())  # (the tests read the standby too)
        yield scratch


@pytest.fixture
async def amqp(failover_settings: Settings) -> AsyncIterator[aio_pika.abc.AbstractRobustConnection]:
    """A broker connection; the test's exchange and queues are deleted afterwards."""
    connection = await aio_pika.connect_robust(BASE.amqp_url)
    yield connection
    await delete_topology(await connection.channel(), failover_settings)
    await connection.close()
