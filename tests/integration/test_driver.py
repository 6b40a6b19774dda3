"""``sql.driver.in_transaction``: the asyncpg connection the hot path writes on is inside the
caller's SQLAlchemy transaction, and a connection without one is refused."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import scalar
from worker.settings import Settings
from worker.sql.driver import NotInTransaction, _begin, in_transaction

INSERT = "INSERT INTO accounts (account, balance_cents) VALUES ($1, 1)"


async def test_a_transaction_that_sent_nothing_yet_is_begun_and_commits_with_sqlalchemy(
    engine: AsyncEngine,
) -> None:
    async with engine.connect() as conn, conn.begin():
        driver = await in_transaction(conn)
        assert driver.is_in_transaction()
        await driver.execute(INSERT, "raw")
        await conn.execute(text("INSERT INTO accounts VALUES ('core', 1)"))
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 2


async def test_the_driver_rolls_back_with_sqlalchemy(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        transaction = await conn.begin()
        driver = await in_transaction(conn)
        await driver.execute(INSERT, "raw")
        await transaction.rollback()
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 0


async def test_a_connection_without_a_transaction_is_refused(
    engine: AsyncEngine, settings: Settings
) -> None:
    async with engine.connect() as conn:
        with pytest.raises(NotInTransaction):
            await in_transaction(conn)
    raw = await asyncpg.connect(settings.database_url)
    try:
        with pytest.raises(NotInTransaction):
            await in_transaction(raw)
        async with raw.transaction():
            assert await in_transaction(raw) is raw
    finally:
        await raw.close()


async def test_without_the_adapters_coroutine_a_statement_begins_the_transaction(
    engine: AsyncEngine,
) -> None:
    # Given an SQLAlchemy whose asyncpg adapter has no _start_transaction (another version)
    async with engine.connect() as conn, conn.begin():
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        assert driver is not None
        assert not driver.is_in_transaction()

        # When the driver is asked for, SQLAlchemy is made to begin by a statement of its own
        await _begin(conn, object())

        # Then the driver is inside SQLAlchemy's transaction
        assert driver.is_in_transaction()
        await driver.execute(INSERT, "fallback")
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 1
