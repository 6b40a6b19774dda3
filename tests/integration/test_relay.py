"""The outbox relay against the real PostgreSQL and RabbitMQ: every committed event arrives, with
a stable message id, once in normal operation and again (same id) after a crash; failures stay
with their row; an ordering key's events arrive in commit order even with two relays."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import pytest
from aio_pika import ExchangeType, Message
from aio_pika.abc import (
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import payment, rows, scalar, wait_until
from tests.integration.support import running_relay, running_worker, worker_process
from worker.faults import RELAY_AFTER_PUBLISH
from worker.settings import Settings
from worker.sql import outbox
from worker.sql.rows import OutboxMessage
from worker.telemetry import Count
from worker.transport.relay import Relay


@dataclass
class Capture:
    """A durable queue downstream of the relay, read in arrival order."""

    queue: AbstractQueue
    messages: list[AbstractIncomingMessage] = field(default_factory=list)

    async def drain(self) -> list[AbstractIncomingMessage]:
        while (message := await self.queue.get(fail=False, no_ack=True)) is not None:
            self.messages.append(message)
        return self.messages

    async def wait_for(self, count: int, timeout: float = 30.0) -> list[AbstractIncomingMessage]:
        async def enough() -> bool:
            return len(await self.drain()) >= count

        await wait_until(enough, timeout=timeout)
        return self.messages

    def ids(self) -> Counter[str]:
        return Counter(str(m.message_id) for m in self.messages)


@pytest.fixture
async def capture(settings: Settings, amqp: AbstractRobustConnection) -> AsyncIterator[Capture]:
    """The test's exchange, and a capture queue bound to every routing key but ``unrouted.*``."""
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(settings.exchange, ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(f"{settings.queue}.capture", durable=True)
    for pattern in ("event.#", "payment.settled"):
        await queue.bind(exchange, pattern)
    yield Capture(queue)
    await channel.queue_delete(queue.name)
    await channel.close()


def event(
    settings: Settings,
    n: int,
    *,
    routing_key: str = "event.created",
    ordering_key: str | None = None,
    exchange: str | None = None,
) -> OutboxMessage:
    return OutboxMessage(
        message_id=uuid.uuid4(),
        exchange=settings.exchange if exchange is None else exchange,
        routing_key=routing_key,
        body=f'{{"n": {n}}}'.encode(),
        content_type="application/json",
        headers={"tenant": "t1"},
        correlation_id=f"corr-{n}",
        causation_id=f"cause-{n}",
        ordering_key=ordering_key,
    )


async def commit(engine: AsyncEngine, messages: Sequence[OutboxMessage], *, each: bool) -> None:
    """Commit ``messages`` to the outbox, each in its own transaction or all in one."""
    for group in [[m] for m in messages] if each else [list(messages)]:
        async with engine.begin() as conn:
            await outbox.append_outbox(conn, group)


async def outbox_count(engine: AsyncEngine) -> int:
    return int(await scalar(engine, "SELECT count(*) FROM outbox"))


async def test_every_committed_event_arrives_persistent_with_its_ids(
    settings: Settings, engine: AsyncEngine, capture: Capture
) -> None:
    # Given 60 events committed in 60 transactions
    sent = [event(settings, n) for n in range(60)]
    await commit(engine, sent, each=True)

    # When a relay runs
    async with running_relay(settings) as relay:
        got = await capture.wait_for(len(sent))
        await wait_until(lambda: _is(outbox_count(engine), 0))

    # Then each arrived once, persistent, with the row's message id, content type and ids
    assert capture.ids() == Counter(str(m.message_id) for m in sent)
    by_id = {m.message_id: m for m in got}
    for m in sent:
        out = by_id[str(m.message_id)]
        assert out.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert out.content_type == "application/json"
        assert out.correlation_id == m.correlation_id
        assert out.headers["causation-id"] == m.causation_id
        assert out.headers["tenant"] == "t1"
        assert out.body == m.body
        assert out.timestamp is not None
    assert relay.stats[Count.RELAY_PUBLISHED] == len(sent)


async def test_two_relays_publish_each_row_once(
    settings: Settings, engine: AsyncEngine, capture: Capture
) -> None:
    # Given 400 events, and two relays taking small batches
    sent = [event(settings, n) for n in range(400)]
    await commit(engine, sent, each=False)
    small = settings.replace(relay_batch_size=7)

    # When both relay at once
    async with running_relay(small) as first, running_relay(small) as second:
        await capture.wait_for(len(sent))
        await wait_until(lambda: _is(outbox_count(engine), 0))
        await asyncio.sleep(0.3)  # room for a stray second publish to show up
        await capture.drain()

    # Then every row was published exactly once between them
    assert capture.ids() == Counter(str(m.message_id) for m in sent)
    assert first.stats[Count.RELAY_PUBLISHED] + second.stats[Count.RELAY_PUBLISHED] == len(sent)


async def test_a_relay_skips_rows_another_relay_holds(
    settings: Settings, engine: AsyncEngine, capture: Capture
) -> None:
    # Given 10 events, the first 4 of them claimed by a relay that is stuck mid-batch
    sent = [event(settings, n) for n in range(10)]
    await commit(engine, sent, each=False)
    async with engine.connect() as stuck, stuck.begin():
        held = await outbox.claim_outbox(stuck, 4)
        assert [r.message_id for r in held] == [m.message_id for m in sent[:4]]

        # When another relay runs meanwhile
        async with running_relay(settings):
            await capture.wait_for(6)
            await asyncio.sleep(0.2)
            await capture.drain()

        # Then it published the other 6 without waiting for the stuck one, and not its rows
        assert capture.ids() == Counter(str(m.message_id) for m in sent[4:])
        await stuck.rollback()
    assert await outbox_count(engine) == 4


async def test_the_broker_down_then_up_loses_nothing(
    settings: Settings,
    engine: AsyncEngine,
    capture: Capture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = [event(settings, n) for n in range(20)]
    later = [event(settings, n) for n in range(20, 50)]
    async with running_relay(settings.replace(relay_poll_interval=0.2)) as relay:
        # Given a relay that has published the first events
        await commit(engine, first, each=True)
        await capture.wait_for(len(first))

        # When RabbitMQ stops, events are committed meanwhile, and RabbitMQ comes back
        _rabbitmqctl("stop_app")
        try:
            caplog.clear()
            await commit(engine, later, each=True)

            def retries() -> int:
                relay_log = [r for r in caplog.records if r.name == "worker.transport.relay"]
                return sum("Retrying" in r.getMessage() for r in relay_log)

            async def retrying() -> bool:
                return retries() >= 1

            await wait_until(retrying, timeout=30)
            # (the rows stay while the broker is away, and the relay backs off: a hot loop
            # would retry hundreds of times in a few seconds)
            await asyncio.sleep(3)
            assert await outbox_count(engine) == len(later)
            assert retries() <= 12
        finally:
            _rabbitmqctl("start_app")
            _rabbitmqctl("await_startup")

        # Then every event arrives
        await wait_until(lambda: _is(outbox_count(engine), 0), timeout=60)
    await capture.wait_for(len(first) + len(later))
    assert set(capture.ids()) == {str(m.message_id) for m in first + later}
    assert relay.stats[Count.RELAY_PUBLISHED] >= len(first) + len(later)


async def test_a_failing_row_backs_off_then_is_parked_while_others_flow(
    settings: Settings, engine: AsyncEngine, capture: Capture
) -> None:
    # Given an unroutable event, one for a missing exchange, and 30 good ones around them
    unroutable = event(settings, 0, routing_key="unrouted.event")
    nowhere = event(settings, 1, exchange=f"{settings.exchange}-missing")
    good = [event(settings, n) for n in range(2, 32)]
    await commit(engine, [good[0], unroutable, *good[1:15], nowhere, *good[15:]], each=True)
    fast = settings.replace(relay_max_attempts=3, relay_retry_delay=0.05, relay_poll_interval=0.1)

    # When a relay runs
    async with running_relay(fast) as relay:
        await capture.wait_for(len(good))

        async def both_parked() -> bool:
            return await scalar(engine, "SELECT count(*) FROM outbox_parked") == 2

        await wait_until(both_parked)

    # Then the good ones arrived once each, and each bad one was tried 3 times and parked
    assert capture.ids() == Counter(str(m.message_id) for m in good)
    parked = {
        r.message_id: r
        for r in await rows(
            engine,
            "SELECT message_id, attempts, last_error, routing_key, body FROM outbox_parked",
        )
    }
    assert parked.keys() == {unroutable.message_id, nowhere.message_id}
    assert parked[unroutable.message_id].attempts == 3
    assert "unroutable" in parked[unroutable.message_id].last_error
    assert parked[unroutable.message_id].body == unroutable.body
    assert "does not exist" in parked[nowhere.message_id].last_error
    assert await outbox_count(engine) == 0
    assert relay.stats[Count.RELAY_PARKED] == 2
    assert relay.stats[Count.RELAY_FAILED] == 6


async def test_a_row_the_broker_nacks_backs_off_then_is_parked_while_others_flow(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, capture: Capture
) -> None:
    # Given a queue that refuses every publish (length 0, reject-publish) bound to one routing
    # key, an event for it and 10 good ones around it
    channel = await amqp.channel()
    exchange = await channel.get_exchange(settings.exchange)
    full = await channel.declare_queue(
        f"{settings.queue}.full",
        durable=True,
        arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
    )
    await full.bind(exchange, "refused.event")
    refused = event(settings, 0, routing_key="refused.event")
    good = [event(settings, n) for n in range(1, 11)]
    await commit(engine, [*good[:5], refused, *good[5:]], each=True)
    fast = settings.replace(relay_max_attempts=3, relay_retry_delay=0.05, relay_poll_interval=0.1)

    # When a relay runs
    try:
        async with running_relay(fast) as relay:
            await capture.wait_for(len(good))

            async def parked() -> bool:
                return await scalar(engine, "SELECT count(*) FROM outbox_parked") == 1

            await wait_until(parked)
    finally:
        await channel.queue_delete(full.name)
        await channel.close()

    # Then the good ones arrived once each, and the nacked one failed 3 times and was parked
    assert capture.ids() == Counter(str(m.message_id) for m in good)
    (row,) = await rows(engine, "SELECT message_id, attempts, last_error FROM outbox_parked")
    assert row.message_id == refused.message_id
    assert row.attempts == 3
    assert "nacked by the broker" in row.last_error
    assert await outbox_count(engine) == 0
    assert relay.stats[Count.RELAY_PARKED] == 1
    assert relay.stats[Count.RELAY_FAILED] == 3


async def test_each_failure_doubles_the_wait_before_the_next_try(engine: AsyncEngine) -> None:
    settings = Settings(exchange="events")
    async with engine.connect() as conn, conn.begin():
        await outbox.append_outbox(conn, [event(settings, 0)])
        (row_id,) = (await conn.execute(text("SELECT id FROM outbox"))).one()
        waits = []
        for _ in range(4):  # now() stands still inside one transaction
            parked = await outbox.fail_outbox(
                conn, {row_id: "returned"}, max_attempts=5, retry_delay=0.5
            )
            assert parked == []
            wait = "SELECT extract(epoch FROM available_at - now()) FROM outbox"
            waits.append(float((await conn.execute(text(wait))).scalar_one()))
        assert waits == [0.5, 1.0, 2.0, 4.0]
        await outbox.fail_outbox(conn, {row_id: "returned"}, max_attempts=5, retry_delay=0.5)
        assert (await conn.execute(text("SELECT count(*) FROM outbox"))).scalar_one() == 0
        await conn.rollback()


async def test_a_later_row_of_a_key_waits_behind_an_older_one(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given two rows of key "a" and two of "b"; "a"'s oldest row waits for a retry
    rows_ = [event(settings, n, ordering_key=k) for n, k in enumerate("aabb")]
    rows_.append(event(settings, 4))
    await commit(engine, rows_, each=True)
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE outbox SET available_at = now() + interval '1 h' WHERE message_id = :m"),
            {"m": rows_[0].message_id},
        )

    # When a relay claims, another relay holding "b"'s oldest row
    async with engine.connect() as other, other.begin():
        await other.execute(
            text("SELECT id FROM outbox WHERE message_id = :m FOR UPDATE"),
            {"m": rows_[2].message_id},
        )
        async with engine.connect() as conn, conn.begin():
            claimed = await outbox.claim_outbox(conn, 10)

    # Then only the unordered row is returned: no key's row may overtake an older one
    assert [r.message_id for r in claimed] == [rows_[4].message_id]


async def test_rows_behind_a_row_waiting_for_its_retry_do_not_fill_the_claim(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given key "a": its oldest row waiting for a retry and 10 more behind it; then a row of "b"
    # and one without a key
    rows_ = [event(settings, n, ordering_key="a") for n in range(11)]
    rows_ += [event(settings, 11, ordering_key="b"), event(settings, 12)]
    await commit(engine, rows_, each=False)
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE outbox SET available_at = now() + interval '1 h' WHERE message_id = :m"),
            {"m": rows_[0].message_id},
        )

    # When a relay claims 5 rows
    async with engine.connect() as conn, conn.begin():
        claimed = await outbox.claim_outbox(conn, 5)

    # Then "a"'s held-back rows did not take its 5 places: it got the rows that can go
    assert [r.message_id for r in claimed] == [rows_[11].message_id, rows_[12].message_id]


async def test_a_busy_key_is_neither_claimed_nor_locked(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given three rows of key "a", two of "b" and one without a key
    rows_ = [event(settings, n, ordering_key=k) for n, k in enumerate(["a", "b", "a", "b", "a"])]
    rows_.append(event(settings, 5))
    await commit(engine, rows_, each=True)

    # When a relay claims with "a" in flight (an earlier batch of its own still publishing it)
    async with engine.connect() as conn, conn.begin():
        claimed = await outbox.claim_outbox(conn, 3, busy=["a"])

        # Then it gets "b"'s run and the unordered row, within its limit, and leaves "a" unlocked
        assert [r.message_id for r in claimed] == [rows_[i].message_id for i in (1, 3, 5)]
        async with engine.connect() as other, other.begin():
            free = await other.execute(
                text("SELECT message_id FROM outbox ORDER BY id FOR UPDATE SKIP LOCKED")
            )
            assert [m for (m,) in free] == [rows_[i].message_id for i in (0, 2, 4)]


async def test_an_ordering_key_gives_ids_in_commit_order(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a transaction that appended an event of key "k" and has not committed
    async with engine.connect() as first:
        await first.begin()
        await outbox.append_outbox(first, [event(settings, 1, ordering_key="k")])

        # When a second transaction appends another event of "k"
        async def second() -> None:
            async with engine.begin() as conn:
                await outbox.append_outbox(conn, [event(settings, 2, ordering_key="k")])

        task = asyncio.create_task(second())

        # Then it waits for the first to end, and so gets the later id
        async def waiting_on_the_key() -> bool:
            sql = (
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
            )
            return bool(await scalar(engine, sql))

        await wait_until(waiting_on_the_key)
        assert not task.done()
        await first.commit()
    await task
    order = await rows(engine, "SELECT body FROM outbox ORDER BY id")
    assert [bytes(r.body) for r in order] == [b'{"n": 1}', b'{"n": 2}']


async def test_one_notify_per_committed_transaction(
    settings: Settings, engine: AsyncEngine, database_url: str
) -> None:
    listener = await asyncpg.connect(database_url)
    heard: list[str] = []
    await listener.add_listener(outbox.OUTBOX_CHANNEL, lambda *args: heard.append(args[2]))
    try:
        async with engine.begin() as conn:  # three events, one transaction
            await outbox.append_outbox(conn, [event(settings, n) for n in range(3)], notify=True)
        async with engine.begin() as conn:  # no events: no notification
            await outbox.append_outbox(conn, [], notify=True)

        async def heard_one() -> bool:
            return len(heard) == 1

        await wait_until(heard_one)
        await asyncio.sleep(0.2)
        assert len(heard) == 1
    finally:
        await listener.close()


async def test_payment_events_arrive_in_commit_order_per_account_under_two_relays(
    settings: Settings,
    engine: AsyncEngine,
    capture: Capture,
    amqp: AbstractRobustConnection,
) -> None:
    # Given a worker without its own relay, two relays with tiny batches, and 150 payments over
    # 3 accounts processed 4 at a time (so their transactions interleave)
    consumer_only = settings.replace(relay=False, concurrency=4)
    relays = settings.replace(relay_batch_size=3)
    rng = random.Random(3)
    sent = [payment(f"p{i}", f"acct-{rng.randrange(3)}", rng.randint(1, 900)) for i in range(150)]
    async with (
        running_worker(consumer_only, payments),
        running_relay(relays),
        running_relay(relays),
    ):
        channel = await amqp.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)
        for p in sent:
            body = Message(
                json.dumps(p).encode(),
                message_id=p["payment_id"],
                content_type="application/json",
            )
            await exchange.publish(body, "payment.requested")
        got = await capture.wait_for(len(sent))

    # Then per account, each event's balance is the previous one plus its amount: commit order
    balances: dict[str, int] = {}
    for message in got:
        settled = json.loads(message.body)
        previous = balances.get(settled["account"], 0)
        assert settled["balance_cents"] == previous + settled["amount_cents"], settled
        balances[settled["account"]] = settled["balance_cents"]
    assert len(capture.ids()) == len(sent)


async def test_a_relay_killed_after_publishing_publishes_again_with_the_same_ids(
    settings: Settings, engine: AsyncEngine, capture: Capture, tmp_path: Path
) -> None:
    # Given 5 committed events
    sent = [event(settings, n) for n in range(5)]
    await commit(engine, sent, each=False)

    # When a relay process dies right after the broker confirmed its batch, before its commit
    log = tmp_path / "relay.log"
    with worker_process(settings, log, "relay", WORKER_CRASH_AT=RELAY_AFTER_PUBLISH) as process:
        code = await asyncio.to_thread(process.wait, 60)
    assert code == -signal.SIGKILL, log.read_text()
    await capture.wait_for(len(sent))

    # Then the rows are all still there, and the next relay publishes them again, same ids
    assert await outbox_count(engine) == len(sent)
    async with running_relay(settings):
        await capture.wait_for(2 * len(sent))
        await wait_until(lambda: _is(outbox_count(engine), 0))
    assert capture.ids() == Counter({str(m.message_id): 2 for m in sent})


async def test_a_new_exchange_is_probed_once_not_once_per_row(
    settings: Settings,
    engine: AsyncEngine,
    capture: Capture,
    amqp: AbstractRobustConnection,
) -> None:
    # Given 300 events without an ordering key (a batch publishes them all at once)
    sent = [event(settings, n) for n in range(300)]
    await commit(engine, sent, each=False)
    opened = Counter[str]()

    class Counting(Relay):
        async def _exchange(self, name: str) -> AbstractExchange | None:
            opened["asked"] += 1
            return await super()._exchange(name)

    class CountingConnection:
        def channel(self, **kwargs: Any) -> Any:
            opened["channels"] += 1
            return amqp.channel(**kwargs)

    relay = Counting(settings, engine, CountingConnection())  # type: ignore[arg-type]

    # When a relay publishes them
    async with running(relay):
        await capture.wait_for(len(sent))

    # Then it asked for the exchange once per batch, and opened one probe channel (and its
    # publishing channel), not one per row
    assert opened["channels"] == 2
    assert opened["asked"] <= len(sent) // settings.relay_batch_size + 1


@contextlib.asynccontextmanager
async def running(relay: Relay) -> AsyncIterator[asyncio.Task[None]]:
    """``relay.run`` in a task; on exit, stop it and wait for it (its error is raised)."""
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=120)


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def test_a_settlement_event_published_twice_makes_one_notice(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given the payments worker, and a payment.settled event the relay published twice
    settled = {**payment("p1", "alice", 250), "balance_cents": 250}
    event_id = str(uuid.uuid4())
    async with running_worker(settings.replace(relay=False), payments) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)
        for _ in range(2):
            message = Message(
                json.dumps(settled).encode(),
                message_id=event_id,
                content_type="application/json",
            )
            await exchange.publish(message, "payment.settled")

        async def both_handled() -> bool:
            return worker.stats[Count.PROCESSED] + worker.stats[Count.DUPLICATE] == 2

        await wait_until(both_handled)

    # Then one notice was recorded, under the event's id, and the repeat counted as a duplicate
    notices = await rows(
        engine, "SELECT payment_id, event_id, balance_cents FROM settlement_notices"
    )
    assert [tuple(n) for n in notices] == [("p1", event_id, 250)]
    assert (worker.stats[Count.PROCESSED], worker.stats[Count.DUPLICATE]) == (1, 1)
