"""How long a unit of work waits on PostgreSQL: its own steps (the claim, the end of the batch
and the commit) at most ``database_timeout``, and then it fails transiently with nothing
committed; a handler's own statements as long as they take, unless the handler bounds them."""

from __future__ import annotations

import time

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import envelope, scalar
from worker import Context, Router
from worker.core.config import UnitOfWorkConfig
from worker.core.outcomes import Outcome
from worker.core.unit_of_work import process
from worker.errors import HandlerFailed, is_transient

BOUND = UnitOfWorkConfig(exchange="events", database_timeout=0.5)
"""A unit of work whose own steps may wait on PostgreSQL half a second each."""

router = Router()


@router.handler("slow.query")
async def slow_query(body: dict[str, float], ctx: Context) -> None:
    """A handler's own long query: four times the unit of work's bound."""
    await ctx.connection.execute(text("SELECT pg_sleep(:s)"), {"s": body["seconds"]})


@router.handler("bounded.query")
async def bounded_query(body: dict[str, float], ctx: Context) -> None:
    """A handler that bounds its own statements, as any handler may."""
    await ctx.connection.execute(text("SET LOCAL statement_timeout = '200ms'"))
    await ctx.connection.execute(text("SELECT pg_sleep(:s)"), {"s": body["seconds"]})


async def test_a_handlers_long_query_is_not_cut_by_the_units_own_bound(
    engine: AsyncEngine,
) -> None:
    # Given a unit of work bounded at 0.5 s a step, and a handler whose query takes 2 s
    env = envelope(router, "slow.query", {"seconds": 2.0}, "slow-1")

    # When it runs: Then the query runs to its end and the message is processed
    assert await process(engine, env, BOUND) is Outcome.PROCESSED
    assert await scalar(engine, "SELECT status FROM inbox WHERE key = 'slow-1'") == "completed"


async def test_a_handler_bounds_its_own_statements_with_a_statement_timeout(
    engine: AsyncEngine,
) -> None:
    # Given a handler that sets statement_timeout in its transaction, and a query beyond it
    env = envelope(router, "bounded.query", {"seconds": 2.0}, "bounded-1")

    # When it runs: Then its query is cut by its own bound, and nothing commits
    with pytest.raises(HandlerFailed) as failed:
        await process(engine, env, BOUND)
    assert isinstance(failed.value.__cause__, Exception)
    assert "statement timeout" in str(failed.value.__cause__)
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE key = 'bounded-1'") == 0


async def test_a_claim_that_waits_past_the_bound_fails_transiently_and_commits_nothing(
    engine: AsyncEngine, database_url: str
) -> None:
    # Given another session holding the key's inbox row (a claim not yet committed)
    env = envelope(router, "slow.query", {"seconds": 0.0}, "held-1")
    holder = await asyncpg.connect(database_url)
    holding = holder.transaction()
    await holding.start()
    try:
        await holder.execute(
            "INSERT INTO inbox (handler, key, fingerprint, status, routing_key) "
            "VALUES ('slow.query', 'held-1', '\\x00', 'completed', 'slow.query')"
        )
        # When a unit of work claims the same key: Then it gives up after the bound
        started = time.monotonic()
        with pytest.raises(TimeoutError) as timed_out:
            await process(engine, env, BOUND)
        waited = time.monotonic() - started
        assert is_transient(timed_out.value)
        assert 0.5 <= waited < 10, waited  # (0.5 s, and a rollback, on a busy machine)
    finally:
        await holding.rollback()
        await holder.close()

    # And once the row is released, the message is processed as usual
    assert await process(engine, env, BOUND) is Outcome.PROCESSED
