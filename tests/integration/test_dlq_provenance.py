"""Provenance of the dead-letter queue against the real RabbitMQ, PostgreSQL and ``worker dlq``
CLI: a copy is the worker's only if the worker's own record says so, never because its headers
claim it; and the DLQ tool's conventions (``--json``, ``show``, unknown reasons, closed pipes).

The attack: a message published to the events exchange with a 1 ms ``expiration`` and
hand-made ``x-worker-*`` headers is dead-lettered by the broker into the DLQ, claiming another
message's key and parking id, a handler, a reason and another routing key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, _environ, broker_depth, rows, wait_until, worker_environ
from tests.integration.support import running_worker
from tests.integration.test_dlq import Copy, park, worker
from worker import Context, Permanent, Retryable, Router
from worker.core.envelope import Delivery
from worker.ops import dlq, janitor
from worker.ops.cli import Exit
from worker.settings import Settings
from worker.sql import parkings
from worker.telemetry import Count
from worker.transport.dead_letters import PARKING_ID, Failure
from worker.transport.topology import declare_topology

ROUTING_KEY = "ledger.entry"


class Switch:
    """Whether the ledger handler fails, and how: ``permanent`` or ``transient`` or None."""

    failing: str | None = "permanent"


def ledger(switch: type[Switch]) -> Router:
    """A handler that records each body's ``n`` under its key, or fails as ``switch`` says."""
    router = Router()

    @router.handler(ROUTING_KEY)
    async def entry(body: dict[str, Any], ctx: Context) -> None:
        if switch.failing == "permanent":
            raise Permanent("the ledger is closed")
        if switch.failing == "transient":
            raise Retryable("the ledger is busy")
        await ctx.connection.execute(
            text("INSERT INTO dlq_ledger (key, n) VALUES (:key, :n)"),
            {"key": ctx.key, "n": body["n"]},
        )

    return router


@pytest.fixture
async def ledger_table(engine: AsyncEngine) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS dlq_ledger (key text, n int)"))
        await conn.execute(text("TRUNCATE dlq_ledger"))
    yield
    async with engine.begin() as conn:
        await conn.execute(text("DROP TABLE dlq_ledger"))


async def applied(engine: AsyncEngine) -> list[tuple[str, int]]:
    return [tuple(row) for row in await rows(engine, "SELECT key, n FROM dlq_ledger ORDER BY n")]


async def inbox_row(engine: AsyncEngine, key: str) -> list[Any]:
    return await rows(
        engine,
        "SELECT handler, status, error, fingerprint, updated_at FROM inbox WHERE key = :key",
        key=key,
    )


async def dlq_depth(settings: Settings, count: int) -> None:
    async def reached() -> bool:
        return await broker_depth(settings.dead_letter_queue) == count

    await wait_until(reached, timeout=30)


async def forge(
    amqp: AbstractRobustConnection,
    settings: Settings,
    body: bytes,
    headers: dict[str, Any],
    routing_key: str = ROUTING_KEY,
) -> None:
    """Publish ``body`` to the events exchange as any producer may, expiring in 1 ms in the
    unconsumed work queue (bound with ``routing_key``), so that the broker dead-letters it into
    the DLQ."""
    async with amqp.channel(publisher_confirms=True) as channel:
        await declare_topology(channel, settings, [routing_key])
        exchange = await channel.get_exchange(settings.exchange)
        await exchange.publish(
            aio_pika.Message(
                body, headers=headers, content_type="application/json", expiration=0.001
            ),
            routing_key=routing_key,
            mandatory=True,
        )


async def send(
    amqp: AbstractRobustConnection, settings: Settings, body: bytes, headers: dict[str, Any]
) -> None:
    """Publish a JSON ``body`` to the events exchange for the ledger handler."""
    async with amqp.channel() as channel:
        exchange = await channel.get_exchange(settings.exchange)
        await exchange.publish(
            aio_pika.Message(body, headers=headers, content_type="application/json"),
            routing_key=ROUTING_KEY,
        )


def forged_headers(key: str, parking_id: str) -> dict[str, Any]:
    return {
        "idempotency-key": key,
        "x-worker-reason": "handler-error",
        "x-worker-error": "ValueError: looks genuine",
        "x-worker-handler": ROUTING_KEY,
        "x-worker-dead-lettered-at": datetime.now(UTC).isoformat(),
        "x-worker-original-routing-key": "payment.settled",
        PARKING_ID: parking_id,
    }


