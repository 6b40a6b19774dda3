"""Client CPU per message of a plain handler's two Core statements, through SQLAlchemy's own
``AsyncConnection`` and through ``ctx.connection``'s fast path (``worker.core.connection``).

The statements are the benchmark's ``settle_one``'s (``benchmarks.throughput``): a ledger row
inserted ``ON CONFLICT DO NOTHING RETURNING``, then the balance upserted, built at each call
(``sa``, ``fast``) or built once with ``bindparam``s (``sa-pre``, ``fast-pre``). Each variant runs
``--messages`` messages in one transaction, in alternating rounds; the figures are this process's
CPU time (its socket writes included) and wall time per message: PostgreSQL's work is the same
for all four, so the differences are the client's.

A fresh database ``worker_bench_<hex>`` is created next to the one in ``WORKER_DATABASE_URL``,
migrated and dropped at the end; no broker is needed. From the repository root::

    .venv/bin/python -m benchmarks.execute_path [--messages 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from examples.payments import router as payments_router
from examples.payments.tables import accounts, ledger_entries
from worker.core.connection import HandlerConnection
from worker.database import create_engine
from worker.settings import Settings
from worker.sql.driver import in_transaction
from worker.testing import scratch_database

Settle = Callable[[AsyncConnection, str, str, int], Awaitable[None]]


async def settle_built_per_call(
    conn: AsyncConnection, payment: str, account: str, amount: int
) -> None:
    """``settle_one``'s two statements, built at each call."""
    recorded = await conn.execute(
        insert(ledger_entries)
        .values(payment_id=payment, account=account, amount_cents=amount)
        .on_conflict_do_nothing()
        .returning(ledger_entries.c.payment_id)
    )
    if recorded.first() is not None:
        new = insert(accounts).values(account=account, balance_cents=amount)
        await conn.execute(
            new.on_conflict_do_update(
                index_elements=[accounts.c.account],
                set_={"balance_cents": accounts.c.balance_cents + new.excluded.balance_cents},
            )
        )


RECORD = (
    insert(ledger_entries)
    .values(payment_id=bindparam("p"), account=bindparam("a"), amount_cents=bindparam("m"))
    .on_conflict_do_nothing()
    .returning(ledger_entries.c.payment_id)
)
_NEW = insert(accounts).values(account=bindparam("a"), balance_cents=bindparam("m"))
ADD = _NEW.on_conflict_do_update(
    index_elements=[accounts.c.account],
    set_={"balance_cents": accounts.c.balance_cents + _NEW.excluded.balance_cents},
)


async def settle_built_once(conn: AsyncConnection, payment: str, account: str, amount: int) -> None:
    """The same two statements, built once, executed with parameters."""
    values: dict[str, Any] = {"p": payment, "a": account, "m": amount}
    if (await conn.execute(RECORD, values)).first() is not None:
        await conn.execute(ADD, values)


VARIANTS: dict[str, tuple[Settle, bool]] = {
    "sa": (settle_built_per_call, False),
    "fast": (settle_built_per_call, True),
    "sa-pre": (settle_built_once, False),
    "fast-pre": (settle_built_once, True),
}
"""Name: (handler body, on the fast path)."""


async def run_variant(
    engine: AsyncEngine, name: str, messages: int, round_: int
) -> tuple[float, float]:
    """CPU and wall seconds per message of ``messages`` messages of ``name``, in one transaction."""
    settle, fast = VARIANTS[name]
    async with engine.connect() as conn, conn.begin():
        driver = await in_transaction(conn)
        target = HandlerConnection(conn, driver) if fast else conn
        await settle(target, f"warm-{name}-{round_}", "warm", 1)  # compiled, prepared
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(messages):
            await settle(target, f"{name}-{round_}-{i}", f"account-{i % 1000}", 1)
        return (time.process_time() - cpu) / messages, (time.perf_counter() - wall) / messages


async def measure(settings: Settings, messages: int, rounds: int) -> None:
    engine = create_engine(settings, application_name="worker-bench-execute-path")
    try:
        for round_ in range(rounds):
            for name in VARIANTS:
                cpu, wall = await run_variant(engine, name, messages, round_)
                print(
                    f"round {round_} {name:8s} cpu {cpu * 1e6:6.1f} µs/msg"
                    f"  wall {wall * 1e6:6.1f} µs/msg",
                    flush=True,
                )
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000, help="messages per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    options = parser.parse_args()
    with scratch_database(Settings.load(), payments_router, prefix="worker_bench") as settings:
        asyncio.run(measure(settings, options.messages, options.rounds))


if __name__ == "__main__":
    main()
