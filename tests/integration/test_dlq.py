"""``worker dlq list|replay|purge`` against the real RabbitMQ and PostgreSQL: a page leaves the
queue as it was, filters select exactly, a dry run changes nothing, an old copy is not replayed
without ``--force``, and a purge deletes exactly what it selects and keeps the rest in order.

Messages are parked the way the worker parks them (a ``Failure``'s dead-letter headers, published
to ``<queue>.dlx``), each with its key recorded as failed in the inbox.
"""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, broker_depth, rows, run, wait_until, worker_environ
from worker.core.envelope import Delivery
from worker.ops import dlq
from worker.settings import Settings
from worker.sql import parkings
from worker.transport.dead_letters import Failure
from worker.transport.topology import declare_topology

HANDLER = "dlq.job"
OTHER_HANDLER = "dlq.other"


@dataclass(frozen=True)
class Copy:
    """One message to park: its key, handler, reason, and how long ago it was parked."""

    key: str
    reason: str = "handler-error"
    handler: str = HANDLER
    age: timedelta = timedelta(0)


async def park(
    amqp: AbstractRobustConnection, engine: AsyncEngine, settings: Settings, *copies: Copy
) -> None:
    """Declare the topology and park each copy, in order, as the worker does: its record
    committed first (dated ``age`` ago), then the copy with its parking id (persistent: a broker
    restart keeps them), and its key failed in the inbox."""
    failures = [
        Failure(
            Delivery(
                body=b'{"n": 1}', routing_key=copy.handler, headers={"idempotency-key": copy.key}
            ),
            "KeyError: 'account'",
            "KeyError",
            copy.handler,
        )
        for copy in copies
    ]
    records = [
        failure.parking(copy.reason, failed_key=True)
        for failure, copy in zip(failures, copies, strict=True)
    ]
    async with engine.begin() as conn:
        await parkings.record_parkings(conn, records)
        for record, copy in zip(records, copies, strict=True):
            await conn.execute(
                text(
                    "UPDATE dead_letters SET parked_at = now() - make_interval(secs => :age) "
                    "WHERE parking_id = :id"
                ),
                {"age": copy.age.total_seconds(), "id": record.parking_id},
            )
    async with amqp.channel(publisher_confirms=True) as channel:
        await declare_topology(channel, settings, [HANDLER, OTHER_HANDLER])
        dead_letter_exchange = await channel.get_exchange(settings.dead_letter_exchange)
        for failure, record in zip(failures, records, strict=True):
            headers = failure.dead_letter_headers(record.reason, record.parking_id)
            parked = aio_pika.Message(
                failure.delivery.body,
                headers=headers,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await dead_letter_exchange.publish(parked, routing_key=failure.delivery.routing_key)
    async with engine.begin() as conn:
        for copy in copies:
            await conn.execute(
                text(
                    "INSERT INTO inbox (handler, key, fingerprint, status, error, routing_key) "
                    "VALUES (:h, :k, '\\x00', 'failed', 'KeyError', :h)"
                ),
                {"h": copy.handler, "k": copy.key},
            )


async def worker(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    """``worker dlq *argv`` in a subprocess, off the event loop."""
    return await asyncio.to_thread(run, WORKER_SCRIPT, "dlq", *argv, **worker_environ(settings))


async def parked_keys(
    amqp: AbstractRobustConnection, engine: AsyncEngine, settings: Settings
) -> list[str | None]:
    """The keys in the DLQ, in queue order (they stay parked)."""
    return [parked.key for parked in await dlq.list_parked(amqp, engine, settings)]


async def failed_keys(engine: AsyncEngine) -> list[str]:
    found = await rows(engine, "SELECT key FROM inbox WHERE status = 'failed' ORDER BY key")
    return [key for (key,) in found]


def keys_in(output: str, verb: str = "") -> list[str]:
    """The keys of the lines ``[verb ]key=...`` of a ``dlq`` command's output, in order."""
    prefix = f"{verb} key=".lstrip()
    return [
        line.removeprefix(prefix).split(" ", 1)[0]
        for line in output.splitlines()
        if line.startswith(prefix)
    ]


OLD = timedelta(days=8)
"""Longer ago than the default inbox_retention (7 days)."""


async def test_list_shows_a_page_and_leaves_the_queue_as_it_was(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given five parked messages, two of them invalid
    keys = ["k1", "k2", "k3", "k4", "k5"]
    await park(
        amqp, engine, settings, *(Copy(k, "invalid" if k in ("k2", "k4") else "x") for k in keys)
    )

    # When the operator lists a page of two, everything, and the invalid ones
    page = await worker(settings, "list", "--limit", "2")
    everything = await worker(settings, "list", "--all")
    invalid = await worker(settings, "list", "--reason", "invalid")

    # Then each shows what it selected, oldest first, and the queue is as it was
    assert page.returncode == 0, page.stderr
    assert keys_in(page.stdout) == keys[:2]
    assert "2 parked message(s) shown" in page.stdout
    assert "--all shows more" in page.stdout
    assert keys_in(everything.stdout) == keys
    assert "5 parked message(s) shown" in everything.stdout
    assert "shows more" not in everything.stdout
    assert keys_in(invalid.stdout) == ["k2", "k4"]
    assert await broker_depth(settings.dead_letter_queue) == 5
    assert await parked_keys(amqp, engine, settings) == keys


async def test_list_shows_100_by_default(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, *(Copy(f"k{i:03}") for i in range(101)))

    listed = await worker(settings, "list")

    assert listed.returncode == 0, listed.stderr
    assert keys_in(listed.stdout) == [f"k{i:03}" for i in range(100)]
    assert "100 parked message(s) shown" in listed.stdout
    assert await broker_depth(settings.dead_letter_queue) == 101


async def test_replay_refuses_a_copy_older_than_the_inbox_retention_unless_forced(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a copy parked eight days ago (the inbox keeps keys seven) and one parked just now
    await park(amqp, engine, settings, Copy("k-old", age=OLD), Copy("k-new"))

    # When the operator replays everything
    replayed = await worker(settings, "replay", "-v")

    # Then the new one goes back to work and the old one stays parked with its key failed
    assert replayed.returncode == 0, replayed.stderr
    assert keys_in(replayed.stdout, "replayed") == ["k-new"]
    assert keys_in(replayed.stdout, "refused") == ["k-old"]
    assert "inbox_retention" in replayed.stdout
    assert "1 message(s) sent back" in replayed.stdout
    assert "1 refused and left parked (--force replays them)" in replayed.stdout
    assert await parked_keys(amqp, engine, settings) == ["k-old"]
    assert await broker_depth(settings.queue) == 1
    assert await failed_keys(engine) == ["k-old"]

    # When the operator insists
    forced = await worker(settings, "replay", "--force", "-v")

    # Then the old one goes back too
    assert forced.returncode == 0, forced.stderr
    assert keys_in(forced.stdout, "replayed") == ["k-old"]
    assert await parked_keys(amqp, engine, settings) == []
    assert await broker_depth(settings.queue) == 2
    assert await failed_keys(engine) == []


async def test_a_message_the_broker_dead_lettered_is_unverified_and_goes_back_only_forced(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a message the work queue rejected, which the broker dead-lettered itself, and one
    # put in the DLQ by hand: neither has the worker's record
    await park(amqp, engine, settings)
    async with amqp.channel(publisher_confirms=True) as channel:
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", headers={"idempotency-key": "k-rejected"}),
            routing_key=settings.queue,
        )
        rejected = await (await channel.get_queue(settings.queue)).get(no_ack=False)
        await rejected.reject()
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", headers={"idempotency-key": "k-timeless"}),
            routing_key=settings.dead_letter_queue,
        )

    async def both_parked() -> bool:
        return await broker_depth(settings.dead_letter_queue) == 2

    await wait_until(both_parked)

    # When both are replayed without --force, then with it
    refused = await dlq.replay(amqp, engine, settings)
    listed = await dlq.list_parked(amqp, engine, settings)
    forced = await dlq.replay(amqp, engine, settings, force=True)

    # Then they are unverified, stay parked until forced, and then both go back
    assert refused == []
    # (in either order: the broker dead-letters the rejected one on its own time)
    assert sorted((p.key, p.reason, p.claims.get("broker_reason")) for p in listed) == [
        ("k-rejected", "unverified", "rejected"),
        ("k-timeless", "unverified", None),
    ]
    assert sorted(parked.key for parked in forced) == ["k-rejected", "k-timeless"]
    assert await parked_keys(amqp, engine, settings) == []
    assert await broker_depth(settings.queue) == 2


async def test_a_dry_run_changes_nothing(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, Copy("k1"), Copy("k2", age=OLD), Copy("k3"))

    replay = await worker(settings, "replay", "--dry-run", "--verbose")
    purge = await worker(settings, "purge", "--all", "--dry-run", "-v")

    assert replay.returncode == 0, replay.stderr
    assert keys_in(replay.stdout, "would replay") == ["k1", "k3"]
    assert keys_in(replay.stdout, "refused") == ["k2"]
    assert "dry run: 2 message(s) would be sent back" in replay.stdout
    assert "nothing changed" in replay.stdout
    assert purge.returncode == 0, purge.stderr
    assert keys_in(purge.stdout, "would purge") == ["k1", "k2", "k3"]
    assert "dry run: 3 message(s) would be purged" in purge.stdout
    assert await parked_keys(amqp, engine, settings) == ["k1", "k2", "k3"]
    assert await broker_depth(settings.dead_letter_queue) == 3
    assert await broker_depth(settings.queue) == 0
    assert await failed_keys(engine) == ["k1", "k2", "k3"]


async def test_bulk_actions_sum_up_by_reason_and_handler_unless_verbose(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given many parked messages of two reasons, one of them too old to replay
    copies = [Copy(f"k{n}") for n in range(12)] + [Copy("bad", reason="invalid")]
    await park(amqp, engine, settings, *copies, Copy("old", age=OLD))

    # When they are replayed without --verbose
    replay = await worker(settings, "replay")

    # Then the output is a few lines of totals, not a line per message
    assert replay.returncode == 0, replay.stderr
    assert keys_in(replay.stdout) == []
    lines = replay.stdout.splitlines()
    assert f"replayed by reason: handler-error handler={HANDLER}: 12" in lines
    assert f"replayed by reason: invalid handler={HANDLER}: 1" in lines
    assert sum(line.startswith("refused: ") for line in lines) == 1
    assert lines[-1].startswith("13 message(s) sent back")
    assert len(lines) == 4


async def test_replay_filters_select_exactly(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given messages of two handlers and two reasons
    await park(
        amqp,
        engine,
        settings,
        Copy("k1"),
        Copy("k2", reason="invalid"),
        Copy("k3", handler=OTHER_HANDLER),
        Copy("k4"),
        Copy("k5"),
    )

    # When the operator replays at most two handler errors of one handler
    replayed = await worker(
        settings, "replay", "--reason", "handler-error", "--handler", HANDLER, "--limit", "2", "-v"
    )
    by_key = await worker(settings, "replay", "--key", "k3", "-v")

    # Then exactly those went back, and the rest stay parked in their order
    assert replayed.returncode == 0, replayed.stderr
    assert keys_in(replayed.stdout, "replayed") == ["k1", "k4"]
    assert keys_in(by_key.stdout, "replayed") == ["k3"]
    assert await parked_keys(amqp, engine, settings) == ["k2", "k5"]
    assert await failed_keys(engine) == ["k2", "k5"]
    assert await broker_depth(settings.queue) == 3


async def test_purge_deletes_exactly_the_matching_messages_and_keeps_the_order(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(
        amqp,
        engine,
        settings,
        Copy("k1", reason="invalid"),
        Copy("k2"),
        Copy("k3", reason="invalid"),
        Copy("k4"),
        Copy("k5", reason="invalid", handler=OTHER_HANDLER),
    )

    purged = await worker(settings, "purge", "--reason", "invalid", "--handler", HANDLER, "-v")

    assert purged.returncode == 0, purged.stderr
    assert keys_in(purged.stdout, "purged") == ["k1", "k3"]
    assert "2 message(s) purged from" in purged.stdout
    assert await parked_keys(amqp, engine, settings) == ["k2", "k4", "k5"]
    assert await broker_depth(settings.dead_letter_queue) == 3
    assert await broker_depth(settings.queue) == 0
    # the inbox is not the DLQ's to change: the keys stay failed
    assert await failed_keys(engine) == ["k1", "k2", "k3", "k4", "k5"]

    everything = await worker(settings, "purge", "--all")
    assert "3 message(s) purged" in everything.stdout
    assert await broker_depth(settings.dead_letter_queue) == 0


async def test_purge_needs_a_filter_or_all(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, Copy("k1"))

    refused = await worker(settings, "purge")

    assert refused.returncode == 2
    assert "dlq purge needs --key, --reason, --handler or --all" in refused.stderr
    assert await parked_keys(amqp, engine, settings) == ["k1"]


async def test_bulk_actions_leave_messages_parked_after_they_began(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a message parked "later" than the command starts (a replayed message that failed
    # again while the replay was still going: taking it back would cycle)
    await park(amqp, engine, settings, Copy("k-now"), Copy("k-later", age=-timedelta(hours=1)))

    replayed = await worker(settings, "replay", "-v")
    purged = await worker(settings, "purge", "--all", "-v")

    assert keys_in(replayed.stdout, "replayed") == ["k-now"]
    assert keys_in(purged.stdout, "purged") == []
    assert await parked_keys(amqp, engine, settings) == ["k-later"]


@pytest.mark.parametrize(
    ("selection", "matches"),
    [
        (dlq.Selection(), True),
        (dlq.Selection(key="k"), True),
        (dlq.Selection(key="other"), False),
        (dlq.Selection(reason="invalid"), True),
        (dlq.Selection(reason="handler-error"), False),
        (dlq.Selection(handler=HANDLER), True),
        (dlq.Selection(handler=OTHER_HANDLER), False),
        (dlq.Selection(key="k", reason="invalid", handler=HANDLER), True),
        (dlq.Selection(key="k", reason="invalid", handler=OTHER_HANDLER), False),
    ],
)
def test_a_selection_matches_when_every_filter_given_does(
    selection: dlq.Selection, matches: bool
) -> None:
    parked = dlq.Parked(
        key="k",
        handler=HANDLER,
        reason="invalid",
        error="",
        exception_type="",
        attempts=1,
        first_failure_at="",
        routing_key=HANDLER,
        message_id=None,
    )
    assert selection.matches(parked) is matches
    assert selection.filters is (selection != dlq.Selection())
