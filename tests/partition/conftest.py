"""Silent network partitions: a PostgreSQL cluster and a RabbitMQ node of these tests' own
(``scripts/partition``, the script a person runs by hand too), whose ports have their packets
dropped on the loopback interface while the worker runs against them.

Only those two servers' ports are ever cut (5461 and 5692 by default), never the machine's main
servers'. The RabbitMQ node listens on a second port too (5693), never cut: the tests publish
and observe through it, as a producer elsewhere in the network would. Every rule is removed at
the start of the session (leftovers of an interrupted run) and after each cut, in ``finally``.

Marked ``partition`` and left out of a run that does not ask for them (about ten minutes of
partitions): ``./scripts/test -m partition tests/partition``, as CI runs them. Without root,
``pg_createcluster``, ``rabbitmq-server`` or ``iptables`` they are skipped, unless ``CI`` is
set: there they must run, so they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection

from tests.integration.support import BASE, EXAMPLES, ROOT, TEST_RETRY_DELAYS
from worker.settings import Settings
from worker.testing import scratch_database
from worker.transport.topology import delete_topology

HERE = Path(__file__).parent
SCRIPT = ROOT / "scripts" / "partition"
PG_PORT = int(os.environ.get("PARTITION_PG_PORT", "5461"))
AMQP_PORT = int(os.environ.get("PARTITION_AMQP_PORT", "5692"))
CONTROL_PORT = AMQP_PORT + 1
"""The node's second AMQP port, never cut: the test's own publisher and checks use it."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``partition``; skip them unless the run asks for them."""
    asked = "partition" in (config.getoption("markexpr") or "")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.partition)
            if not asked:
                item.add_marker(pytest.mark.skip(reason="about ten minutes: run with -m partition"))


def script(*args: str) -> str:
    """``scripts/partition args``; its output, or the test fails."""
    done = subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"partition {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


@dataclass(frozen=True)
class Network:
    """The path to the two servers, cut and healed through ``scripts/partition``."""

    pg_port: int = PG_PORT
    amqp_port: int = AMQP_PORT

    @contextlib.contextmanager
    def cut(self, port: int, client: int | None = None) -> Iterator[None]:
        """Packets to and from ``port`` (only the connection from ``client`` if given) dropped
        inside the block; every rule removed on the way out, however it is left."""
        try:
            script("cut", str(port), *([] if client is None else [str(client)]))
            yield
        finally:
            script("heal")


def missing() -> str:
    """What this machine lacks to run these tests, or nothing."""
    if os.geteuid() != 0:
        return "root (to start servers and drop packets)"
    for tool, package in (
        ("pg_createcluster", "postgresql-common"),
        ("rabbitmq-server", "rabbitmq-server"),
        ("iptables", "iptables"),
    ):
        if shutil.which(tool) is None:
            return f"{tool} ({package})"
    return ""


@pytest.fixture(scope="package")
def network() -> Iterator[Network]:
    """The two servers up for these tests, and gone afterwards."""
    lacking = missing()
    if lacking:
        if os.environ.get("CI"):
            pytest.fail(f"the partition tests need {lacking}, and CI must run them")
        pytest.skip(f"needs {lacking}")
    script("heal")  # (rules an interrupted run left behind)
    try:
        script("up")
        yield Network()
    finally:
        script("down")


@pytest.fixture
def partition_settings(network: Network) -> Iterator[Settings]:
    """A fresh database with the examples' tables on the partition's PostgreSQL, and broker
    names of this test's own on its RabbitMQ node (through the port that is cut)."""
    suffix = uuid.uuid4().hex[:10]
    base = BASE.replace(
        database_url=f"postgresql://postgres@127.0.0.1:{network.pg_port}/postgres",
        amqp_url=f"amqp://guest:guest@127.0.0.1:{network.amqp_port}/",
        exchange=f"partition-{suffix}-events",
        queue=f"partition-{suffix}",
        retry_delays=TEST_RETRY_DELAYS,
        http_port=0,
    )
    with scratch_database(base, EXAMPLES, prefix="worker_partition") as scratch:
        yield scratch


@pytest.fixture
async def control(
    partition_settings: Settings,
) -> AsyncIterator[AbstractRobustConnection]:
    """A connection to the node through the port never cut; the test's exchange and queues are
    deleted afterwards."""
    connection = await aio_pika.connect_robust(f"amqp://guest:guest@127.0.0.1:{CONTROL_PORT}/")
    yield connection
    await delete_topology(await connection.channel(), partition_settings)
    await connection.close()
