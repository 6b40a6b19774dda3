"""``worker.ops.dlq`` as the console uses it, against the real RabbitMQ and PostgreSQL: a scan
takes no more than its limit and says when the queue holds more, groups count what it took, a
selection of ids acts on those copies only, an action confirmed after a preview leaves what was
parked since, and the DLQ's depth is read without ever declaring it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import broker_depth, rows
from tests.integration.test_dlq import HANDLER, OTHER_HANDLER, Copy, park, parked_keys
from worker.ops import dlq
from worker.settings import Settings

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
