"""A handler module for process-level tests: it writes, then waits on an advisory lock that the
test holds, so the test can kill the worker while the transaction is open."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from worker import Context, Router

router = Router()


@router.handler("blocking.credit")
async def credit_then_wait(body: dict[str, Any], ctx: Context) -> None:
    await ctx.connection.execute(
        text(
            "INSERT INTO accounts VALUES (:account, :cents) ON CONFLICT (account) DO UPDATE"
            " SET balance_cents = accounts.balance_cents + excluded.balance_cents"
        ),
        {"account": body["account"], "cents": body["amount_cents"]},
    )
    await ctx.connection.execute(
        text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": body["lock"]}
    )
