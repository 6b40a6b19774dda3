"""The getting-started package (``docs/getting-started/inventory``) works as its reader uses it.

Built as a user would: the worker's sources and the package are copied into a temporary
directory and installed, not editable, into a fresh virtualenv (offline: ``tests.venvs``).
Then, against a database and broker names of this test's own: ``worker migrate`` (the package's
entry point brings its handlers and migration in, with no ``--handlers``), ``alembic -n
inventory check`` with the package's ``alembic.ini`` (``script_location = worker:migrations``:
the worker's migration environment found in the installed package, outside this repository),
``worker run`` as a process fed twice the same message by a producer, and the package's own
tests. Alembic also writes the package's next revision there, where its reader would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import pytest
from aio_pika.abc import AbstractQueue

from tests.helpers import free_port, rows, wait_until, worker_environ
from tests.integration.support import BASE, TEST_RETRY_DELAYS, request, require_services
from tests.venvs import copy_tree, fresh_venv, pip_install, run
from worker.database import create_engine
from worker.settings import Settings
from worker.testing import empty_database
from worker.transport.topology import delete_topology

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "docs" / "getting-started" / "inventory"
WORKER_SOURCES = ("pyproject.toml", "README.md", "worker")
PACKAGE_FILES = ("pyproject.toml", "alembic.ini", "inventory", "tests")


@dataclass(frozen=True)
class Installed:
    """A virtualenv holding the worker and the inventory package, and the package's sources."""

    python: Path
    package: Path

    @property
    def worker(self) -> Path:
        return self.python.with_name("worker")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("getting-started")
    worker = copy_tree(ROOT, WORKER_SOURCES, base / "rabbit-outbox-worker")
    package = copy_tree(PACKAGE, PACKAGE_FILES, base / "inventory")
    python = fresh_venv(base / "venv")
    pip_install(python, worker, package)
    return Installed(python, package)


def environ(settings: Settings | None = None, **extra: str) -> dict[str, str]:
    """This process's environment without ``WORKER_*`` or ``PYTHONPATH`` (the virtualenv finds
    what it installed, nothing of this checkout), plus the ``WORKER_*`` of ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_") and k != "PYTHONPATH"}
    if settings is not None:
        env |= worker_environ(settings, WORKER_HTTP_PORT=str(settings.http_port))
    return env | extra


@pytest.fixture
def database() -> Iterator[Settings]:
    require_services()
    with empty_database(BASE, prefix="worker_getting_started") as scratch:
        yield scratch


@pytest.fixture
async def service(database: Settings) -> AsyncIterator[Settings]:
    """The inventory service's settings: an empty database, an exchange and queues of its own
    (deleted afterwards), and a free port for ``/metrics``."""
    suffix = uuid.uuid4().hex[:10]
    settings = database.replace(
        exchange=f"test-{suffix}-events",
        queue=f"test-{suffix}",
        retry_delays=TEST_RETRY_DELAYS,
        http_port=free_port(),
    )
    yield settings
    connection = await aio_pika.connect(BASE.amqp_url)
    async with connection:
        await delete_topology(await connection.channel(), settings)


@contextlib.asynccontextmanager
async def events(settings: Settings, routing_key: str) -> AsyncIterator[AbstractQueue]:
    """A queue of this test's own bound to ``routing_key`` on the service's exchange: what
    a consumer of those events would get. Deleted with its connection."""
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(settings.exchange, routing_key)
        yield queue


@contextlib.contextmanager
def worker_running(
    installed: Installed, settings: Settings, cwd: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``worker run`` from the virtualenv, named no handler module: the entry point serves the
    inventory's. Its output goes to ``cwd/worker.log``, printed if the test fails."""
    log = cwd / "worker.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [installed.worker, "run"], cwd=cwd, env=environ(settings), stdout=out, stderr=out
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        print(log.read_text(errors="replace"))


async def publish_twice(settings: Settings, routing_key: str, body: object, key: str) -> None:
    """A producer sending the same message twice (a retry after a lost confirm, say)."""
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)
        for _ in range(2):
            message = aio_pika.Message(
                json.dumps(body).encode(),
                content_type="application/json",
                headers={"idempotency-key": key},
            )
            await exchange.publish(message, routing_key=routing_key)


async def handled(settings: Settings, handler: str) -> Counter[str]:
    """How the worker's deliveries to ``handler`` ended so far, read from its ``/metrics``
    (``worker_messages_total`` by outcome); nothing while it is not serving yet."""
    try:
        page = (await request(settings.http_port, "/metrics")).body.decode()
    except OSError:
        return Counter()
    prefix = f'worker_messages_total{{handler="{handler}",outcome="'
    return Counter(
        {
            outcome: int(float(value))
            for line in page.splitlines()
            if line.startswith(prefix)
            for outcome, value in [line.removeprefix(prefix).split('"} ')]
        }
    )