async def test_a_forged_copy_is_unverified_refused_and_forced_touches_no_inbox_row(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, ledger_table: None
) -> None:
    # Given a message the worker parked itself (its handler failed; its key is failed)
    class Broken(Switch):
        failing = "permanent"

    router = ledger(Broken)
    async with running_worker(settings, router):
        await send(amqp, settings, b'{"n": 1}', {"idempotency-key": "k-victim"})
        await dlq_depth(settings, 1)
    [genuine] = await dlq.list_parked(amqp, engine, settings)
    assert genuine.verified
    assert genuine.reason == "handler-error"
    assert genuine.failed_key
    victim_row = await inbox_row(engine, "k-victim")
    assert [row[1] for row in victim_row] == ["failed"]

    # When an attacker who may only publish to the events exchange makes the broker
    # dead-letter a body of their own, claiming the victim's key, its parking id, a reason,
    # a handler and the routing key payment.settled
    await forge(amqp, settings, b'{"n": 666}', forged_headers("k-victim", str(genuine.parking_id)))
    await dlq_depth(settings, 2)

    # Then the list shows the worker's copy as it parked it and the forged one as unverified,
    # its headers as claims
    listed = await worker(settings, "list")
    assert listed.returncode == 0, listed.stderr
    lines = [line for line in listed.stdout.splitlines() if line.startswith("key=")]
    assert len(lines) == 2
    assert "reason=handler-error" in lines[0]
    assert f"id={genuine.parking_id}" in lines[0]
    assert "reason=unverified" in lines[1]
    assert f"routing_key={ROUTING_KEY}" in lines[1]
    assert "why='its body is not the one the worker parked'" in lines[1]
    assert "claims: reason='handler-error'" in lines[1]
    assert "routing_key='payment.settled'" in lines[1]

    # When the operator replays the key without --force
    refused = await worker(settings, "replay", "--reason", "unverified", "--key", "k-victim", "-v")

    # Then the forged copy is refused and nothing changed
    assert refused.returncode == 0, refused.stderr
    assert "0 message(s) sent back" in refused.stdout
    assert "1 refused" in refused.stdout
    assert "unverified (its body is not the one the worker parked)" in refused.stdout
    assert await broker_depth(settings.dead_letter_queue) == 2
    assert await inbox_row(engine, "k-victim") == victim_row

    # When the operator forces it
    forced = await worker(
        settings, "replay", "--reason", "unverified", "--key", "k-victim", "--force", "-v"
    )

    # Then it goes back as a fresh delivery, routed by the broker's routing key, and the
    # victim's failed inbox row is untouched
    assert forced.returncode == 0, forced.stderr
    assert "1 message(s) sent back" in forced.stdout
    assert await inbox_row(engine, "k-victim") == victim_row
    async with amqp.channel() as channel:
        queue = await channel.get_queue(settings.queue)
        fresh = await queue.get(no_ack=False, timeout=10)
        headers = dict(fresh.headers or {})
        await fresh.nack(requeue=True)
    assert fresh.body == b'{"n": 666}'
    assert headers == {"idempotency-key": "k-victim", "x-worker-original-routing-key": ROUTING_KEY}

    # When the handler is fixed and the worker takes the fresh delivery
    class Fixed(Switch):
        failing = None

    async with running_worker(settings, ledger(Fixed)) as running:
        await wait_until(lambda: _settled(running.stats, "dead_lettered", 1))
    # Then the forged body is not applied under the victim's key (the key's failed row says
    # it was another body: key reused), and the victim's row is still as the worker left it
    assert await applied(engine) == []
    assert await inbox_row(engine, "k-victim") == victim_row
    reused = await dlq.list_parked(amqp, engine, settings, selection=dlq.Selection(key="k-victim"))
    assert [(p.reason, p.verified) for p in reused] == [
        ("handler-error", True),
        ("key-reused", True),
    ]

    # When the operator replays the worker's own copy of the victim
    async with running_worker(settings, ledger(Fixed)) as running:
        replayed = await worker(settings, "replay", "--reason", "handler-error", "-v")
        assert replayed.returncode == 0, replayed.stderr
        assert "1 message(s) sent back" in replayed.stdout
        await wait_until(lambda: _settled(running.stats, "processed", 1))

    # Then it runs once, with its own body
    assert await applied(engine) == [("k-victim", 1)]
    assert [row[1] for row in await inbox_row(engine, "k-victim")] == ["completed"]
    assert await parkings_left(engine) == 2  # (the victim's stays until it expires)


