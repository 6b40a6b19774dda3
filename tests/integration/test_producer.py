"""``worker.outbox.publish`` from a producer's own transaction, against the real PostgreSQL and
RabbitMQ: the event commits and rolls back with the caller's writes on every kind of connection
it takes, is refused outside a transaction, holds its ordering key until commit, wakes relays, and
a retried producer transaction's event is applied once by the worker."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from examples.payments import router as payments
from tests.helpers import payment, rows, scalar, wait_until
from tests.integration.support import running_worker
from worker import outbox
from worker.outbox import Event, NotInTransaction
from worker.settings import Settings
from worker.sql.outbox import OUTBOX_CHANNEL

CREDIT = text("INSERT INTO accounts (account, balance_cents) VALUES (:account, 100)")


async def outbox_rows(engine: AsyncEngine) -> list[dict[str, object]]:
    found = await rows(
        engine,
        "SELECT message_id, exchange, routing_key, body, content_type, headers, correlation_id,"
        " causation_id, ordering_key FROM outbox ORDER BY id",
    )
    return [dict(row._mapping) for row in found]


async def test_an_event_commits_with_the_callers_write_and_carries_its_key(
    engine: AsyncEngine,
) -> None:
    # When an SQLAlchemy transaction writes a row and publishes an event with a key
    async with engine.begin() as conn:
        await conn.execute(CREDIT, {"account": "alice"})
        message_id = await outbox.publish(
            conn,
            "order.placed",
            {"order": 7},
            key="order-7",
            ordering_key="customer-1",
            headers={"tenant": "t1"},
            correlation_id="req-1",
        )

    # Then both committed, and the row holds what the relay will publish
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 1
    (row,) = await outbox_rows(engine)
    assert row["message_id"] == message_id
    assert row["exchange"] == "events"
    assert row["routing_key"] == "order.placed"
    assert bytes(row["body"]) == b'{"order":7}'  # type: ignore[arg-type]
    assert row["content_type"] == "application/json"
    assert row["headers"] == {"tenant": "t1", "idempotency-key": "order-7"}
    assert (row["correlation_id"], row["causation_id"]) == ("req-1", None)
    assert row["ordering_key"] == "customer-1"


async def test_without_a_key_the_events_key_is_its_message_id(engine: AsyncEngine) -> None:
    given = uuid.uuid4()
    async with engine.begin() as conn:
        assert await outbox.publish(conn, "x.y", b"\x00raw", message_id=given) == given
    (row,) = await outbox_rows(engine)
    assert row["headers"] == {"idempotency-key": str(given)}
    assert row["content_type"] == "application/octet-stream"


async def test_a_rollback_takes_the_event_back_with_the_write(engine: AsyncEngine) -> None:
    async def place_order() -> None:
        async with engine.begin() as conn:
            await conn.execute(CREDIT, {"account": "alice"})
            await outbox.publish(conn, "order.placed", {"order": 1})
            raise RuntimeError("a business rule refused the order")

    with pytest.raises(RuntimeError, match="business rule"):
        await place_order()
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 0
    assert await outbox_rows(engine) == []


async def test_a_session_publishes_in_its_own_transaction(engine: AsyncEngine) -> None:
    # When a session publishes before it wrote anything, then writes and commits
    async with AsyncSession(engine) as session:
        await outbox.publish(session, "order.placed", {"order": 2})
        await session.execute(CREDIT, {"account": "bob"})
        await session.commit()
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 1
    assert len(await outbox_rows(engine)) == 1

    # And a session closed without commit leaves nothing
    async with AsyncSession(engine) as session:
        await session.execute(CREDIT, {"account": "carol"})
        await outbox.publish(session, "order.placed", {"order": 3})
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 1
    assert len(await outbox_rows(engine)) == 1


async def test_an_asyncpg_connection_publishes_inside_its_transaction_only(
    engine: AsyncEngine, settings: Settings
) -> None:
    raw = await asyncpg.connect(settings.database_url)
    try:
        # Outside a transaction: refused, nothing written
        with pytest.raises(NotInTransaction):
            await outbox.publish(raw, "order.placed", {"order": 4})
        assert await outbox_rows(engine) == []

        async with raw.transaction():
            await raw.execute("INSERT INTO accounts VALUES ('dave', 1)")
            await outbox.publish(raw, "order.placed", {"order": 5})
    finally:
        await raw.close()
    assert len(await outbox_rows(engine)) == 1


async def test_a_connection_or_session_without_a_transaction_is_refused(
    engine: AsyncEngine,
) -> None:
    async with engine.connect() as conn:
        with pytest.raises(NotInTransaction):
            await outbox.publish(conn, "order.placed", {"order": 6})
    async with AsyncSession(engine, autobegin=False) as session:
        with pytest.raises(NotInTransaction):
            await outbox.publish(session, "order.placed", {"order": 6})
    assert await outbox_rows(engine) == []


async def test_many_events_go_in_one_statement_in_their_order(engine: AsyncEngine) -> None:
    events = [Event(f"order.{n}", {"n": n}, key=f"k{n}") for n in range(5)]
    async with engine.begin() as conn:
        ids = await outbox.publish_many(conn, events)
        assert await outbox.publish_many(conn, []) == []
    found = await outbox_rows(engine)
    assert [row["message_id"] for row in found] == ids
    assert [row["routing_key"] for row in found] == [f"order.{n}" for n in range(5)]


async def test_an_event_that_could_never_be_published_is_refused_before_anything_is_written(
    engine: AsyncEngine,
) -> None:
    bad = [
        Event("r" * 256, {}),  # over AMQP's 255 bytes
        Event("", {}),
        Event("a.b", {}, key=""),
        Event("a.b", {}, key="k\x00"),
        Event("a.b", {}, ordering_key="o\x00"),
        Event("a.b", {"when": object()}),  # not JSON
        Event("a.b", {}, headers={"h": object()}),
    ]
    for event in bad:
        async with engine.begin() as conn:
            with pytest.raises((ValueError, TypeError)):
                await outbox.publish_many(conn, [Event("fine", {}), event])
    assert await outbox_rows(engine) == []


async def test_an_ordering_key_is_held_until_the_publishing_transaction_ends(
    engine: AsyncEngine,
) -> None:
    async with engine.connect() as first:
        await first.begin()
        await outbox.publish(first, "order.placed", {"n": 1}, ordering_key="customer-9")

        # Then another transaction cannot publish on that key before the first ends
        async with engine.connect() as second:
            await second.begin()
            await second.execute(text("SET LOCAL lock_timeout = '200ms'"))
            with pytest.raises(Exception, match="lock timeout"):
                await outbox.publish(second, "order.placed", {"n": 2}, ordering_key="customer-9")
            await second.rollback()
        await first.commit()
    assert len(await outbox_rows(engine)) == 1


async def test_a_commit_wakes_listening_relays_once(
    engine: AsyncEngine, settings: Settings
) -> None:
    listener = await asyncpg.connect(settings.database_url)
    woken: asyncio.Queue[str] = asyncio.Queue()
    await listener.add_listener(OUTBOX_CHANNEL, lambda *args: woken.put_nowait(args[2]))
    try:
        async with engine.begin() as conn:
            await outbox.publish(conn, "a.b", {})
            await outbox.publish_many(conn, [Event("a.c", {}), Event("a.d", {})])
            await asyncio.sleep(0.2)
            assert woken.empty()  # (nothing before the commit)
        assert await asyncio.wait_for(woken.get(), 10) == OUTBOX_CHANNEL
        await asyncio.sleep(0.2)
        assert woken.empty()
    finally:
        await listener.close()


def test_the_default_exchange_follows_the_workers_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WORKER_EXCHANGE", raising=False)
    assert outbox.default_exchange() == "events"
    monkeypatch.setenv("WORKER_EXCHANGE", "shop-events")
    assert outbox.default_exchange() == "shop-events"


async def test_a_retried_producer_transaction_is_applied_once_by_the_worker(
    engine: AsyncEngine, settings: Settings
) -> None:
    # Given a producer whose first commit's outcome it never learned: it runs the transaction
    # again, with the same key, so the outbox holds the event twice
    for _ in range(2):
        async with engine.begin() as conn:
            await outbox.publish(
                conn,
                "payment.requested",
                payment("pay-1", "erin", 250),
                key="order-42:payment",
                exchange=settings.exchange,
            )
    assert len(await outbox_rows(engine)) == 2

    # When the worker runs with its relay
    async with running_worker(settings, payments):
        await wait_until(lambda: _drained(engine))

    # Then the payment was applied once, under the producer's key, and announced once
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account = 'erin'") == 250
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == 1
    assert (
        await scalar(engine, "SELECT status FROM inbox WHERE key = 'order-42:payment'")
        == "completed"
    )


async def _drained(engine: AsyncEngine) -> bool:
    """The payment settled, its ``payment.settled`` event was relayed and noted, nothing left."""
    return (
        await scalar(engine, "SELECT count(*) FROM settlement_notices") == 1
        and await scalar(engine, "SELECT count(*) FROM outbox") == 0
    )