def alembic(installed: Installed, package: Path, env: dict[str, str], *args: str) -> str:
    """``alembic -n inventory args`` in ``package``, as its reader runs it; its output. The
    virtualenv reaches Alembic through the test environment, where it has no script."""
    done = run(installed.python, "-m", "alembic", "-n", "inventory", *args, cwd=package, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


async def test_the_service_migrates_and_runs_from_its_installed_package(
    installed: Installed, service: Settings, tmp_path: Path
) -> None:
    # Given the worker and the inventory package installed, migrated with no --handlers
    migrated = await asyncio.to_thread(
        run, installed.worker, "migrate", cwd=tmp_path, env=environ(service)
    )
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    assert "'stock.received', 'stock.reserved'" in migrated.stderr  # (bound to the queue)

    # Then Alembic, from the package's alembic.ini, finds its migration equal to its tables
    checked = await asyncio.to_thread(
        alembic, installed, installed.package, environ(service), "check"
    )
    assert "No new upgrade operations detected" in checked

    # When the worker runs and a producer sends one stock.received twice, under one key
    announced: list[object] = []
    async with events(service, "stock.changed") as changes:

        async def relayed() -> bool:
            while (message := await changes.get(fail=False, no_ack=True)) is not None:
                announced.append(json.loads(message.body))
            return bool(announced)

        async def handled_both() -> bool:
            ended = await handled(service, "stock.received")
            return ended["processed"] + ended["duplicate"] >= 2

        with worker_running(installed, service, tmp_path) as worker:
            await publish_twice(service, "stock.received", {"sku": "apple", "quantity": 5}, "d1")
            await wait_until(handled_both, timeout=60)

            # Then one is processed and the other acked as its duplicate, and the event relayed
            assert await handled(service, "stock.received") == {"processed": 1, "duplicate": 1}
            await wait_until(relayed, timeout=60)

            # And the worker stops cleanly on SIGTERM
            worker.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(worker.wait, 60) == 0
        await relayed()  # (anything published since)

    # And the stock was received once, and announced once
    assert announced == [{"sku": "apple", "on_hand": 5}]
    engine = create_engine(service, application_name="getting-started-test")
    try:
        assert await rows(engine, "SELECT sku, on_hand FROM stock_levels") == [("apple", 5)]
        assert await rows(engine, "SELECT key FROM inbox") == [("d1",)]
        assert await rows(engine, "SELECT id FROM outbox") == []
    finally:
        await engine.dispose()


def test_the_packages_own_tests_pass(installed: Installed) -> None:
    # When its reader runs pytest in the package (its tests need WORKER_DATABASE_URL alone)
    tested = run(
        installed.python,
        "-I",  # (as the pytest script: the package is imported from where it is installed)
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        cwd=installed.package,
        env=environ(WORKER_DATABASE_URL=BASE.database_url),
    )

    # Then they pass, with the worker's pytest plugin as their only setup
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "passed" in tested.stdout
    assert "skipped" not in tested.stdout


def test_alembic_writes_the_packages_next_revision(
    installed: Installed, database: Settings, tmp_path: Path
) -> None:
    # Given the package's tables at head, and a column added to its metadata
    package = copy_tree(installed.package, PACKAGE_FILES, tmp_path / "inventory")
    env = environ(WORKER_DATABASE_URL=database.database_url)
    alembic(installed, package, env, "upgrade", "head")
    tables = package / "inventory" / "tables.py"
    column = '    Column("on_hand", Integer, nullable=False),\n'
    assert column in tables.read_text()
    tables.write_text(tables.read_text().replace(column, column + '    Column("bin", Text),\n'))

    # When Alembic autogenerates a revision
    alembic(
        installed,
        package,
        env,
        "revision",
        "--autogenerate",
        "--rev-id",
        "inventory_0002",
        "-m",
        "stock bins",
    )

    # Then it is the next one of the package's history, in the package, and adds the column
    (revision,) = (package / "inventory" / "migrations" / "versions").glob("inventory_0002_*.py")
    assert "down_revision: str | None = 'inventory_0001'" in revision.read_text()
    assert "add_column('stock_levels', sa.Column('bin'" in revision.read_text()
    alembic(installed, package, env, "upgrade", "head")
    assert "No new upgrade operations detected" in alembic(installed, package, env, "check")