async def test_a_copy_of_a_parked_copy_shows_nothing_it_claims_and_replays_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, ledger_table: None
) -> None:
    # Given a message the worker parked itself (its handler failed for good)
    class Broken(Switch):
        failing = "permanent"

    async with running_worker(settings, ledger(Broken)):
        await send(amqp, settings, b'{"n": 1}', {"idempotency-key": "k-copied"})
        await dlq_depth(settings, 1)
    [genuine] = await dlq.list_parked(amqp, engine, settings)
    assert genuine.verified

    # When an attacker dead-letters an exact copy of it (its body, key and parking id are shown
    # to viewers and logged) with failure headers of their own choosing
    lies = {
        "x-worker-error": "TRANSIENT: the DB was down; replay with --force is safe",
        "x-worker-exception-type": "OperationalError",
        "x-worker-attempts": 7,
        "x-worker-first-failure-at": "2020-01-01T00:00:00+00:00",
    }
    headers = forged_headers("k-copied", str(genuine.parking_id)) | lies
    await forge(amqp, settings, b'{"n": 1}', headers)
    await dlq_depth(settings, 2)

    # Then the worker's copy shows its own record's failure, and the copy is a second copy of
    # that parking, unverified, whatever its headers say
    first, second = await dlq.list_parked(amqp, engine, settings)
    assert first.verified
    assert first.parking_id == genuine.parking_id
    assert (first.error, first.exception_type, first.attempts) == (
        "Permanent: the ledger is closed",
        "Permanent",
        1,
    )
    assert first.first_failure_at
    assert not first.first_failure_at.startswith("2020")
    assert not second.verified
    assert second.unverified_because == f"a second copy of parking {genuine.parking_id}"
    assert "TRANSIENT" not in second.error
    listed = await worker(settings, "list")
    assert listed.returncode == 0, listed.stderr
    lines = [line for line in listed.stdout.splitlines() if line.startswith("key=")]
    assert "TRANSIENT" not in lines[0], lines[0]
    assert "second copy of parking" in lines[1], lines[1]

    # When the operator fixes the handler and replays what the worker parked
    class Fixed(Switch):
        failing = None

    async with running_worker(settings, ledger(Fixed)) as running:
        replayed = await worker(settings, "replay", "--reason", "handler-error", "-v")
        assert replayed.returncode == 0, replayed.stderr
        assert "1 message(s) sent back" in replayed.stdout
        await wait_until(lambda: _settled(running.stats, "processed", 1))

    # Then the effect is applied once and the second copy stays, refused
    assert await applied(engine) == [("k-copied", 1)]
    [left] = await dlq.list_parked(amqp, engine, settings)
    assert not left.verified
    assert f"a copy of parking {genuine.parking_id}, replayed at" in (left.unverified_because or "")
    refused = await worker(settings, "replay", "--key", "k-copied", "-v")
    assert "0 message(s) sent back" in refused.stdout, refused.stdout
    assert await applied(engine) == [("k-copied", 1)]


async def parkings_left(engine: AsyncEngine) -> int:
    [(count,)] = await rows(engine, "SELECT count(*) FROM dead_letters")
    return int(count)


async def _settled(stats: Any, name: str, count: int) -> bool:
    return bool(stats[name] >= count)


