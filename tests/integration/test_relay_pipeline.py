"""The relay's pipeline against the real PostgreSQL and RabbitMQ: with several batches in flight at
once (their confirms slowed down so that they overlap), an ordering key's events still arrive one
at a time in commit order and never past a failed one, shutdown lets the batches in flight commit,
and a batch that fails mid-pipeline loses nothing and deletes nothing twice."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import aiormq.exceptions
import pytest
from aio_pika import ExchangeType
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import rows, scalar, wait_until
from tests.integration import test_relay
from tests.integration.test_relay import Capture, commit, outbox_count, running
from worker.settings import Settings
from worker.sql import outbox
from worker.sql.outbox import OutboxRow
from worker.sql.rows import OutboxMessage
from worker.telemetry import Count
from worker.transport.publisher import Channel
from worker.transport.relay import Relay

KEYS = ("k0", "k1", "k2", "k3")

capture = test_relay.capture
"""The capture queue of ``test_relay``: bound to the test's exchange for ``event.#``."""


class SlowRelay(Relay):
    """A relay whose every publish first waits up to ``delay`` seconds (so that batches overlap),
    that may raise ``fail(row)`` instead of publishing a row, and that records how many batches
    were publishing at once."""

    def __init__(
        self,
        *args: Any,
        delay: float,
        fail: Callable[[OutboxRow], BaseException | None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.fail = fail
        self.rng = random.Random(7)
        self.publishing = 0
        self.most_publishing = 0

    async def _publish(self, rows: list[OutboxRow]) -> tuple[list[int], dict[int, str]]:
        self.publishing += 1
        self.most_publishing = max(self.most_publishing, self.publishing)
        try:
            return await super()._publish(rows)
        finally:
            self.publishing -= 1

    async def _publish_one(self, channel: Channel, row: OutboxRow, exists: bool) -> str | None:
        await asyncio.sleep(self.rng.uniform(0, self.delay))
        if self.fail is not None and (error := self.fail(row)) is not None:
            raise error
        return await super()._publish_one(channel, row, exists)


def sequenced(settings: Settings, per_key: int, seed: int) -> list[OutboxMessage]:
    """``per_key`` events of each of ``KEYS``, shuffled together; each carries its key's sequence
    number, and the list's order is the order they will be committed in."""
    keys = [k for k in KEYS for _ in range(per_key)]
    random.Random(seed).shuffle(keys)
    seq: Counter[str] = Counter()
    messages = []
    for key in keys:
        messages.append(
            OutboxMessage(
                message_id=uuid.uuid4(),
                exchange=settings.exchange,
                routing_key="event.sequenced",
                body=json.dumps({"key": key, "seq": seq[key]}).encode(),
                content_type="application/json",
                headers={},
                correlation_id=None,
                causation_id=None,
                ordering_key=key,
            )
        )
        seq[key] += 1
    return messages


def arrivals(capture: Capture) -> dict[str, list[int]]:
    """The sequence numbers each key's events arrived with, in arrival order."""
    got: dict[str, list[int]] = defaultdict(list)
    for message in capture.messages:
        body = json.loads(message.body)
        got[body["key"]].append(body["seq"])
    return got


def first_arrivals(capture: Capture) -> dict[str, list[int]]:
    """As ``arrivals``, each event counted at its first arrival only (a rolled-back batch
    publishes its confirmed rows again)."""
    return {key: list(dict.fromkeys(seqs)) for key, seqs in arrivals(capture).items()}


@pytest.mark.parametrize(
    "batch_size",
    [
        pytest.param(6, id="first-rows"),  # 4 keys in 6 rows: each key's first row per batch
        pytest.param(16, id="runs"),  # 4 keys in 16 rows: each key's run, one row at a time
    ],
)
async def test_pipelined_batches_keep_each_keys_order_and_hold_it_behind_a_failed_row(
    settings: Settings,
    engine: AsyncEngine,
    capture: Capture,
    amqp: AbstractRobustConnection,
    batch_size: int,
) -> None:
    # Given 50 events of each of 4 keys, interleaved, and k1's 21st addressed to an exchange
    # that does not exist yet (its publish fails until it does)
    late_exchange = f"{settings.exchange}-late"
    sent = sequenced(settings, 50, seed=1)
    stuck = next(i for i, m in enumerate(sent) if json.loads(m.body) == {"key": "k1", "seq": 20})
    sent[stuck] = dataclasses.replace(sent[stuck], exchange=late_exchange)
    await commit(engine, sent, each=False)
    fast = settings.replace(
        relay_batch_size=batch_size,
        relay_retry_delay=0.05,
        relay_poll_interval=0.05,
        relay_max_attempts=50,
    )
    relay = SlowRelay(fast, engine, amqp, delay=0.02)

    # When a relay with slowed confirms (so that its batches overlap) runs
    async with running(relay):

        async def failed_twice() -> bool:
            sql = "SELECT attempts FROM outbox WHERE message_id = :m"
            return (await scalar(engine, sql, m=sent[stuck].message_id) or 0) >= 2

        await wait_until(failed_twice, timeout=30)
        others = sum(1 for m in sent if m.ordering_key != "k1")
        await capture.wait_for(others + 20)
        await asyncio.sleep(0.3)  # room for a row of k1 that overtook to show up
        await capture.drain()

        # Then, while its 21st row fails, k1 stops at its 20th; the other keys went on
        assert arrivals(capture)["k1"] == list(range(20))
        assert {k: len(v) for k, v in arrivals(capture).items()} == {
            "k0": 50,
            "k1": 20,
            "k2": 50,
            "k3": 50,
        }

        # When the exchange appears
        channel = await amqp.channel()
        exchange = await channel.declare_exchange(late_exchange, ExchangeType.TOPIC, durable=True)
        await capture.queue.bind(exchange, "event.#")
        await capture.wait_for(len(sent))
        await wait_until(lambda: _is(outbox_count(engine), 0))

    # Then every key's events arrived once each, in commit order, and batches did overlap
    assert arrivals(capture) == {k: list(range(50)) for k in KEYS}
    assert relay.telemetry.stats[Count.RELAY_PUBLISHED] == len(sent)
    assert relay.most_publishing >= 2
    await channel.exchange_delete(late_exchange)
    await channel.close()


async def test_stopping_lets_the_batches_in_flight_commit(
    settings: Settings,
    engine: AsyncEngine,
    capture: Capture,
    amqp: AbstractRobustConnection,
) -> None:
    # Given 120 events and a relay with slow confirms, several batches of it in flight, one of
    # them with rows confirmed but not yet deleted
    sent = sequenced(settings, 30, seed=2)
    await commit(engine, sent, each=False)
    relay = SlowRelay(settings.replace(relay_batch_size=10), engine, amqp, delay=0.3)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))

    async def caught_mid_batch() -> bool:
        # batches overlap, and one of them has published rows it has not committed yet
        arrived = len(await capture.drain())
        return relay.publishing >= 2 and arrived > relay.telemetry.stats[Count.RELAY_PUBLISHED]

    await wait_until(caught_mid_batch, timeout=30, interval=0.01)

    # When it is told to stop
    stop.set()
    await asyncio.wait_for(task, 30)

    # Then what it published is deleted and counted, and what it did not is still there: no
    # batch was cut off between its confirms and its commit
    await asyncio.sleep(0.2)
    await capture.drain()
    published = set(capture.ids())
    left = {str(r.message_id) for r in await rows(engine, "SELECT message_id FROM outbox")}
    assert published
    assert left
    assert published.isdisjoint(left)
    assert published | left == {str(m.message_id) for m in sent}
    assert relay.telemetry.stats[Count.RELAY_PUBLISHED] == len(published)
    assert max(capture.ids().values()) == 1
    for key, seqs in arrivals(capture).items():
        assert seqs == list(range(len(seqs))), key


