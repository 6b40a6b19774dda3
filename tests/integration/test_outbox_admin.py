"""``worker outbox list``, ``retry`` and ``cancel`` for events in every state, run as the real
CLI against the real PostgreSQL and RabbitMQ.

The backing-off rows are made the way a user meets them: a real relay publishes events for a
routing key no queue is bound to, and the broker returns them.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from datetime import datetime, timedelta

import sqlalchemy
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, rows, run, scalar, wait_until, worker_environ
from tests.integration.support import (
    ROUTING_KEY,
    add_outbox_row,
    declare,
    make_overdue,
    park,
    running_relay,
    schedule,
)
from worker import outbox
from worker.settings import Settings
from worker.sql import inspection

UNBOUND = "stock.changed"
"""A routing key no queue is bound to, as the getting-started service's events are at first."""

HOUR_LONG_BACKOFF = {"relay_retry_delay": 3600.0, "relay_max_attempts": 5}
"""A relay whose failed rows would wait out the five-minute cap before their next attempt."""


async def worker(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    """``worker *argv`` in a subprocess, off the event loop."""
    return await asyncio.to_thread(run, WORKER_SCRIPT, *argv, **worker_environ(settings))


async def publish_unbound(engine: AsyncEngine, settings: Settings, count: int) -> list[uuid.UUID]:
    async with engine.begin() as conn:
        return await outbox.publish_many(
            conn,
            [outbox.Event(UNBOUND, {"n": n}, exchange=settings.exchange) for n in range(count)],
        )


async def backing_off(engine: AsyncEngine, settings: Settings, count: int) -> list[uuid.UUID]:
    """``count`` events that a real relay failed to publish once (unroutable), now backing off."""
    message_ids = await publish_unbound(engine, settings, count)

    async def all_failed_once() -> bool:
        failed = "SELECT count(*) FROM outbox WHERE attempts = 1 AND available_at > now()"
        return bool(await scalar(engine, failed) == count)

    async with running_relay(settings.replace(**HOUR_LONG_BACKOFF)):
        await wait_until(all_failed_once)
    return message_ids


async def given_rows_in_each_state(
    engine: AsyncEngine, amqp: AbstractRobustConnection, settings: Settings, *, failed: int
) -> None:
    """The topology, ``failed`` events backing off, one pending row and one parked."""
    await declare(amqp, settings)
    await backing_off(engine, settings, failed)
    await add_outbox_row(engine, settings)
    await park(engine, settings)


async def test_outbox_list_shows_pending_backing_off_and_parked_rows(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given the topology, two events a relay could not route, one pending row and one parked
    await declare(amqp, settings)
    failed = await backing_off(engine, settings, 2)
    pending_id, pending_message = await add_outbox_row(engine, settings)
    parked_id, parked_message = await park(engine, settings)

    # When an operator lists the outbox
    result = await worker(settings, "outbox", "list")

    # Then each state is shown, in the order a row moves through them
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [text.split()[0] for text in lines[:4]] == [
        "pending",
        "backing-off",
        "backing-off",
        "parked",
    ]
    assert lines[0].startswith(f"pending     id={pending_id} message_id={pending_message} ")
    assert "next_attempt=" not in lines[0]
    assert "last_error" not in lines[0]
    for text in lines[1:3]:
        assert f"routing_key={UNBOUND} ordering_key=- attempts=1 " in text
        assert " next_attempt=" in text
        assert " (in " in text
        assert 'last_error="returned as unroutable: no queue is bound to exchange ' in text
    assert {text.split()[2] for text in lines[1:3]} == {f"message_id={m}" for m in failed}
    assert lines[3].startswith(f"parked      id={parked_id} message_id={parked_message} ")
    assert "parked_at=" in lines[3]
    assert lines[4:] == [
        "0 scheduled, 1 pending, 2 backing-off, 1 parked outbox row(s) shown",
        "`worker outbox retry --routing-key KEY` (or --id ID, --all) publishes backing-off and "
        "parked rows now",
    ]


async def test_outbox_list_filters_by_state_and_routing_key(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await given_rows_in_each_state(engine, amqp, settings, failed=3)

    backing = await worker(settings, "outbox", "list", "--state", "backing-off", "--limit", "2")
    parked = await worker(settings, "outbox", "list", "--state", "parked", "--state", "pending")
    by_key = await worker(settings, "outbox", "list", "--routing-key", ROUTING_KEY)
    nothing = await worker(settings, "outbox", "list", "--routing-key", "nobody.sends")

    assert backing.returncode == 0, backing.stderr
    assert [text.split()[0] for text in backing.stdout.splitlines()[:2]] == ["backing-off"] * 2
    assert backing.stdout.splitlines()[2:] == [
        "2 backing-off outbox row(s) shown",
        "(--limit 2 reached for backing-off: there may be more)",
        f"`worker outbox retry --routing-key {UNBOUND}` (or --id ID, --all) publishes "
        "backing-off and parked rows now",
    ]
    # the states come in their own order, whatever the order of the flags
    assert [text.split()[0] for text in parked.stdout.splitlines()[:2]] == ["pending", "parked"]
    assert "1 pending, 1 parked outbox row(s) shown" in parked.stdout
    assert [text.split()[0] for text in by_key.stdout.splitlines()[:2]] == ["pending", "parked"]
    assert f"routing_key={UNBOUND}" not in by_key.stdout
    assert "0 scheduled, 1 pending, 0 backing-off, 1 parked outbox row(s) shown" in by_key.stdout
    assert nothing.stdout.splitlines() == [
        "0 scheduled, 0 pending, 0 backing-off, 0 parked outbox row(s) shown"
    ]


async def test_outbox_list_json_is_one_object_per_row(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await declare(amqp, settings)
    (failed,) = await backing_off(engine, settings, 1)
    _, pending = await add_outbox_row(engine, settings, ordering_key="acct-1")

    result = await worker(settings, "outbox", "list", "--json")

    assert result.returncode == 0, result.stderr
    first, second = [json.loads(text) for text in result.stdout.splitlines()]
    assert set(first) == {
        "state",
        "id",
        "message_id",
        "exchange",
        "routing_key",
        "ordering_key",
        "attempts",
        "last_error",
        "created_at",
        "available_at",
        "due_in_seconds",
        "parked_at",
    }
    assert (first["state"], first["message_id"], first["ordering_key"]) == (
        "pending",
        str(pending),
        "acct-1",
    )
    assert (first["attempts"], first["last_error"], first["due_in_seconds"]) == (0, None, 0)
    assert second["state"] == "backing-off"
    assert second["message_id"] == str(failed)
    assert (second["exchange"], second["routing_key"]) == (settings.exchange, UNBOUND)
    assert second["attempts"] == 1
    assert second["last_error"].startswith("returned as unroutable")
    assert 0 < second["due_in_seconds"] <= 3600
    available_at = datetime.fromisoformat(second["available_at"])
    assert available_at > datetime.fromisoformat(second["created_at"])
    assert second["parked_at"] is None


async def test_an_unknown_state_is_a_usage_error_that_lists_the_valid_ones(
    settings: Settings,
) -> None:
    listed = await worker(settings, "outbox", "list", "--state", "backing_off")
    retried = await worker(settings, "outbox", "retry", "--all", "--state", "pending")

    assert listed.returncode == 2
    assert listed.stdout == ""
    assert (
        "argument --state: invalid choice: 'backing_off' "
        "(choose from 'scheduled', 'pending', 'backing-off', 'parked')" in listed.stderr
    )
    assert retried.returncode == 2
    assert "(choose from 'backing-off', 'parked')" in retried.stderr


async def test_retry_hurries_a_backing_off_row_and_the_relay_publishes_it_once_bound(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given events a relay failed to route, now waiting out an hour-long backoff
    await declare(amqp, settings)
    async with amqp.channel() as channel:
        exchange = await channel.get_exchange(settings.exchange)
        stock = await channel.declare_queue(f"{settings.queue}-stock", auto_delete=True)
        failed = await backing_off(engine, settings, 3)
        async with running_relay(settings.replace(**HOUR_LONG_BACKOFF)):
            # When the operator binds a queue, then retries the routing key
            await stock.bind(exchange, UNBOUND)
            result = await worker(settings, "outbox", "retry", "--routing-key", UNBOUND)

            # Then the rows are due at once, and the running relay publishes them now
            assert result.returncode == 0, result.stderr
            assert result.stdout.splitlines() == [
                f"retried by routing key: {UNBOUND}: 3",
                "3 backing-off outbox row(s) made due now, 0 parked outbox row(s) moved back "
                "into the outbox",
            ]

            async def published() -> bool:
                return bool(await scalar(engine, "SELECT count(*) FROM outbox") == 0)

            await wait_until(published)
        received = []
        while (message := await stock.get(no_ack=True, fail=False)) is not None:
            received.append(message)
    assert sorted(m.message_id or "" for m in received) == sorted(map(str, failed))
    assert {m.headers["idempotency-key"] for m in received} == {str(m) for m in failed}


async def test_retry_by_id_hurries_and_unparks_and_keeps_attempts_of_a_hurried_row(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await declare(amqp, settings)
    (failed,) = await backing_off(engine, settings, 1)
    ((failed_id,),) = await rows(engine, "SELECT id FROM outbox WHERE message_id = :m", m=failed)
    parked_id, parked = await park(engine, settings)
    pending_id, _ = await add_outbox_row(engine, settings)

    result = await worker(
        settings, "outbox", "retry", "--id", str(failed_id), str(parked_id), str(pending_id)
    )

    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == f"hurried id={failed_id} message_id={failed}"
    assert out[1].startswith(f"retried id={parked_id} as id=")
    assert out[-1] == (
        "1 backing-off outbox row(s) made due now, 1 parked outbox row(s) moved back into the "
        "outbox"
    )
    assert result.stderr.splitlines() == [f"already due (pending): {pending_id}"]
    state = await rows(
        engine,
        "SELECT message_id, attempts, available_at <= now() FROM outbox WHERE message_id IN "
        "(:a, :b) ORDER BY id",
        a=failed,
        b=parked,
    )
    assert state == [(failed, 1, True), (parked, 0, True)]


async def test_retry_of_a_state_leaves_the_other_alone(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await given_rows_in_each_state(engine, amqp, settings, failed=1)

    result = await worker(settings, "outbox", "retry", "--all", "--state", "parked")

    assert result.returncode == 0, result.stderr
    assert "0 backing-off outbox row(s) made due now, 1 parked" in result.stdout
    assert await scalar(engine, "SELECT count(*) FROM outbox WHERE available_at > now()") == 1
    assert await scalar(engine, "SELECT count(*) FROM outbox WHERE available_at <= now()") == 2
    assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 0


async def test_retry_of_a_routing_key_that_matches_nothing_is_an_error(
    settings: Settings, engine: AsyncEngine
) -> None:
    await park(engine, settings)

    result = await worker(settings, "outbox", "retry", "--routing-key", "stock.chanegd")

    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "worker: error: no backing-off or parked outbox row has routing key 'stock.chanegd' "
        "(see `worker outbox list`)"
    ]
    assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 1


async def test_retry_all_with_nothing_to_retry_succeeds(settings: Settings) -> None:
    result = await worker(settings, "outbox", "retry", "--all")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "0 backing-off outbox row(s) made due now, 0 parked outbox row(s) moved back into the "
        "outbox"
    ]


# --- scheduled events ----------------------------------------------------------------------------


async def test_outbox_list_shows_scheduled_events_earliest_due_first_within_the_limit(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given four events scheduled out of order, one of them due a minute ago and not yet moved
    # (no relay runs), and a pending row
    later, soon, latest, overdue = await schedule(
        engine,
        settings,
        timedelta(hours=2),
        timedelta(minutes=10),
        timedelta(days=3),
        timedelta(hours=1),
        ordering_key="acct-1",
    )
    await make_overdue(engine, overdue, 60.0)
    await add_outbox_row(engine, settings)

    # When an operator lists the scheduled events, all of them and then at most three
    everything = await worker(settings, "outbox", "list", "--state", "scheduled")
    limited = await worker(settings, "outbox", "list", "--state", "scheduled", "--limit", "3")

    # Then they come earliest due first, each with its due time and how far ahead (or overdue)
    assert everything.returncode == 0, everything.stderr
    lines = everything.stdout.splitlines()
    assert [text.split()[2] for text in lines[:4]] == [
        f"message_id={m}" for m in (overdue, soon, later, latest)
    ]
    for text in lines[:4]:
        assert text.startswith("scheduled   id=")
        assert f"routing_key={ROUTING_KEY} ordering_key=acct-1 attempts=0 " in text
    overdue_by = re.search(r" due_at=(\S+) \(overdue by (\d+)s\)$", lines[0])
    assert overdue_by is not None
    assert 60 <= int(overdue_by.group(2)) < 120
    ahead = [re.search(r" due_at=(\S+) \(in (\d+)s\)$", text) for text in lines[1:4]]
    seconds_ahead = [int(found.group(2)) for found in ahead if found]
    for seconds, expected in zip(seconds_ahead, (600, 7200, 3 * 86400), strict=True):
        assert expected - 60 < seconds <= expected
    due_times = [datetime.fromisoformat(found.group(1)) for found in [overdue_by, *ahead] if found]
    assert due_times == sorted(due_times)
    assert lines[4:] == [
        "4 scheduled outbox row(s) shown",
        "`worker outbox cancel MESSAGE_ID...` takes scheduled and pending events back",
    ]
    assert limited.returncode == 0, limited.stderr
    assert [text.split()[2] for text in limited.stdout.splitlines()[:3]] == [
        f"message_id={m}" for m in (overdue, soon, later)
    ]
    assert limited.stdout.splitlines()[3:5] == [
        "3 scheduled outbox row(s) shown",
        "(--limit 3 reached for scheduled: there may be more)",
    ]


async def test_outbox_list_json_shows_a_scheduled_event_with_its_due_time(
    settings: Settings, engine: AsyncEngine
) -> None:
    (scheduled,) = await schedule(engine, settings, timedelta(minutes=30))

    result = await worker(settings, "outbox", "list", "--json")

    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(text) for text in result.stdout.splitlines()]
    assert (row["state"], row["message_id"], row["routing_key"]) == (
        "scheduled",
        str(scheduled),
        ROUTING_KEY,
    )
    assert (row["attempts"], row["last_error"], row["parked_at"]) == (0, None, None)
    assert 29 * 60 < row["due_in_seconds"] <= 30 * 60
    due_at = datetime.fromisoformat(row["available_at"])
    created_at = datetime.fromisoformat(row["created_at"])
    assert due_at - created_at == timedelta(minutes=30)


async def test_the_scheduled_listing_reads_a_range_of_the_due_at_index_never_the_table(
    engine: AsyncEngine,
) -> None:
    # Given 20,000 scheduled events the statistics know of
    async with engine.begin() as conn:
        await conn.execute(
            sqlalchemy.text(
                "INSERT INTO outbox_scheduled (message_id, exchange, routing_key, body, "
                "content_type, due_at) SELECT gen_random_uuid(), 'events', 'k', '\\x00', "
                "'application/json', now() + make_interval(secs => n) "
                "FROM generate_series(1, 20000) AS n"
            )
        )
        await conn.execute(sqlalchemy.text("ANALYZE outbox_scheduled"))

    # When the listing's statement is planned
    statement = inspection.entries_query("scheduled", 100)
    async with engine.connect() as conn:
        compiled = statement.compile(conn.sync_engine, compile_kwargs={"literal_binds": True})
        plan = "\n".join(
            row[0] for row in await conn.execute(sqlalchemy.text(f"EXPLAIN {compiled}"))
        )

    # Then it is a limited scan of the (due_at, id) index: no sequential scan, no sort
    assert plan.lstrip().startswith("Limit"), plan
    assert "Index Scan using ix_outbox_scheduled_due_at_id on outbox_scheduled" in plan
    assert "Seq Scan" not in plan
    assert "Sort" not in plan


async def test_cancel_takes_back_a_scheduled_and_a_pending_event_in_one_transaction(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given an event scheduled for tomorrow, a pending one and one scheduled to stay
    tomorrow, stays = await schedule(engine, settings, timedelta(days=1), timedelta(days=1))
    _, pending = await add_outbox_row(engine, settings)

    # When an operator cancels the first two
    result = await worker(settings, "outbox", "cancel", str(tomorrow), str(pending))

    # Then both are gone and are said to be cancelled; the other waits as before
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"cancelled    message_id={tomorrow}",
        f"cancelled    message_id={pending}",
        "2 outbox event(s) cancelled",
    ]
    assert result.stderr == ""
    assert await rows(engine, "SELECT message_id FROM outbox_scheduled") == [(stays,)]
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 0


async def test_cancel_of_a_published_a_parked_or_an_unknown_id_says_so_and_exits_1(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given an event a real relay published, a parked one, a scheduled one and an id never sent
    await declare(amqp, settings)
    _, published = await add_outbox_row(engine, settings)

    async def drained() -> bool:
        return bool(await scalar(engine, "SELECT count(*) FROM outbox") == 0)

    async with running_relay(settings):
        await wait_until(drained)
    _, parked = await park(engine, settings)
    (scheduled,) = await schedule(engine, settings, timedelta(hours=1))
    never_sent = uuid.uuid4()
    asked = [str(m) for m in (published, parked, scheduled, never_sent)]

    # When an operator cancels them all, first as a dry run, then for real, in JSON
    dry = await worker(settings, "outbox", "cancel", "--dry-run", *asked)
    left_by_dry_run = await scalar(engine, "SELECT count(*) FROM outbox_scheduled")
    done = await worker(settings, "outbox", "cancel", "--json", *asked)

    # Then only the scheduled one is cancelled; the others are named, and the status is 1
    assert dry.returncode == 1
    assert dry.stdout.splitlines() == [
        f"would cancel message_id={scheduled}",
        f"parked       message_id={parked}",
        f"unknown      message_id={published}",
        f"unknown      message_id={never_sent}",
        "dry run: 1 outbox event(s) would be cancelled; nothing changed",
    ]
    assert left_by_dry_run == 1
    assert done.returncode == 1
    assert [json.loads(text) for text in done.stdout.splitlines()] == [
        {"message_id": str(scheduled), "outcome": "cancelled"},
        {"message_id": str(parked), "outcome": "parked"},
        {"message_id": str(published), "outcome": "unknown"},
        {"message_id": str(never_sent), "outcome": "unknown"},
    ]
    assert done.stderr.splitlines() == [
        f"worker: error: parked, not cancelled: {parked} (see `worker outbox list --state parked`)",
        f"worker: error: no unpublished event has message_id {published}, {never_sent} "
        "(published already, or never sent)",
    ]
    assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0
    assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 1


async def test_cancel_of_something_that_is_no_message_id_is_a_usage_error(
    settings: Settings, engine: AsyncEngine
) -> None:
    (scheduled,) = await schedule(engine, settings, timedelta(hours=1))

    result = await worker(settings, "outbox", "cancel", str(scheduled), "42")

    assert result.returncode == 2
    assert "argument MESSAGE_ID: '42' is not a message id (a UUID)" in result.stderr
    assert await rows(engine, "SELECT message_id FROM outbox_scheduled") == [(scheduled,)]