async def test_a_copy_back_from_the_retry_queues_is_parked_verified_and_replays_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, ledger_table: None
) -> None:
    # Given a handler that fails transiently until fixed: the message goes round both
    # delayed-retry queues and is then parked by the worker
    class Busy(Switch):
        failing = "transient"

    async with running_worker(settings, ledger(Busy)) as running:
        await send(
            amqp,
            settings,
            b'{"n": 7}',
            {"idempotency-key": "k-retried", PARKING_ID: "not-a-parking-id"},
        )
        await dlq_depth(settings, 1)
        assert running.stats[Count.RETRY_SCHEDULED] == 2

    # Then the copy that came back from the retry queues is the worker's, with its record's
    # facts, and carries its own parking id, not the one it came with
    [parked] = await dlq.list_parked(amqp, engine, settings)
    assert parked.verified
    assert (parked.key, parked.handler, parked.reason, parked.routing_key) == (
        "k-retried",
        ROUTING_KEY,
        "retries-exhausted",
        ROUTING_KEY,
    )
    assert parked.attempts == 3

    # When the handler is fixed and the copy replayed
    class Fixed(Switch):
        failing = None

    async with running_worker(settings, ledger(Fixed)) as running:
        replayed = await worker(settings, "replay", "--key", "k-retried")
        assert "1 message(s) sent back" in replayed.stdout, replayed.stdout
        await wait_until(lambda: _settled(running.stats, "processed", 1))

    # Then it is applied once
    assert await applied(engine) == [("k-retried", 7)]
    assert await broker_depth(settings.dead_letter_queue) == 0


async def test_a_retry_copy_the_broker_dead_lettered_is_routed_by_its_claimed_routing_key(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, ledger_table: None
) -> None:
    # Given a retry copy in the work queue (it came through the default exchange, routed by its
    # x-worker-original-routing-key) that the broker dead-lettered itself (a rejection here; a
    # quorum queue's delivery limit alike): it has no record of the worker's
    async with amqp.channel(publisher_confirms=True) as channel:
        await declare_topology(channel, settings, [ROUTING_KEY])
        await channel.default_exchange.publish(
            aio_pika.Message(
                b'{"n": 9}',
                content_type="application/json",
                headers={
                    "idempotency-key": "k-limit",
                    "x-worker-attempts": 2,
                    "x-worker-original-routing-key": ROUTING_KEY,
                },
            ),
            routing_key=settings.queue,
        )
        rejected = await (await channel.get_queue(settings.queue)).get(no_ack=False, timeout=10)
        await rejected.reject()
    await dlq_depth(settings, 1)

    # When it is listed, then forced back
    [parked] = await dlq.list_parked(amqp, engine, settings)
    refused = await worker(settings, "replay")

    class Fixed(Switch):
        failing = None

    async with running_worker(settings, ledger(Fixed)) as running:
        forced = await worker(settings, "replay", "--force")
        await wait_until(lambda: _settled(running.stats, "processed", 1))

    # Then it is unverified, routed by the routing key the consumer routes it by, refused
    # without --force, and forced it runs as a fresh delivery (its attempts forgotten)
    assert (parked.reason, parked.routing_key, parked.claims["broker_reason"]) == (
        "unverified",
        ROUTING_KEY,
        "rejected",
    )
    assert "1 refused" in refused.stdout
    assert "1 message(s) sent back" in forced.stdout
    assert await applied(engine) == [("k-limit", 9)]


def test_a_retry_copy_drops_the_parking_id_it_came_with() -> None:
    delivery = Delivery(b"{}", ROUTING_KEY, headers={PARKING_ID: "someone's", "a": 1})
    failure = Failure(delivery, "boom", "ValueError", ROUTING_KEY)

    assert PARKING_ID not in failure.headers()
    record = failure.parking("handler-error", failed_key=False)
    assert failure.dead_letter_headers("handler-error", record.parking_id)[PARKING_ID] == str(
        record.parking_id
    )


