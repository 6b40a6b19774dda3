"""The worker's pytest plugin: fixtures to test your handler modules against a real PostgreSQL.

Installed with the worker (a ``pytest11`` entry point), it is active in every pytest run of the
environment and does nothing until a test asks for one of its fixtures:

- ``worker_router``: your handler modules, named by the ``worker_handlers`` ini option (or
  ``WORKER_HANDLERS``); override the fixture to return a ``Router`` yourself.
- ``worker_settings``: ``Settings`` pointing at a scratch database (created beside
  ``WORKER_DATABASE_URL`` for the test session, migrated for the worker and your modules, dropped
  at the end).
- ``worker_engine``: an engine on it; every table of the worker and of your modules is emptied
  before each test that takes it, so no test sees another's keys or rows.
- ``worker_harness``: a ``worker.testing.Harness`` on that engine: ``await
  worker_harness.deliver(routing_key, body, key=...)`` runs your handler exactly as the worker
  would (checks, inbox claim, one transaction, outbox), ``published`` holds the events it
  emitted and ``dead_letters`` what it parked.

The async fixtures need pytest-asyncio (they are declared with ``pytest_asyncio.fixture``, so
they work in its strict mode too); without it, only the synchronous ones are offered.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.router import Router
from worker.database import create_engine
from worker.settings import Settings
from worker.sql.tables import metadata as worker_metadata
from worker.testing import Harness, scratch_database

HANDLERS_INI = "worker_handlers"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        HANDLERS_INI,
        "handler modules the worker fixtures serve (module or module:router), as --handlers",
        type="args",
        default=[],
    )


@pytest.fixture(scope="session")
def worker_router(pytestconfig: pytest.Config) -> Router:
    """The handler modules named by the ``worker_handlers`` ini option, else by
    ``WORKER_HANDLERS`` (installed entry points are not added: a test names what it tests)."""
    from worker.ops.plugins import load_routers

    named: list[str] = list(pytestconfig.getini(HANDLERS_INI))
    if not named:
        named = list(Settings.load().handlers)
    if not named:
        raise pytest.UsageError(
            f"the worker fixtures need your handler modules: set `{HANDLERS_INI} = your.module` "
            "in the pytest configuration, or WORKER_HANDLERS, or override the worker_router "
            "fixture"
        )
    return load_routers(named, include_installed=False)


@pytest.fixture(scope="session")
def worker_settings(worker_router: Router) -> Iterator[Settings]:
    """Settings for a scratch database migrated for the worker and ``worker_router``'s modules,
    created beside ``WORKER_DATABASE_URL`` for the session and dropped after it."""
    with scratch_database(Settings.load(), worker_router, prefix="worker_pytest") as scratch:
        yield scratch


def tables_of(router: Router) -> list[Table]:
    """Every table of the worker and of ``router``'s modules: what ``worker_engine`` empties."""
    tables = list(worker_metadata.sorted_tables)
    for module in router.with_migrations():
        if module.metadata is not None:
            tables += module.metadata.sorted_tables
    return list(dict.fromkeys(tables))


if importlib.util.find_spec("pytest_asyncio") is not None:  # (else the sync fixtures only)
    import pytest_asyncio

    @pytest_asyncio.fixture
    async def worker_engine(
        worker_settings: Settings, worker_router: Router
    ) -> AsyncIterator[AsyncEngine]:
        """An engine on the scratch database, every table emptied before the test."""
        engine = create_engine(worker_settings, application_name="worker-pytest", pool_size=2)
        try:
            preparer = engine.dialect.identifier_preparer
            quoted = ", ".join(preparer.format_table(table) for table in tables_of(worker_router))
            async with engine.begin() as conn:
                await conn.exec_driver_sql(f"TRUNCATE {quoted}")
            yield engine
        finally:
            await engine.dispose()

    @pytest_asyncio.fixture
    async def worker_harness(
        worker_router: Router, worker_engine: AsyncEngine, worker_settings: Settings
    ) -> Harness:
        """A ``Harness`` for ``worker_router`` on clean tables, fresh for each test."""
        return Harness.from_settings(worker_router, worker_engine, worker_settings)
