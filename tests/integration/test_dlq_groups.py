"""``worker.ops.dlq`` as the console uses it, against the real RabbitMQ and PostgreSQL: a scan
takes no more than its limit and says when the queue holds more, groups count what it took, a
selection of ids acts on those copies only, an action confirmed after a preview leaves what was
parked since, and the DLQ's depth is read without ever declaring it.

A sweep takes the queue a chunk at a time (``dlq.CHUNK``, made 3 here so that five or eight
copies span chunks): it keeps the queue's order across chunks (a quorum queue's too, when it
reaches its end), takes no more than a chunk ahead of what it has shown, finds each chunk's
records in one primary-key lookup, and is not stalled by a message the queue counted but never
delivers.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime, timedelta

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import broker_depth, rows, wait_until
from tests.integration.test_console_plans import Explain
from tests.integration.test_dlq import HANDLER, OTHER_HANDLER, Copy, park, parked_keys
from worker.ops import dlq
from worker.settings import Settings
from worker.sql import parkings


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeps take 3 messages at a time, so that a few copies span several chunks."""
    monkeypatch.setattr(dlq, "CHUNK", 3)


COPIES = (
    Copy("k1"),
    Copy("k2", reason="invalid"),
    Copy("k3", handler=OTHER_HANDLER),
    Copy("k4", age=timedelta(minutes=5)),
    Copy("k5"),
)


