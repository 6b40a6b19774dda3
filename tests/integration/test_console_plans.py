"""The console's reads, planned by the real PostgreSQL on tables of 20,000 rows each: none reads
a whole table (no ``Seq Scan``), so a console left open costs the same whatever the size of the
inbox, the outbox and the workflows' tables.

``CONSOLE_READS`` names each statement a console page runs to read, built by the SQL module's
``*_query`` function that its reader runs too; a page that reads something new adds a line
here. With ``WORKER_WRITE_PLANS=1`` the test writes the plans (``EXPLAIN (COSTS OFF)``) to
``docs/console-plans.txt``; otherwise it checks that the file names every read (it is
regenerated when one is added) and compares nothing else in it: plans vary with the
statistics and the server's version, "no Seq Scan" does not.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement, Executable

from worker.sql import audit, inspection, lookup

ROWS = 20_000
CAP = 4096
PAGE = 200
WINDOW = ROWS // 20
"""The window a page of one routing key reads (``outbox.SCAN_ROWS`` in the console, sized for
an outbox of millions): here a twentieth of the tables, so that it is planned as it is on a
large outbox, as a range of the index under a LIMIT (a window of half a table is read faster
by a sequential scan, and the planner rightly takes one)."""
A_MOMENT = datetime(2024, 1, 1, tzinfo=UTC)
PLANS_FILE = Path(__file__).resolve().parents[2] / "docs" / "console-plans.txt"
WATCHED_TABLES = (
    "inbox",
    "workflow_steps",
    "workflow_waits",
    "outbox",
    "outbox_scheduled",
    "outbox_parked",
    "console_audit",
)

CONSOLE_READS: dict[str, Callable[[], Any]] = {
    "outbox: counts by state": inspection.outbox_counts_query,
    **{
        f"outbox: {state} rows": (lambda state=state: inspection.entries_query(state, PAGE))
        for state in inspection.OUTBOX_STATES
    },
    **{
        f"outbox: {state} rows, next page": (
            lambda state=state: inspection.entries_query(
                state, PAGE, after=inspection.OutboxCursor(A_MOMENT, ROWS // 2)
            )
        )
        for state in inspection.OUTBOX_STATES
    },
    **{
        f"outbox: {state} rows of a routing key": (
            lambda state=state: inspection.entries_query(
                state, PAGE, routing_key="rk-7", scan=WINDOW
            )
        )
        for state in inspection.OUTBOX_STATES
    },
    **{
        f"outbox: where a window of {state} rows ends": (
            lambda state=state: inspection.scan_end_query(state, WINDOW)
        )
        for state in inspection.OUTBOX_STATES
    },
    **{
        f"outbox: {state} rows ticked": (
            lambda state=state: inspection.entries_query(state, PAGE, ids=[5, 500, 5000])
        )
        for state in inspection.OUTBOX_STATES
    },
    **{
        f"outbox: a row of {table}": (
            lambda table=table: lookup.outbox_row_query(table, ROWS // 3, CAP)
        )
        for table in lookup.OUTBOX_TABLES
    },
    "inbox: a key": lambda: lookup.inbox_entry_query("h-3", "k-33", CAP),
    "inbox: a workflow's steps": lambda: lookup.workflow_steps_query("h-3", "k-33", PAGE, CAP),
    "inbox: a workflow's waits": lambda: lookup.workflow_waits_query("h-3", "k-33", PAGE, CAP),
    "inbox: the keys updated last": lambda: lookup.recent_keys_query(20),
    "audit: the newest page": lambda: audit.page_query(before=None, limit=100),
    "audit: an older page": lambda: audit.page_query(before=ROWS // 2, limit=100),
}
"""Each read of the console, by what it reads (the plans file's headings)."""


class Explain(Executable, ClauseElement):
    """``EXPLAIN (COSTS OFF) <statement>``, with the statement's parameters bound as it runs."""

    inherit_cache = False

    def __init__(self, statement: Any) -> None:
        self.statement = statement


@compiles(Explain, "postgresql")
def _explain(element: Explain, compiler: SQLCompiler, **kw: Any) -> str:
    return "EXPLAIN (COSTS OFF) " + compiler.process(element.statement, **kw)


FILL = [
    "INSERT INTO inbox (handler, key, fingerprint, status, routing_key, result, error,"
    " updated_at) SELECT 'h-' || n % 10, 'k-' || n, '\\x00', CASE WHEN n % 50 = 0 THEN"
    " 'failed' WHEN n % 10 = 3 THEN 'in_progress' ELSE 'completed' END, 'rk-' || n % 20,"
    " jsonb_build_object('n', n), NULL, now() - make_interval(secs => n)"
    " FROM generate_series(1, :rows) AS n",
    "INSERT INTO workflow_steps (handler, key, step, position, output)"
    " SELECT 'h-3', 'k-' || n, 'step-' || s, s, jsonb_build_object('s', s)"
    " FROM generate_series(3, :rows, 10) AS n, generate_series(1, 5) AS s",
    "INSERT INTO workflow_waits (handler, key, name, routing_key, correlation, due_at,"
    " timer_id, resume_exchange, resume_routing_key, resume_body, resume_content_type,"
    " resume_headers, outcome, resolved_at) SELECT 'h-3', 'k-' || n, 'wait', 'signal',"
    " 'c-' || n, now() + interval '1 h', gen_random_uuid(), 'events', 'resume', '\\x00',"
    " 'application/json', '{}', CASE WHEN n % 20 = 3 THEN NULL ELSE 'event' END,"
    " CASE WHEN n % 20 = 3 THEN NULL ELSE now() END FROM generate_series(3, :rows, 10) AS n",
    "INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, attempts,"
    " last_error, available_at) SELECT gen_random_uuid(), 'events', 'rk-' || n % 20, '\\x00',"
    " 'application/json', n % 2, CASE WHEN n % 2 = 1 THEN 'returned' END,"
    " now() + make_interval(secs => CASE WHEN n % 2 = 1 THEN n ELSE -n END)"
    " FROM generate_series(1, :rows) AS n",
    "INSERT INTO outbox_scheduled (message_id, exchange, routing_key, body, content_type,"
    " due_at) SELECT gen_random_uuid(), 'events', 'rk-' || n % 20, '\\x00', 'application/json',"
    " now() + make_interval(secs => n) FROM generate_series(1, :rows) AS n",
    "INSERT INTO outbox_parked (id, message_id, exchange, routing_key, body, content_type,"
    " headers, attempts, last_error, created_at) SELECT n, gen_random_uuid(), 'events',"
    " 'rk-' || n % 20, '\\x00', 'application/json', '{}', 5, 'returned', now()"
    " FROM generate_series(1, :rows) AS n",
    "INSERT INTO console_audit (actor, role, action, target, count, outcome)"
    " SELECT 'olivia', 'operator', 'outbox.retry', 'ids ' || n, 1, 'done'"
    " FROM generate_series(1, :rows) AS n",
]


async def plans(engine: AsyncEngine) -> dict[str, str]:
    """Each of ``CONSOLE_READS``, planned."""
    planned = {}
    async with engine.connect() as conn:
        for name, build in CONSOLE_READS.items():
            lines = await conn.execute(Explain(build()))
            planned[name] = "\n".join(line for (line,) in lines)
    return planned


async def test_no_read_of_the_console_scans_a_whole_table(engine: AsyncEngine) -> None:
    # Given 20,000 rows in each table the console reads, analyzed
    async with engine.begin() as conn:
        for fill in FILL:
            await conn.execute(text(fill), {"rows": ROWS})
    async with engine.connect() as conn:
        autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await autocommit.execute(text(f"ANALYZE {', '.join(WATCHED_TABLES)}"))

    # When each read of the console is planned
    planned = await plans(engine)

    # Then none reads a whole table: each is a primary key's or an index's range
    for name, plan in planned.items():
        assert "Seq Scan" not in plan, f"{name}:\n{plan}"
        assert "Index" in plan, f"{name}:\n{plan}"
    # And the plans the docs show name every read (WORKER_WRITE_PLANS=1 writes them)
    if os.environ.get("WORKER_WRITE_PLANS") == "1":
        PLANS_FILE.write_text(plans_text(planned))
    written = PLANS_FILE.read_text()
    missing = [name for name in planned if f"\n## {name}\n" not in written]
    assert not missing, f"{PLANS_FILE} lacks {missing}: run with WORKER_WRITE_PLANS=1"


def plans_text(planned: dict[str, str]) -> str:
    """The plans file: a heading per read, then its plan."""
    head = (
        "# The worker console's reads, as PostgreSQL plans them on tables of "
        f"{ROWS:,} rows each\n"
        "# (EXPLAIN (COSTS OFF); written by tests/integration/test_console_plans.py with\n"
        "# WORKER_WRITE_PLANS=1, which also checks that none has a Seq Scan).\n"
    )
    return head + "".join(f"\n## {name}\n{plan}\n" for name, plan in planned.items())
