"""The migrations build exactly the tables the code declares, and undo cleanly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from examples.payments import router as payments
from examples.payments.tables import metadata as payments_metadata
from tests.integration.support import (
    BASE,
    inspect_database,
    require_services,
    schema_diff,
    table_names,
)
from worker import schema, testing
from worker.settings import Settings
from worker.sql import tables


@pytest.fixture
def empty_database() -> Iterator[Settings]:
    require_services()
    with testing.empty_database(BASE, prefix="worker_migrations") as empty:
        yield empty


def test_upgrade_from_empty_matches_the_metadata_and_downgrade_removes_it(
    empty_database: Settings,
) -> None:
    # When every migration runs on an empty database
    schema.upgrade(empty_database, payments)

    # Then the tables are exactly what the code declares
    assert inspect_database(empty_database, schema_diff(tables.metadata)) == []
    assert inspect_database(empty_database, schema_diff(payments_metadata)) == []
    assert inspect_database(empty_database, table_names) == {
        "inbox",
        "process_samples",
        "console_audit",
        "outbox",
        "outbox_parked",
        "outbox_scheduled",
        "workflow_steps",
        "workflow_waits",
        "workflow_signals",
        "ingress_requests",
        "dead_letters",
        "accounts",
        "ledger_entries",
        "settlement_notices",
        "alembic_version",
        "alembic_version_payments",
    }

    # And downgrading to base removes them, after which upgrading works again
    schema.downgrade(empty_database, payments)
    assert inspect_database(empty_database, table_names) <= {
        "alembic_version",
        "alembic_version_payments",
    }
    schema.upgrade(empty_database, payments)
    assert {"inbox", "accounts"} <= inspect_database(empty_database, table_names)


def test_the_worker_history_alone_leaves_handler_tables_to_their_own(
    empty_database: Settings,
) -> None:
    schema.upgrade(empty_database)  # no handler modules
    assert inspect_database(empty_database, table_names) == {
        "inbox",
        "outbox",
        "outbox_parked",
        "outbox_scheduled",
        "workflow_steps",
        "workflow_waits",
        "workflow_signals",
        "ingress_requests",
        "dead_letters",
        "process_samples",
        "console_audit",
        "alembic_version",
    }