async def test_cancelled_after_the_grace_period_the_batches_in_flight_roll_back(
    settings: Settings,
    engine: AsyncEngine,
    capture: Capture,
    amqp: AbstractRobustConnection,
) -> None:
    # Given a relay whose confirms take far longer than a shutdown's grace period, stopping
    sent = [dataclasses.replace(m, ordering_key=None) for m in sequenced(settings, 10, seed=5)]
    await commit(engine, sent, each=False)
    relay = SlowRelay(settings.replace(relay_batch_size=10), engine, amqp, delay=60)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))

    async def overlapping() -> bool:
        return relay.publishing >= 2

    await wait_until(overlapping, timeout=30)
    stop.set()
    await asyncio.sleep(0.2)

    # When the grace period runs out and it is cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)

    # Then its batches were cancelled too, not waited for: they rolled back, every row is left
    assert relay.telemetry.stats[Count.RELAY_PUBLISHED] == 0
    assert await outbox_count(engine) == len(sent)


@pytest.mark.parametrize("where", ["publish", "delete"])
async def test_an_outage_in_one_batch_loses_nothing_and_deletes_each_row_once(
    settings: Settings,
    engine: AsyncEngine,
    capture: Capture,
    amqp: AbstractRobustConnection,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    # Given 160 events, and a connection lost once mid-pipeline: in the middle of a batch's
    # publishes, or at its delete (after its confirms)
    sent = sequenced(settings, 40, seed=3)
    await commit(engine, sent, each=False)
    outages = 0

    def lost(when: bool) -> BaseException | None:
        nonlocal outages
        if when and outages == 0:
            outages += 1
            return ConnectionError("connection lost (injected)")
        return None

    calls = Counter[str]()

    def fail_publish(_: OutboxRow) -> BaseException | None:
        calls["publish"] += 1
        return lost(where == "publish" and calls["publish"] == 45)

    delete_outbox = outbox.delete_outbox

    async def failing_delete(conn: Any, ids: Any) -> None:
        calls["delete"] += 1
        if error := lost(where == "delete" and calls["delete"] == 4):
            raise error
        await delete_outbox(conn, ids)

    monkeypatch.setattr(outbox, "delete_outbox", failing_delete)
    relay = SlowRelay(
        settings.replace(relay_batch_size=8), engine, amqp, delay=0.01, fail=fail_publish
    )

    # When the relay drains them
    async with running(relay):
        await wait_until(lambda: _is(outbox_count(engine), 0), timeout=60)
        await capture.wait_for(len(sent))
        await asyncio.sleep(0.2)
        await capture.drain()

    # Then the batch rolled back and was retried: every event arrived, those the failed batch
    # had published arrived twice (same message id), each row was deleted (counted) once, and
    # each key's events first arrived in commit order
    assert outages == 1
    assert set(capture.ids()) == {str(m.message_id) for m in sent}
    assert relay.telemetry.stats[Count.RELAY_PUBLISHED] == len(sent)
    assert first_arrivals(capture) == {k: list(range(40)) for k in KEYS}
    if where == "delete":
        assert sum(capture.ids().values()) > len(sent)


async def test_a_channel_closed_under_the_relay_fails_its_batches_and_the_new_one_publishes(
    settings: Settings, engine: AsyncEngine, capture: Capture, amqp: AbstractRobustConnection
) -> None:
    # Given 40 events of each of 4 keys, drained by a relay with slowed confirms
    sent = sequenced(settings, 40, seed=3)
    await commit(engine, sent, each=False)
    fast = settings.replace(relay_batch_size=8, relay_retry_delay=0.05, relay_poll_interval=0.05)
    relay = SlowRelay(fast, engine, amqp, delay=0.01)
    async with running(relay):
        await capture.wait_for(20)
        assert relay._channel is not None
        before = await relay._channel.get_underlay_channel()

        # When the broker closes its publishing channel mid-run (a publish to a missing
        # exchange is a channel error)
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
            await before.basic_publish(b"{}", exchange=f"{settings.exchange}-none", routing_key="x")
        await wait_until(lambda: _is(outbox_count(engine), 0), timeout=60)
        await capture.wait_for(len(sent))
        await asyncio.sleep(0.2)
        await capture.drain()
        after = await relay._channel.get_underlay_channel()

    # Then the relay went on on the channel the robust connection opened in its place: every
    # event arrived (those of the failed batches perhaps twice, same id), each row was deleted
    # once, and each key's events first arrived in commit order
    assert before.is_closed
    assert after is not before
    assert set(capture.ids()) == {str(m.message_id) for m in sent}
    assert relay.telemetry.stats[Count.RELAY_PUBLISHED] == len(sent)
    assert first_arrivals(capture) == {k: list(range(40)) for k in KEYS}


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)
