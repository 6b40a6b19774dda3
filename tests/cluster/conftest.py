"""A three-node RabbitMQ cluster for the tests of this folder, started and removed by
``scripts/rabbitmq-cluster`` (the script a person runs by hand too), and a scratch database on
the main PostgreSQL.

The cluster runs beside the machine's main broker (nodes ``rabbit-c1..c3@localhost``, AMQP ports
5681-5683) and is gone after these tests. Without ``rabbitmq-server``, or run by another user
than root, the tests are skipped, unless the environment variable ``CI`` is set: there they
fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.integration.support import BASE, EXAMPLES
from worker.database import create_engine
from worker.testing import scratch_database

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "rabbitmq-cluster"
NODES = (1, 2, 3)
CTL = ("rabbitmqctl", "-n")
START_WITHIN = 300.0
"""Seconds ``up`` may take (three nodes start in about 20 s on two cores; far more is a fault)."""


def node_name(node: int) -> str:
    return f"rabbit-c{node}@localhost"


def amqp_port(node: int) -> int:
    return 5680 + node


def amqp_url(node: int) -> str:
    return f"amqp://guest:guest@127.0.0.1:{amqp_port(node)}/"


def script(*args: str, timeout: float = START_WITHIN) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@dataclass(frozen=True)
class Cluster:
    """The running cluster, driven through ``scripts/rabbitmq-cluster`` and ``rabbitmqctl``."""

    def urls(self, first: int = 1) -> str:
        """``WORKER_AMQP_URL`` for the three nodes, node ``first`` first, then round."""
        order = [*NODES[first - 1 :], *NODES[: first - 1]]
        return ",".join(amqp_url(node) for node in order)

    async def run(self, *args: str) -> str:
        """``scripts/rabbitmq-cluster args``, off the event loop; its output, or a failure."""
        done = await asyncio.to_thread(script, *args)
        assert done.returncode == 0, f"rabbitmq-cluster {' '.join(args)}: {done.stderr}"
        return done.stdout

    async def leader(self, queue: str) -> int:
        """The node leading quorum queue ``queue``."""
        name = (await self.run("leader", queue)).strip()
        return next(node for node in NODES if node_name(node) == name)

    async def depth(self, queue: str, *, on: int) -> int:
        """Messages of ``queue`` (ready and unacknowledged), as node ``on`` counts them."""
        listing = await asyncio.to_thread(
            subprocess.run,
            [*CTL, node_name(on), "-q", "list_queues", "--no-table-headers", "name", "messages"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        for line in listing.stdout.splitlines():
            name, count = line.split("\t")
            if name == queue:
                return int(count)
        raise AssertionError(f"no queue {queue} on {node_name(on)}")


def missing_for_a_cluster() -> str:
    """What this machine lacks to run ``scripts/rabbitmq-cluster``, or nothing."""
    if shutil.which("rabbitmq-server") is None:
        return "rabbitmq-server (RabbitMQ installed)"
    if os.geteuid() != 0:
        return "root (the script runs the nodes as the rabbitmq user)"
    return ""


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    """The three nodes, up for these tests (``rabbitmq-cluster up``), then removed (``down``)
    before any other test runs: three more brokers would only slow the rest of the suite."""
    missing = missing_for_a_cluster()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the cluster tests need {missing}, and CI must run them")
        pytest.skip(f"needs {missing} to start a three-node RabbitMQ cluster")
    try:
        up = script("up")
        if up.returncode != 0:
            pytest.fail(f"rabbitmq-cluster up failed:\n{up.stdout}{up.stderr}")
        yield Cluster()
    finally:
        down = script("down")
        assert down.returncode == 0, f"rabbitmq-cluster down failed:\n{down.stderr}"


@pytest.fixture(scope="package")
def database_url() -> Iterator[str]:
    """A fresh database on the main PostgreSQL with the example handler modules' tables."""
    with scratch_database(BASE, EXAMPLES, prefix="worker_cluster") as scratch:
        yield scratch.database_url


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(BASE.replace(database_url=database_url), application_name="tests")
    yield engine
    await engine.dispose()