async def test_groups_count_the_first_messages_of_a_scan_and_say_when_there_are_more(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given five parked messages: three handler errors of one handler, one invalid, one of
    # another handler
    await park(amqp, engine, settings, *COPIES)

    # When they are grouped, with room for all and with room for three
    everything = await dlq.grouped(amqp, engine, settings)
    first_three = await dlq.grouped(amqp, engine, settings, scan_limit=3)
    one_handler = await dlq.grouped(
        amqp, engine, settings, selection=dlq.Selection(handler=HANDLER)
    )

    # Then the groups count what the scan took, and say when the queue held more
    assert [(g.reason, g.handler, g.count) for g in everything.groups] == [
        ("handler-error", HANDLER, 3),
        ("handler-error", OTHER_HANDLER, 1),
        ("invalid", HANDLER, 1),
    ]
    assert (everything.scanned, everything.more, everything.count) == (5, False, 5)
    errors = everything.groups[0]
    assert errors.first is not None
    assert errors.last is not None
    assert errors.last - errors.first > timedelta(minutes=4)  # k4 was parked 5 minutes earlier
    assert errors.example == "KeyError: 'account'"
    assert (first_three.scanned, first_three.more, first_three.count) == (3, True, 3)
    assert [(g.reason, g.handler) for g in one_handler.groups] == [
        ("handler-error", HANDLER),
        ("invalid", HANDLER),
    ]
    assert one_handler.scanned == 5
    # and the queue is as it was
    assert await parked_keys(amqp, engine, settings) == ["k1", "k2", "k3", "k4", "k5"]


async def test_a_scan_bounds_what_a_filtered_action_takes(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given five parked messages
    await park(amqp, engine, settings, *COPIES)

    # When the handler errors are replayed within a scan of the first two messages
    scan = dlq.Scan(2)
    tally = await dlq.Tally().carry_out(
        dlq.replaying(
            amqp, engine, settings, selection=dlq.Selection(reason="handler-error"), scan=scan
        )
    )

    # Then only k1 went back (k2 is invalid; the rest were beyond the scan), and the scan says
    # the queue held more
    assert tally.done_count == 1
    assert (scan.taken, scan.more) == (2, True)
    assert await parked_keys(amqp, engine, settings) == ["k2", "k3", "k4", "k5"]
    assert await broker_depth(settings.queue) == 1


async def test_a_selection_of_ids_purges_those_copies_only(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given five parked messages
    await park(amqp, engine, settings, *COPIES)
    listed = await dlq.list_parked(amqp, engine, settings)
    chosen = frozenset({listed[1].id, listed[3].id})

    # When two of them, ticked by id, are purged
    tally = await dlq.Tally().carry_out(
        dlq.purging(amqp, engine, settings, selection=dlq.Selection(ids=chosen))
    )

    # Then those two are gone, with their records, and the others keep their order
    assert tally.done_count == 2
    assert await parked_keys(amqp, engine, settings) == ["k1", "k3", "k5"]
    records = await rows(engine, "SELECT key FROM dead_letters ORDER BY key")
    assert [key for (key,) in records] == ["k1", "k3", "k5"]


async def test_an_action_confirmed_after_its_preview_leaves_what_was_parked_since(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a message parked before a preview was made and one parked after it
    await park(amqp, engine, settings, Copy("k-before", age=timedelta(minutes=1)))
    preview_made = datetime.now(UTC) - timedelta(seconds=30)
    await park(amqp, engine, settings, Copy("k-after"))

    # When the replay is confirmed with the preview's time
    tally = await dlq.Tally().carry_out(
        dlq.replaying(amqp, engine, settings, parked_before=preview_made)
    )

    # Then only the message the preview saw went back
    assert tally.done_count == 1
    assert await parked_keys(amqp, engine, settings) == ["k-after"]


async def test_find_stops_at_its_limit(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, *COPIES)
    [third] = (await dlq.list_parked(amqp, engine, settings))[2:3]

    [shown] = await dlq.find(amqp, engine, settings, third.id, limit=1)
    beyond = await dlq.find(amqp, engine, settings, third.id, scan=dlq.Scan(2))

    assert shown.parked.key == "k3"
    assert shown.body == b'{"n": 1}'
    assert beyond == []


async def test_the_depth_of_a_missing_dlq_is_none_and_it_stays_missing(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given no DLQ yet, a look says so and declares nothing (else the second would find it)
    assert await dlq.depth(amqp, settings) is None
    assert await dlq.depth(amqp, settings) is None

    # When messages are parked, its depth counts them
    await park(amqp, engine, settings, *COPIES[:2])
    assert await dlq.depth(amqp, settings) == 2


EIGHT = tuple(Copy(f"k{n}") for n in range(1, 9))


async def depths_while_browsing(
    amqp: AbstractRobustConnection, engine: AsyncEngine, settings: Settings, shown: int
) -> list[int | None]:
    """The DLQ's ready messages after each of the first ``shown`` messages a browse shows
    (once the broker counts every message ready: a closed sweep's return to the queue can
    take a moment to show in the count)."""

    async def all_ready() -> bool:
        return await dlq.depth(amqp, settings) == await broker_depth(settings.dead_letter_queue)

    await wait_until(all_ready)
    depths = []
    async with contextlib.aclosing(dlq.browse(amqp, engine, settings)) as outcomes:
        for _ in range(shown):
            await anext(outcomes)
            depths.append(await dlq.depth(amqp, settings))
    return depths


async def test_a_sweep_takes_a_chunk_at_a_time_and_keeps_the_order_across_chunks(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given eight parked messages of 8 bytes each
    await park(amqp, engine, settings, *EIGHT)

    # When a browse shows its first two, with chunks of 3, and with room for 20 bytes of bodies
    three = await depths_while_browsing(amqp, engine, settings, 2)
    monkeypatch.setattr(dlq, "CHUNK_BYTES", 20)
    twenty_bytes = await depths_while_browsing(amqp, engine, settings, 2)

    # Then it took the first alone (its size unknown), then a chunk, and no more: the rest are
    # still ready
    assert three == [7, 4]
    assert twenty_bytes == [7, 5]  # 20 bytes: two bodies of 8
    # And every sweep sees all eight in the queue's order, which it leaves as it was
    assert await parked_keys(amqp, engine, settings) == [f"k{n}" for n in range(1, 9)]
    scanned = await dlq.grouped(amqp, engine, settings, scan_limit=7)
    assert (scanned.scanned, scanned.more, scanned.count) == (7, True, 7)
    assert await broker_depth(settings.dead_letter_queue) == 8


async def test_actions_across_chunks_act_in_order_and_keep_the_rest_in_order(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given eight parked messages
    await park(amqp, engine, settings, *EIGHT)
    listed = await dlq.list_parked(amqp, engine, settings)
    chosen = frozenset(listed[n].id for n in (1, 3, 6))  # k2, k4, k7: in three chunks

    # When three of them, in three different chunks, are purged by id, and then the first
    # four of the rest replayed
    purged = dlq.purging(amqp, engine, settings, selection=dlq.Selection(ids=chosen))
    purged_keys = [outcome.parked.key async for outcome in purged]
    replayed = await dlq.replay(amqp, engine, settings, limit=4)

    # Then each was done in the queue's order, and the one left is the last
    assert purged_keys == ["k2", "k4", "k7"]
    assert [parked.key for parked in replayed] == ["k1", "k3", "k5", "k6"]
    assert await parked_keys(amqp, engine, settings) == ["k8"]
    assert await broker_depth(settings.queue) == 4
    records = await rows(engine, "SELECT key FROM dead_letters ORDER BY key")
    assert [key for (key,) in records] == ["k1", "k3", "k5", "k6", "k8"]


async def test_a_message_the_queue_counted_but_never_delivers_does_not_stall_a_sweep(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a parked copy, and behind it a message that expires (1 ms) while it waits: the
    # queue counts it ready until it reaches the head, and then drops it instead of
    # delivering it
    monkeypatch.setattr(dlq, "STALL_SECONDS", 0.2)
    await park(amqp, engine, settings, Copy("k1"))
    async with amqp.channel() as channel:
        expiring = aio_pika.Message(b"{}", headers={"idempotency-key": "k-gone"}, expiration=0.001)
        await channel.default_exchange.publish(expiring, routing_key=settings.dead_letter_queue)

    # When the DLQ is listed
    listed = await parked_keys(amqp, engine, settings)

    # Then the sweep ends with the copy it was given, and the copy stays parked
    assert listed == ["k1"]
    assert await parked_keys(amqp, engine, settings) == ["k1"]


async def test_a_chunks_records_are_found_in_one_primary_key_lookup(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given two parked copies among 20,000 records, analyzed
    await park(amqp, engine, settings, Copy("k1"), Copy("k2"))
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO dead_letters (parking_id, handler, key, reason, routing_key,"
                " body_sha256, failed_key) SELECT gen_random_uuid(), 'h', 'other-' || n,"
                " 'invalid', 'h', '\\x00', false FROM generate_series(1, 20000) AS n"
            )
        )
    async with engine.connect() as conn:
        autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await autocommit.execute(text("ANALYZE dead_letters"))
    ids = [parked.parking_id for parked in await dlq.list_parked(amqp, engine, settings)]
    unknown = uuid.uuid4()

    # When a chunk's records are looked up, and the lookup is planned for a chunk of 100
    async with engine.connect() as conn:
        found = await parkings.find_parkings(conn, {*filter(None, ids), unknown})
        plan = "\n".join(
            line
            for (line,) in await conn.execute(
                Explain(parkings.find_parkings_query([uuid.uuid4() for _ in range(100)]))
            )
        )

    # Then the records of the copies are found by their ids, none for an unknown id, through
    # the primary key (no whole-table scan)
    assert sorted(record.key or "" for record in found.values()) == ["k1", "k2"]
    assert set(found) == set(ids)
    assert "Seq Scan" not in plan, plan
    assert "pk_dead_letters" in plan, plan
    # and a lookup of more than a bounded number of ids at once is refused
    with pytest.raises(ValueError, match="at most"):
        parkings.find_parkings_query([uuid.uuid4() for _ in range(parkings.MAX_FOUND + 1)])


async def test_a_quorum_dlq_keeps_its_order_through_sweeps_that_reach_its_end(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given eight messages parked in a quorum DLQ, which puts the messages given back to it
    # behind those it still holds, in the order they come back
    quorum = settings.replace(queue_type="quorum")
    await park(amqp, engine, quorum, *EIGHT)

    # When it is listed twice, three messages in three chunks are purged by id, and then a
    # browse is left after its second message
    first = await parked_keys(amqp, engine, quorum)
    again = await parked_keys(amqp, engine, quorum)
    listed = await dlq.list_parked(amqp, engine, quorum)
    chosen = frozenset(listed[n].id for n in (1, 3, 6))
    tally = await dlq.Tally().carry_out(
        dlq.purging(amqp, engine, quorum, selection=dlq.Selection(ids=chosen))
    )
    after_purge = await parked_keys(amqp, engine, quorum)
    async with contextlib.aclosing(dlq.browse(amqp, engine, quorum)) as outcomes:
        shown = [(await anext(outcomes)).parked.key for _ in range(2)]

    # Then each sweep that reached the end found them in the order they were parked and left
    # them in it, the purge too
    assert first == again == [f"k{n}" for n in range(1, 9)]
    assert tally.done_count == 3
    assert after_purge == ["k1", "k3", "k5", "k6", "k8"]
    # and the browse left early gave back what it took (a chunk of one, then one of three:
    # k1, then k3 k5 k6), in its order, behind k8, which it never took
    assert shown == ["k1", "k3"]
    assert await parked_keys(amqp, engine, quorum) == ["k8", "k1", "k3", "k5", "k6"]
