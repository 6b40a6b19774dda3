"""The migrations build exactly the tables the code declares, and undo cleanly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from examples.payments import router as payments
from examples.payments.tables import metadata as payments_metadata
from tests.conftest import BASE, _require_services
from worker import schema, testing
from worker.settings import Settings
from worker.sql import tables


@pytest.fixture
def empty_database() -> Iterator[Settings]:
    _require_services()
    with testing.empty_database(BASE, prefix="worker_migrations") as empty:
        yield empty


def _inspect(settings: Settings, fn: Any) -> Any:
    async def go() -> Any:
        engine = create_async_engine(settings.sqlalchemy_url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(fn)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _diff(metadata: MetaData) -> Any:
    def compare(conn: Connection) -> list[Any]:
        context = MigrationContext.configure(
            conn,
            opts={"compare_type": True, "include_object": schema.own_objects_only},
        )
        return list(compare_metadata(context, metadata))

    return compare


def _tables(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


def test_upgrade_from_empty_matches_the_metadata_and_downgrade_removes_it(
    empty_database: Settings,
) -> None:
    # When every migration runs on an empty database
    schema.upgrade(empty_database, payments)

    # Then the tables are exactly what the code declares
    assert _inspect(empty_database, _diff(tables.metadata)) == []
    assert _inspect(empty_database, _diff(payments_metadata)) == []
    assert _inspect(empty_database, _tables) == {
        "inbox",
        "outbox",
        "outbox_parked",
        "workflow_steps",
        "accounts",
        "ledger_entries",
        "settlement_notices",
        "alembic_version",
        "alembic_version_payments",
    }

    # And downgrading to base removes them, after which upgrading works again
    schema.downgrade(empty_database, payments)
    assert _inspect(empty_database, _tables) <= {"alembic_version", "alembic_version_payments"}
    schema.upgrade(empty_database, payments)
    assert {"inbox", "accounts"} <= _inspect(empty_database, _tables)


def test_the_worker_history_alone_leaves_handler_tables_to_their_own(
    empty_database: Settings,
) -> None:
    schema.upgrade(empty_database)  # no handler modules
    assert _inspect(empty_database, _tables) == {
        "inbox",
        "outbox",
        "outbox_parked",
        "workflow_steps",
        "alembic_version",
    }
