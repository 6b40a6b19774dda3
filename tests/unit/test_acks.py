"""The settling rules alone: which acks become one multiple-ack, with stand-in channels that
record what they were sent (the consumer tests cover real channels)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from worker.telemetry import Count, Telemetry
from worker.transport.acks import Settlements


@dataclass(eq=False)
class Channel:
    """The part of an aiormq channel that settling uses: it records what it was sent."""

    sent: list[tuple[str, int, bool]] = field(default_factory=list)
    is_closed: bool = False

    async def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.sent.append(("ack", delivery_tag, multiple))

    async def basic_nack(
        self, delivery_tag: int, multiple: bool = False, requeue: bool = True
    ) -> None:
        self.sent.append(("nack", delivery_tag, multiple))

    @property
    def closing(self) -> asyncio.Future[None]:
        """An observer of the channel's close (it never closes)."""
        return asyncio.get_running_loop().create_future()


@dataclass
class Delivery:
    """The part of a ``Received`` that settling uses."""

    channel: Channel
    delivery_tag: int
    message_id: str = "m"

    @property
    def void(self) -> bool:
        return self.channel.is_closed


def deliveries(channel: Channel, *tags: int) -> list[Delivery]:
    return [Delivery(channel, tag) for tag in tags]


async def test_a_run_from_the_first_tag_is_one_multiple_ack() -> None:
    channel, settlements = Channel(), Settlements()
    assert await settlements.ack(deliveries(channel, 3, 1, 2)) == 1  # type: ignore[arg-type]
    assert channel.sent == [("ack", 3, True)]


async def test_a_gap_keeps_the_deliveries_after_it_single() -> None:
    # Given tags 1-3 committed while 4 is still running, and 5-6 committed
    channel, settlements = Channel(), Settlements()
    await settlements.ack(deliveries(channel, 1, 2, 3))
    # When 5 and 6 are acked, 4 unsettled
    assert await settlements.ack(deliveries(channel, 5, 6)) == 0  # type: ignore[arg-type]
    # And when 4 and 7 come, the run resumes over the individually settled 5 and 6
    assert await settlements.ack(deliveries(channel, 7, 4)) == 1  # type: ignore[arg-type]
    assert channel.sent == [
        ("ack", 3, True),
        ("ack", 5, False),
        ("ack", 6, False),
        ("ack", 7, True),
    ]


async def test_a_tag_never_seen_is_never_covered_by_a_multiple_ack() -> None:
    # Given tag 1 dropped by the client (it never reached the worker) and 2-4 committed
    channel, settlements = Channel(), Settlements()
    assert await settlements.ack(deliveries(channel, 2, 3, 4)) == 0  # type: ignore[arg-type]
    # Then each was acked alone, and 1 stays unsettled for the broker to redeliver
    assert channel.sent == [("ack", 2, False), ("ack", 3, False), ("ack", 4, False)]


async def test_a_requeued_delivery_counts_as_settled() -> None:
    channel, settlements = Channel(), Settlements()
    [first, second, third] = deliveries(channel, 1, 2, 3)
    await settlements.requeue(first)  # type: ignore[arg-type]
    assert await settlements.ack([second, third]) == 1  # type: ignore[list-item]
    assert channel.sent == [("nack", 1, False), ("ack", 3, True)]


async def test_channels_are_counted_apart() -> None:
    old, new, settlements = Channel(), Channel(), Settlements()
    await settlements.ack([*deliveries(old, 1, 2), *deliveries(new, 1, 2)])  # type: ignore[list-item]
    assert old.sent == [("ack", 2, True)]
    assert new.sent == [("ack", 2, True)]


@dataclass(eq=False)
class DyingConnection:
    """A channel whose client queues at most ``room`` frames for a writer that never writes them
    and, once the connection dies, fails the queued ones and refuses new ones: a settlement that
    waits for room waits for ever (as aiormq's bounded write queue does)."""

    room: int
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.room)

    is_closed = False  # (as aiormq's, it fails what it was given to write instead)
    closing = Channel.closing  # (never done: what waits for room ends on its own here)

    async def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        if self.closed.is_set():
            raise ConnectionError("closed")
        await self.slots.acquire()  # (never released: nothing is written)
        await self.closed.wait()
        raise ConnectionError("closed while queued")


@dataclass
class QueuedDelivery:
    channel: DyingConnection
    delivery_tag: int
    message_id: str = "m"

    @property
    def void(self) -> bool:
        return self.channel.is_closed


async def test_acks_on_a_connection_that_dies_end_and_hold_up_nothing() -> None:
    # Given five deliveries acked alone on a connection whose client queues two frames
    channel, settlements = DyingConnection(room=2), Settlements()
    queued = [QueuedDelivery(channel, tag) for tag in (2, 3, 4, 5, 6)]
    acking = asyncio.create_task(settlements.ack(queued))  # type: ignore[arg-type]
    for _ in range(10):
        await asyncio.sleep(0)

    # When the connection dies, Then the call ends (its tags are void: the broker redelivers)
    channel.closed.set()
    await asyncio.wait_for(acking, 10)
    # And the next settlement is not held up behind it
    await asyncio.wait_for(settlements.ack([QueuedDelivery(channel, 7)]), 10)  # type: ignore[list-item]


def receiving(channel: Channel, settlements: Settlements, *tags: int) -> list[Delivery]:
    """Deliveries the consumer received (and so will settle), in the order given."""
    received = deliveries(channel, *tags)
    for delivery in received:
        settlements.received(delivery)  # type: ignore[arg-type]
    return received


