"""``ctx.connection`` / ``ctx.session``'s fast path (``core.connection``, ``sql.compiled``) against
the real PostgreSQL: every statement is run both ways, through SQLAlchemy's own
``AsyncConnection`` and through ``HandlerConnection``, and both answer the same — rows, keys,
row counts, exceptions and how the worker classifies them — whether the fast path took the
statement or handed it back to SQLAlchemy."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import sqlalchemy.exc
from sqlalchemy import (
    JSON,
    Column,
    Enum,
    Integer,
    MetaData,
    Numeric,
    Table,
    Text,
    bindparam,
    delete,
    event,
    func,
    insert,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Result
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import registry

from examples.payments.tables import accounts, ledger_entries
from tests.helpers import scalar, wait_until
from worker.core.connection import HandlerConnection, HandlerSession
from worker.core.context import Context
from worker.errors import Fault, classify, is_contention, unusable_connection_is_a_disconnect
from worker.sql.compiled import FastResult
from worker.sql.driver import in_transaction


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


scratch = MetaData()
things = Table(
    "things",
    scratch,
    Column("id", Text, primary_key=True),
    Column("doc", JSON),
    Column("color", Enum(Color, native_enum=False)),
    Column("price", Numeric(10, 2)),
)
counters = Table(
    "counters",
    scratch,
    Column("id", Integer, primary_key=True),
    Column("name", Text),
    Column("n", Integer, default=lambda: 41 + 1),
)
COUNTERS = "CREATE TEMP TABLE counters (id serial PRIMARY KEY, name text, n int) ON COMMIT DROP"
THINGS = (
    "CREATE TEMP TABLE things (id text PRIMARY KEY, doc json, color varchar(4),"
    " price numeric(10, 2)) ON COMMIT DROP"
)
RAISE = (
    "CREATE FUNCTION pg_temp.raise_state(state text) RETURNS int LANGUAGE plpgsql AS"
    " $$ BEGIN RAISE EXCEPTION 'raised %', state USING ERRCODE = state; END $$"
)


class Account:
    """An ORM entity over the payments example's ``accounts``."""

    account: str
    balance_cents: int

    def __init__(self, account: str, balance_cents: int) -> None:
        self.account = account
        self.balance_cents = balance_cents


registry().map_imperatively(Account, accounts)


@pytest.fixture
async def both(engine: AsyncEngine) -> AsyncIterator[tuple[AsyncConnection, HandlerConnection]]:
    """SQLAlchemy's connection and the handler's, in one transaction that is rolled back."""
    async with engine.connect() as conn:
        transaction = await conn.begin()
        fast = HandlerConnection(conn, await in_transaction(conn))
        await conn.execute(text(THINGS))
        await conn.execute(text(RAISE))
        await conn.execute(text(COUNTERS))
        await conn.execute(
            insert(accounts),
            [{"account": f"a{i}", "balance_cents": i * 10} for i in range(5)],
        )
        yield conn, fast
        await transaction.rollback()


async def twice(
    both: tuple[AsyncConnection, HandlerConnection], statement: Any, params: Any = None
) -> tuple[Result[Any], Result[Any]]:
    slow, fast = both
    return await slow.execute(statement, params), await fast.execute(statement, params)


READS: dict[str, Callable[[Result[Any]], Any]] = {
    "first": lambda r: r.first(),
    "one": lambda r: r.one(),
    "one_or_none": lambda r: r.one_or_none(),
    "scalar": lambda r: r.scalar(),
    "scalar_one": lambda r: r.scalar_one(),
    "scalar_one_or_none": lambda r: r.scalar_one_or_none(),
    "scalars": lambda r: r.scalars().all(),
    "all": lambda r: r.all(),
    "mappings": lambda r: [dict(m) for m in r.mappings()],
    "fetchall": lambda r: r.fetchall(),
    "iteration": lambda r: [tuple(row) for row in r],
    "keys": lambda r: list(r.keys()),
    "attributes": lambda r: [(row.account, row.balance_cents) for row in r],
    "by column": lambda r: [row._mapping[accounts.c.balance_cents] for row in r],
}


