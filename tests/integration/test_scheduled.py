"""Scheduled events against the real PostgreSQL and RabbitMQ: ``delay=`` counts from the
transaction's start by the database's clock and ``at=`` is kept as given; ``cancel`` takes back an
event that is not published yet, and nothing else; an ordering key's scheduled event takes its
place in the key's order when it is due; a relay publishes a scheduled event once the database
says it is due, never before, and promptly after a downtime."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest
from aio_pika import ExchangeType
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tests.helpers import envelope, rows, scalar, wait_until
from tests.integration.support import running_relay
from worker import Context, Router, outbox
from worker.core.config import UnitOfWorkConfig
from worker.core.unit_of_work import process, process_batch
from worker.outbox import Event
from worker.settings import Settings
from worker.sql import outbox as outbox_sql
from worker.sql.outbox import OUTBOX_CHANNEL, SCHEDULED_NOTICE
from worker.telemetry import Telemetry
from worker.transport.schedule import Schedule

UNIT = UnitOfWorkConfig(exchange="events")
LATER = timedelta(hours=1)
"""Far enough out that no test run reaches it: a test makes an event due by moving its
``due_at`` in SQL, never by waiting."""


async def transaction_start(conn: AsyncConnection) -> datetime:
    """The database's ``now()`` in ``conn``'s transaction: the instant a delay counts from."""
    started: datetime = (await conn.execute(text("SELECT now()"))).scalar_one()
    return started


async def scheduled(engine: AsyncEngine) -> dict[uuid.UUID, Any]:
    """The rows of ``outbox_scheduled`` by message id, in id order."""
    found = await rows(
        engine, "SELECT message_id, ordering_key, due_at FROM outbox_scheduled ORDER BY id"
    )
    return {row.message_id: row for row in found}


async def in_outbox(engine: AsyncEngine) -> list[uuid.UUID]:
    """The message ids in ``outbox`` in id order (the order a relay publishes a key's events)."""
    found = await rows(engine, "SELECT message_id FROM outbox ORDER BY id")
    return [row.message_id for row in found]


async def make_due(engine: AsyncEngine, *message_ids: uuid.UUID, ago: float = 0.0) -> None:
    """Move the due time of scheduled events to the database's now (minus ``ago`` seconds), in
    one statement: all of them due at the same instant."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE outbox_scheduled SET due_at = now() - make_interval(secs => :ago)"
                " WHERE message_id = ANY(:ids)"
            ),
            {"ids": list(message_ids), "ago": ago},
        )


async def move(engine: AsyncEngine, limit: int = 100) -> int:
    """What a relay's mover does, once, in its own transaction."""
    async with engine.begin() as conn:
        return await outbox_sql.move_due(conn, limit)  # type: ignore[arg-type]


async def publish(engine: AsyncEngine, settings: Settings, n: int, **schedule: Any) -> uuid.UUID:
    """Commit one event ``sched.<n>`` to the test's exchange, in its own transaction."""
    async with engine.begin() as conn:
        return await outbox.publish(
            conn, f"sched.{n}", {"n": n}, exchange=settings.exchange, **schedule
        )


# The clock is the database's


async def test_a_delay_counts_from_the_transactions_start_by_the_database_clock(
    engine: AsyncEngine,
) -> None:
    # Given a transaction that schedules an event 30 minutes out, then runs a little longer
    async with engine.begin() as conn:
        started = await transaction_start(conn)
        message_id = await outbox.publish(conn, "reminder.due", {}, delay=timedelta(minutes=30))
        await conn.execute(text("SELECT pg_sleep(0.05)"))

    # Then it waits in outbox_scheduled, due 30 minutes after the transaction's now()
    (row,) = (await scheduled(engine)).values()
    assert row.message_id == message_id
    assert row.due_at == started + timedelta(minutes=30)
    assert await in_outbox(engine) == []


async def test_at_is_the_instant_given_whatever_its_timezone(engine: AsyncEngine) -> None:
    at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    async with engine.begin() as conn:
        await outbox.publish(conn, "reminder.due", {}, at=at.astimezone(timezone(-LATER * 5)))
    (row,) = (await scheduled(engine)).values()
    assert row.due_at == at


async def test_publish_many_sends_each_event_to_its_table_in_the_order_given(
    engine: AsyncEngine,
) -> None:
    # Given events due now and scheduled ones, mixed, in one call
    at = datetime(2031, 1, 1, tzinfo=UTC)
    events = [
        Event("a.0", {}),
        Event("a.1", {}, delay=timedelta(seconds=90)),
        Event("a.2", {}),
        Event("a.3", {}, at=at),
        Event("a.4", {}, delay=timedelta(0)),
    ]
    async with engine.begin() as conn:
        started = await transaction_start(conn)
        ids = await outbox.publish_many(conn, events)

    # Then the ones due now are in the outbox, the scheduled ones (even a zero delay) wait, each
    # in the order given, with the ids returned in the order given
    assert await in_outbox(engine) == [ids[0], ids[2]]
    waiting = await scheduled(engine)
    assert list(waiting) == [ids[1], ids[3], ids[4]]
    assert [row.due_at for row in waiting.values()] == [
        started + timedelta(seconds=90),
        at,
        started,
    ]


async def test_a_refused_schedule_writes_nothing(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        with pytest.raises(ValueError, match="naive"):
            await outbox.publish(conn, "a", {}, at=datetime(2031, 1, 1))
        with pytest.raises(ValueError, match="not both"):
            await outbox.publish(conn, "a", {}, delay=LATER, at=datetime.now(UTC))
        with pytest.raises(ValueError, match="negative"):
            await outbox.publish_many(conn, [Event("a", {}), Event("b", {}, delay=-LATER)])
    assert await scheduled(engine) == {}
    assert await in_outbox(engine) == []


async def test_a_commit_that_schedules_tells_the_relays_once(
    engine: AsyncEngine, database_url: str
) -> None:
    listener = await asyncpg.connect(database_url)
    heard: list[str] = []
    await listener.add_listener(OUTBOX_CHANNEL, lambda *args: heard.append(args[3]))
    try:
        # When one transaction schedules two events
        async with engine.begin() as conn:
            await outbox.publish_many(conn, [Event("a", {}, delay=LATER), Event("b", {}, at=END)])

        # Then the relays hear "scheduled", once
        async def heard_it() -> bool:
            return heard == [SCHEDULED_NOTICE]

        await wait_until(heard_it)
    finally:
        await listener.close()


END = datetime(2031, 1, 1, tzinfo=UTC)


# Cancel


async def test_cancel_takes_back_a_scheduled_event_once(engine: AsyncEngine) -> None:
    # Given a scheduled event
    async with engine.begin() as conn:
        message_id = await outbox.publish(conn, "a", {}, delay=LATER)

    # When it is cancelled, then cancelled again in the same and in a later transaction
    async with engine.begin() as conn:
        assert await outbox.cancel(conn, message_id) is True
        assert await outbox.cancel(conn, message_id) is False
    async with engine.begin() as conn:
        assert await outbox.cancel(conn, message_id) is False

    # Then it is gone
    assert await scheduled(engine) == {}


async def test_cancel_takes_back_an_event_that_is_due_but_not_published(
    engine: AsyncEngine,
) -> None:
    # Given a scheduled event that fell due and was moved into the outbox, and an event due at
    # once that no relay has published
    async with engine.begin() as conn:
        moved = await outbox.publish(conn, "a", {}, delay=LATER)
        waiting = await outbox.publish(conn, "b", {})
    await make_due(engine, moved)
    assert await move(engine) == 1
    assert await in_outbox(engine) == [waiting, moved]

    # When both are cancelled, then each is gone
    async with engine.begin() as conn:
        assert await outbox.cancel(conn, moved) is True
        assert await outbox.cancel(conn, waiting) is True
    assert await in_outbox(engine) == []


async def test_cancel_takes_back_both_events_of_a_message_id_scheduled_and_due(
    engine: AsyncEngine,
) -> None:
    # Given a message id scheduled for later and, under the same id, an event due at once that no
    # relay has published (the tables' message ids are unique each, not together)
    repeated = uuid.uuid4()
    async with engine.begin() as conn:
        await outbox.publish(conn, "a", {}, message_id=repeated, delay=LATER)
        await outbox.publish(conn, "a", {}, message_id=repeated)

    # When it is cancelled
    async with engine.begin() as conn:
        assert await outbox.cancel(conn, repeated) is True

    # Then neither is left to be published
    assert await scheduled(engine) == {}
    assert await in_outbox(engine) == []


async def test_cancel_is_false_for_an_unknown_event(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        assert await outbox.cancel(conn, uuid.uuid4()) is False
        with pytest.raises(TypeError):
            await outbox.cancel(conn, str(uuid.uuid4()))  # type: ignore[arg-type]


async def test_a_rollback_undoes_a_cancel(engine: AsyncEngine) -> None:
    # Given a scheduled event
    async with engine.begin() as conn:
        message_id = await outbox.publish(conn, "a", {}, delay=LATER)

    # When a transaction cancels it, then fails
    async def cancel_then_fail() -> None:
        async with engine.begin() as conn:
            assert await outbox.cancel(conn, message_id) is True
            raise RuntimeError("the business rule refused")

    with pytest.raises(RuntimeError, match="refused"):
        await cancel_then_fail()

    # Then it is still scheduled, and can be cancelled for real
    assert list(await scheduled(engine)) == [message_id]
    async with engine.begin() as conn:
        assert await outbox.cancel(conn, message_id) is True


async def test_cancel_is_false_for_a_published_event(
    settings: Settings, engine: AsyncEngine, capture: AbstractQueue
) -> None:
    # Given an event a relay has published
    message_id = await publish(engine, settings, 1)
    async with running_relay(settings):
        await arrived(capture, 1)
        await wait_until(lambda: _empty(engine))

    # Then it can no longer be taken back
    async with engine.begin() as conn:
        assert await outbox.cancel(conn, message_id) is False


async def test_a_handler_cancels_events_of_this_call_and_of_earlier_transactions(
    engine: AsyncEngine,
) -> None:
    # Given an event scheduled by an earlier transaction
    async with engine.begin() as conn:
        earlier = await outbox.publish(conn, "reminder.due", {}, delay=LATER)
    answers: list[bool] = []
    router = Router()

    @router.handler("order.cancelled")
    async def cancel_reminders(body: dict[str, Any], ctx: Context) -> None:
        # publishes a reminder and an immediate event, then takes both back, and the earlier one
        reminder = ctx.publish("reminder.due", {}, delay=LATER)
        notice = ctx.publish("order.notice", {})
        kept = ctx.publish("order.kept", {}, delay=LATER)
        answers.append(await ctx.cancel(reminder))
        answers.append(await ctx.cancel(notice))
        answers.append(await ctx.cancel(reminder))
        answers.append(await ctx.cancel(uuid.UUID(body["earlier"])))
        answers.append(await ctx.cancel(uuid.uuid4()))
        assert kept in {m.message_id for m in ctx.outbox}

    # When the handler runs and commits
    await process(engine, envelope(router, "order.cancelled", {"earlier": str(earlier)}, "k"), UNIT)

    # Then what it cancelled is gone, what it kept is scheduled, and each answer says so
    assert answers == [True, True, False, True, False]
    assert await in_outbox(engine) == []
    (row,) = (await scheduled(engine)).values()
    assert row.message_id != earlier
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 1


def reminder_router(answers: list[bool], *, fail_after_cancel: bool = False) -> Router:
    """``order.placed`` schedules the order's reminder (its message id derived from the order);
    ``payment.received`` cancels it, recording the answer (with ``fail_after_cancel``, then
    fails)."""
    router = Router()
    namespace = uuid.UUID("0d7e4f9a-3b1c-4e55-8a2d-6c9b1f0e7a34")

    @router.handler("order.placed")
    async def placed(body: dict[str, Any], ctx: Context) -> None:
        ctx.publish(
            "reminder.due", {}, message_id=uuid.uuid5(namespace, body["order"]), delay=LATER
        )

    @router.handler("payment.received")
    async def settle(body: dict[str, Any], ctx: Context) -> None:
        answers.append(await ctx.cancel(uuid.uuid5(namespace, body["order"])))
        if fail_after_cancel:
            raise ValueError("the payment is refused")

    return router


async def test_a_handler_cancels_an_event_another_message_of_its_transaction_published(
    engine: AsyncEngine,
) -> None:
    # Given an order placed (its reminder scheduled) and paid (its reminder cancelled), delivered
    # together so that one transaction handles both
    answers: list[bool] = []
    router = reminder_router(answers)
    placed = envelope(router, "order.placed", {"order": "o-1"}, "placed-1")
    paid = envelope(router, "payment.received", {"order": "o-1"}, "paid-1")

    # When they are processed
    await process_batch(engine, [placed, paid], UNIT)

    # Then the cancel took the reminder back, as it would had they been handled one by one
    assert answers == [True]
    assert await scheduled(engine) == {}
    assert await in_outbox(engine) == []


async def test_a_cancel_by_a_handler_that_then_fails_leaves_its_batchmates_event(
    engine: AsyncEngine,
) -> None:
    # Given an order placed and paid in one transaction, the payment's handler failing after
    # it cancelled the reminder
    answers: list[bool] = []
    router = reminder_router(answers, fail_after_cancel=True)
    placed = envelope(router, "order.placed", {"order": "o-2"}, "placed-2")
    paid = envelope(router, "payment.received", {"order": "o-2"}, "paid-2")

    # When they are processed
    await process_batch(engine, [placed, paid], UNIT)

    # Then the failed handler's cancel is undone with the rest of its work: the reminder waits
    assert len(await scheduled(engine)) == 1


# Ordering keys


async def test_events_of_a_key_due_at_one_instant_are_moved_in_the_order_scheduled(
    engine: AsyncEngine,
) -> None:
    # Given key K's events scheduled in three transactions (two in one call), another key's and
    # an unkeyed one between them, all later made due at one instant
    async with engine.begin() as conn:
        first = await outbox.publish(conn, "a", {}, ordering_key="K", delay=LATER)
    async with engine.begin() as conn:
        other = await outbox.publish(conn, "a", {}, ordering_key="L", delay=LATER)
        second, third = await outbox.publish_many(
            conn,
            [Event("a", {}, ordering_key="K", at=END), Event("a", {}, ordering_key="K", at=END)],
        )
    async with engine.begin() as conn:
        unkeyed = await outbox.publish(conn, "a", {}, delay=LATER)
        fourth = await outbox.publish(conn, "a", {}, ordering_key="K", delay=LATER * 2)
    await make_due(engine, fourth, third, unkeyed, second, other, first)

    # When a mover runs
    assert await move(engine) == 6

    # Then they are in the outbox in the order they were scheduled
    order = await in_outbox(engine)
    assert [m for m in order if m not in {other, unkeyed}] == [first, second, third, fourth]
    assert set(order) == {first, second, third, fourth, other, unkeyed}


async def test_a_due_event_takes_its_place_after_its_keys_events_already_in_the_outbox(
    engine: AsyncEngine,
) -> None:
    # Given K's event scheduled first, then K's event due at once, not yet published
    async with engine.begin() as conn:
        later = await outbox.publish(conn, "a", {}, ordering_key="K", delay=LATER)
    async with engine.begin() as conn:
        now = await outbox.publish(conn, "a", {}, ordering_key="K")

    # When the scheduled one falls due and is moved
    await make_due(engine, later, ago=60)
    assert await move(engine) == 1

    # Then it comes after the one already waiting
    assert await in_outbox(engine) == [now, later]


async def test_a_cancel_in_flight_holds_its_key_so_a_later_event_cannot_overtake_it(
    engine: AsyncEngine,
) -> None:
    # Given K's two scheduled events, both due, and a transaction cancelling the first, still open
    async with engine.begin() as conn:
        first = await outbox.publish(conn, "a", {}, ordering_key="K", delay=LATER)
    async with engine.begin() as conn:
        second = await outbox.publish(conn, "a", {}, ordering_key="K", delay=LATER)
    await make_due(engine, first, second)
    async with engine.connect() as conn:
        cancelling = await conn.begin()
        assert await outbox.cancel(conn, first) is True

        # When a mover runs meanwhile: K is left for later, as for a producer holding it
        assert await move(engine) == 0

        # And the cancel is rolled back
        await cancelling.rollback()

    # Then the next mover moves K's events in their order
    assert await move(engine) == 2
    assert await in_outbox(engine) == [first, second]


async def test_a_cancel_takes_no_ordering_lock_so_it_cannot_deadlock_with_a_producer(
    engine: AsyncEngine,
) -> None:
    # Given a scheduled event of key B
    async with engine.begin() as conn:
        b_event = await outbox.publish(conn, "b", {}, ordering_key="B", delay=LATER)

    # When one transaction cancels it and, while it is open, another publishes events of keys A
    # and B (taking A's lock, then B's: a cancel holding B's would make it wait)
    async with engine.connect() as canceller, engine.connect() as producer:
        await canceller.begin()
        assert await outbox.cancel(canceller, b_event) is True
        await producer.begin()
        both = [Event("a", {}, ordering_key="A"), Event("b", {}, ordering_key="B")]
        await asyncio.wait_for(outbox.publish_many(producer, both), timeout=10)

        # Then the producer waits for nothing of the canceller's, so the canceller publishing A
        # next waits for the producer's commit instead of both waiting for each other
        one = asyncio.create_task(outbox.publish(canceller, "a", {}, ordering_key="A"))
        await producer.commit()
        await asyncio.wait_for(one, timeout=10)
        await canceller.commit()
    assert len(await in_outbox(engine)) == 3
    assert await scheduled(engine) == {}


async def test_a_mover_leaves_a_key_a_producer_holds_and_moves_it_behind_the_producers_event(
    engine: AsyncEngine,
) -> None:
    # Given K's scheduled event, due, and a producer transaction holding K (not committed)
    async with engine.begin() as conn:
        due = await outbox.publish(conn, "a", {}, ordering_key="K", delay=LATER)
        free = await outbox.publish(conn, "a", {}, ordering_key="L", delay=LATER)
    await make_due(engine, due, free)
    async with engine.begin() as producer:
        appended = await outbox.publish(producer, "a", {}, ordering_key="K")

        # When a mover runs meanwhile: it does not wait for K, and moves L
        assert await move(engine) == 1
        assert await in_outbox(engine) == [free]
    # Then once the producer committed, the next mover moves K's event behind the producer's
    assert await move(engine) == 1
    assert [m for m in await in_outbox(engine) if m != free] == [appended, due]


async def test_a_keys_due_events_a_producer_holds_do_not_hold_back_other_keys_due_after_them(
    engine: AsyncEngine,
) -> None:
    # Given more of K's due events than a move takes, and after them an unkeyed due event, while
    # a producer transaction holds K (not committed)
    async with engine.begin() as conn:
        ours = await outbox.publish_many(
            conn, [Event("a", {}, ordering_key="K", delay=LATER) for _ in range(3)]
        )
        other = await outbox.publish(conn, "a", {}, delay=LATER)
    await make_due(engine, *ours, ago=60)
    await make_due(engine, other)
    async with engine.begin() as producer:
        await outbox.publish(producer, "a", {}, ordering_key="K")

        # When a mover that takes 2 events a move runs meanwhile
        moved = await move(engine, limit=2)

        # Then it moves the other event, and leaves all of K's for the producer's commit
        assert moved == 1
        assert await in_outbox(engine) == [other]
        assert set(await scheduled(engine)) == set(ours)


async def test_a_move_leaves_scheduled_an_event_whose_message_id_entered_the_outbox_meanwhile(
    engine: AsyncEngine, database_url: str
) -> None:
    # Given a due scheduled event and another, and an event of the first one's message id
    # committed to the outbox after a mover chose them (it holds their rows)
    repeated = uuid.uuid4()
    async with engine.begin() as conn:
        await outbox.publish(conn, "a", {}, message_id=repeated, delay=LATER)
        other = await outbox.publish(conn, "b", {}, delay=LATER)
    await make_due(engine, repeated, other)
    chosen = [row.id for row in await rows(engine, "SELECT id FROM outbox_scheduled ORDER BY id")]
    async with engine.begin() as conn:
        await outbox.publish(conn, "a", {}, message_id=repeated)

    # When the mover moves what it chose
    mover = await asyncpg.connect(database_url)
    try:
        async with mover.transaction():
            moved = await mover.fetchval(outbox_sql.MOVE_DUE, chosen)
    finally:
        await mover.close()

    # Then the other one moved, and the first waits, scheduled, for its namesake to be published
    assert moved == 1
    assert list(await scheduled(engine)) == [repeated]
    assert sorted(map(str, await in_outbox(engine))) == sorted(map(str, [repeated, other]))


# The relay


@pytest.fixture
async def capture(
    settings: Settings, amqp: AbstractRobustConnection
) -> AsyncIterator[AbstractQueue]:
    """The test's exchange, and a queue bound to ``sched.#`` that the tests read."""
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(settings.exchange, ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(f"{settings.queue}.capture", durable=True)
    await queue.bind(exchange, "sched.#")
    yield queue
    await channel.queue_delete(queue.name)
    await channel.close()


async def arrived(queue: AbstractQueue, count: int) -> list[AbstractIncomingMessage]:
    """Wait until ``count`` messages were read from ``queue``; all read, in arrival order."""
    got: list[AbstractIncomingMessage] = []

    async def enough() -> bool:
        while (message := await queue.get(fail=False, no_ack=True)) is not None:
            got.append(message)
        return len(got) >= count

    await wait_until(enough)
    return got


async def _empty(engine: AsyncEngine) -> bool:
    return await scalar(engine, "SELECT count(*) FROM outbox") == 0


async def test_a_scheduled_event_does_not_hold_back_its_keys_events_due_before_it(
    settings: Settings, engine: AsyncEngine, capture: AbstractQueue
) -> None:
    # Given K's event scheduled for later, then two of K's events due at once
    waiting = await publish(engine, settings, 0, ordering_key="K", delay=LATER)
    due = [await publish(engine, settings, n, ordering_key="K") for n in (1, 2)]

    # When a relay runs, then K's due events arrive in order, and the scheduled one waits
    async with running_relay(settings):
        got = await arrived(capture, 2)
    assert [uuid.UUID(m.message_id or "") for m in got] == due
    assert list(await scheduled(engine)) == [waiting]


async def test_a_notice_heard_while_a_move_runs_makes_the_relay_look_again_at_once(
    settings: Settings, engine: AsyncEngine, database_url: str
) -> None:
    # Given a relay's schedule, polling hourly, and a due event whose move will wait for a
    # producer transaction that is writing an event of its message id
    schedule = Schedule(engine, batch=10, poll_interval=3600, telemetry=Telemetry())
    repeated = await publish(engine, settings, 0, delay=LATER)
    await make_due(engine, repeated)
    producer = await asyncpg.connect(database_url)
    try:
        writing = producer.transaction()
        await writing.start()
        await outbox.publish(producer, "sched.1", {}, message_id=repeated)

        # When the schedule moves, and while the move runs (waiting for that producer) a
        # commit's "scheduled" notice is heard, then the producer rolls back
        moving = asyncio.create_task(schedule.move_due())

        async def the_move_waits() -> bool:
            waiting = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            return bool(await scalar(engine, waiting))

        await wait_until(the_move_waits)
        schedule.notice()
        await writing.rollback()
        assert await moving == 1
    finally:
        await producer.close()

    # Then the relay looks again at once: the event that notice was about may be due soon
    assert schedule.seconds_until_due() == 0


async def test_a_relay_publishes_nothing_early_and_a_due_event_promptly(
    settings: Settings, engine: AsyncEngine, capture: AbstractQueue
) -> None:
    async with running_relay(settings):
        # Given a scheduled event, then an event due at once committed after it
        waiting = await publish(engine, settings, 0, delay=LATER)
        marker = await publish(engine, settings, 1)

        # When the relay has published the later event: the scheduled one is not published
        (got,) = await arrived(capture, 1)
        assert got.message_id == str(marker)
        assert list(await scheduled(engine)) == [waiting]

        # Then once the database says it is due, the running relay publishes it
        await make_due(engine, waiting)
        (got,) = await arrived(capture, 1)
        assert got.message_id == str(waiting)
    assert await scheduled(engine) == {}


async def test_events_that_fell_due_while_no_relay_ran_are_published_once_one_starts(
    settings: Settings, engine: AsyncEngine, capture: AbstractQueue
) -> None:
    # Given K's events that fell due a minute ago and (scheduled after it) an hour ago while no
    # relay ran, and one still in the future
    recent = await publish(engine, settings, 0, ordering_key="K", at=END)
    old = await publish(engine, settings, 1, ordering_key="K", delay=LATER)
    future = await publish(engine, settings, 2, ordering_key="K", delay=LATER)
    await make_due(engine, old, ago=3600)
    await make_due(engine, recent, ago=60)

    # When a relay starts, then both due events are published, the earlier due first
    async with running_relay(settings):
        got = await arrived(capture, 2)
    assert [m.message_id for m in got] == [str(old), str(recent)]
    assert list(await scheduled(engine)) == [future]


async def test_a_keys_events_due_at_one_instant_arrive_in_the_order_scheduled(
    settings: Settings, engine: AsyncEngine, capture: AbstractQueue
) -> None:
    # Given K's events scheduled for one instant in five transactions, other keys' between them
    ours, others = [], []
    for n in range(5):
        ours.append(await publish(engine, settings, n, ordering_key="K", at=END))
        others.append(await publish(engine, settings, 10 + n, ordering_key=f"L{n}", at=END))
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE outbox_scheduled SET due_at = now()"))

    # When a relay runs, then K's arrive in the order they were scheduled
    async with running_relay(settings):
        got = await arrived(capture, 10)
    order = [uuid.UUID(m.message_id or "") for m in got]
    assert [m for m in order if m in ours] == ours
    assert set(order) == set(ours) | set(others)


async def test_a_due_event_whose_message_id_waits_in_the_outbox_holds_up_nothing(
    settings: Settings, engine: AsyncEngine, capture: AbstractQueue
) -> None:
    # Given an event scheduled with a message id, due, and an event of that message id due at once
    # that no relay has published yet (outbox's message ids are unique), then another event
    repeated = uuid.uuid4()
    await publish(engine, settings, 0, message_id=repeated, delay=LATER)
    await make_due(engine, repeated)
    await publish(engine, settings, 1, message_id=repeated)
    other = await publish(engine, settings, 2)

    # When a relay runs, then every event is published: the scheduled one once its namesake has
    # left the outbox (a mover inserting it beside its namesake would fail, and the relay with it)
    async with running_relay(settings):
        got = await arrived(capture, 3)
    assert sorted(m.message_id or "" for m in got) == sorted(map(str, [repeated, repeated, other]))
    assert [m.routing_key for m in got if m.message_id == str(repeated)] == ["sched.1", "sched.0"]
    assert await scheduled(engine) == {}