async def test_purge_takes_unverified_copies_only_when_asked_for_them(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a copy the worker parked and a forged one claiming the same key
    await park(amqp, engine, settings, Copy("k1"))
    await forge(amqp, settings, b'{"n": 2}', forged_headers("k1", "0" * 32))
    await dlq_depth(settings, 2)

    # When the operator purges the key, then the unverified copies
    by_key = await worker(settings, "purge", "--key", "k1", "-v")
    unverified = await worker(settings, "purge", "--reason", "unverified", "-v")

    # Then the key's purge deletes the worker's copy (and its record) only; the second the
    # forged one
    assert by_key.returncode == 0, by_key.stderr
    assert "1 message(s) purged" in by_key.stdout
    assert "1 unverified left parked (--reason unverified purges them)" in by_key.stdout
    assert "1 message(s) purged" in unverified.stdout
    assert await broker_depth(settings.dead_letter_queue) == 0
    assert await parkings_left(engine) == 0


async def test_list_json_gives_one_object_per_copy(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, Copy("k1"), Copy("k2", reason="invalid"))
    await forge(amqp, settings, b'{"n": 3}', forged_headers("k1", "not-an-id"))
    await dlq_depth(settings, 3)

    listed = await worker(settings, "list", "--json")

    assert listed.returncode == 0, listed.stderr
    objects = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(o["key"], o["reason"], o["verified"]) for o in objects] == [
        ("k1", "handler-error", True),
        ("k2", "invalid", True),
        ("k1", "unverified", False),
    ]
    keys = {
        "id",
        "verified",
        "unverified_because",
        "key",
        "handler",
        "reason",
        "routing_key",
        "error",
        "exception_type",
        "attempts",
        "first_failure_at",
        "dead_lettered_at",
        "message_id",
        "claims",
    }
    assert all(set(o) == keys for o in objects)
    assert objects[0]["handler"] == "dlq.job"
    assert objects[0]["claims"] == {}
    assert objects[2]["handler"] is None
    assert objects[2]["claims"]["routing_key"] == "payment.settled"
    assert objects[2]["unverified_because"] == "no record of its parking id"
    assert objects[2]["id"].startswith("sha256:")