@pytest.mark.parametrize("read", READS)
async def test_each_result_method_answers_as_sqlalchemy(
    both: tuple[AsyncConnection, HandlerConnection], read: str
) -> None:
    # Given a select of one row, and one of several
    one = select(accounts).where(accounts.c.account == "a3")
    many = select(accounts.c.account, accounts.c.balance_cents).order_by(accounts.c.account)
    for statement in (one, many):
        # When it runs both ways
        slow, fast = await twice(both, statement)
        # Then the fast path took it, and each read answers the same (or fails the same)
        assert isinstance(fast, FastResult)
        expected = _outcome(READS[read], slow)
        assert _outcome(READS[read], fast) == expected


def _outcome(read: Callable[[Result[Any]], Any], result: Result[Any]) -> Any:
    try:
        return read(result)
    except sqlalchemy.exc.SQLAlchemyError as exc:
        return type(exc)


async def test_returning_and_rowcount_answer_as_sqlalchemy(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given the benchmark's insert … on conflict do nothing returning, built per call
    def entry(payment_id: str) -> Any:
        return (
            pg_insert(ledger_entries)
            .values(payment_id=payment_id, account="a1", amount_cents=5)
            .on_conflict_do_nothing()
            .returning(ledger_entries.c.payment_id)
        )

    slow, fast = both
    # When a new row is inserted both ways, then inserted again
    assert (await slow.execute(entry("s"))).first() == ("s",)
    new = await fast.execute(entry("f"))
    assert isinstance(new, FastResult)
    assert (new.rowcount, new.first()) == (1, ("f",))
    again = await fast.execute(entry("f"))
    assert (again.rowcount, again.first()) == (0, None)
    # Then an update's row count, and its rows (none: a closed result), are SQLAlchemy's
    raise_all = update(accounts).values(balance_cents=accounts.c.balance_cents + 1)
    slow_update, fast_update = await twice(both, raise_all)
    assert isinstance(fast_update, FastResult)
    assert fast_update.rowcount == slow_update.rowcount == 5
    for result in (slow_update, fast_update):
        with pytest.raises(sqlalchemy.exc.ResourceClosedError):
            result.first()
    # And parameters given at execute, with bindparams, bind as SQLAlchemy binds them
    by_name = select(accounts.c.balance_cents).where(accounts.c.account == bindparam("name"))
    slow_row, fast_row = await twice(both, by_name, {"name": "a2"})
    assert isinstance(fast_row, FastResult)
    assert fast_row.scalar_one() == slow_row.scalar_one() == 22


async def test_json_enum_and_numeric_columns_read_back_the_same(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given a row with a JSON document, an Enum and a Numeric, written on the fast path
    slow, fast = both
    await fast.execute(
        insert(things).values(id="t1", doc={"a": [1, "x"]}, color=Color.BLUE, price="1.50")
    )
    # When each column is read back both ways (the fast path may hand some back)
    for column in (things.c.doc, things.c.color, things.c.price, things.c.id):
        slow_result, fast_result = await twice(both, select(column))
        # Then each reads the same value, of the same type
        expected = slow_result.scalar_one()
        got = fast_result.scalar_one()
        assert (got, type(got)) == (expected, type(expected))
    assert (await slow.execute(select(things.c.color))).scalar_one() is Color.BLUE


async def test_what_the_fast_path_does_not_cover_still_runs(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given statements the fast path hands back to SQLAlchemy: text(), IN lists, an ORM select,
    # executemany, execution options
    slow, fast = both
    cases: list[tuple[Any, Any]] = [
        (text("SELECT account FROM accounts ORDER BY account"), None),
        (select(accounts.c.account).where(accounts.c.account.in_(["a1", "a2"])), None),
        (select(Account).where(Account.account == "a1"), None),  # type: ignore[arg-type]
        (select(accounts.c.account).execution_options(logging_token="x"), None),
    ]
    for statement, params in cases:
        # When they run on the handler's connection
        result = await fast.execute(statement, params)
        # Then SQLAlchemy ran them, and they answer as on its own connection
        assert not isinstance(result, FastResult)
        assert result.all() == (await slow.execute(statement, params)).all()
    rows = [{"account": "m1", "balance_cents": 1}, {"account": "m2", "balance_cents": 2}]
    assert not isinstance(await fast.execute(insert(accounts), rows), FastResult)
    assert isinstance(fast, AsyncConnection)
    assert await fast.scalar(select(func.count()).select_from(accounts)) == 7


ERRORS = {
    "unique violation": None,
    "deadlock": "40P01",
    "serialization failure": "40001",
    "undefined table": "42P01",
}


@pytest.mark.parametrize("case", ERRORS)
async def test_driver_errors_raise_and_classify_as_sqlalchemy(
    both: tuple[AsyncConnection, HandlerConnection], case: str
) -> None:
    # Given a statement that PostgreSQL refuses with the case's SQLSTATE
    state = ERRORS[case]
    statement: Any = (
        insert(accounts).values(account="a1", balance_cents=1)
        if state is None
        else select(func.pg_temp.raise_state(state))
    )
    caught: list[BaseException] = []
    for conn in both:
        # When it runs each way, in a savepoint
        with pytest.raises(sqlalchemy.exc.DBAPIError) as raised:
            async with conn.begin_nested():
                await conn.execute(statement)
        caught.append(raised.value)
    # Then both raise the same exception types, classified the same way
    slow, fast = caught
    assert type(fast) is type(slow)
    assert type(fast.orig) is type(slow.orig)  # type: ignore[attr-defined]
    assert type(fast.__cause__) is type(slow.__cause__)
    assert type(fast.__cause__.__cause__) is type(slow.__cause__.__cause__)  # type: ignore[union-attr]
    assert fast.orig.sqlstate == slow.orig.sqlstate  # type: ignore[attr-defined]
    assert classify(fast) is classify(slow)
    assert (
        is_contention(fast)
        is is_contention(slow)
        is (case in ("deadlock", "serialization failure"))
    )


async def test_the_orm_session_sees_what_it_added(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given a handler's session on the handler's connection
    _, fast = both
    ctx = Context(fast, None, "events")  # type: ignore[arg-type]
    session = ctx.session
    assert isinstance(session, HandlerSession)
    try:
        # When it adds an entity and selects without flushing (autoflush: SQLAlchemy's path)
        session.add(Account("orm1", 7))
        pending = await session.execute(
            select(accounts.c.balance_cents).where(accounts.c.account == "orm1")
        )
        assert not isinstance(pending, FastResult)
        assert pending.scalar_one() == 7
        # and adds another, flushes, and selects with Core (clean: the fast path)
        session.add(Account("orm2", 8))
        await session.flush()
        flushed = await session.execute(
            select(accounts.c.balance_cents).where(accounts.c.account == "orm2")
        )
        # Then both are seen in the transaction, and by the ORM too
        assert isinstance(flushed, FastResult)
        assert flushed.scalar_one() == 8
        entity = (
            await session.execute(select(Account).where(Account.account == "orm2"))
        ).scalar_one()  # type: ignore[arg-type]
        assert entity.balance_cents == 8
    finally:
        await ctx.close()


async def test_generated_keys_python_defaults_and_missing_values_are_sqlalchemys(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given a table whose key the database generates and with a Python-side default
    slow, fast = both
    # When a row is inserted on the handler's connection
    inserted = await fast.execute(insert(counters).values(name="c"))
    # Then SQLAlchemy ran it: the generated key and the default are there
    assert not isinstance(inserted, FastResult)
    assert inserted.inserted_primary_key is not None
    [key] = inserted.inserted_primary_key
    assert (await slow.execute(select(counters.c.n).where(counters.c.id == key))).scalar() == 42
    # And a statement missing a bind value fails as SQLAlchemy fails it
    needs = select(accounts.c.account).where(accounts.c.account == bindparam("name"))
    caught = []
    for conn in both:
        with pytest.raises(sqlalchemy.exc.SQLAlchemyError) as raised:
            await conn.execute(needs)
        caught.append(type(raised.value))
    assert caught[0] is caught[1]


async def test_statements_sent_at_once_run_one_after_another(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given several fast-path statements and one of SQLAlchemy's, started together
    _, fast = both
    reads = [
        select(accounts.c.balance_cents).where(accounts.c.account == f"a{i}") for i in range(5)
    ]
    # When they are awaited together on the handler's connection
    results = await asyncio.gather(
        *(fast.execute(read) for read in reads), fast.execute(text("SELECT 1"))
    )
    # Then each ran (one at a time on the one connection) and answered its own rows
    assert [r.scalar_one() for r in results] == [0, 10, 20, 30, 40, 1]


async def _answer(conn: AsyncConnection, statement: Any) -> Any:
    """What ``statement`` answers on ``conn`` (keys, rows, mappings, row count, or the error's
    types), and the accounts after it, in a savepoint rolled back."""
    savepoint = await conn.begin_nested()
    try:
        result = await conn.execute(statement)
        if result.returns_rows:
            rows = result.all()
            answer: Any = (list(result.keys()), rows, [dict(row._mapping) for row in rows])
        else:
            answer = result.rowcount
        after = (await conn.execute(text("SELECT * FROM accounts ORDER BY 1"))).all()
        return answer, after
    except sqlalchemy.exc.DBAPIError as exc:
        return type(exc), type(exc.orig), exc.orig.sqlstate  # type: ignore[union-attr]
    finally:
        await savepoint.rollback()


STAR_AND_TEXT_COLUMNS: dict[str, Any] = {
    "*": select(literal_column("*")).select_from(accounts).order_by(accounts.c.account),
    "text() columns": select(text("account, balance_cents"))
    .select_from(accounts)
    .order_by(accounts.c.account),
    "a literal column of two": select(literal_column("account, balance_cents"))
    .select_from(accounts)
    .order_by(accounts.c.account),
    "returning *": insert(accounts)
    .values(account="z", balance_cents=1)
    .returning(literal_column("*")),
}


@pytest.mark.parametrize("case", STAR_AND_TEXT_COLUMNS)
async def test_star_and_text_columns_are_named_as_sqlalchemy_names_them(
    both: tuple[AsyncConnection, HandlerConnection], case: str
) -> None:
    # Given a statement whose SQL returns other columns than its compiled form lists (a `*`,
    # a text() or literal column holding several): SQLAlchemy names them from the driver
    statement = STAR_AND_TEXT_COLUMNS[case]
    slow, fast = both
    # When it runs both ways
    expected, got = await _answer(slow, statement), await _answer(fast, statement)
    # Then the keys, rows and mappings are SQLAlchemy's (each column, by its own name)
    assert got == expected
    assert expected[0][0][:2] == ["account", "balance_cents"]


async def test_a_statement_holding_several_commands_is_refused_as_sqlalchemy_refuses_it(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given a delete without a bind value whose text() holds a second command
    # (a handler that builds text() from a message's content)
    statement = delete(accounts).where(text("account = 'a1'; DELETE FROM accounts"))
    slow, fast = both
    # When it runs both ways
    expected, got = await _answer(slow, statement), await _answer(fast, statement)
    # Then both refuse it (a prepared statement holds one command), and nothing is deleted
    assert got == expected
    assert expected[2] == "42601"
    assert len((await fast.execute(select(accounts.c.account))).all()) == 5


SLEEPING = "SELECT count(*) FROM pg_stat_activity WHERE pid = :pid AND query LIKE '%pg_sleep%'"


@pytest.mark.parametrize("way", ["sqlalchemy", "fast path"])
async def test_a_connection_lost_mid_statement_renews_the_pool_as_sqlalchemy_does(
    engine: AsyncEngine, way: str
) -> None:
    # Given a pool holding an idle connection, and a unit of work on another one
    pool = create_async_engine(engine.url, pool_size=2)
    try:
        idle = await pool.connect()
        idle_pid = (await idle.execute(select(func.pg_backend_pid()))).scalar()
        async with pool.connect() as conn:
            await idle.close()  # back in the pool
            await conn.begin()
            pid = (await conn.execute(select(func.pg_backend_pid()))).scalar()
            assert pid != idle_pid
            handler = HandlerConnection(conn, await in_transaction(conn))
            runs: Any = conn if way == "sqlalchemy" else handler
            sleep = select(func.length(func.pg_sleep(5).cast(Text)))

            async def sleeping() -> bool:
                return bool(await scalar(engine, SLEEPING, pid=pid))

            async def terminate() -> None:
                await wait_until(sleeping, interval=0.01)
                await scalar(engine, "SELECT pg_terminate_backend(:pid)", pid=pid)

            # When its backend is terminated while a statement runs
            with pytest.raises(sqlalchemy.exc.DBAPIError) as raised:
                await asyncio.gather(runs.execute(sleep), terminate())
            # Then it is a disconnect, classified transient, the connection invalidated
            assert raised.value.connection_invalidated
            assert classify(raised.value) is Fault.TRANSIENT
            assert conn.invalidated
        # And the idle connection, made before, is replaced too at its next checkout
        async with pool.connect() as again:
            assert (await again.execute(select(func.pg_backend_pid()))).scalar() != idle_pid
    finally:
        await pool.dispose()


async def test_a_sessions_own_execution_options_are_applied_as_sqlalchemy_applies_them(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given sessions whose execution options map tables without a schema to another schema,
    # where a table of the same name holds other rows
    slow, fast = both
    await slow.execute(text("CREATE SCHEMA other"))
    await slow.execute(text("CREATE TABLE other.accounts (account text, balance_cents int)"))
    await slow.execute(text("INSERT INTO other.accounts VALUES ('other', 1)"))
    options = {"schema_translate_map": {None: "other"}}
    answers = []
    # (the handler's first: SQLAlchemy's session sets its options on the shared connection)
    for conn, kind in ((fast, HandlerSession), (slow, AsyncSession)):
        session = kind(bind=conn, execution_options=options)
        # When a Core select runs on each
        result = await session.execute(select(accounts.c.account))
        answers.append(result.scalars().all())
        await session.close()
    # Then both read the table the options name
    assert answers[0] == answers[1] == ["other"]


class Refused(Exception):
    """What a deployment's ``handle_error`` hook raises instead of SQLAlchemy's error."""


@pytest.mark.parametrize("way", ["sqlalchemy", "fast path"])
async def test_an_engines_own_error_hook_sees_the_error_as_on_sqlalchemys_path(
    engine: AsyncEngine, way: str
) -> None:
    # Given an engine with a handle_error hook of its own (besides the worker's)
    hooked = create_async_engine(engine.url)
    event.listen(hooked.sync_engine, "handle_error", unusable_connection_is_a_disconnect)
    seen: list[type[BaseException]] = []

    def refuse(context: Any) -> None:
        seen.append(type(context.original_exception))
        raise Refused("refused") from context.original_exception

    event.listen(hooked.sync_engine, "handle_error", refuse)
    try:
        async with hooked.connect() as conn:
            await conn.begin()
            handler = HandlerConnection(conn, await in_transaction(conn))
            runs: Any = conn if way == "sqlalchemy" else handler
            # When a statement fails
            with pytest.raises(Refused):
                await runs.execute(select(accounts.c.account).where(func.pg_temp.nothing()))
            # Then the hook saw the driver's error and what it raised is what the handler gets
            assert len(seen) == 1
    finally:
        await hooked.dispose()


@pytest.mark.parametrize("kind", [AsyncSession, HandlerSession])
async def test_a_sessions_rollback_undoes_its_core_statements_as_sqlalchemys_does(
    engine: AsyncEngine, kind: type[AsyncSession]
) -> None:
    # Given a handler's session (as Context opens it) on a unit of work's transaction
    name = f"rolled-back-{kind.__name__}"
    async with engine.connect() as conn:
        await conn.begin()
        handler = HandlerConnection(conn, await in_transaction(conn))
        session = kind(bind=handler, expire_on_commit=False, join_transaction_mode="rollback_only")
        # When a Core insert runs on it, and the session is rolled back
        await session.execute(insert(accounts).values(account=name, balance_cents=1))
        await session.rollback()
        # Then the transaction it joined is rolled back (the worker's commit commits nothing)
        assert not conn.in_transaction()
        assert not handler.driver.is_in_transaction()
        await conn.commit()
        await session.close()
    async with engine.connect() as other:
        found = await other.scalar(select(func.count()).where(accounts.c.account == name))
    assert found == 0


async def test_columns_of_a_statement_built_at_each_call_find_their_values(
    both: tuple[AsyncConnection, HandlerConnection],
) -> None:
    # Given a select of a subquery's column and of a label, built anew at each call (one shape,
    # compiled once: later calls are other objects than the ones compiled)
    def build(floor: int) -> tuple[Any, list[Any]]:
        sub = select(accounts.c.account, accounts.c.balance_cents).where(
            accounts.c.balance_cents > floor
        )
        sub = sub.subquery()
        plus = (sub.c.balance_cents + 1).label("plus")
        statement = select(sub.c.account, plus).order_by(sub.c.account).limit(1)
        return statement, [sub.c.account, plus, "plus", "account"]

    answers = []
    for conn in both:
        reads = []
        for floor in (0, 10, 20):
            # When each is run and its row read by its own column objects
            statement, keys = build(floor)
            row = (await conn.execute(statement)).one()
            reads.append([row._mapping[key] for key in keys])
        answers.append(reads)
    # Then each finds its values, as on SQLAlchemy's path
    assert (
        answers[1]
        == answers[0]
        == [["a1", 11, 11, "a1"], ["a2", 21, 21, "a2"], ["a3", 31, 31, "a3"]]
    )
