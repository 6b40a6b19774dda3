"""The pytest plugin as a user meets it: a project of their own whose pytest configuration names
its handler module, and tests that take ``worker_harness`` and ``worker_engine`` and nothing
else, run by pytest in a subprocess against the real PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.support import BASE, require_services

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
[pytest]
worker_handlers = examples.payments
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
"""

TESTS = """\
from sqlalchemy import text

BODY = {"payment_id": "p1", "account": "alice", "amount_cents": 100}


async def test_paying_twice_charges_once(worker_harness):
    first = await worker_harness.deliver("payment.requested", BODY, key="p1")
    again = await worker_harness.deliver("payment.requested", BODY, key="p1")
    assert (first.outcome, again.outcome) == ("processed", "duplicate")
    assert [e.routing_key for e in worker_harness.published] == ["payment.settled"]


async def test_each_test_starts_from_empty_tables(worker_harness, worker_engine):
    again = await worker_harness.deliver("payment.requested", BODY, key="p1")
    assert again.outcome == "processed"
    async with worker_engine.connect() as conn:
        balance = await conn.scalar(text("SELECT balance_cents FROM accounts"))
    assert balance == 100


async def test_a_reused_payment_is_parked(worker_harness):
    await worker_harness.deliver("payment.requested", BODY, key="p1")
    reused = await worker_harness.deliver("payment.requested", BODY, key="p2")
    assert reused.outcome == "dead_lettered"
    assert [d.key for d in worker_harness.dead_letters] == ["p2"]
"""


def pytest_in(project: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest run on ``project`` from inside it, as its owner would, with no ``WORKER_*``
    variable but those of ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")} | env
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project)],
        cwd=project,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_users_tests_need_only_the_fixtures(tmp_path: Path) -> None:
    require_services()
    (tmp_path / "pytest.ini").write_text(CONFIG)
    (tmp_path / "test_payments.py").write_text(TESTS)
    result = pytest_in(tmp_path, WORKER_DATABASE_URL=BASE.database_url, PYTHONPATH=str(ROOT))

    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_without_handler_modules_the_fixtures_say_what_to_set(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    (tmp_path / "test_x.py").write_text("def test_x(worker_router):\n    pass\n")
    result = pytest_in(tmp_path)
    assert result.returncode != 0
    assert "worker_handlers = your.module" in result.stdout + result.stderr