async def test_acks_above_a_delivery_in_flight_wait_and_go_out_with_it_in_one_multiple_ack() -> (
    None
):
    # Given tags 1-6 received, 1-2 committed and acked
    telemetry = Telemetry()
    channel, settlements = Channel(), Settlements(hold=10, telemetry=telemetry)
    d = {m.delivery_tag: m for m in receiving(channel, settlements, 1, 2, 3, 4, 5, 6)}
    assert await settlements.ack([d[1], d[2]]) == 1  # type: ignore[list-item]
    # When 4 and 5 commit while 3 is still in flight, Then their acks wait
    assert await settlements.ack([d[5], d[4]]) == 0  # type: ignore[list-item]
    assert channel.sent == [("ack", 2, True)]
    # And when 3 commits, one multiple-ack settles 3-5; 6, in flight, is not covered
    assert await settlements.ack([d[3]]) == 1  # type: ignore[list-item]
    assert channel.sent == [("ack", 2, True), ("ack", 5, True)]
    assert telemetry.stats[Count.MULTIPLE_ACKS] == 2


async def test_a_requeued_delivery_below_waiting_acks_lets_them_go() -> None:
    channel, settlements = Channel(), Settlements(hold=10)
    first, second, third = receiving(channel, settlements, 1, 2, 3)
    await settlements.ack([second, third])  # type: ignore[list-item]
    await settlements.requeue(first)  # type: ignore[arg-type]
    assert channel.sent == [("nack", 1, False), ("ack", 3, True)]


async def test_no_ack_waits_behind_a_delivery_the_client_dropped() -> None:
    # Given tag 2 never received (dropped by the client), 1, 3 and 4 received
    channel, settlements = Channel(), Settlements(hold=10)
    d = {m.delivery_tag: m for m in receiving(channel, settlements, 1, 3, 4)}
    # When 3 and 4 commit, Then they are acked alone at once: nothing will settle 2
    await settlements.ack([d[3], d[4]])  # type: ignore[list-item]
    assert channel.sent == [("ack", 3, False), ("ack", 4, False)]


async def test_at_most_hold_acks_wait_the_highest_others_go_alone() -> None:
    # Given room for two acks to wait, and 2-3 committed while 1 is in flight
    channel, settlements = Channel(), Settlements(hold=2)
    d = {m.delivery_tag: m for m in receiving(channel, settlements, 1, 2, 3, 4, 5)}
    await settlements.ack([d[2], d[3]])  # type: ignore[list-item]
    assert channel.sent == []
    # When 4 commits too, Then the highest one past the two is acked alone
    await settlements.ack([d[4]])  # type: ignore[list-item]
    assert channel.sent == [("ack", 4, False)]
    # And when 1 commits, one multiple-ack settles 1-3 (4 was settled already)
    await settlements.ack([d[1]])  # type: ignore[list-item]
    assert channel.sent == [("ack", 4, False), ("ack", 3, True)]


async def test_flush_acks_every_waiting_delivery_alone() -> None:
    channel, settlements = Channel(), Settlements(hold=10)
    _, second, third = receiving(channel, settlements, 1, 2, 3)
    await settlements.ack([second, third])  # type: ignore[list-item]
    await settlements.flush()
    assert channel.sent == [("ack", 2, False), ("ack", 3, False)]


async def test_deliveries_never_reported_received_do_not_wait() -> None:
    channel, settlements = Channel(), Settlements(hold=10)
    await settlements.ack(deliveries(channel, 2, 3))  # type: ignore[arg-type]
    assert channel.sent == [("ack", 2, False), ("ack", 3, False)]


async def test_a_delivery_received_late_is_no_longer_taken_for_dropped() -> None:
    channel, settlements = Channel(), Settlements(hold=10)
    d = {m.delivery_tag: m for m in receiving(channel, settlements, 1, 3, 2, 4)}
    await settlements.ack([d[3], d[4]])  # type: ignore[list-item]
    assert channel.sent == []  # 1 and 2 were received: 3 and 4 wait for them
    await settlements.ack([d[1], d[2]])  # type: ignore[list-item]
    assert channel.sent == [("ack", 4, True)]


async def test_a_delivery_is_never_settled_twice() -> None:
    # Given 1 acked and 2 requeued
    channel, settlements = Channel(), Settlements()
    first, second = deliveries(channel, 1, 2)
    await settlements.ack([first])  # type: ignore[list-item]
    await settlements.requeue(second)  # type: ignore[arg-type]
    # When either is settled again, Then nothing more is sent (the broker would close the
    # channel for an unknown tag)
    await settlements.ack([first, second])  # type: ignore[list-item]
    await settlements.reject(first)  # type: ignore[arg-type]
    assert channel.sent == [("ack", 1, False), ("nack", 2, False)]


async def test_deliveries_of_a_closed_channel_are_never_settled() -> None:
    # Given deliveries received on a channel that then closed, and a new channel's with the
    # same tags
    old, new, settlements = Channel(), Channel(), Settlements(hold=10)
    stale = receiving(old, settlements, 1, 2, 3)
    old.is_closed = True
    fresh = receiving(new, settlements, 1, 2)
    # When all of them commit, Then only the new channel's are acked, on the new channel
    await settlements.ack([*stale, *fresh])  # type: ignore[list-item]
    await settlements.requeue(stale[0])  # type: ignore[arg-type]
    assert old.sent == []
    assert new.sent == [("ack", 2, True)]