async def test_show_escapes_a_hostile_body_and_bounds_it_unless_full(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given an unverified copy whose body and headers would drive a terminal
    hostile = b"\x1b[2J\x1b[31mred\x07\r\nforged line\xe2\x80\xae" + b"x" * 5000 + b"END"
    headers = forged_headers("k-show", "nope") | {"x-note": "\x1b]0;title\x07"}
    await forge(amqp, settings, hostile, headers)
    await dlq_depth(settings, 1)
    [parked] = await dlq.list_parked(amqp, engine, settings)

    shown = await worker(settings, "show", parked.id)
    full = await worker(settings, "show", parked.id, "--full")

    assert shown.returncode == 0, shown.stderr
    for output in (shown.stdout, full.stdout):
        assert "\x1b" not in output
        assert "\x07" not in output
        assert "\r" not in output
        assert "\u202e" not in output
        assert "\\x1b[31mred\\x07\\r" in output
        assert "x-note: \\x1b]0;title\\x07" in output
        assert "provenance: unverified" in output
        assert "x-worker-reason: handler-error" in output
    assert f"body ({len(hostile)} bytes; the first 4096 shown, --full shows all):" in shown.stdout
    assert "END" not in shown.stdout
    assert shown.stdout.splitlines()[-1] == "forged line\\u202e" + "x" * 4067
    assert full.stdout.rstrip().endswith("END")
    assert await broker_depth(settings.dead_letter_queue) == 1

    missing = await worker(settings, "show", "sha256:00000000000000000000000000000000")
    assert missing.returncode == 2
    assert "no message with id 'sha256:00000000000000000000000000000000'" in missing.stderr


async def test_an_unknown_reason_is_a_usage_error_that_lists_the_reasons(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, Copy("k1"))

    for action in ("list", "replay", "purge"):
        typo = await worker(settings, action, "--reason", "handler_error")

        assert typo.returncode == 2, (action, typo.stdout, typo.stderr)
        assert typo.stdout == ""
        [line] = typo.stderr.splitlines()
        assert "unknown reason 'handler_error' (did you mean handler-error?)" in line
        assert "handler-error" in line.split("the reasons are: ")[1]
        assert line.endswith("unverified")
    assert await broker_depth(settings.dead_letter_queue) == 1


async def test_a_closed_pipe_ends_the_list_quietly(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given more parked messages than a pipe holds in lines
    await park(amqp, engine, settings, *(Copy(f"k{i:04}") for i in range(600)))

    # When the reader takes one line and leaves (`worker dlq list --all | head -1`)
    def first_line_then_leave() -> tuple[str, int, str]:
        with subprocess.Popen(
            [str(WORKER_SCRIPT), "dlq", "list", "--all"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_environ(**worker_environ(settings)),
        ) as process:
            assert process.stdout is not None
            assert process.stderr is not None
            line = process.stdout.readline()
            process.stdout.close()
            returncode = process.wait(timeout=120)
            return line, returncode, process.stderr.read()

    line, returncode, stderr = await asyncio.to_thread(first_line_then_leave)

    # Then the command ends at once, quietly, and the queue is as it was
    assert line.startswith("key=k0000 ")
    assert returncode == Exit.BROKEN_PIPE  # (what a shell shows as 141, as for SIGPIPE)
    assert stderr == ""
    assert await broker_depth(settings.dead_letter_queue) == 600


async def test_is_parked_tells_a_key_in_the_dlq_until_it_is_purged(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await park(amqp, engine, settings, Copy("k-invalid", reason="invalid"))

    async def parked(key: str) -> bool:
        async with engine.connect() as conn:
            return await parkings.is_parked(conn, "dlq.job", key)

    assert await parked("k-invalid")
    assert not await parked("k-other")
    await worker(settings, "purge", "--key", "k-invalid")
    assert not await parked("k-invalid")


async def test_the_janitor_expires_records_after_twice_the_inbox_retention(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given records of copies parked 8 days ago (past the inbox's 7) and 15 days ago
    await park(
        amqp,
        engine,
        settings,
        Copy("k-8", age=timedelta(days=8)),
        Copy("k-15", age=timedelta(days=15)),
    )

    # When the janitor sweeps
    swept = await janitor.sweep(engine, settings)

    # Then only the older record is gone: that copy is now unverified, the other still the
    # worker's (refused for its age, replayed when forced)
    assert swept is not None
    assert swept.parkings == 1
    listed = await dlq.list_parked(amqp, engine, settings)
    assert [(p.key, p.reason) for p in listed] == [("k-8", "handler-error"), ("k-15", "unverified")]


REFUSE_PARKINGS = (
    """CREATE OR REPLACE FUNCTION dlq_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION 'no parking records' USING ERRCODE = 'insufficient_privilege'; END $$""",
    "CREATE TRIGGER dlq_refuse BEFORE INSERT ON dead_letters "
    "FOR EACH ROW EXECUTE FUNCTION dlq_refuse()",
)

ALLOW_PARKINGS = "DROP TRIGGER IF EXISTS dlq_refuse ON dead_letters"


async def test_no_copy_is_parked_without_its_record_first(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, ledger_table: None
) -> None:
    # Given a worker whose parking records cannot be written (a privilege refused: a
    # deployment fault, not the message's)
    class Broken(Switch):
        failing = "permanent"

    async with engine.begin() as conn:
        for statement in REFUSE_PARKINGS:
            await conn.execute(text(statement))
    try:
        async with running_worker(settings, ledger(Broken)) as running:
            await send(amqp, settings, b'{"n": 5}', {"idempotency-key": "k-unrecorded"})

            # When its handler fails for good
            await wait_until(lambda: _settled(running.stats, "requeued", 1))

            # Then nothing is parked and the key is not failed: the delivery went back
            assert await broker_depth(settings.dead_letter_queue) == 0
            assert running.stats[Count.DEAD_LETTERED] == 0
            assert await inbox_row(engine, "k-unrecorded") == []

            # When the privilege is back, the worker parks it, its record first
            async with engine.begin() as conn:
                await conn.execute(text(ALLOW_PARKINGS))
            await wait_until(lambda: _settled(running.stats, "dead_lettered", 1), timeout=60)
    finally:
        async with engine.begin() as conn:
            await conn.execute(text(ALLOW_PARKINGS))

    [parked] = await dlq.list_parked(amqp, engine, settings)
    assert parked.verified
    assert (parked.key, parked.reason) == ("k-unrecorded", "handler-error")


async def test_the_log_line_of_a_parked_message_names_the_id_dlq_show_takes(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    ledger_table: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a handler that fails for good
    class Broken(Switch):
        failing = "permanent"

    # When the worker parks a message of it
    with caplog.at_level(logging.WARNING, logger="worker"):
        async with running_worker(settings, ledger(Broken)):
            await send(amqp, settings, b'{"n": 1}', {"idempotency-key": "k-logged"})
            await dlq_depth(settings, 1)

    # Then its log line names the parking id, and `worker dlq show` finds the message by it
    [parked] = await dlq.list_parked(amqp, engine, settings)
    [line] = [r.getMessage() for r in caplog.records if "dead-lettered message" in r.getMessage()]
    assert f"as parking {parked.parking_id}" in line
    shown = await worker(settings, "show", str(parked.parking_id))
    assert shown.returncode == 0, shown.stderr
